"""Module layering: what each package may import (read from the source, every import statement,
function-level ones included; only an `if TYPE_CHECKING:` block, which never runs, is left out)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "llmpipe"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in LIB.rglob("*.py")}


class _Imports(ast.NodeVisitor):
    """(imported module or module.name, names imported) of every import statement in a module."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, list[str]]] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(a.name, []) for a in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: from the package up
            up = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join(up + ([node.module] if node.module else []))
        self.found.append((base, [a.name for a in node.names]))


def _statements(path: Path) -> list[tuple[str, list[str]]]:
    visitor = _Imports(_module(path), path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text()))
    return visitor.found


def _imports(path: Path) -> set[str]:
    found = set()
    for module, names in _statements(path):
        found.add(module)
        found |= {f"{module}.{n}" for n in names}
    return found


def _edges() -> dict[str, set[str]]:
    """module -> the llmpipe modules it imports (`from pkg import sub` names the submodule, not pkg)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for module, names in _statements(path):
            for target in [f"{module}.{n}" if f"{module}.{n}" in MODULES else module for n in names] or [module]:
                while target not in MODULES and "." in target:
                    target = target.rpartition(".")[0]
                if target in MODULES and target != m and target.startswith("llmpipe"):
                    edges[m].add(target)
    return edges


@pytest.mark.parametrize("files,forbidden", [
    ("parallel/*.py", "llmpipe.train"),  # strategies receive what the loop builds; they never reach up
    ("optim.py", "llmpipe.train"),
    ("optim.py", "llmpipe.parallel"),
    ("data/[cst]*.py", "llmpipe.stages"),  # the readers (corpus, shards, sampler, tokenizer) raise their own
    # errors (llmpipe.data.errors); only data/prepare.py, the stage function, knows the stage contract
    ("models/llama/model.py", "llmpipe"),  # architecture only
    # the inference runtime is shared by export, bench, generate (serve, eval next): it imports none of them
    ("infer/*.py", "llmpipe.export"),
    ("infer/*.py", "llmpipe.bench"),
    ("infer/*.py", "llmpipe.stages"),
    ("infer/*.py", "llmpipe.config"),
    ("infer/*.py", "llmpipe.tools"),
    # config.py's own checks import nothing that imports config.py (no circle through a lazy import)
    ("config_checks.py", "llmpipe.config"),
    ("config_checks.py", "llmpipe.stages"),
    ("config_checks.py", "llmpipe.preflight"),
    ("config_checks.py", "llmpipe.train"),
    ("config_checks.py", "llmpipe.export.atc"),  # its argument rules are export/atc_args.py, a leaf
    ("export/atc_args.py", "llmpipe.config"),
    ("export/atc_args.py", "llmpipe.stages"),
    ("models/limits.py", "llmpipe"),
    ("config.py", "llmpipe.preflight"),  # the machine's pre-flight runs before stages, never at config load
    ("config.py", "llmpipe.stages"),
    ("stages.py", "llmpipe.preflight"),
    ("tools/*.py", "llmpipe.cli"),  # the tools sit under the command line, above every stage
    ("train/launch.py", "llmpipe.config"),  # the launch is a pure function of the settings it is given
])
def test_packages_do_not_import_upwards(files, forbidden):
    offenders = {p.relative_to(LIB).as_posix(): sorted(m for m in _imports(p) if m == forbidden or
                                                       m.startswith(forbidden + "."))
                 for p in LIB.glob(files)}
    assert len(offenders) >= 1
    assert {k: v for k, v in offenders.items() if v} == {}


def test_only_the_command_line_imports_the_tools():
    offenders = {m: sorted(t for t in targets if t.startswith("llmpipe.tools"))
                 for m, targets in _edges().items()
                 if not m.startswith("llmpipe.tools") and m not in ("llmpipe.cli", "llmpipe.__main__")}
    assert {m: v for m, v in offenders.items() if v} == {}


def test_tasks_never_import_flows():
    """flows/ sequence the tasks; tasks/ never reach up (not even for a side effect)."""
    offenders = {p.name: sorted(m for m in _imports(p) if m == "flows" or m.startswith("flows."))
                 for p in (ROOT / "tasks").glob("*.py")}
    assert len(offenders) >= 2
    assert {k: v for k, v in offenders.items() if v} == {}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle_through_a_function_level_import():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_llmpipe():
    assert _circles(_edges()) == []


# The rooms from the bottom up: a module may import its own layer's and lower ones. A top-level
# module is its own room (llmpipe.config -> "config"); a package's modules are its room.
LAYERS = (
    {"llmpipe", "errors", "device", "debug", "lock", "mfu", "optim", "manifest", "attempts",  # kernel
     "console"},  # what the terminal shows and the stage logs: logging and tqdm only
    {"chat"},  # the chat template (jinja2's sandbox) and conversation sets: text in, text out
    {"models"},  # the architecture and its Hugging Face names
    {"config"},  # the typed config tree
    {"stages"},  # the stage contract: fingerprints, skip, partial folder, publish
    {"data", "checkpoint", "infer"},  # corpus and shards, the training state on disk, the inference runtime
    {"parallel"},  # layouts and strategies: they use checkpoint/, checkpoint/ never reaches into them
    {"train", "export", "bench", "eval"},  # the stages that drive them
    # what is checked before a run (of the config alone, of this machine) or a deployment (the gates' verdicts)
    {"config_checks", "preflight", "verdicts"},
    {"tools", "tracking"},  # user tools outside the stages; MLflow, fed from the run folder
    {"cli", "__main__", "docs_gen"},  # docs_gen: the references generated from the config and the parser
)
def test_the_chat_room_imports_only_the_errors_jinja2_and_the_standard_library():
    """llmpipe.chat renders untrusted templates for data, training, export and serving alike: nothing heavy."""
    allowed = {"llmpipe.errors", "llmpipe.chat"} | set(__import__("sys").stdlib_module_names)
    found = {p.relative_to(LIB).as_posix(): sorted(m for m in _imports(p) if m.split(".")[0] != "jinja2" and
                                                   m.split(".")[0] not in allowed and
                                                   not any(m == a or m.startswith(a + ".") for a in allowed))
             for p in (LIB / "chat").glob("*.py")}
    assert "chat/template.py" in found
    assert {k: v for k, v in found.items() if v} == {}


# Imports that run back up, each with its reason (at most 3).
BACK_ARROWS = {
    # config.from_dict runs its checks lazily; config_checks imports no config (no circle)
    ("llmpipe.config", "llmpipe.config_checks"),
}


def _room(module: str) -> str:
    parts = module.split(".")
    return "llmpipe" if len(parts) == 1 else parts[1]


def _layer(module: str) -> int:
    room = _room(module)
    return next(i for i, rooms in enumerate(LAYERS) if room in rooms)


def test_every_room_has_a_layer():
    rooms = {_room(m) for m in MODULES}
    assert rooms - set().union(*LAYERS) == set()


def test_at_most_three_imports_run_back_up():
    back = {(m, t) for m, targets in _edges().items() for t in targets if _layer(t) > _layer(m)}
    assert back == BACK_ARROWS
    assert len(BACK_ARROWS) <= 3


def test_no_module_imports_a_private_name_of_another():
    offenders = set()
    for m, path in MODULES.items():
        for module, names in _statements(path):
            if module.startswith("llmpipe") and module != m:
                offenders |= {f"{m}: {module}.{n}" for n in names if n.startswith("_") and not n.startswith("__")}
    assert offenders == set()


STAGE_DOC = re.compile(r'^"""The (?P<name>\w+) stage:')


def test_every_stage_entry_is_run_in_a_room_module_that_names_the_stage():
    """The rule written at StageSpec.entry: "llmpipe.<room>.<module>:run", one stage per module, the
    module's docstring opening with "The <name> stage:"."""
    from llmpipe.stages import SPECS

    modules = []
    for name, spec in SPECS.items():
        module, _, func = spec.entry.partition(":")
        assert func == "run", name
        assert re.fullmatch(r"llmpipe\.\w+\.\w+", module), name
        assert (LIB / module.split(".")[1]).is_dir(), name
        match = STAGE_DOC.match(MODULES[module].read_text())
        assert match and match["name"] == name, (name, module)
        modules.append(module)
    assert len(set(modules)) == len(modules)
