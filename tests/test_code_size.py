"""Modules over 800 lines and functions over 80 are reported, as a smell to look at, not a failure.

A module holds one concept and is split when it holds two, never to meet a line count.
"""

import ast
import warnings
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED_DIRS = ("tasks_app", "scheduler_site", "examples", "tests", "bench")
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


def checked_modules() -> list[Path]:
    """Return the hand-written modules: not migrations, not the generated protobuf code."""
    return sorted(
        path
        for top in CHECKED_DIRS
        for path in (ROOT / top).rglob("*.py")
        if "migrations" not in path.parts and not path.name.endswith("_pb2.py")
    )


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """Yield (qualified name, lines from `def` to its last line) of every function, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def long_modules() -> dict[str, int]:
    """Return the line count of every module over MAX_MODULE_LINES, by path."""
    counts = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in checked_modules()}
    return {name: lines for name, lines in counts.items() if lines > MAX_MODULE_LINES}


def long_functions() -> dict[str, int]:
    """Return the length of every function over MAX_FUNCTION_LINES, by path::qualified name."""
    found = {}
    for path in checked_modules():
        for name, lines in functions(ast.parse(path.read_text(), filename=str(path))):
            if lines > MAX_FUNCTION_LINES:
                found[f"{path.relative_to(ROOT).as_posix()}::{name}"] = lines
    return found


def test_the_checked_trees_hold_modules():
    names = {path.relative_to(ROOT).as_posix() for path in checked_modules()}
    assert {"tasks_app/producer.py", "scheduler_site/settings.py", "tests/test_code_size.py"} <= names
    assert not any(name.endswith("_pb2.py") or "/migrations/" in name for name in names)


def test_function_lengths_count_from_def_to_the_last_line():
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n\n        return g\n")
    assert dict(functions(tree)) == {"A.f": 5, "A.f.g": 2}


class LongCode(UserWarning):
    """A module or a function past the size worth a second look."""


def test_modules_over_the_line_threshold_are_reported():
    for name, lines in long_modules().items():
        warnings.warn(
            f"{name} has {lines} lines (over {MAX_MODULE_LINES}): does it hold two concepts?", LongCode, stacklevel=1
        )


def test_functions_over_the_line_threshold_are_reported():
    for name, lines in long_functions().items():
        warnings.warn(
            f"{name} has {lines} lines (over {MAX_FUNCTION_LINES}): can its steps be named?", LongCode, stacklevel=1
        )
