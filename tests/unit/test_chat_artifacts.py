"""Issue 24 items 2 (the template's digest from training to every artifact), 6 (a chat run's hf/ folder) and 7
(`llmpipe generate --chat`), on one small chat run: the prepare_data stage on the demo's conversation set
(chatml), a real 1-step training, the real consolidate and export_onnx stage functions. Then the
consolidated weights are set to a bigram model whose greedy answer to any question is "Hi" and the
end-of-turn token, so generation's stopping is exact (the tiny model's trained text is noise)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmpipe.chat import synth
from llmpipe.chat.template import BUILTIN_TEMPLATES, load_template
from llmpipe.checkpoint import consolidate
from llmpipe.checkpoint.template_digest import TemplateDigestError, digest
from llmpipe.cli import main
from llmpipe.data.tokenizer import train_tokenizer
from llmpipe.export import onnx as export
from llmpipe.manifest import Manifest, file_entry
from llmpipe.models.llama import io as model_io
from llmpipe.stages import StageContext, StageError, stage_dir
from llmpipe.tools.generate import ChatStreamer, run_generate
from llmpipe.train.loop import train
from tests.conftest import make_cfg

CHATML = BUILTIN_TEMPLATES["chatml"]
SHA = digest(CHATML)
EOS = "<|endoftext|>"


def _publish(folder: Path, stage: str, outputs: dict[str, str], metrics: dict) -> None:
    """The stage's manifest (a folder output listed file by file, as stages.py does)."""
    entries = {}
    for name, rel in outputs.items():
        path = folder / rel
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        for f in files:
            key = name if f == path else f"{name}/{f.relative_to(path).as_posix()}"
            entries[key] = file_entry(folder, f.relative_to(folder).as_posix())
    Manifest(stage, "completed", "test", entries, metrics=metrics).write(folder)


def _republish(folder: Path) -> None:
    """What a tamperer does after editing a file: the manifest made to match the files again."""
    m = Manifest.read(folder)
    m.outputs = {name: file_entry(folder, e["path"]) for name, e in m.outputs.items()}
    m.write(folder)


def _prepare(cfg) -> tuple[Path, object]:
    """The real prepare_data stage on the demo's conversation set (chatml)."""
    from llmpipe.data.tokenizer import load_tokenizer
    from llmpipe.stages import run_stage

    run_stage("prepare_data", cfg)
    folder = stage_dir(cfg.run_dir(), "prepare_data")
    return folder, load_tokenizer(folder / "tokenizer.json")


def _bigram(folder: Path, tok) -> None:
    """Consolidated weights whose next token depends on the current one alone (attention and MLP outputs
    zero): every token predicts itself but the cycle last-of-prompt -> "H" -> "i" -> <|im_end|> -> ..."""
    weights = load_file(str(folder / model_io.WEIGHTS))
    for name in weights:
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            weights[name].zero_()
    emb = torch.randn(weights["tok_embeddings.weight"].shape, generator=torch.Generator().manual_seed(0))
    prompt_end = tok.encode("<|im_start|>assistant\n").ids[-1]
    cycle = [prompt_end, tok.token_to_id("H"), tok.token_to_id("i"), tok.token_to_id("<|im_end|>")]
    pred = list(range(len(emb)))
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        pred[b] = a
    weights.update({"tok_embeddings.weight": emb, "output.weight": emb[pred].clone()})
    save_file(weights, str(folder / model_io.WEIGHTS))


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chat")
    synth.write(root / "set", seed=1, n_arithmetic=100)
    cfg = make_cfg(root, train__max_steps=1, train__checkpoint={"every_steps": 1},
                   data={"inputs": [str(root / "set" / "train.jsonl")], "format": "chat", "chat_template": "chatml",
                         "seq_len": 64, "tokenizer": {"vocab_size": 300}, "workers": 1},
                   export={"kv_cache": False, "kv_cache_len": 64, "parity_shapes": [[1, 8]]})
    run = cfg.run_dir()
    prep, tok = _prepare(cfg)
    trained = stage_dir(run, "train")
    train(cfg, prep, trained)
    (step,) = (trained / "checkpoints").glob("step-*")
    _publish(trained, "train", {"checkpoint": step.relative_to(trained).as_posix()}, {})
    inputs = {"train": (trained, Manifest.read(trained)), "prepare_data": (prep, Manifest.read(prep))}
    folder = stage_dir(run, "consolidate")
    folder.mkdir()
    result = consolidate.run(StageContext(cfg, "consolidate", run, folder, inputs, "fp"))
    _bigram(folder, tok)
    _publish(folder, "consolidate", result.outputs, result.metrics)
    folder = stage_dir(run, "export_onnx")
    folder.mkdir()
    result = export.run(StageContext(cfg, "export_onnx", run, folder,
                                     {"consolidate": (stage_dir(run, "consolidate"), Manifest.read(
                                         stage_dir(run, "consolidate")))}, "fp"))
    _publish(folder, "export_onnx", result.outputs, result.metrics)
    return run


