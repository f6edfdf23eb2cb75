"""Module layering: what each package may import (read from the source, every import statement,
function-level ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[2] / "llmpipe"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize("files,forbidden", [
    ("parallel/*.py", "llmpipe.train"),  # strategies receive what the loop builds; they never reach up
    ("optim.py", "llmpipe.train"),
    ("optim.py", "llmpipe.parallel"),
    ("data/[cst]*.py", "llmpipe.stages"),  # the readers (corpus, shards, sampler, tokenizer) raise their own
    # errors (llmpipe.data.errors); only data/prepare.py, the stage function, knows the stage contract
    ("models/llama/model.py", "llmpipe"),  # architecture only
])
def test_packages_do_not_import_upwards(files, forbidden):
    offenders = {p.relative_to(LIB).as_posix(): sorted(m for m in _imports(p) if m == forbidden or
                                                       m.startswith(forbidden + "."))
                 for p in LIB.glob(files)}
    assert len(offenders) >= 1
    assert {k: v for k, v in offenders.items() if v} == {}
