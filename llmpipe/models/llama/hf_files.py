"""The tokenizer and generation files of a Hugging Face folder, so that transformers' AutoTokenizer and
pipeline, vLLM, TGI and converters (CTranslate2's) take consolidate's hf/ folder as it is:

    tokenizer_config.json    tokenizer_class PreTrainedTokenizerFast (the tokenizer.json beside it), the
                             special tokens, model_max_length, and the chat template of a chat run
    special_tokens_map.json  the special tokens again (older readers take them from here)
    generation_config.json   bos/pad ids, eos_token_id as a list (eos, then the chat template's end-of-turn
                             tokens that are single tokens), default sampling

The special tokens are the run's tokenizer's: eos is data.tokenizer.eos_token (what training put after
every document), bos the special token its post-processor puts first (none for llmpipe's own BPE), unk
its BPE model's unknown token, pad a special token named as pads are, else eos (so batching works).

A model.init_from folder's own tokenizer_config.json / generation_config.json values are carried over
(`read_carried`). These files are untrusted input: each is read within the manifest reader's bounds (size,
nesting), and every value used is checked: a special token must be a token of the run's tokenizer, an id
inside the model's vocabulary, a sampling setting a finite number in its range; anything else is refused
with one line naming the file and the field. Keys llmpipe does not use are not carried (a tokenizer_config's
tokenizer_class, for one: the folder holds tokenizer.json only).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmpipe.manifest import read_json_bounded
from llmpipe.models.llama.hf import HFFolderError

TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, GENERATION_CONFIG = ("tokenizer_config.json", "special_tokens_map.json",
                                                           "generation_config.json")
SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")
MAX_TOKEN_CHARS = 256
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<|finetune_right_pad_id|>")
# What generation_config.json says when init_from's does not: Llama 3's instruct models' sampling.
DEFAULT_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
# generation_config.json's sampling keys carried from init_from, each with its check: (type, low, high, low open)
_SAMPLING = {"do_sample": (bool, None, None, False), "temperature": (float, 0.0, 100.0, True),
             "top_p": (float, 0.0, 1.0, True), "top_k": (int, 0, 1 << 20, False),
             "repetition_penalty": (float, 0.0, 100.0, True), "max_new_tokens": (int, 1, 1 << 24, False)}


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from an untrusted file (None when there is no file), read against the manifest
    reader's bounds (size, nesting); HFFolderError naming the file otherwise."""
    try:
        data = read_json_bounded(path)
    except FileNotFoundError:
        return None
    except ValueError as err:
        raise HFFolderError(f"{path}: {err}") from None
    if not isinstance(data, dict):
        raise HFFolderError(f"{path}: expected a JSON object")
    return data


