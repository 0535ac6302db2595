"""The import structure docs/architecture.md describes: no cycle between butter's parts.

(The layer rules themselves are import-linter contracts in pyproject.toml, run by CI.)
"""

from __future__ import annotations

import itertools

import grimp


def _parts(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """butter's top-level parts (packages and modules) -> the parts each imports."""
    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        if not module.startswith("butter.") or part(module) == module.split(".")[0]:
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.startswith("butter.") and part(imported) != part(module):
                edges.setdefault(part(module), set()).add(part(imported))
    return edges


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(edges.get(node, ()))
    return False


def test_no_import_cycle_between_butters_parts() -> None:
    edges = _parts(grimp.build_graph("butter"))
    assert {"butter.pipeline", "butter.engine", "butter.server"} <= set(edges)  # it looked
    cycles = [(a, b) for a, b in itertools.combinations(sorted(edges), 2)
              if _reaches(edges, a, b) and _reaches(edges, b, a)]
    assert cycles == []