def _copy(chat_run: Path, tmp_path: Path) -> Path:
    return shutil.copytree(chat_run, tmp_path / "run")


def _tokenizer(run: Path):
    from llmpipe.data.tokenizer import load_tokenizer

    return load_tokenizer(stage_dir(run, "consolidate") / model_io.TOKENIZER)


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# -- the hf/ folder and the digests ------------------------------------------------------------------


def test_the_hf_folder_renders_every_conversation_exactly_as_training_s_template(chat_run):
    transformers = pytest.importorskip("transformers")
    hf = stage_dir(chat_run, "consolidate") / "hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    template = load_template(CHATML, "chatml")
    for messages in ([{"role": "user", "content": "What is 2 + 3?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "7 * 6?"}]):
        for prompt in (False, True):
            assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
                   template.render(messages, add_generation_prompt=prompt, bos_token="", eos_token=EOS)
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (EOS, EOS, None)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert transformers.GenerationConfig.from_pretrained(hf).eos_token_id == [0, end]  # eos, then the end of turn


def test_consolidate_and_export_record_training_s_digest_and_keep_the_template_beside_their_files(chat_run):
    for stage in ("consolidate", "export_onnx"):
        folder = stage_dir(chat_run, stage)
        assert Manifest.read(folder).metrics["chat_template_sha256"] == SHA
        assert (folder / "chat_template.jinja").read_text() == CHATML
        assert Manifest.read(folder).verify(folder) is None


def test_consolidate_refuses_a_data_folder_whose_template_is_not_the_one_it_recorded(chat_run, tmp_path):
    run = _copy(chat_run, tmp_path)
    prep = stage_dir(run, "prepare_data")
    edited = CHATML.replace("<|im_end|>", "<|im_end|>\n")
    (prep / "chat_template.jinja").write_text(edited)
    cfg = make_cfg(tmp_path)
    inputs = {"train": (stage_dir(run, "train"), Manifest.read(stage_dir(run, "train"))),
              "prepare_data": (prep, Manifest.read(prep))}
    (tmp_path / "work").mkdir()
    with pytest.raises(TemplateDigestError) as err:
        consolidate.run(StageContext(cfg, "consolidate", run, tmp_path / "work", inputs, "fp"))
    assert str(err.value) == (f"{prep / 'chat_template.jinja'}: chat template sha256 {digest(edited)[:12]} differs "
                              f"from training's {SHA[:12]}; refusing an artifact whose chat template is not the one "
                              "the model was trained with (re-run the stage that wrote it)")


def test_export_onnx_refuses_a_consolidated_model_whose_hf_template_was_edited_before_exporting(chat_run, tmp_path):
    run = _copy(chat_run, tmp_path)
    folder = stage_dir(run, "consolidate")
    config = json.loads((folder / "hf" / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("assistant", "bot")
    (folder / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    _republish(folder)
    (tmp_path / "work").mkdir()
    ctx = StageContext(make_cfg(tmp_path), "export_onnx", run, tmp_path / "work",
                       {"consolidate": (folder, Manifest.read(folder))}, "fp")
    with pytest.raises(TemplateDigestError, match=r"^(.+)/hf/tokenizer_config.json: chat template sha256 "
                                                  rf"{digest(config['chat_template'])[:12]} differs from training's "
                                                  rf"{SHA[:12]}; refusing"):
        export.run(ctx)
    assert not any((tmp_path / "work").iterdir())  # refused before anything was exported


# -- llmpipe generate --chat --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["torch", "fp32"])
def test_generate_chat_prints_only_the_answer_and_stops_at_the_end_of_turn_token(chat_run, variant, capsys):
    assert main(["generate", str(chat_run), "--chat", "What is 2 + 3?", "--variant", variant,
                 "--max-new-tokens", "20"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hi\n"  # neither the prompt nor <|im_end|>
    prompt = load_template(CHATML, "x").render([{"role": "user", "content": "What is 2 + 3?"}],
                                               add_generation_prompt=True)
    n = len(_tokenizer(chat_run).encode(prompt).ids)
    assert f"prompt {n} tokens, 3 new tokens," in captured.err  # H, i, <|im_end|>: stopped, not 20


def test_a_system_message_is_rendered_before_the_question(chat_run):
    alone = run_generate(chat_run, None, 4, "torch", chat="Hi", out=io.StringIO())
    system = run_generate(chat_run, None, 4, "torch", chat="Hi", system="Be brief.", out=io.StringIO())
    rendered = load_template(CHATML, "x").render([{"role": "system", "content": "Be brief."}], bos_token="",
                                                 eos_token=EOS)
    assert system["prompt_tokens"] == alone["prompt_tokens"] + len(_tokenizer(chat_run).encode(rendered).ids)
    assert system["text"] == alone["text"] == "Hi"


def test_a_stop_string_of_several_tokens_ends_the_answer_and_no_part_of_it_is_ever_printed():
    tok = train_tokenizer(["Hello world, the END is near"] * 10, 300)

    class Writes(io.StringIO):
        def __init__(self):
            super().__init__()
            self.pieces: list[str] = []

        def write(self, s):
            self.pieces.append(s)
            return super().write(s)

    out = Writes()
    ids = tok.encode("Hello wor END more").ids
    stream = ChatStreamer(tok, out, stop_ids=[0], stop_strings=["END"])
    for i in ids:
        stream(torch.tensor([i]).numpy())
        if stream.stop():
            break
    assert stream.finish() == out.getvalue() == "Hello wor "
    assert all("E" not in piece for piece in out.pieces)


def test_chat_on_a_run_without_a_chat_template_is_one_line(tmp_path, capsys):
    folder = stage_dir(tmp_path / "text", "consolidate")
    folder.mkdir(parents=True)
    (folder / model_io.WEIGHTS).write_bytes(b"weights")
    _publish(folder, "consolidate", {"model": model_io.WEIGHTS}, {})
    assert main(["generate", str(tmp_path / "text"), "--chat", "hello"]) == 1
    assert _error(capsys) == (f"error: --chat: {tmp_path / 'text'} has no chat template (it was trained on text, "
                              "data.format: text); use --prompt")


def test_system_without_chat_is_refused_before_anything_is_loaded(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x", "--system", "Be brief."]) == 2
    assert _error(capsys) == "error: --system: only with --chat (a system message for the chat template)"


def _edit_hf(run: Path) -> tuple[Path, str]:
    path = stage_dir(run, "consolidate") / "hf" / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] += "{# edited #}"
    path.write_text(json.dumps(config))
    return path, config["chat_template"]


def _edit_jinja(run: Path, stage: str) -> tuple[Path, str]:
    path = stage_dir(run, stage) / "chat_template.jinja"
    path.write_text(CHATML + "\n")
    return path, CHATML + "\n"


@pytest.mark.parametrize("edit, variant", [
    (_edit_hf, "torch"),
    (lambda run: _edit_jinja(run, "consolidate"), "torch"),
    (lambda run: _edit_jinja(run, "prepare_data"), "torch"),
    (lambda run: _edit_jinja(run, "export_onnx"), "fp32"),
], ids=["hf-tokenizer-config", "consolidate-jinja", "data-jinja", "export-jinja"])
def test_generate_refuses_an_artifact_whose_template_differs_from_training_s_naming_the_file(
        chat_run, tmp_path, capsys, edit, variant):
    run = _copy(chat_run, tmp_path)
    path, source = edit(run)
    _republish(path.parent if path.parent.name != "hf" else path.parent.parent)  # the manifest made to match
    for mode in (["--chat", "hi"], ["--prompt", "hi"]):
        assert main(["generate", str(run), *mode, "--variant", variant]) == 1
        assert _error(capsys) == (f"error: {path}: chat template sha256 {digest(source)[:12]} differs from "
                                  f"training's {SHA[:12]}; refusing an artifact whose chat template is not the "
                                  "one the model was trained with (re-run the stage that wrote it)")


def test_an_edit_the_manifest_was_not_made_to_match_is_refused_by_the_manifest(chat_run, tmp_path, capsys):
    run = _copy(chat_run, tmp_path)
    _edit_hf(run)
    assert main(["generate", str(run), "--chat", "hi", "--variant", "torch"]) == 1
    assert "hf/tokenizer_config.json" in _error(capsys)


def test_consolidate_s_stage_error_names_init_from_when_its_token_is_not_the_tokenizer_s(chat_run, tmp_path):
    init = tmp_path / "init"
    init.mkdir()
    (init / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    tok = stage_dir(chat_run, "prepare_data") / "tokenizer.json"
    args = model_io.read_args(stage_dir(chat_run, "consolidate"))
    with pytest.raises(StageError, match=r"^consolidate: model.init_from: (.+)/init/tokenizer_config.json: "
                                         r"eos_token: '<\|eot_id\|>' is not a token of the run's tokenizer$"):
        consolidate.folder_files(tok, EOS, args, CHATML, str(init))


def test_the_benchmark_s_sample_of_a_chat_run_is_the_answer_to_its_prompt_asked_in_the_template(chat_run):
    from llmpipe.bench import llm
    from llmpipe.bench.run import chat_sample
    from llmpipe.infer.decode import TorchEngine
    from llmpipe.tools import report

    folder = stage_dir(chat_run, "consolidate")
    cfg = make_cfg(chat_run, benchmark={"llm": {"sample_prompt": "What is 2 + 3?", "sample_tokens": 12}})
    ctx = StageContext(cfg, "benchmark", chat_run, chat_run, {"consolidate": (folder, Manifest.read(folder))}, "fp")
    sample = chat_sample(ctx, _tokenizer(chat_run))
    assert sample[0] == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    got = llm.sample_text(TorchEngine(model_io.load_model(folder)), _tokenizer(chat_run), *sample)
    assert (got["text"], len(got["tokens"]), got["chat"]) == ("Hi", 3, True)
    html = report._llm_section({"samples": {"cpu/torch": got}, "prefill": [], "decode": []}, "06_benchmark")
    assert "cpu/torch (chat: the conversation as the template renders it, then the answer)" in html
