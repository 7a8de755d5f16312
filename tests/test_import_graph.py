"""The import graph of tokenloop/: no cycles at import time, and the layering docs/layout.md describes.

Read with `ast`, never imported, so the test needs no torch and sees every module, even ones that fail
to import. For cycles an edge is any import: at module level, inside a function (it couples two rooms as
much, only later) or under `if TYPE_CHECKING:` (a type checker runs it); the layering rules count the
first two. Imports inside functions are how the front end stays free of torch until a command needs the
engine: those that reach torch are listed below, so that a new one is a decision, not an accident.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "tokenloop"

# Annotation-only edges (`if TYPE_CHECKING:`) that close a cycle; each entry is (importer, imported). None today:
# a room below another names what it needs of it by a protocol (fused_cpu.FusedModel, cluster/members.py).
ALLOWED_CYCLE_EDGES: frozenset[tuple[str, str]] = frozenset()

# The front end's rooms: importing them (`tokenloop serve` before its core starts, `tokenloop --help`) must
# not import torch (~1.6 s).
FRONT_END = ("tokenloop.serving", "tokenloop.cli", "tokenloop.cluster")
# Imports inside a front-end function that reach torch: each runs only in the command that needs the engine.
LAZY_TORCH_IMPORTS: dict[str, frozenset[str]] = {
    "tokenloop.cli.options": frozenset({"tokenloop.engine", "tokenloop.llm"}),  # load_engine
    "tokenloop.cli.trace": frozenset({"tokenloop.engine", "tokenloop.llm"}),
    "tokenloop.cli.simulate_calibrate": frozenset({"tokenloop.engine", "tokenloop.llm"}),  # a real sweep
    "tokenloop.cli.simulate_runs": frozenset({"tokenloop.llm", "tokenloop.sim.engine"}),
    "tokenloop.cli.simulate_cluster": frozenset({"tokenloop.llm", "tokenloop.sim.cluster"}),
    "tokenloop.cluster.launch": frozenset({"tokenloop.core.engine_core"}),  # in-process replicas (tests)
}

# (rooms, rooms they must never import): prefixes of dotted module names.
LAYERING_RULES: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (("tokenloop.core",),
     ("tokenloop.serving", "tokenloop.bench", "tokenloop.cli", "tokenloop.cluster", "tokenloop.sim",
      "tokenloop.engine", "tokenloop.llm", "tokenloop.outputs", "tokenloop.tokenizer"),
     "the engine core is token ids in, token ids out: no front end, no text, no observers' state"),
    (("tokenloop.observe",),
     ("tokenloop.engine", "tokenloop.core.engine_core", "tokenloop.llm", "tokenloop.serving",
      "tokenloop.bench", "tokenloop.cli", "tokenloop.outputs"),
     "observers read records; they never call the loop"),
    (("tokenloop.model",),
     ("tokenloop.core", "tokenloop.engine", "tokenloop.runner", "tokenloop.sampler", "tokenloop.serving",
      "tokenloop.bench", "tokenloop.cli", "tokenloop.observe"),
     "the model is a forward pass over given tensors; it knows no scheduler or server"),
    (("tokenloop.tokenizer",),
     ("tokenloop.core", "tokenloop.model", "tokenloop.engine", "tokenloop.serving", "tokenloop.bench",
      "tokenloop.cli", "tokenloop.runner", "tokenloop.sampler"),
     "text <-> ids needs nothing of the engine"),
    (("tokenloop.structured",),
     ("tokenloop.core", "tokenloop.engine", "tokenloop.serving", "tokenloop.bench", "tokenloop.cli"),
     "grammars and tool-call parsing serve both the sampler and the server, and call neither"),
    (("tokenloop.sim",),
     ("tokenloop.model", "tokenloop.engine", "tokenloop.llm", "tokenloop.serving", "tokenloop.bench",
      "tokenloop.cli", "tokenloop.cluster", "tokenloop.tokenizer"),
     "the simulator is the real core with no model behind it: no weights, no text, no front end"),
    (("tokenloop.errors",), ("tokenloop",), "the error hierarchy is the bottom of the house"),
    (("tokenloop.serving", "tokenloop.core", "tokenloop.model", "tokenloop.engine", "tokenloop.llm",
      "tokenloop.observe", "tokenloop.tokenizer", "tokenloop.structured"),
     ("tokenloop.cli", "tokenloop.bench"),
     "the command line and the benchmarks sit on top; nothing below imports them"),
]


def module_files(package_dir: Path = PACKAGE_DIR) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def import_nodes(body: list[ast.stmt], in_functions: bool,
                 annotations: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module (or, with `in_functions`, any of its code) runs; with
    `annotations`, those under `if TYPE_CHECKING:` too (a type checker runs them)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if annotations or not _is_type_checking(node.test):
                yield from import_nodes(node.body, in_functions, annotations)
            yield from import_nodes(node.orelse, in_functions, annotations)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from import_nodes(block, in_functions, annotations)
        elif isinstance(node, (ast.With, ast.ClassDef)):  # class bodies run at import time
            yield from import_nodes(node.body, in_functions, annotations)
        elif in_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from import_nodes(node.body, in_functions, annotations)
        elif in_functions and isinstance(node, (ast.For, ast.While)):
            yield from import_nodes(node.body + node.orelse, in_functions, annotations)


def imported_modules(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
                     known: Mapping[str, object]) -> Iterator[str]:
    """The known modules one import statement names: `import a.b.c` -> a.b.c; `from a.b import c` -> a.b,
    and a.b.c too when c is a module. Parent packages that Python also runs are not edges: counting them
    would make every package whose __init__ re-exports its submodules a cycle with them."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name in known)
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source in known:
        yield source
    yield from (f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in known)


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def import_graph(in_functions: bool = False, package_dir: Path = PACKAGE_DIR,
                 annotations: bool = False) -> dict[str, set[str]]:
    """Module -> the tokenloop modules it imports."""
    modules = module_files(package_dir)
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        tree = _parsed(path)
        targets = {target for node in import_nodes(tree.body, in_functions, annotations)
                   for target in imported_modules(module, is_package, node, modules)}
        graph[module] = targets - {module}
    return graph


