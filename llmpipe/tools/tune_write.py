"""`llmpipe tune buckets --write`: `write_bucket_cap` sets the winner in the config file with a minimal
text edit (comments and order kept), verified against the parsed YAML before the file is replaced. A
symlinked config has its target edited; the original is kept as CONFIG.bak, or CONFIG.bak.1, .2, ...
when earlier backups exist (one is never overwritten, nor written through a link).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

import yaml

from llmpipe import config as config_mod
from llmpipe.config import ConfigError
from llmpipe.tools.tune import TuneError

KEY = ("train", "parallel", "bucket_cap_mb")
MAX_BACKUPS = 100  # CONFIG.bak, CONFIG.bak.1 ... CONFIG.bak.99: --write refuses beyond

_FOUND = re.compile(r"(?<![\w-])bucket_cap_mb[ \t]*:[ \t]*(?P<value>[^,}\s#]*)")
_TOP = re.compile(r"train[ \t]*:[ \t]*(#.*)?$")
_PARALLEL = re.compile(r"(?P<indent>[ \t]+)parallel[ \t]*:[ \t]*(?P<rest>.*)$")


def _number(v: float) -> str:
    """`v` as a YAML number PyYAML reads back as `v` (it reads `1e-05` as a string, `1.0e-05` as a float)."""
    text = str(int(v)) if v == int(v) else repr(v)
    return text.replace("e", ".0e", 1) if "e" in text and "." not in text else text


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _content(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith("#")


def _edit_existing(text: str, value: str) -> str | None:
    """Replace the value of the one uncommented `bucket_cap_mb:` (block or flow style); None if there are several."""
    found = [m for m in _FOUND.finditer(text)
             if "#" not in text[text.rfind("\n", 0, m.start()) + 1:m.start()]]
    if len(found) != 1:
        return None
    m = found[0]
    return text[:m.start("value")] + value + text[m.end("value"):]


def _insert(text: str, value: str) -> str | None:
    """Add bucket_cap_mb under a block-style `train:` (into its `parallel:`, block or flow, or a new one),
    or a new train section at the end; None when the file's shape is not one of these."""
    nl = "\r\n" if "\r\n" in text else "\n"
    lines = text.splitlines(keepends=True)
    tops = [i for i, ln in enumerate(lines) if _TOP.match(ln.rstrip("\r\n"))]
    if not tops:
        if re.search(r"^train\b", text, re.M):
            return None  # train in another shape (flow style, a key with odd spacing)
        sep = "" if not text or text.endswith("\n") else nl
        return text + sep + f"train:{nl}  parallel:{nl}    bucket_cap_mb: {value}{nl}"
    start = tops[0] + 1
    end = next((i for i in range(start, len(lines)) if _content(lines[i]) and _indent(lines[i]) == 0), len(lines))
    children = [i for i in range(start, end) if _content(lines[i])]
    child = " " * (_indent(lines[children[0]]) if children else 2)
    for i in children:
        m = _PARALLEL.match(lines[i].rstrip("\r\n"))
        if not m or m["indent"] != child:
            continue
        rest = m["rest"]
        if rest.startswith("{"):
            inner = "" if re.match(r"\{\s*\}", rest) else ", "
            lines[i] = lines[i].replace("{", "{bucket_cap_mb: " + value + inner, 1)
        elif not rest or rest.startswith("#"):
            below = next((j for j in range(i + 1, end) if _content(lines[j])), None)
            deeper = below is not None and _indent(lines[below]) > len(child)
            grand = " " * _indent(lines[below]) if deeper else child * 2
            lines.insert(i + 1, f"{grand}bucket_cap_mb: {value}{nl}")
        else:
            return None
        return "".join(lines)
    lines.insert(start, f"{child}parallel:{nl}{child * 2}bucket_cap_mb: {value}{nl}")
    return "".join(lines)


def _unshared(tree: Any) -> Any:
    """A copy of a parsed YAML tree in which no two places share a dict or list."""
    if isinstance(tree, dict):
        return {k: _unshared(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unshared(v) for v in tree]
    return tree


def edit_text(text: str, v: float) -> str | None:
    """`text` (a config's YAML) with train.parallel.bucket_cap_mb set to `v` and nothing else changed, or
    None when no minimal edit does that (checked by parsing both)."""
    try:
        old = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return None
    expected = _unshared(old)  # NOTE: not deepcopy, which keeps an alias's sharing: the edit must change one place
    node = expected
    for key in KEY[:-1]:
        if not isinstance(node, dict):
            return None
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    if not isinstance(node, dict):
        return None
    node[KEY[-1]] = v
    value = _number(v)
    for new in (_edit_existing(text, value), _insert(text, value)):
        try:
            if new is not None and yaml.safe_load(new) == expected:
                return new
        except yaml.YAMLError:
            continue
    return None


def _backup(path: Path, data: bytes, st: os.stat_result) -> Path:
    """`data`, the original of `path`, saved in a new file `path`.bak, or `path`.bak.1, .2, ... when that
    name is taken: an earlier backup is never overwritten, and a link planted at one of the names is
    never written through (O_EXCL creates the file itself or fails)."""
    for i in range(MAX_BACKUPS):
        backup = path.with_name(f"{path.name}.bak" + (f".{i}" if i else ""))
        try:
            fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(fd)
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))  # as shutil.copy2 kept them
        return backup
    raise TuneError(f"{path}: {path.name}.bak and {MAX_BACKUPS - 1} numbered backups of it exist; remove the ones "
                    "you do not need; not written")


def write_bucket_cap(path: Path, v: float, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """Set train.parallel.bucket_cap_mb to `v` in the config file `path`, keeping everything else of the
    text. A symlink's target is the file edited (the link stays). The original is kept beside the file
    edited, as a new file (see `_backup`). The edited text must load (with `overrides`, those setting
    the bucket size left out) with the new value before it replaces the file, atomically, from a
    temporary file in the same folder. Returns a line to print."""
    path = Path(path)
    target = Path(os.path.realpath(path))  # NOTE: replacing `path` itself would turn a link into a plain file
    if not target.is_file():
        raise TuneError(f"{path}: not a regular file; not written")
    data = target.read_bytes()
    st = os.stat(target)
    text = data.decode("utf-8")
    try:
        current = (yaml.safe_load(text) or {}).get("train", {}).get("parallel", {}).get("bucket_cap_mb")
    except (yaml.YAMLError, AttributeError):
        current = None
    if current == v:
        return f"{path}: train.parallel.bucket_cap_mb is already {_number(v)}; not rewritten"
    new = edit_text(text, v)
    if new is None:
        raise TuneError(f"{path}: cannot set bucket_cap_mb with a minimal edit of this file; set "
                        f"train.parallel.bucket_cap_mb: {_number(v)} there yourself")
    keep = [o for o in overrides if not o.partition("=")[0].strip().endswith("bucket_cap_mb")]
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tune-", suffix=".tmp", dir=target.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(new)
            f.flush()
            os.fsync(fd)
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
        try:
            loaded = config_mod.load(tmp, keep).train.parallel.bucket_cap_mb
        except ConfigError as err:
            raise TuneError(f"{path}: the edited file does not load ({err}); not written") from None
        if loaded != v:
            raise TuneError(f"{path}: the edited file reads bucket_cap_mb={loaded:g}, not {v:g}; not written")
        backup = _backup(target, data, st)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    where = f"{target} (the target of {path})" if path.is_symlink() else str(path)
    return f"wrote train.parallel.bucket_cap_mb: {_number(v)} to {where} (the original is {backup})"
