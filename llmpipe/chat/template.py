"""Chat templates: Hugging Face's format (the `chat_template` of a tokenizer_config.json), rendered sandboxed.

A template is untrusted code (it may come with any model folder), so it is compiled in jinja2's
`ImmutableSandboxedEnvironment` (no attribute access to Python internals, no mutation of what it is given),
its source is limited in size, and each render in time and output size. The environment mirrors the one
transformers builds in `apply_chat_template` (trim_blocks, lstrip_blocks, loopcontrols, the globals
`raise_exception` and `strftime_now`, a `tojson` that does not escape HTML), so a template renders here
exactly what transformers renders (tested for the built-in ones).

The template is one artifact: its sha256 (of the source, UTF-8) is recorded by prepare_data and checked
by every later stage that renders a conversation.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmpipe.errors import UserError

MAX_TEMPLATE_BYTES = 64 << 10  # a real chat template is a few KiB; the largest on the Hub are ~20 KiB
RENDER_SECONDS = 2.0  # per render; a conversation renders in well under a millisecond
MAX_OUTPUT_CHARS = 64 << 20  # per render (a conversation is at most data.max_record_bytes, 16 MiB)
MAX_INT_ARGUMENT = 1 << 24  # larger numbers in a call or a repetition are refused (e.g. 'x' * 10**10)
BUILTIN_NAMES = ("chatml", "llama3")
# The probe conversation that shows what a template writes after an assistant's words.
_PROBE = "\x00llmpipe-probe\x00"


class TemplateError(UserError):
    """A chat template that cannot be used: one line naming where it came from and what failed."""


def _builtin_source(name: str) -> str:
    return resources.files("llmpipe.chat").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


BUILTIN_TEMPLATES: dict[str, str] = {name: _builtin_source(name) for name in BUILTIN_NAMES}


class _Deadline(Exception):
    pass


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, plus bounds on repetition and on numbers handed to calls (memory bombs)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise jinja2.exceptions.SecurityError(f"exponent {right} is too large")
        if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int) or \
                isinstance(right, (str, list, tuple)) and isinstance(left, int):
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if len(seq) * max(n, 0) > MAX_OUTPUT_CHARS:
                raise jinja2.exceptions.SecurityError("repetition too large")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARGUMENT:
                raise jinja2.exceptions.SecurityError(f"argument {value} is too large")
        return super().call(__context, __obj, *args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # NOTE: as transformers: jinja's own tojson escapes HTML characters, which a chat template must not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):  # noqa: A002 (the name templates call it with)
    return datetime.now().strftime(format)


def _environment() -> _Environment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _plain(value):
    """What a template sees of a message: JSON types only (no object with methods the sandbox doesn't know)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


@dataclass
class ChatTemplate:
    """A compiled chat template. `render` raises TemplateError (one line naming `origin`) on any failure."""

    source: str
    origin: str
    sha256: str = ""
    end_of_turn: list[str] = field(default_factory=list)
    _compiled: jinja2.Template | None = field(default=None, repr=False, compare=False)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False, bos_token: str = "",
               eos_token: str = "") -> str:
        """The conversation as text, as transformers' apply_chat_template(..., tokenize=False) renders it."""
        context = {"messages": _plain(list(messages)), "tools": None, "documents": None,
                   "add_generation_prompt": add_generation_prompt, "bos_token": bos_token, "eos_token": eos_token}
        deadline = time.monotonic() + RENDER_SECONDS
        code = self._compiled.root_render_func.__code__.co_filename

        def tracer(frame, event, arg):  # line events only inside the template's own code
            if frame.f_code.co_filename != code:
                return None
            if time.monotonic() > deadline:
                raise _Deadline
            return tracer

        pieces, size = [], 0
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            for piece in self._compiled.generate(**context):
                size += len(piece)
                if size > MAX_OUTPUT_CHARS:
                    raise TemplateError(f"chat template {self.origin}: renders more than {MAX_OUTPUT_CHARS} characters")
                pieces.append(piece)
        except _Deadline:
            raise TemplateError(f"chat template {self.origin}: rendering took longer than {RENDER_SECONDS:g} s "
                                "(a loop that does not end?)") from None
        except TemplateError:
            raise
        except Exception as err:  # a template may raise anything: its own raise_exception, a TypeError, ...
            raise TemplateError(f"chat template {self.origin}: failed to render ({_one_line(err)})") from None
        finally:
            sys.settrace(previous)
        return "".join(pieces)


