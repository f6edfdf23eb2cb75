"""What the evaluate stage evaluates: evaluate.tasks resolved, checked, and the project's local tasks built.

evaluate.tasks lists any of:

- `local`: the project's own tasks, made deterministically (evaluate.seed) from the run's data into the
  stage's tasks/ folder as lm_eval task YAMLs over JSON-lines files beside them:
    llmpipe_choice   text runs: a multiple-choice continuation from the validation split: a context of
                     whole lines, the true next line against `evaluate.choices - 1` lines of other
                     validation documents (acc, acc_norm);
    llmpipe_ppl      the validation documents' perplexity through loglikelihood_rolling (bits_per_byte,
                     byte_perplexity, word_perplexity);
    llmpipe_chat_qa  chat runs with evaluate.chat_questions: each held-out conversation's last question
                     in the run's chat template (as training rendered it), the answer generated greedily
                     until the template's end of turn, exact match against the conversation's answer;
- a path to a task YAML file (lm_eval's format) inside the project (the working folder) or the run, checked
  before it is used (read_task_yaml): `!function` and any other tag (they run Python), `include`, YAML
  anchors and aliases (a few hundred bytes of them expand to gigabytes) and `custom_dataset` are refused;
  a template (any string holding `{{`, `{%` or `{#`) must parse, and may not name an attribute or key
  beginning with `_` (`__globals__`, `__class__`: the ways out of Python's objects) nor jinja's globals
  (cycler, joiner, namespace, lipsum, range, dict): the document's fields are what a task reads; every dataset
  source (dataset_path when it names a local path, dataset_kwargs' data_files,
  data_dir and cache_dir) must lie in the project or the run, with no URL; dataset_kwargs may not ask for
  trust_remote_code, storage_options, download_config or token. During the stage lm_eval's templates are
  rendered in jinja2's ImmutableSandboxedEnvironment besides, with the chat templates' bounds on the size of
  what a single call makes (sandboxed_templates);
- an lm_eval task name (`arc_easy`, `hellaswag`, `mmlu`): its dataset must already be in the local Hugging
  Face cache, as everything runs offline (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1).

`fingerprint_extra` is the part of the stage's fingerprint beyond its config section: the lm_eval version,
the digests of the task files and of the chat questions it reads, and of the graphs it evaluates (export_onnx's
and the benchmark's variants, read off their manifests), so a re-timed benchmark re-runs nothing here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmpipe.errors import ConfigError, UserError

LOCAL = "local"
CHOICE, PPL, CHAT_QA = "llmpipe_choice", "llmpipe_ppl", "llmpipe_chat_qa"
MAX_YAML_BYTES = 1 << 20
MAX_QUESTIONS_BYTES = 64 << 20
MAX_ITEMS = 400  # items written per local task (evaluate.limit picks the first ones)
MAX_DOC_CHARS = 2000  # llmpipe_ppl: each validation document cut to this many characters
CONTEXT_TOKENS = 96  # llmpipe_choice: the context's tokens at most (each choice is scored after it)


class EvalTaskError(UserError):
    """A task that cannot be evaluated: unknown, unreadable, outside the project, its dataset missing."""


@dataclass
class TaskPlan:
    """The tasks of one evaluation: local task names, lm_eval names, YAML configs (parsed), in config order."""

    local: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    yamls: dict[str, Path] = field(default_factory=dict)  # task name -> its YAML file


def is_path(entry: str) -> bool:
    return entry.endswith((".yaml", ".yml")) or "/" in entry


def local_tasks(cfg) -> list[str]:
    if cfg.data.format == "chat":
        return [PPL, CHAT_QA] if cfg.evaluate.chat_questions else [PPL]
    return [CHOICE, PPL]


def _inside(path: Path, roots: list[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(r.resolve()) for r in roots)


_JINJA = ("{{", "{%", "{#")
JINJA_GLOBALS = ("cycler", "joiner", "namespace", "lipsum", "range", "dict")
DATASET_KWARGS_REFUSED = ("trust_remote_code", "storage_options", "download_config", "token")


def _no_aliases(text: str, path: Path, option: str) -> None:
    """Refuse YAML anchors and aliases before anything is built: the parser's events, not the tree."""
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise EvalTaskError(f"{option}: {path}: line {event.start_mark.line + 1}: YAML anchors and aliases "
                                "(&name, *name) are not accepted; write the task out in full")


def _strings(tree: Any, key: str = ""):
    """(key path, string) of every string in a parsed YAML tree, keys included."""
    if isinstance(tree, str):
        yield key, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            where = f"{key}.{k}" if key else str(k)
            yield from _strings(k, where)
            yield from _strings(v, where)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _strings(v, f"{key}[{i}]")


