"""The house's size rules (issue 31): no function over 60 lines, no module over 400, without a reason next to it.

Read with `ast`, never imported. A long function carries a comment line starting with `# long:` right above its
`def` (or above its decorators) saying why it is one piece; a long module carries a line starting with
`Long module:` in its docstring saying why it is one room. Anything else that long is split.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "tokenloop"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400
FUNCTION_MARKER = "# long:"
MODULE_MARKER = "Long module:"

def _functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """From `def` to its last line (decorators not counted)."""
    return (node.end_lineno or node.lineno) - node.lineno + 1


def has_function_marker(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> bool:
    """A `# long:` comment in the comment lines right above the function (or its decorators)."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    index = first - 2  # the line above, 0-based
    while index >= 0 and lines[index].strip().startswith("#"):
        if lines[index].strip().startswith(FUNCTION_MARKER):
            return True
        index -= 1
    return False


def has_module_marker(tree: ast.Module) -> bool:
    doc = ast.get_docstring(tree) or ""
    return any(line.strip().startswith(MODULE_MARKER) for line in doc.splitlines())


@functools.cache
def long_pieces(package_dir: Path = PACKAGE_DIR) -> tuple[list[tuple[str, str, int]], list[tuple[str, int]]]:
    """(module, function, lines) of every unmarked long function and (module, lines) of every unmarked long
    module, paths relative to the package."""
    functions, modules = [], []
    for path in sorted(package_dir.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source, filename=str(path))
        name = path.relative_to(package_dir).as_posix()
        if len(lines) > MAX_MODULE_LINES and not has_module_marker(tree):
            modules.append((name, len(lines)))
        functions += [(name, node.name, function_lines(node)) for node in _functions(tree)
                      if function_lines(node) > MAX_FUNCTION_LINES and not has_function_marker(node, lines)]
    return functions, modules


def test_the_checker_reads_markers(tmp_path: Path) -> None:
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "a.py").write_text(f'"""Short."""\n\n\ndef long_one():\n{body}\n\n\n'
                                   f"# long: one table, read top to bottom\n@staticmethod\ndef marked():\n{body}\n"
                                   f"\n\ndef short():\n    return 1\n")
    filler = "\n" * MAX_MODULE_LINES
    (tmp_path / "b.py").write_text(f'"""A room.\n\nLong module: one kind of state.\n"""\n{filler}')
    (tmp_path / "c.py").write_text(f'"""A room."""\n{filler}')
    functions, modules = long_pieces(tmp_path)
    assert functions == [("a.py", "long_one", MAX_FUNCTION_LINES + 1)]
    assert modules == [("c.py", MAX_MODULE_LINES + 1)]


def test_no_long_function_without_a_reason() -> None:
    functions, _ = long_pieces()
    found = sorted(f"{module} {name}: {lines} lines" for module, name, lines in functions)
    assert not found, (f"functions over {MAX_FUNCTION_LINES} lines: split them, or say why they are one piece in a "
                       f"`{FUNCTION_MARKER}` comment above the def:\n  " + "\n  ".join(found))


def test_no_long_module_without_a_reason() -> None:
    _, modules = long_pieces()
    found = sorted(f"{module}: {lines} lines" for module, lines in modules)
    assert not found, (f"modules over {MAX_MODULE_LINES} lines: split them by stage, or say why they are one room "
                       f"in a `{MODULE_MARKER}` line of the docstring:\n  " + "\n  ".join(found))
