"""The chat template is one artifact from training to deployment: every copy is checked against training's.

prepare_data records the digest (sha256 of the template's UTF-8 source) of the template it rendered the
conversations with, `chat_template_sha256` in its manifest's metrics, beside data/chat_template.jinja.
consolidate and export_onnx record the same metric and keep a copy of the template beside what they
write (consolidate: chat_template.jinja beside model.safetensors and the `chat_template` of
hf/tokenizer_config.json; export_onnx: chat_template.jinja beside the graphs). Every reader (export_onnx,
generate, the benchmark's samples) checks each copy against training's digest first and refuses, with
one line naming the file and both digests, an artifact whose template is not the one the model was
trained with: the failure users report most (garbage or endless output, no error) comes from exactly
that drift. A text run has no template anywhere ("none"), and a template that appears in one of its
artifacts is refused the same way.

The stage manifests' sha256 of every file already stop a file edited after its stage; this check
also holds when a manifest was rewritten to match, when a later stage was run against an older one,
and for the parts of a file the manifest cannot tell apart (a tokenizer_config.json edited elsewhere).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from llmpipe.chat.template import MAX_TEMPLATE_BYTES
from llmpipe.errors import UserError
from llmpipe.manifest import Manifest
from llmpipe.models.llama.hf_files import TOKENIZER_CONFIG, read_json

TEMPLATE_FILE = "chat_template.jinja"
METRIC = "chat_template_sha256"
RENDER = "chat_render"  # consolidate's metric: the bos_token / eos_token training rendered conversations with


class TemplateDigestError(UserError):
    """An artifact whose chat template differs from training's; one line naming the file and both digests."""


def digest(source: str | None) -> str | None:
    """sha256 of a template's source as prepare_data records it (llmpipe.chat.template.ChatTemplate.sha256),
    None for no template."""
    return None if source is None else hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()


def _short(sha: str | None) -> str:
    return sha[:12] if sha else "none"


def mismatch(path: Path | str, have: str | None, want: str | None) -> TemplateDigestError:
    return TemplateDigestError(f"{path}: chat template sha256 {_short(have)} differs from training's "
                               f"{_short(want)}; refusing an artifact whose chat template is not the one the "
                               "model was trained with (re-run the stage that wrote it)")


def read_template(path: Path) -> str:
    """A chat_template.jinja's source, bounded in size; TemplateDigestError naming the file otherwise."""
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise TemplateDigestError(f"{path}: larger than {MAX_TEMPLATE_BYTES >> 10} KiB, not a chat template")
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise TemplateDigestError(f"{path}: cannot be read ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise TemplateDigestError(f"{path}: not UTF-8 text") from None


def copies(folder: Path) -> list[tuple[Path, str | None]]:
    """Every copy of the chat template an artifact folder holds, (file, source or None): its
    chat_template.jinja, and hf/tokenizer_config.json's chat_template (None when that file has none)."""
    from llmpipe.models.llama.hf import HFFolderError

    found: list[tuple[Path, str | None]] = []
    if (folder / TEMPLATE_FILE).is_file():
        found.append((folder / TEMPLATE_FILE, read_template(folder / TEMPLATE_FILE)))
    config = folder / "hf" / TOKENIZER_CONFIG
    try:
        data = read_json(config)
    except HFFolderError as err:
        raise TemplateDigestError(str(err)) from None
    if data is not None:
        source = data.get("chat_template")
        if source is not None and not isinstance(source, str):
            raise TemplateDigestError(f"{config}: chat_template: expected a string (llmpipe writes one)")
        found.append((config, source))
    return found


def check_folder(folder: Path, training: str | None) -> str | None:
    """The chat template of an artifact folder, after every copy in it is checked against training's
    digest (`training`, None for a text run); TemplateDigestError at the first that differs."""
    source = None
    for path, text in copies(folder):
        if digest(text) != training:
            raise mismatch(path, digest(text), training)
        source = text if text is not None else source
    if training is not None and source is None:
        raise mismatch(folder / TEMPLATE_FILE, None, training)
    return source


def training_digest(run_dir: Path, recorded: str | None, recorded_in: Path) -> str | None:
    """Training's template digest: prepare_data's (its manifest's metric, which its chat_template.jinja
    must hash to) when its folder is there, which the digest a later stage recorded (`recorded`, from the
    manifest `recorded_in`) must equal; else the recorded one."""
    from llmpipe.stages import stage_dir

    folder = stage_dir(run_dir, "prepare_data")
    data = Manifest.read(folder)
    if data is None:
        return recorded
    want = data.metrics.get(METRIC)
    source = read_template(folder / TEMPLATE_FILE) if (folder / TEMPLATE_FILE).is_file() else None
    if digest(source) != want:
        raise mismatch(folder / TEMPLATE_FILE, digest(source), want)
    if recorded != want:
        raise mismatch(recorded_in, recorded, want)
    return want


def consolidated_template(run_dir: Path, folder: Path, manifest: Manifest):
    """(the template, the bos/eos strings it renders with) of consolidate's folder, every copy checked
    against training's digest first; None for a text run. What a stage reading consolidate's model for chat
    (the benchmark's sample, evaluate's questions) renders conversations with."""
    from llmpipe.chat.template import load_template

    source = check_folder(folder, training_digest(run_dir, manifest.metrics.get(METRIC), folder / "manifest.json"))
    if source is None:
        return None
    return load_template(source, str(folder / TEMPLATE_FILE)), manifest.metrics.get(RENDER) or {}
