"""No import cycles between the project's modules, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "packages", ROOT / "integrations"]


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in SOURCES:
        for path in root.rglob("src/**/*.py"):
            parts = path.parts
            name = ".".join(parts[parts.index("src") + 1 :]).removesuffix(".py")
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module ``name`` imports (at any depth of the file), as known module names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            # Importing a parent package (its __init__) is how submodules load: not an edge.
            if target and target != name and not name.startswith(target + "."):
                out.add(target)
    return out


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    seen: set[str] = set()
    while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_cycles() -> None:
    known = _modules()
    assert "sidestream.sync" in known and "sidestream.state" in known
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    cycles = [cycle for name in sorted(graph) if (cycle := _cycle_from(name, graph))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_sync_is_the_lower_layer() -> None:
    known = _modules()
    sync_imports = _imports("sidestream.sync", known["sidestream.sync"], known)
    assert "sidestream.state" not in sync_imports
    assert "sidestream.metric" not in sync_imports
    assert _imports("sidestream._reduce_op", known["sidestream._reduce_op"], known) == set()


def test_the_check_finds_a_cycle() -> None:
    # The checker itself must be able to fail: two modules importing each other lazily.
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _cycle_from("a", graph) == ["a", "b", "a"]
    assert _cycle_from("c", graph) is None
