"""The dependency rule of docs/ARCHITECTURE.md, read from the imports of tasks_app's modules."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tasks_app"
LAYERS = ("protocol", "consumer", "django_tasks", "web", "periodic")
# Layer -> the layers it must never import.
FORBIDDEN = {
    "protocol": {"consumer", "django_tasks", "web", "periodic"},
    "web": {"consumer"},
    "periodic": {"consumer", "web"},
}


def module_name(path: Path) -> str:
    """Return the dotted name of a module of tasks_app (a package's name for its __init__.py)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Return every hand-written module of tasks_app by dotted name (migrations aside)."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if "migrations" not in path.parts}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """Return the tasks_app modules that `name` imports, at any depth of its code (TYPE_CHECKING ones too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in known and module != name}


def import_graph() -> dict[str, set[str]]:
    """Return, for each module of tasks_app, the modules of tasks_app it imports."""
    found = modules()
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def layer(name: str) -> str | None:
    """Return the subpackage a module belongs to (None for the app's top-level modules)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return one path around each import cycle found by a depth-first walk."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            found.append([*path[path.index(name) :], name])
            return
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    return found


def test_the_graph_sees_relative_absolute_and_module_imports():
    graph = import_graph()
    assert "tasks_app.protocol.broker" in graph["tasks_app.consumer.executor"]
    assert "tasks_app.django_tasks.runner" in graph["tasks_app.consumer.executor"]
    assert "tasks_app.django_tasks.backend" in graph["tasks_app.backends"]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_each_layer_imports_only_what_the_rule_allows():
    broken = [
        f"{name} imports {target}"
        for name, targets in import_graph().items()
        for target in sorted(targets)
        if layer(target) in FORBIDDEN.get(layer(name) or "", set())
    ]
    assert not broken


def test_the_protocol_imports_no_django_model_or_view():
    graph = import_graph()
    offending = {
        name: sorted(t for t in targets if t in {"tasks_app.models", "tasks_app.urls", "tasks_app.admin"})
        for name, targets in graph.items()
        if layer(name) == "protocol"
    }
    assert not {name: targets for name, targets in offending.items() if targets}


def test_tasks_app_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_documented_import_paths_still_work() -> None:
    """The paths README gives users (`tasks_app.broker.get_broker`, `tasks_app.backends.RedisBackend`) import."""
    from tasks_app.backends import RedisBackend
    from tasks_app.broker import get_broker
    from tasks_app.django_tasks.backend import RedisBackend as backend
    from tasks_app.protocol.broker import get_broker as protocol_get_broker

    assert get_broker is protocol_get_broker
    assert RedisBackend is backend