def _escape(text: str) -> str | None:
    """What in a template reaches past the document's fields (an attribute or key beginning with `_`, a
    jinja global), or None."""
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as err:
        return f"does not parse: {err.message}"
    for node in ast.find_all((nodes.Getattr, nodes.Const, nodes.Name)):
        if isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
            return f"attribute {node.attr!r}"
        if isinstance(node, nodes.Const) and isinstance(node.value, str) and node.value.startswith("_"):
            return f"name {node.value!r}"
        if isinstance(node, nodes.Name) and node.name in JINJA_GLOBALS:
            return f"jinja's global {node.name!r}"
    return None


def _check_templates(tree: dict, path: Path, option: str) -> None:
    for key, text in _strings(tree):
        why = _escape(text) if any(t in text for t in _JINJA) else None
        if why:
            raise EvalTaskError(f"{option}: {path}: {key}: a template may read the document's fields only, not "
                                f"{why} ({text[:60]!r})")


def _local(value: str, path: Path, root: Path) -> list[Path]:
    """Where a dataset source may be read from: relative to the project (the process's working folder, as
    `datasets` resolves it) and to the YAML's folder (as this project writes data_files)."""
    p = Path(value).expanduser()
    return [p] if p.is_absolute() else [root / p, path.parent / p]


def _check_sources(tree: dict, path: Path, roots: list[Path], option: str) -> None:
    if "custom_dataset" in tree:
        raise EvalTaskError(f"{option}: {path}: custom_dataset: not accepted (it runs Python)")
    dataset = tree.get("dataset_path")
    if isinstance(dataset, str) and ("://" in dataset or "::" in dataset):
        raise EvalTaskError(f"{option}: {path}: dataset_path: {dataset!r} is a URL; only local data or the "
                            "Hugging Face cache are read")
    if isinstance(dataset, str) and (dataset.startswith((".", "~", "/")) or
                                     any(p.exists() for p in _local(dataset, path, roots[0]))):
        if not all(_inside(p, roots) for p in _local(dataset, path, roots[0])):
            raise EvalTaskError(f"{option}: {path}: dataset_path: {dataset} is outside the project and the run; "
                                "refusing to read it")
    kwargs = tree.get("dataset_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise EvalTaskError(f"{option}: {path}: dataset_kwargs: not a mapping")
    for key in DATASET_KWARGS_REFUSED:
        if kwargs.get(key):
            raise EvalTaskError(f"{option}: {path}: dataset_kwargs.{key}: not accepted")
    for key in ("data_dir", "cache_dir"):
        value = kwargs.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or "://" in value or "::" in value or \
                not all(_inside(p, roots) for p in _local(value, path, roots[0])):
            raise EvalTaskError(f"{option}: {path}: dataset_kwargs.{key}: {value} is outside the project and the "
                                "run; refusing to read it")
    for f in _data_file_names(tree):
        if "://" in f or "::" in f:
            raise EvalTaskError(f"{option}: {path}: dataset_kwargs.data_files: {f} is a URL; only local files "
                                "are read")


@contextlib.contextmanager
def sandboxed_templates():
    """lm_eval renders a task's templates (doc_to_text, ...) in a plain jinja2 Environment, in which a
    template can reach Python (`cycler.__init__.__globals__.os`); while this is entered, it renders them in
    jinja2's ImmutableSandboxedEnvironment (with the chat templates' bounds on single calls) instead."""
    from jinja2 import BaseLoader, StrictUndefined
    from lm_eval import utils

    from llmpipe.chat.template import bounded_sandbox

    env = bounded_sandbox(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    env.filters.update({k: v for k, v in utils.env.filters.items() if k == "regex_replace"})
    plain, utils.env = utils.env, env
    try:
        yield env
    finally:
        utils.env = plain


def read_task_yaml(path: Path, roots: list[Path], option: str = "evaluate.tasks") -> dict[str, Any]:
    """A user's task YAML, parsed safely and checked (see the module's docstring): inside `roots`, a mapping
    with a `task` name, no tags, anchors or aliases, plain field references in its templates, its dataset
    sources inside `roots`. One line (EvalTaskError) naming the file and the key otherwise."""
    if not path.is_file():
        raise EvalTaskError(f"{option}: {path}: task file not found")
    if not _inside(path, roots):
        raise EvalTaskError(f"{option}: {path}: outside the project ({roots[0]}) and the run ({roots[-1]}); "
                            "refusing to read it")
    raw = path.read_bytes()[:MAX_YAML_BYTES + 1]
    if len(raw) > MAX_YAML_BYTES:
        raise EvalTaskError(f"{option}: {path}: larger than {MAX_YAML_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
        _no_aliases(text, path, option)
        tree = yaml.safe_load(text)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        first = str(err).strip().splitlines()[0]
        hint = " (`!function` runs Python and is not accepted here)" if "!function" in str(err) else ""
        raise EvalTaskError(f"{option}: {path}: not a task YAML: {first}{hint}") from None
    if not isinstance(tree, dict) or not isinstance(tree.get("task"), str) or not tree["task"]:
        raise EvalTaskError(f"{option}: {path}: not a task YAML (a mapping with a `task` name)")
    if "include" in tree:
        raise EvalTaskError(f"{option}: {path}: `include` is not accepted; write the task out in full")
    _check_templates(tree, path, option)
    _check_sources(tree, path, roots, option)
    for f in data_files(tree, path):
        if not _inside(f, roots):
            raise EvalTaskError(f"{option}: {path}: its data file {f} is outside the project and the run; "
                                "refusing to read it")
    return tree


def data_files(tree: dict[str, Any], path: Path) -> list[Path]:
    """The local files a task YAML's dataset_kwargs.data_files names (relative to the YAML's folder)."""
    out = []
    for f in _data_file_names(tree):
        p = Path(f)
        out.append(p if p.is_absolute() else path.parent / p)
    return out


def _data_file_names(tree: dict[str, Any]) -> list[str]:
    kwargs = tree.get("dataset_kwargs") or {}
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    if files is None:
        return []
    values = files.values() if isinstance(files, dict) else [files]
    return [str(f) for v in values for f in (v if isinstance(v, list) else [v])]


def task_config(path: Path, tree: dict[str, Any] | None = None) -> dict[str, Any]:
    """A task YAML as the config dict lm_eval loads, its data files made absolute (relative ones are relative
    to the YAML's folder, as this project writes them)."""
    tree = dict(tree if tree is not None else yaml.safe_load(path.read_text(encoding="utf-8")))
    kwargs = tree.get("dataset_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("data_files") is not None:
        files = kwargs["data_files"]
        fix = lambda f: str(Path(str(f)) if Path(str(f)).is_absolute() else (path.parent / str(f)).resolve())
        if isinstance(files, dict):
            files = {k: [fix(x) for x in v] if isinstance(v, list) else fix(v) for k, v in files.items()}
        else:
            files = [fix(x) for x in files] if isinstance(files, list) else fix(files)
        tree["dataset_kwargs"] = {**kwargs, "data_files": files}
    return tree


def plan(cfg, root: Path | None = None) -> TaskPlan:
    """evaluate.tasks resolved: YAML files read and checked (one line each), names kept for lm_eval."""
    root = Path.cwd() if root is None else root
    roots = [root, cfg.run_dir()]
    out = TaskPlan()
    for entry in cfg.evaluate.tasks:
        if entry == LOCAL:
            out.local += [t for t in local_tasks(cfg) if t not in out.local]
        elif is_path(entry):
            path = Path(entry) if Path(entry).is_absolute() else root / entry
            tree = read_task_yaml(path, roots)
            out.yamls[tree["task"]] = path
        else:
            out.names.append(entry)
    everything = [*out.local, *out.names, *out.yamls]
    if len(set(everything)) != len(everything):
        raise ConfigError(f"evaluate.tasks: a task is named twice ({', '.join(everything)})")
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _graphs(run_dir: Path, stage: str, prefix: tuple[str, ...]) -> dict[str, Any]:
    from llmpipe.manifest import Manifest, ManifestError
    from llmpipe.stages import stage_dir

    try:
        manifest = Manifest.read(stage_dir(run_dir, stage))
    except (ManifestError, OSError, ValueError):
        return {"state": "invalid"}
    if manifest is None:
        return {"state": "missing"}
    return {name: entry.get("sha256") for name, entry in sorted(manifest.outputs.items())
            if name.startswith(prefix)}


def fingerprint_extra(cfg) -> dict[str, Any]:
    """The stage's inputs beyond its config and its input stages: see the module's docstring."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        lm_eval_version = version("lm_eval")
    except PackageNotFoundError:
        lm_eval_version = None
    files: dict[str, Any] = {}
    for entry in cfg.evaluate.tasks:
        if entry != LOCAL and is_path(entry):
            path = Path(entry)
            try:
                tree = None
                if path.is_file() and path.stat().st_size <= MAX_YAML_BYTES:
                    text = path.read_text(encoding="utf-8")
                    _no_aliases(text, path, "evaluate.tasks")  # never expand an alias bomb, here either
                    tree = yaml.safe_load(text)
                paths = [path, *(data_files(tree, path) if isinstance(tree, dict) else [])]
                files[entry] = {str(p): sha256(p) if p.is_file() else None for p in paths}
            except (OSError, yaml.YAMLError, UnicodeDecodeError, EvalTaskError):
                files[entry] = "unreadable"
    questions = cfg.evaluate.chat_questions
    if questions and cfg.data.format == "chat":
        p = Path(questions)
        files["chat_questions"] = sha256(p) if p.is_file() else None
    run_dir = cfg.run_dir()
    extra = {"lm_eval": lm_eval_version, "files": files,
             "graphs": {"export_onnx": _graphs(run_dir, "export_onnx", ("model", "decoder_static")),
                        "benchmark": _graphs(run_dir, "benchmark", ("variants/",))}}
    rejected = _rejected(run_dir)
    if rejected:  # what is scored (the benchmark's accepted variants); absent when none: earlier runs unchanged
        extra["benchmark_rejected"] = rejected
    return extra


def _rejected(run_dir: Path) -> list[str]:
    """The variants the finished benchmark rejected (evaluate does not score them)."""
    from llmpipe.manifest import Manifest, ManifestError
    from llmpipe.stages import stage_dir

    try:
        manifest = Manifest.read(stage_dir(run_dir, "benchmark"))
    except (ManifestError, OSError, ValueError):
        return []
    return sorted(manifest.metrics.get("rejected") or []) if manifest is not None else []


# --------------------------------------------------------------------------- the local tasks


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def _yaml(folder: Path, task: dict[str, Any], records: list[dict]) -> Path:
    data = folder / f"{task['task']}.jsonl"
    _write_jsonl(data, records)
    task = {**task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data.name}},
            "test_split": "test", "metadata": {"version": 1.0}}
    path = folder / f"{task['task']}.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def _good(line: str) -> bool:
    s = line.strip()
    return 8 <= len(s) <= 160 and any(c.isalpha() for c in s)


def choice_records(docs: list[str], tokenizer, n_choices: int, seed: int, max_tokens: int) -> list[dict]:
    """llmpipe_choice's items: a context of whole lines (at most CONTEXT_TOKENS, and half of max_tokens) ending
    with a newline,
    the document's true next line and n_choices - 1 lines of other documents, shuffled (`label`: the true one)."""
    rng = random.Random(seed)
    lines = [d.split("\n") for d in docs]
    pool = [(j, ln) for j, doc in enumerate(lines) for ln in doc if _good(ln)]
    candidates = [(j, i) for j, doc in enumerate(lines) for i in range(1, len(doc)) if _good(doc[i])]
    rng.shuffle(candidates)
    budget = max(8, min(CONTEXT_TOKENS, max_tokens // 2))
    items = []
    for j, i in candidates:
        if len(items) >= MAX_ITEMS:
            break
        answer = lines[j][i]
        if len(tokenizer.encode(answer).ids) > max_tokens // 4:
            continue
        context, k = "", i
        while k > 0:
            longer = lines[j][k - 1] + "\n" + context
            if len(tokenizer.encode(longer).ids) > budget:
                break
            context, k = longer, k - 1
        if not context.strip():
            continue
        others = [ln for o, ln in pool if o != j and ln.strip() != answer.strip()]
        if len(others) < n_choices - 1:
            continue
        picked = list(dict.fromkeys(rng.sample(others, min(len(others), 4 * n_choices))))[:n_choices - 1]
        if len(picked) < n_choices - 1:
            continue
        choices = [answer, *picked]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(answer)})
    return items


SPAN_WORDS = 6  # llmpipe_choice on text without line breaks: the answer and each distractor, in words


def span_records(docs: list[str], tokenizer, n_choices: int, seed: int, max_tokens: int) -> list[dict]:
    """llmpipe_choice's items for text without usable lines: a context of words, the document's next
    SPAN_WORDS words against spans of as many words from other documents."""
    rng = random.Random(seed)
    words = [d.split() for d in docs]
    budget = max(8, min(CONTEXT_TOKENS, max_tokens // 2))
    spans = [(j, " " + " ".join(w[k:k + SPAN_WORDS])) for j, w in enumerate(words)
             for k in range(1, max(1, len(w) - SPAN_WORDS), SPAN_WORDS)]
    items = []
    for j in rng.sample(range(len(words)), len(words)) * 8:
        w = words[j]
        if len(items) >= MAX_ITEMS or len(w) < 2 * SPAN_WORDS:
            continue
        k = rng.randrange(SPAN_WORDS, len(w) - SPAN_WORDS + 1)
        start = k
        while start > 0 and len(tokenizer.encode(" ".join(w[start - 1:k])).ids) <= budget:
            start -= 1
        answer = " " + " ".join(w[k:k + SPAN_WORDS])
        others = list(dict.fromkeys(t for o, t in spans if o != j and t != answer))
        if k - start < 1 or len(others) < n_choices - 1:
            continue
        choices = [answer, *rng.sample(others, n_choices - 1)]
        rng.shuffle(choices)
        items.append({"context": " ".join(w[start:k]), "choices": choices, "label": choices.index(answer)})
    return items


def validation_docs(val_bin: Path, tokenizer, limit: int = MAX_ITEMS, special: bool = False) -> list[str]:
    """The validation split's documents as text (decoded), at most `limit`, in shard order. `special`: keep the
    special tokens (a chat run's rendered conversations keep their template markers)."""
    from llmpipe.data.shards import TokenShard

    shard = TokenShard(val_bin)
    docs = []
    for j in range(min(shard.n_docs, 4 * limit)):
        ids = shard.document(j).tolist()
        text = tokenizer.decode(ids, skip_special_tokens=not special)
        if text.strip():
            docs.append(text)
        if len(docs) >= limit:
            break
    return docs


def question_records(path: Path, render, seed: int = 0) -> list[dict]:
    """llmpipe_chat_qa's items from JSON lines of {"messages": [...]}: every message up to the last user turn
    rendered by `render(messages) -> prompt`, the last assistant message after it the answer; shuffled with
    `seed`, so that evaluate.limit takes a sample of every kind of question, not the file's first kind."""
    if not path.is_file():
        raise EvalTaskError(f"evaluate.chat_questions: {path}: file not found")
    if path.stat().st_size > MAX_QUESTIONS_BYTES:
        raise EvalTaskError(f"evaluate.chat_questions: {path}: larger than {MAX_QUESTIONS_BYTES} bytes")
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            roles = [m["role"] for m in messages]
            last = len(roles) - 1 - roles[::-1].index("user")
            answer = next(m["content"] for m in messages[last + 1:] if m["role"] == "assistant")
        except (ValueError, KeyError, TypeError, StopIteration):
            raise EvalTaskError(f"evaluate.chat_questions: {path}: line {n} is not a conversation with a "
                                "user question and an assistant answer") from None
        items.append({"prompt": render(messages[:last + 1]), "question": messages[last]["content"],
                      "answer": str(answer)})
    if not items:
        raise EvalTaskError(f"evaluate.chat_questions: {path}: no conversations")
    random.Random(seed).shuffle(items)
    return items[:MAX_ITEMS]


def build_local(folder: Path, names: list[str], *, docs: list[str], tokenizer, cfg, max_tokens: int,
                chat: tuple | None = None, skipped: dict[str, str] | None = None) -> dict[str, Path]:
    """Write the local tasks `names` into `folder`; returns task name -> YAML. `chat`: (render(messages),
    end-of-turn strings) of a chat run. A task the data cannot make is left out, with why in `skipped`."""
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    skipped = {} if skipped is None else skipped
    e = cfg.evaluate
    if CHOICE in names:
        items = choice_records(docs, tokenizer, e.choices, e.seed, max_tokens) or \
            span_records(docs, tokenizer, e.choices, e.seed, max_tokens)
        if not items:  # NOTE: a local task the run's data cannot make is left out and said so, not an error
            skipped[CHOICE] = (f"not built: the validation split has too little text for a continuation task with "
                               f"distractors from other documents ({len(docs)} document(s))")
        else:
            out[CHOICE] = _yaml(folder, {
                "task": CHOICE, "output_type": "multiple_choice", "doc_to_text": "{{context}}",
                "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}", "target_delimiter": "",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}, items)
    if PPL in names:
        records = [{"text": d[:MAX_DOC_CHARS]} for d in docs]
        if not records:
            raise EvalTaskError(f"{PPL}: the validation split has no documents")
        out[PPL] = _yaml(folder, {
            "task": PPL, "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
            "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]},
            records)
    if CHAT_QA in names:
        render, end_of_turn = chat
        items = question_records(Path(e.chat_questions), render, e.seed)
        out[CHAT_QA] = _yaml(folder, {
            "task": CHAT_QA, "output_type": "generate_until", "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}", "target_delimiter": "",
            "generation_kwargs": {"until": [t for t in end_of_turn if t] or ["\n\n"], "do_sample": False,
                                  "max_gen_toks": e.max_gen_tokens},
            "filter_list": [{"name": "strip", "filter": [{"function": "remove_whitespace"},
                                                         {"function": "take_first"}]}],
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}, items)
    return out
