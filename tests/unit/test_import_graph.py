"""The trainer hooks' modules import one another without a circle: every room can be read, tested and
rebuilt from the ones it stands on. Every import counts, those under `TYPE_CHECKING` and inside
functions too: an arrow hidden there is still an arrow."""

from __future__ import annotations

import ast
from pathlib import Path

HOOKS = Path(__file__).resolve().parents[2] / "libs" / "trainer-hooks" / "deadpool"


def import_graph() -> dict[str, set[str]]:
    """Module -> the `deadpool` modules it imports (the package itself is `deadpool`)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(HOOKS.glob("*.py")):
        name = "deadpool" if path.stem == "__init__" else f"deadpool.{path.stem}"
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            imported |= {m for m in modules if m == "deadpool" or m.startswith("deadpool.")}
        graph[name] = imported - {name}
    return {name: {m for m in imported if m in graph} for name, imported in graph.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle found by a depth-first walk, as the path that closes it."""
    found: list[list[str]] = []
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        for target in sorted(graph[module]):
            if target in path:
                found.append([*path[path.index(target) :], target])
            elif target not in done:
                walk(target, [*path, target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            walk(module, [module])
    return found


def test_the_trainer_hooks_import_one_another_without_a_circle() -> None:
    graph = import_graph()
    assert len(graph) > 30, sorted(graph)  # the walk found the package
    assert "deadpool.training_objects" in graph["deadpool.member_rebuild"]  # imports are seen
    assert circles(graph) == []


def test_the_job_is_the_top_room_only_the_package_imports() -> None:
    graph = import_graph()
    assert {name for name, imported in graph.items() if "deadpool.job" in imported} == {"deadpool"}
    assert "deadpool.member_lifecycle" in graph["deadpool.job"]
    assert "deadpool.member_rebuild" in graph["deadpool.member_recovery"]


def test_a_circle_is_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


PROTOCOL = HOOKS.parents[1] / "protocol" / "deadpool_protocol"
PURE_MODULES = frozenset(
    {"__future__", "collections", "dataclasses", "enum", "functools", "hashlib", "hmac", "itertools", "math"}
    | {"re", "struct", "types", "typing", "zlib", "msgpack", "xxhash", "deadpool_protocol"}
)
"""What the protocol may stand on: computation only (no files, sockets, clocks, environment or logging)."""


def test_the_protocol_imports_only_modules_that_do_no_io() -> None:
    found: dict[str, set[str]] = {}
    for path in sorted(PROTOCOL.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            found.setdefault(path.name, set()).update(m.split(".")[0] for m in modules)
    assert "codec.py" in found and "msgpack" in found["codec.py"]  # the walk sees imports
    assert {name: sorted(tops - PURE_MODULES) for name, tops in found.items() if tops - PURE_MODULES} == {}