def _token(value: Any, where: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken object ({"content":
    ...}) or null."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TOKEN_CHARS:
        raise HFFolderError(f"{where}: expected a token (a string of 1..{MAX_TOKEN_CHARS} characters), "
                            f"got {value!r:.60}")
    return value


def _ids(value: Any, where: str, vocab_size: int) -> list[int]:
    values = value if isinstance(value, list) else [value]
    if not values or len(values) > 64 or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise HFFolderError(f"{where}: expected a token id or a list of at most 64, got {value!r:.60}")
    bad = [v for v in values if not 0 <= v < vocab_size]
    if bad:
        raise HFFolderError(f"{where}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return values


def _sampling(key: str, value: Any, where: str) -> Any:
    kind, low, high, open_low = _SAMPLING[key]
    if kind is bool:
        if not isinstance(value, bool):
            raise HFFolderError(f"{where}: expected true or false, got {value!r:.60}")
        return value
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if ok and kind is float:
        ok = math.isfinite(value)
    if not ok or value < low or (open_low and value == low) or value > high:
        span = f"({low:g}, {high:g}]" if open_low else f"[{low}, {high}]"
        raise HFFolderError(f"{where}: expected a {'number' if kind is float else 'whole number'} in {span}, "
                            f"got {value!r:.60}")
    return kind(value)


@dataclass
class Carried:
    """What a model.init_from folder's tokenizer_config.json and generation_config.json say, checked."""

    tokens: dict[str, str] = field(default_factory=dict)  # special token name -> token
    ids: dict[str, list[int]] = field(default_factory=dict)  # bos/eos/pad_token_id -> ids
    sampling: dict[str, Any] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)  # tokens' key -> the file it came from


def read_carried(folder: str | Path | None, vocab_size: int) -> Carried:
    """The values of `folder`'s tokenizer_config.json and generation_config.json llmpipe carries into
    its hf/ folder (none without a folder or files), each checked as far as the files alone tell
    (the tokens against the run's tokenizer: `check_tokens`)."""
    out = Carried()
    if not folder:
        return out
    path = Path(folder) / TOKENIZER_CONFIG
    for key, value in (read_json(path) or {}).items():
        if key in SPECIAL:
            token = _token(value, f"{path}: {key}")
            if token is not None:
                out.tokens[key], out.source[key] = token, str(path)
    path = Path(folder) / GENERATION_CONFIG
    for key, value in (read_json(path) or {}).items():
        if key in ("bos_token_id", "eos_token_id", "pad_token_id") and value is not None:
            out.ids[key] = _ids(value, f"{path}: {key}", vocab_size)
            if key != "eos_token_id" and len(out.ids[key]) != 1:
                raise HFFolderError(f"{path}: {key}: expected one token id, got {value!r:.60}")
        elif key in _SAMPLING and value is not None:
            out.sampling[key] = _sampling(key, value, f"{path}: {key}")
    return out


def _first_special(processor: Any) -> str | None:
    """The special token a tokenizer.json post-processor puts before the text (its bos), or None."""
    if not isinstance(processor, dict):
        return None
    if processor.get("type") == "Sequence":
        for p in processor.get("processors") or []:
            found = _first_special(p)
            if found:
                return found
        return None
    if processor.get("type") == "TemplateProcessing":
        single = processor.get("single") or []
        first = single[0] if isinstance(single, list) and single else None
        if isinstance(first, dict) and isinstance(first.get("SpecialToken"), dict):
            token = first["SpecialToken"].get("id")
            return token if isinstance(token, str) else None
    return None


def special_tokens(tokenizer, eos_token: str, carried: Carried | None = None) -> dict[str, str | None]:
    """bos/eos/pad/unk of the run's `tokenizer` (a `tokenizers.Tokenizer`), init_from's where it names
    them; HFFolderError when a carried token is not one of the tokenizer's."""
    spec = json.loads(tokenizer.to_str())
    unk = (spec.get("model") or {}).get("unk_token")
    specials = {t.get("content") for t in spec.get("added_tokens") or [] if t.get("special")}
    pad = next((p for p in PAD_NAMES if p in specials), None)
    tokens = {"bos_token": _first_special(spec.get("post_processor")), "eos_token": eos_token,
              "pad_token": pad, "unk_token": unk if isinstance(unk, str) else None}
    for key, token in (carried.tokens if carried else {}).items():
        if tokenizer.token_to_id(token) is None:
            raise HFFolderError(f"{carried.source[key]}: {key}: {token!r} is not a token of the run's tokenizer")
        tokens[key] = token
    tokens = {k: v if v is None or tokenizer.token_to_id(v) is not None else None for k, v in tokens.items()}
    tokens["pad_token"] = tokens["pad_token"] or tokens["eos_token"]
    return tokens


def single_token_ids(tokenizer, texts: list[str]) -> list[int]:
    """The ids of those `texts` (a chat template's end-of-turn strings) that are one token each."""
    out = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) == 1 and ids[0] not in out:
            out.append(ids[0])
    return out


def hf_files(tokenizer, eos_token: str, max_len: int, chat_template: str | None = None,
             end_of_turn: list[str] = (), carried: Carried | None = None) -> dict[str, dict[str, Any]]:
    """{file name: JSON object} of tokenizer_config.json, special_tokens_map.json and
    generation_config.json for a folder whose tokenizer.json is `tokenizer`."""
    carried = carried or Carried()
    tokens = special_tokens(tokenizer, eos_token, carried)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens, "model_max_length": max_len,
                        "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    ids = {f"{k}_id": tokenizer.token_to_id(v) for k, v in tokens.items() if v is not None and k != "unk_token"}
    # eos first (transformers' pipeline pads with the first), then init_from's, training's, the end-of-turn tokens
    eos = [ids["eos_token_id"], *carried.ids.get("eos_token_id", []), tokenizer.token_to_id(eos_token),
           *single_token_ids(tokenizer, list(end_of_turn))]
    generation = {**{k: v for k, v in ids.items() if k != "eos_token_id"},
                  **{k: v[0] for k, v in carried.ids.items() if k != "eos_token_id"},
                  "eos_token_id": list(dict.fromkeys(eos)), **DEFAULT_SAMPLING, **carried.sampling}
    return {TOKENIZER_CONFIG: tokenizer_config,
            SPECIAL_TOKENS_MAP: {k: v for k, v in tokens.items() if v is not None},
            GENERATION_CONFIG: generation}


def write_hf_files(folder: Path, files: dict[str, dict[str, Any]]) -> None:
    for name, data in files.items():
        (Path(folder) / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
