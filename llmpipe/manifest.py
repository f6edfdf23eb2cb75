"""Stage manifests: what a stage produced (paths, sizes, sha256), its fingerprint and metrics.

A manifest is `manifest.json` in the stage folder. It is untrusted input like any other file: it is
schema-checked when read (a manifest that does not validate makes the stage "invalid", so it runs
again), its output paths must resolve inside the stage folder, and it "verifies" when every listed
output exists with the recorded size and sha256.

Hashing a large output on every check would make a rerun pay for reading every byte again, so a
verified digest is remembered in `.verified.json` beside the manifest, keyed by the file's size,
mtime, ctime and inode. Any write to the file changes its ctime (which no user-level call can set
back), so a cached digest is reused only for a file untouched since it was hashed; everything else
is hashed again. `verify(rehash=True)` ignores the cache (silent media corruption changes no stat field).

Reading either file is bounded: at most MAX_JSON_BYTES, nested at most MAX_JSON_DEPTH levels (a
deeper document raises RecursionError in json, and later in whatever walks it). Any failure to read
a manifest makes the stage "invalid"; any failure to read the digest cache costs a re-hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import pydantic

import llmpipe

MANIFEST = "manifest.json"
VERIFIED = ".verified.json"  # digest cache: relative path -> [size, mtime_ns, ctime_ns, inode, sha256]
_CHUNK = 8 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A train manifest lists every file of the final checkpoint, about 200 bytes each: 10k ranks' shards
# are a few MB. The bound keeps a hostile or damaged file from filling memory.
MAX_JSON_BYTES = 64 << 20
MAX_JSON_DEPTH = 64  # a real manifest is about 6 deep (config.train.parallel.<field>)


class ManifestError(ValueError):
    """A manifest.json that exists but cannot be trusted: unreadable, not valid JSON, or off-schema."""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def file_entry(root: Path, rel: str, cache: DigestCache | None = None) -> dict[str, Any]:
    """{path, bytes, sha256} of `root/rel`; the digest is remembered in `cache` when given."""
    p = Path(root) / rel
    before = p.stat()
    digest = sha256_file(p)
    if cache is not None and _stat_key(p.stat()) == _stat_key(before):  # unchanged while hashed
        cache.put(rel, before, digest)
    return {"path": rel, "bytes": before.st_size, "sha256": digest}


def fingerprint(payload: dict[str, Any]) -> str:
    """sha256 of a canonical JSON rendering (sorted keys) of `payload`."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def versions() -> dict[str, str]:
    out = {"llmpipe": llmpipe.__version__, "python": platform.python_version()}
    for dist in ("torch", "onnx", "onnxruntime", "tokenizers", "prefect", "deepspeed", "torch_npu"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _depth(obj: Any) -> int:
    """How deeply `obj` nests lists and dicts (iteratively: no recursion to exhaust)."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:
                todo.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def read_json_bounded(path: Path) -> Any:
    """The JSON document in `path`, read against MAX_JSON_BYTES and MAX_JSON_DEPTH.

    FileNotFoundError when absent; ValueError with the reason for anything else that goes wrong
    (unreadable, too large, not UTF-8, not JSON, nested too deeply)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise ValueError(f"unreadable ({err})") from None
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"more than {MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"unreadable ({err})") from None
    except RecursionError:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as err:
        raise ValueError(f"not valid JSON ({err})") from None
    if _depth(data) > MAX_JSON_DEPTH:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
    return data


def read_json_file(path: Path, error: type[Exception], expect: type | None = dict) -> Any:
    """The one reader of a JSON file a run or model folder provides (mlflow.json, config.json,
    tokenizer_config.json, genai_config.json, manifests): read_json_bounded (size cap, UTF-8, depth), and of
    type `expect` (an object by default). Any failure is `error` with one line: "FILE: not found" or
    "FILE: invalid: why"."""
    try:
        data = read_json_bounded(Path(path))
    except FileNotFoundError:
        raise error(f"{path}: not found") from None
    except ValueError as err:
        raise error(f"{path}: invalid: {err}") from None
    if expect is not None and not isinstance(data, expect):
        want = {dict: "an object", list: "a list"}.get(expect, expect.__name__)
        raise error(f"{path}: invalid: expected {want}, found {type(data).__name__}")
    return data


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _relative_inside(path: str) -> str:
    """An output path must be relative, POSIX, and stay below its stage folder."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or "\\" in path or any(part in ("..", "") for part in path.split("/")):
        raise ValueError(f"{path!r} is not a relative path inside the stage folder")
    return path


class OutputEntry(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    path: Annotated[str, pydantic.AfterValidator(_relative_inside)]
    bytes: Annotated[int, pydantic.Field(ge=0)]
    sha256: Annotated[str, pydantic.Field(pattern=_SHA256.pattern)]


def _check_outputs(outputs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    checked = {}
    for name, entry in outputs.items():
        try:
            checked[name] = OutputEntry.model_validate(entry).model_dump()
        except pydantic.ValidationError as err:
            first = err.errors()[0]
            field_ = ".".join(str(x) for x in first["loc"]) or "entry"
            raise ValueError(f"output {name!r}: {field_}: {first['msg']}") from None
    return checked


@dataclass
class Manifest:
    # The Annotated constraints apply when a manifest is read (Manifest.load validates through
    # pydantic); constructing one in code stays a plain dataclass.
    __pydantic_config__ = pydantic.ConfigDict(extra="forbid")

    stage: Annotated[str, pydantic.Field(min_length=1)]
    status: Literal["completed", "skipped"]
    fingerprint: Annotated[str, pydantic.Field(min_length=1)]
    outputs: Annotated[dict[str, Any], pydantic.AfterValidator(_check_outputs)] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    started_at: str = ""
    finished_at: str = ""
    duration_s: float = 0.0
    reason: str | None = None
    inputs: dict[str, str] = field(default_factory=dict)  # input stage -> content digest of what it read
    changes: list[dict[str, Any]] = field(default_factory=list)  # operational changes since: {at, operational}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, stage_dir: Path) -> None:
        write_json_atomic(stage_dir / MANIFEST, self.to_dict())

    @classmethod
    def load(cls, stage_dir: Path) -> Manifest | None:
        """The manifest in `stage_dir`, None when there is none; ManifestError when it does not validate."""
        path = Path(stage_dir) / MANIFEST
        try:
            data = read_json_bounded(path)
        except FileNotFoundError:
            return None
        except ValueError as err:
            raise ManifestError(f"{path}: {err}") from None
        try:
            return _SCHEMA.validate_python(data)
        except pydantic.ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "(top level)"
            raise ManifestError(f"{path}: {where}: {first['msg']}") from None
        except (ValueError, TypeError, RecursionError) as err:  # anything else the schema trips on
            raise ManifestError(f"{path}: does not validate ({type(err).__name__}: {err})") from None

    @classmethod
    def read(cls, stage_dir: Path) -> Manifest | None:
        """The manifest in `stage_dir`, or None when absent, unreadable or off-schema."""
        try:
            return cls.load(stage_dir)
        except ManifestError:
            return None

    def path(self, stage_dir: Path, name: str) -> Path:
        """Absolute path of output `name`; it must resolve (symlinks included) inside `stage_dir`."""
        if name not in self.outputs:
            raise KeyError(f"{self.stage}: no output named {name!r} (has {sorted(self.outputs)})")
        p = Path(stage_dir) / self.outputs[name]["path"]
        if not p.resolve().is_relative_to(Path(stage_dir).resolve()):
            raise ManifestError(f"{self.stage}: output {name} ({p}) resolves outside {stage_dir}")
        return p

    def content_digest(self) -> str:
        """What a consumer of this stage read: its status and every output's sha256. Downstream
        stages put this in their fingerprint, so new bytes upstream make them stale."""
        return fingerprint({"stage": self.stage, "status": self.status, "reason": self.reason,
                            "outputs": {n: e["sha256"] for n, e in self.outputs.items()}})

    def verify(self, stage_dir: Path, full: bool = True, rehash: bool = False) -> str | None:
        """None when every output is present and intact; otherwise the first problem found.

        full=False checks presence and sizes only; full=True also the sha256 (through the digest
        cache unless `rehash`)."""
        cache = DigestCache(stage_dir, enabled=full and not rehash)
        try:
            for name in self.outputs:
                problem = self._verify_one(stage_dir, name, full, cache)
                if problem:
                    return problem
            return None
        finally:
            cache.save()

    def _verify_one(self, stage_dir: Path, name: str, full: bool, cache: DigestCache) -> str | None:
        entry = self.outputs[name]
        try:
            p = self.path(stage_dir, name)
        except ManifestError as err:
            return str(err)
        if not p.is_file():
            return f"output {name} missing ({p})"
        st = p.stat()
        if st.st_size != entry["bytes"]:
            return f"output {name} has {st.st_size} bytes, manifest says {entry['bytes']}"
        if full:
            digest = cache.get(entry["path"], st)
            if digest is None:
                digest = file_entry(stage_dir, entry["path"], cache)["sha256"]
            if digest != entry["sha256"]:
                return f"output {name} ({p}) sha256 differs from the manifest"
        return None


_SCHEMA = pydantic.TypeAdapter(Manifest)


class DigestCache:
    """Remembered sha256 digests of a stage folder's files, keyed by their stat fields (see the module doc)."""

    def __init__(self, stage_dir: Path, enabled: bool = True):
        self.path = Path(stage_dir) / VERIFIED
        self.enabled, self.dirty = enabled, False
        self.entries: dict[str, list] = {}
        if enabled:
            try:
                data = read_json_bounded(self.path)
                self.entries = {k: v for k, v in data.items() if isinstance(v, list) and len(v) == 5}
            except (OSError, ValueError, AttributeError):  # absent, damaged, or not an object
                self.entries = {}

    def get(self, rel: str, st: os.stat_result) -> str | None:
        entry = self.entries.get(rel) if self.enabled else None
        return entry[4] if entry and entry[:4] == _stat_key(st) and isinstance(entry[4], str) else None

    def put(self, rel: str, st: os.stat_result, digest: str) -> None:
        if self.enabled:
            self.entries[rel] = [*_stat_key(st), digest]
            self.dirty = True

    def save(self) -> None:
        """Best effort: a read-only or full disk only costs the next check a re-hash."""
        if self.dirty:
            try:
                write_json_atomic(self.path, self.entries)
            except OSError:
                pass
            self.dirty = False
