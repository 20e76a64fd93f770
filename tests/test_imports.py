"""The import graph of ``dspark_core`` has no cycle.

Every module is parsed (not imported); each ``import`` / ``from ... import`` of a ``dspark_core`` module is an
edge, wherever it sits -- module level or inside a function (a lazy import that dodges a circle still counts).
Only imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dspark_core"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes of ``tree``, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of dotted ``name`` that is a known module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the ``package`` modules it imports (``from pkg import mod`` names the submodule)."""
    paths = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    modules = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_pkg = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import mod`` imports the submodule, ``from mod import name`` the module
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    edges.add(resolved)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, one cycle per entry."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    lines = [f"  {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "cycle among " + ", ".join(component) + ":\n" + "\n".join(lines)


def test_finder_sees_a_lazy_import_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "d.py").write_text("from . import c, e\n")
    (pkg / "e.py").write_text("")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.c"] == set() and graph["pkg.d"] == {"pkg.c", "pkg.e"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b"]]


def test_dspark_core_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50, "dspark_core was not found"
    cycles = find_cycles(graph)
    if cycles:
        pytest.fail("\n".join(_describe(c, graph) for c in cycles))


def test_every_variant_registers_its_kind() -> None:
    from dspark_core.draft.model import DSparkDraft, draft_class, draft_kinds
    from dspark_core.draft.task import DSparkTask, task_class
    from dspark_core.draft.variants.reranker import RerankerTask

    assert draft_kinds() == ("baseline", "engram_markov", "engram_mask_gated", "engram_mask_replace",
                             "draft_memory", "reranker")
    for kind in draft_kinds():
        cls = draft_class(kind)
        assert issubclass(cls, DSparkDraft) and cls.kind == kind
    assert task_class("reranker") is RerankerTask and task_class("engram_markov") is DSparkTask


def test_a_new_variant_is_one_class_statement() -> None:
    from dspark_core.draft.model import DRAFT_CLASSES, DSparkDraft, draft_class

    class ProbeDraft(DSparkDraft, kind="probe_kind"):
        pass

    try:
        assert draft_class("probe_kind") is ProbeDraft
        with pytest.raises(ValueError, match="'probe_kind' is registered twice: .*ProbeDraft and .*OtherDraft"):
            type("OtherDraft", (DSparkDraft,), {}, kind="probe_kind")
    finally:
        DRAFT_CLASSES.pop("probe_kind")
