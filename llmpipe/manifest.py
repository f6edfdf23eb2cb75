"""Stage manifests: what a stage produced (paths, sizes, sha256), its fingerprint and metrics.

A manifest is `manifest.json` in the stage folder. It "verifies" when every listed output exists
with the recorded size and sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import llmpipe

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(root: Path, rel: str) -> dict[str, Any]:
    p = root / rel
    return {"path": rel, "bytes": p.stat().st_size, "sha256": sha256_file(p)}


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


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@dataclass
class Manifest:
    stage: str
    status: str  # "completed" | "skipped"
    fingerprint: str
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    started_at: str = ""
    finished_at: str = ""
    duration_s: float = 0.0
    reason: str | None = None
    inputs: dict[str, str] = field(default_factory=dict)  # input stage -> its fingerprint

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, stage_dir: Path) -> None:
        write_json_atomic(stage_dir / MANIFEST, self.to_dict())

    @classmethod
    def read(cls, stage_dir: Path) -> Manifest | None:
        """The manifest in `stage_dir`, or None when absent or unreadable."""
        path = Path(stage_dir) / MANIFEST
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            return cls(**known)
        except (OSError, ValueError, TypeError):
            return None

    def path(self, stage_dir: Path, name: str) -> Path:
        """Absolute path of output `name`."""
        if name not in self.outputs:
            raise KeyError(f"{self.stage}: no output named {name!r} (has {sorted(self.outputs)})")
        return Path(stage_dir) / self.outputs[name]["path"]

    def verify(self, stage_dir: Path, full: bool = True) -> str | None:
        """None when every output is present and intact; otherwise the first problem found."""
        for name, entry in self.outputs.items():
            p = Path(stage_dir) / entry["path"]
            if not p.is_file():
                return f"output {name} missing ({p})"
            if p.stat().st_size != entry["bytes"]:
                return f"output {name} has {p.stat().st_size} bytes, manifest says {entry['bytes']}"
            if full and sha256_file(p) != entry["sha256"]:
                return f"output {name} sha256 differs from the manifest"
        return None
