"""The house's import rules, from the source: no circles, schemas import no stage (only the
shared error hierarchy), stages meet only through files (pack and shards never import each
other; `prep.pipeline` composes them), and `prep` and `train` are peers: neither imports the other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("prep", "schemas", "train", "families", "packvlm")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> our modules it imports (anywhere in the file, deferred imports included)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_package_edge(a: str, b: str) -> bool:
    """A package's ``__init__`` importing its own modules (family self-registration) is not a circle."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_no_import_circles() -> None:
    graph = _imports(_modules())
    pruned = {a: {b for b in targets if not _is_package_edge(a, b)} for a, targets in graph.items()}
    assert _cycles(pruned) == []


def test_schemas_import_no_stage_and_stages_meet_through_files() -> None:
    graph = _imports(_modules())
    for module, targets in graph.items():
        if module.startswith("schemas"):  # contracts, and the one error hierarchy they base their errors on
            assert all(t.startswith("schemas") or t == "packvlm.errors" for t in targets), (module, targets)
        if module.startswith("prep.pack"):
            assert not any(t.startswith("prep.shards") for t in targets), (module, targets)
        if module.startswith("prep.shards"):
            assert not any(t.startswith("prep.pack") for t in targets), (module, targets)
        if module.startswith("prep.pack"):  # the composition sits above the stages it composes
            assert "prep.pipeline" not in targets, (module, targets)
        if module == "train.context_parallel":  # below the Megatron step that slices with it
            assert not any(t.startswith("train.megatron") for t in targets), (module, targets)
        if module.startswith("packvlm"):  # the ground floor: families, prep and train stand on it
            assert not any(t.startswith(("families", "prep", "train")) for t in targets), (module, targets)
        if module.startswith("families"):  # beneath both stages: prep/train -> families -> schemas/packvlm
            assert not any(t.startswith(("prep", "train")) for t in targets), (module, targets)
    assert graph["packvlm.errors"] == set(), "every layer imports packvlm.errors: it imports nothing of ours"


def _crossings(graph: dict[str, set[str]], source: str, target: str) -> set[tuple[str, str]]:
    return {
        (module, t)
        for module, targets in graph.items()
        if module.split(".")[0] == source
        for t in targets
        if t.split(".")[0] == target
    }


def test_prep_and_train_are_peers() -> None:
    """What both stages need lives below them (`schemas`, `packvlm`); they meet only through files."""
    graph = _imports(_modules())
    train_to_prep = _crossings(graph, "train", "prep")
    assert train_to_prep == set(), "train imports prep: move what both need down"
    assert _crossings(graph, "prep", "train") == set(), "prep imports train"
