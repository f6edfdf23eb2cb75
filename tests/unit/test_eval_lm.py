"""llmpipe's lm_eval model (llmpipe.eval.lm.EngineLM over the exported ONNX graphs) against lm_eval's own
Hugging Face class (HFLM over the same weights in an hf/ folder): the same requests get the same
loglikelihoods (within 1e-4, fp32), the same rolling loglikelihoods and the same greedy text, and a local task
scores the same within its stderr. The model is a tiny random one made here."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import save_file

from llmpipe import device
from llmpipe.eval import tasks as eval_tasks
from llmpipe.eval.lm import EngineLM, ort_logits
from llmpipe.eval.stage import env_info_once
from llmpipe.export import onnx as export
from llmpipe.infer.decode import StaticEngine
from llmpipe.infer.ort import create_session
from llmpipe.models.llama import FLAVORS, Transformer
from llmpipe.models.llama import hf as hf_names
from llmpipe.models.llama.hf_files import hf_files, write_hf_files
from tests.conftest import make_cfg

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

CACHE = 64
ARGS = replace(FLAVORS["debug"], vocab_size=320, max_seq_len=64)
TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "        self.y = y\n\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """An hf/ folder and the prefill + static decoder graphs of one random debug model, its tokenizer."""
    import torch

    from llmpipe.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("evallm")
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    with torch.no_grad():  # a model whose next-token choice is not a coin flip
        model.output.weight.mul_(8.0)
    model.eval()
    tokenizer = train_tokenizer([TEXT * 4], vocab_size=ARGS.vocab_size)
    hf = root / "hf"
    hf.mkdir()
    weights = {hf_names.to_hf_name(k): v.contiguous() for k, v in model.state_dict().items() if "freqs" not in k}
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps(hf_names.hf_config(ARGS, "fp32", 0)))
    tokenizer.save(str(hf / "tokenizer.json"))
    write_hf_files(hf, hf_files(tokenizer, "<|endoftext|>", ARGS.max_seq_len))
    export.export_prefill(model, root / "model.onnx", opset=17)
    export.export_static_decoder(model, root / "decoder_static.onnx", opset=17, length=CACHE)
    return root, tokenizer


def _engine_lm(made) -> EngineLM:
    root, tokenizer = made
    cpu = device.ort_providers(["cpu"])[0]
    prefill = create_session(root / "model.onnx", cpu, 1)
    engine = StaticEngine(prefill, create_session(root / "decoder_static.onnx", cpu, 1), ARGS, CACHE)
    return EngineLM("fp32", tokenizer, ort_logits(prefill), engine, max_length=ARGS.max_seq_len, eot_id=0,
                    prefix_id=0)


def _hflm(made):
    from lm_eval.models.huggingface import HFLM

    hf = str(made[0] / "hf")
    return HFLM(pretrained=hf, tokenizer=hf, device="cpu", dtype="float32", batch_size=1,
                max_length=ARGS.max_seq_len)


def _requests(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


PAIRS = [("def add(a, b):\n", "    return a + b"), ("class Point:", " pass"), ("", "self.x = x"),
         ("        self.y = y\n\n    def ", "norm(self):"), (TEXT * 2, "\n")]  # the last: truncated on the left


def test_the_wrapper_s_loglikelihoods_equal_lm_eval_s_hf_model_s_on_the_same_requests(made):
    ours, theirs = _engine_lm(made), _hflm(made)
    a = ours.loglikelihood(_requests("loglikelihood", PAIRS))
    b = theirs.loglikelihood(_requests("loglikelihood", PAIRS))
    assert [g for _, g in a] == [g for _, g in b]
    assert np.abs(np.array([x for x, _ in a]) - np.array([x for x, _ in b])).max() <= 1e-4
    assert min(x for x, _ in a) < -1.0  # not trivially zero
    docs = [(TEXT * 3,), ("x = 1\n",)]  # the first spans several windows of max_length tokens
    ra = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", docs))
    rb = theirs.loglikelihood_rolling(_requests("loglikelihood_rolling", docs))
    assert np.abs(np.array(ra) - np.array(rb)).max() <= 1e-4
    gen = [("def add(a, b):\n", {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}),
           ("class Point:\n    def ", {"until": ["):"], "max_gen_toks": 8, "do_sample": False})]
    assert ours.generate_until(_requests("generate_until", gen)) == theirs.generate_until(
        _requests("generate_until", gen))


def test_a_local_choice_task_scores_the_same_through_both_within_its_stderr(made, tmp_path):
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    cfg = make_cfg(tmp_path, check="fields")
    docs = [TEXT.replace("Point", f"P{i}").replace("add", f"f{i}") for i in range(12)]
    local = eval_tasks.build_local(tmp_path / "tasks", [eval_tasks.CHOICE, eval_tasks.PPL], docs=docs,
                                   tokenizer=made[1], cfg=cfg, max_tokens=ARGS.max_seq_len)
    specs = [eval_tasks.task_config(p) for p in local.values()]
    manager = TaskManager(include_defaults=False)
    with env_info_once():  # torch's collect_env once, not per model
        runs = [simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=20, log_samples=False,
                                bootstrap_iters=100)["results"] for lm in (_engine_lm(made), _hflm(made))]
    ours, theirs = (r[eval_tasks.CHOICE] for r in runs)
    assert abs(ours["acc,none"] - theirs["acc,none"]) <= theirs["acc_stderr,none"]
    assert abs(runs[0][eval_tasks.PPL]["bits_per_byte,none"] - runs[1][eval_tasks.PPL]["bits_per_byte,none"]) <= 1e-5


ARC = [{"id": f"q{i}", "question": q, "choices": {"text": c, "label": ["A", "B", "C", "D"]}, "answerKey": k}
       for i, (q, c, k) in enumerate([
           ("Which is a function?", ["def add", "class Point", "self.x", "return"], "A"),
           ("Which defines a class?", ["def norm", "class Point:", "x = 1", "a + b"], "B"),
           ("What does add return?", ["a - b", "a * b", "a + b", "b"], "C"),
           ("What is stored in self.y?", ["x", "a", "b", "y"], "D")])]


def test_a_standard_task_s_yaml_runs_offline_on_a_local_copy_of_a_few_of_its_records(made, tmp_path):
    """lm_eval's own arc_easy.yaml, its dataset swapped for four ARC-Easy-shaped records written here (what a
    user with the dataset on disk gets): the wrapper and HFLM score each item alike."""
    import yaml
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from llmpipe.eval.stage import check_tasks, offline

    offline()
    shipped = Path(lm_eval.__file__).parent / "tasks" / "arc" / "arc_easy.yaml"
    (tmp_path / "arc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ARC))
    task = {k: v for k, v in yaml.safe_load(shipped.read_text()).items() if k not in ("dataset_name", "tag")}
    task.update(dataset_path="json", dataset_kwargs={"data_files": {"test": "arc.jsonl"}}, training_split=None,
                validation_split=None)
    (tmp_path / "arc_easy_local.yaml").write_text(yaml.safe_dump(task))
    cfg = make_cfg(tmp_path, check="fields", evaluate={"tasks": [str(tmp_path / "arc_easy_local.yaml")]})
    plan = eval_tasks.plan(cfg, root=tmp_path)
    specs = [eval_tasks.task_config(p, eval_tasks.read_task_yaml(p, [tmp_path])) for p in plan.yamls.values()]
    manager = TaskManager(include_defaults=False)
    check_tasks(specs, manager)
    with env_info_once():
        runs = [simple_evaluate(model=lm, tasks=specs, task_manager=manager, log_samples=True,
                                bootstrap_iters=10) for lm in (_engine_lm(made), _hflm(made))]
    ours, theirs = ([s["acc"] for s in r["samples"]["arc_easy"]] for r in runs)
    assert len(ours) == 4 and ours == theirs
    lls = [[np.array([x[0] for x in s["filtered_resps"]]) for s in r["samples"]["arc_easy"]] for r in runs]
    assert max(np.abs(a - b).max() for a, b in zip(*lls)) <= 1e-4


def test_the_chat_task_asks_each_held_out_question_in_the_template_and_both_models_answer_alike(made, tmp_path):
    """llmpipe_chat_qa from held-out conversations: the prompt is the template's rendering up to the assistant's
    turn, generation stops at its end of turn; the wrapper's answers are HFLM's, and so is the exact match."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from llmpipe.chat.synth import make_conversations
    from llmpipe.chat.template import builtin_template

    _, held_out = make_conversations(seed=0, n_arithmetic=40, n_words=4)
    questions = tmp_path / "val.jsonl"
    questions.write_text("".join(json.dumps(c) + "\n" for c in held_out[:3]))
    tpl = builtin_template("chatml")
    render = lambda messages: tpl.render(messages, add_generation_prompt=True, bos_token="", eos_token="<|endoftext|>")
    cfg = make_cfg(tmp_path, check="fields", evaluate={"chat_questions": str(questions), "max_gen_tokens": 6})
    local = eval_tasks.build_local(tmp_path / "tasks", [eval_tasks.CHAT_QA], docs=[], tokenizer=made[1], cfg=cfg,
                                   max_tokens=ARGS.max_seq_len, chat=(render, tpl.end_of_turn))
    records = [json.loads(x) for x in (tmp_path / "tasks" / "llmpipe_chat_qa.jsonl").read_text().splitlines()]
    assert records[0]["prompt"].endswith("<|im_start|>assistant\n") and records[0]["answer"].endswith(".")
    spec = eval_tasks.task_config(local[eval_tasks.CHAT_QA])
    assert spec["generation_kwargs"]["until"] == tpl.end_of_turn
    manager = TaskManager(include_defaults=False)
    with env_info_once():
        runs = [simple_evaluate(model=lm, tasks=[spec], task_manager=manager, log_samples=True, bootstrap_iters=10)
                for lm in (_engine_lm(made), _hflm(made))]
    ours, theirs = ([s["resps"] for s in r["samples"][eval_tasks.CHAT_QA]] for r in runs)
    assert len(ours) == 3 and ours == theirs
    assert runs[0]["results"][eval_tasks.CHAT_QA]["exact_match,strip"] == \
        runs[1]["results"][eval_tasks.CHAT_QA]["exact_match,strip"]