def imports_torch(package_dir: Path = PACKAGE_DIR) -> set[str]:
    """The tokenloop modules that import torch when they are imported."""
    heavy = set()
    for module, (path, _) in module_files(package_dir).items():
        for node in import_nodes(_parsed(path).body, in_functions=False):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if not node.level else [])
            if any(name == "torch" or name.startswith("torch.") for name in names):
                heavy.add(module)
    return heavy


def runs_on_import(module: str, graph: Mapping[str, set[str]]) -> set[str]:
    """Every module importing `module` runs: its imports, theirs, and the packages above each."""
    seen: set[str] = set()
    stack = [module]
    while stack:
        current = stack.pop()
        if current in seen or current not in graph:
            continue
        seen.add(current)
        parts = current.split(".")
        stack.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        stack.extend(graph[current])
    return seen


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS: white / grey on the stack / black done)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph.get(start, ())))]
        state[start] = 1
        while stack:
            target = next(stack[-1], None)
            if target is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(target) == 1:
                return path[path.index(target):] + [target]
            elif not state.get(target):
                state[target] = 1
                path.append(target)
                stack.append(iter(sorted(graph.get(target, ()))))
    return None


def _in_room(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == room or module.startswith(room + ".") for room in rooms)


# ---- the resolver and the cycle finder themselves ------------------------------------------------------

def test_resolver_reads_relative_from_and_type_checking_imports() -> None:
    known = {"p": 0, "p.a": 0, "p.sub": 0, "p.sub.b": 0, "p.sub.c": 0}
    source = ("from typing import TYPE_CHECKING\nfrom . import c\nfrom ..a import x\nimport p.sub\n"
              "if TYPE_CHECKING:\n    from p.a import y\n"
              "def f():\n    from p.sub.c import z\n")
    body = ast.parse(source).body
    found = {t for node in import_nodes(body, in_functions=False)
             for t in imported_modules("p.sub.b", False, node, known)}
    assert found == {"p.sub", "p.sub.c", "p.a"}
    deep = {t for node in import_nodes(body, in_functions=True)
            for t in imported_modules("p.sub.b", False, node, known)}
    assert deep == found  # the function's import names p.sub.c, already counted


def test_find_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# ---- tokenloop's own graph ---------------------------------------------------------------------------

def test_every_module_parses_and_the_graph_is_not_trivial() -> None:
    graph = import_graph()
    assert {"tokenloop.engine", "tokenloop.core.scheduler", "tokenloop.tokenizer.tokenizer",
            "tokenloop.cli.main"} <= graph.keys()
    assert "tokenloop.core.kv_cache" in graph["tokenloop.core.scheduler"]


def test_no_import_cycle_at_any_level() -> None:
    graph = import_graph(in_functions=True, annotations=True)
    for importer, imported in ALLOWED_CYCLE_EDGES:
        assert imported in graph[importer], f"stale allow-list entry: {importer} no longer imports {imported}"
        graph[importer].discard(imported)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
    module_level = import_graph()
    assert not any(imported in module_level[importer] for importer, imported in ALLOWED_CYCLE_EDGES), \
        "an allowed edge is for annotations only"


def test_the_front_end_imports_no_torch_and_its_lazy_imports_that_do_are_listed() -> None:
    module_level, everywhere = import_graph(), import_graph(in_functions=True)
    heavy = imports_torch()
    assert {"tokenloop.runner", "tokenloop.sampler"} <= heavy  # the finder finds them
    front = [m for m in module_level if _in_room(m, FRONT_END)]
    pulled = sorted(f"{m} -> {sorted(runs_on_import(m, module_level) & heavy)}" for m in front
                    if runs_on_import(m, module_level) & heavy)
    assert not pulled, "importing the front end imports torch:\n  " + "\n  ".join(pulled)
    lazy = {m: frozenset(t for t in everywhere[m] - module_level[m] if runs_on_import(t, module_level) & heavy)
            for m in front}
    assert {m: targets for m, targets in lazy.items() if targets} == LAZY_TORCH_IMPORTS


@pytest.mark.parametrize("rooms, forbidden, why", LAYERING_RULES, ids=[rule[0][0] for rule in LAYERING_RULES])
def test_layering(rooms: tuple[str, ...], forbidden: tuple[str, ...], why: str) -> None:
    graph = import_graph(in_functions=True)
    broken = sorted(f"{module} imports {target}" for module, targets in graph.items()
                    if _in_room(module, rooms) for target in targets
                    if _in_room(target, forbidden) and not _in_room(target, rooms))
    assert not broken, f"{why}:\n  " + "\n  ".join(broken)