def _end_of_turn(tpl: ChatTemplate) -> list[str]:
    """What the template writes after an assistant's words, whitespace stripped ([] when nothing: the caller
    then ends a turn with the tokenizer's EOS, which the template is given as `eos_token`)."""
    text = tpl.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}])
    at = text.rfind(_PROBE)
    if at < 0:
        raise TemplateError(f"chat template {tpl.origin}: does not render the assistant's message")
    tail = text[at + len(_PROBE):].strip()
    return [tail] if tail else []


def load_template(source: str, origin: str) -> ChatTemplate:
    """Compile `source` (from `origin`: a built-in name, a file, a folder) and check that it is usable:
    within the size limit, compiles, renders a conversation, and supports add_generation_prompt."""
    if not isinstance(source, str):
        raise TemplateError(f"chat template {origin}: not a string")
    if len(source.encode("utf-8", "surrogatepass")) > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"chat template {origin}: larger than {MAX_TEMPLATE_BYTES >> 10} KiB")
    try:
        compiled = _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise TemplateError(f"chat template {origin}: syntax error on line {err.lineno} ({err.message})") from None
    except Exception as err:
        raise TemplateError(f"chat template {origin}: does not compile ({_one_line(err)})") from None
    sha = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
    tpl = ChatTemplate(source=source, origin=origin, sha256=sha, _compiled=compiled)
    tpl.end_of_turn = _end_of_turn(tpl)
    user = [{"role": "user", "content": "hi"}]
    if tpl.render(user, add_generation_prompt=True) == tpl.render(user, add_generation_prompt=False):
        raise TemplateError(f"chat template {origin}: does not support add_generation_prompt (renders nothing "
                            "for the assistant's turn to begin)")
    return tpl


def builtin_template(name: str) -> ChatTemplate:
    if name not in BUILTIN_TEMPLATES:
        raise TemplateError(f"no built-in chat template {name!r} (built-in: {', '.join(BUILTIN_NAMES)})")
    return load_template(BUILTIN_TEMPLATES[name], f"built-in {name!r}")


def template_from_file(path: str | Path) -> ChatTemplate:
    path = Path(path)
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise TemplateError(f"chat template {path}: larger than {MAX_TEMPLATE_BYTES >> 10} KiB")
        source = path.read_text(encoding="utf-8")
    except OSError as err:
        raise TemplateError(f"chat template {path}: cannot be read ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise TemplateError(f"chat template {path}: not UTF-8 text") from None
    return load_template(source, str(path))


def template_in_folder(folder: str | Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face folder's tokenizer_config.json (a string, or the list-of-dicts form:
    the one named "default"); a chat_template.jinja beside it as transformers 4.43+ writes; None when none."""
    folder = Path(folder)
    config = folder / "tokenizer_config.json"
    jinja = folder / "chat_template.jinja"
    if config.is_file():
        if config.stat().st_size > (16 << 20):
            raise TemplateError(f"{config}: larger than 16 MiB")
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise TemplateError(f"{config}: not readable JSON ({_one_line(err)})") from None
        found = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(found, list):
            named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
            if "default" not in named:
                raise TemplateError(f"{config}: chat_template is a list without a template named 'default'")
            found = named["default"]
        if found is not None:
            return load_template(found, str(config))
    if jinja.is_file():
        return template_from_file(jinja)
    return None


def resolve_template(init_from: str | None, setting: str | None) -> ChatTemplate | None:
    """The run's chat template: `model.init_from`'s folder's when it has one, else `data.chat_template`
    (a built-in name or a path to a .jinja file); None when neither names one."""
    if init_from:
        found = template_in_folder(init_from)
        if found is not None:
            return found
    if not setting:
        return None
    if setting in BUILTIN_TEMPLATES:
        return builtin_template(setting)
    if not Path(setting).exists() and "/" not in setting and not setting.endswith(".jinja"):
        raise TemplateError(f"no built-in chat template {setting!r} (built-in: {', '.join(BUILTIN_NAMES)}) "
                            "and no such file")
    return template_from_file(setting)
