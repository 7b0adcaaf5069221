"""moerl has no import cycle among its own modules.

Every ``moerl/**/*.py`` is parsed with ``ast`` (nothing is imported). Each import of a moerl module
becomes an edge of a module graph -- top-level imports and lazy ones inside functions/methods alike
(a lazy import that closes a loop is still a cycle: it only moves the partially-initialised-module
failure to call time), and ``importlib.import_module`` / ``__import__`` calls with a literal moerl
name. Imports under ``if TYPE_CHECKING:`` are not executed and are ignored.

Resolution: ``import moerl.a.b`` -> ``moerl.a.b``; ``from moerl.a import b`` -> ``moerl.a.b`` when
that module/package exists, else ``moerl.a``; relative imports likewise, from the importing module's
package. A package's ``__init__.py`` is the module ``moerl.pkg``. Importing ``moerl.a.b`` also runs
``moerl/a/__init__.py``, but parent packages are not added as edges: a package ``__init__`` that
re-exports its submodules would otherwise "cycle" with every one of them, and Python handles that
order fine. A submodule that imports its own package's ``__init__`` (``from moerl.pkg import X``
inside ``moerl/pkg/mod.py`` while ``__init__`` imports ``mod``) *is* reported.

Cycles are the strongly connected components of size > 1 (plus self-imports); each is printed with
the file:line of every edge inside it and one concrete loop.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = "moerl"


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    file: str  # repo-relative path of the importing file
    line: int


# ---------------------------------------------------------------------------------------------------
# Module discovery and import collection
# ---------------------------------------------------------------------------------------------------


def discover_modules(root: Path = REPO, pkg: str = PKG) -> dict[str, Path]:
    """Module name -> file for every ``.py`` under ``root/pkg``."""
    mods: dict[str, Path] = {}
    for path in sorted((root / pkg).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return False


def _walk_runtime(node: ast.AST):
    """Like ast.walk, but skips the body of ``if TYPE_CHECKING:`` (its ``else`` still runs)."""
    stack = [node]
    while stack:
        cur = stack.pop()
        yield cur
        if isinstance(cur, ast.If) and _is_type_checking(cur.test):
            children = list(cur.orelse)
        else:
            children = list(ast.iter_child_nodes(cur))
        stack.extend(reversed(children))


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest existing moerl module that ``name`` (dotted) denotes or lives in."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


def module_imports(mod: str, path: Path, modules: set[str], root: Path = REPO) -> list[Edge]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    package = mod if is_pkg else mod.rpartition(".")[0]
    rel = str(path.relative_to(root))
    edges: list[Edge] = []

    def add(target: str | None, line: int) -> None:
        if target is not None and (target == PKG or target.startswith(PKG + ".")):
            edges.append(Edge(mod, target, rel, line))

    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PKG or alias.name.startswith(PKG + "."):
                    add(_resolve(alias.name, modules), node.lineno)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            arg = node.args[0]  # importlib.import_module("moerl.x") / __import__("moerl.x"): literal names only
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and (
                    arg.value == PKG or arg.value.startswith(PKG + ".")):
                add(_resolve(arg.value, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                up = node.level - 1
                if up > len(base_parts) - 1:
                    raise AssertionError(f"{rel}:{node.lineno}: relative import beyond top-level package")
                base = ".".join(base_parts[: len(base_parts) - up])
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module or ""
            if not (origin == PKG or origin.startswith(PKG + ".")):
                continue
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                add(sub if alias.name != "*" and sub in modules else _resolve(origin, modules), node.lineno)
    return edges


def build_graph(root: Path = REPO, pkg: str = PKG) -> tuple[dict[str, set[str]], list[Edge]]:
    found = discover_modules(root, pkg)
    names = set(found)
    graph: dict[str, set[str]] = {m: set() for m in names}
    edges: list[Edge] = []
    for mod, path in found.items():
        for e in module_imports(mod, path, names, root):
            edges.append(e)
            graph[e.src].add(e.dst)
    return graph, edges


# ---------------------------------------------------------------------------------------------------
# Cycle finding (iterative Tarjan)
# ---------------------------------------------------------------------------------------------------


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    nodes = set(graph) | {d for ds in graph.values() for d in ds}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    sccs: list[list[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                sccs.append(sorted(comp))
    return sccs


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """SCCs of size > 1, plus single modules that import themselves."""
    return sorted(
        [c for c in strongly_connected_components(graph) if len(c) > 1 or c[0] in graph.get(c[0], ())]
    )


def _one_loop(comp: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest closed path through comp[0] inside the component."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in seen:
                seen.add(w)
                prev[w] = v
                queue.append(w)
    return [start]


def describe_cycles(cycles: list[list[str]], graph: dict[str, set[str]], edges: list[Edge]) -> str:
    out = []
    for comp in cycles:
        members = set(comp)
        out.append(f"import cycle among {len(comp)} module(s): {', '.join(comp)}")
        out.append("  e.g. " + " -> ".join(_one_loop(comp, graph)))
        for e in sorted(set(edges), key=lambda e: (e.file, e.line, e.dst)):  # set: `from m import a, b`
            if e.src in members and e.dst in members:
                out.append(f"    {e.file}:{e.line}: {e.src} -> {e.dst}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------


def test_cycle_finder_on_hand_made_graph():
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},  # a -> b -> c -> a
        "d": {"e"},
        "e": set(),
        "f": {"f"},  # self-import
        "g": {"h"},
        "h": {"g", "e"},  # g <-> h
        "i": {"a"},  # reaches a cycle but is not on one
    }
    assert find_cycles(graph) == [["a", "b", "c"], ["f"], ["g", "h"]]
    assert find_cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert _one_loop(["a", "b", "c"], graph) == ["a", "b", "c", "a"]
    # A long chain must not hit the recursion limit (the finder is iterative).
    chain = {str(i): {str(i + 1)} for i in range(5000)}
    chain["5000"] = {"0"}
    (comp,) = find_cycles(chain)
    assert len(comp) == 5001


def test_import_collection_on_hand_made_package(tmp_path):
    pkg = tmp_path / PKG
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import A\n")
    (pkg / "sub" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from moerl.other import Hint\n"
        "A = 1\n"
        "def f():\n"
        "    from ..other import thing\n"  # lazy, relative, resolves to moerl.other
        "    return thing\n"
    )
    (pkg / "sub" / "b.py").write_text(
        "import importlib\nimport moerl.sub.a\nfrom moerl.sub import a\n"
        "f = lambda: importlib.import_module('moerl.other')\n")
    (pkg / "other.py").write_text("from moerl import sub\nthing = 2\nclass C:\n    def m(self):\n        from moerl.sub.a import A\n")
    graph, edges = build_graph(tmp_path, PKG)
    assert graph == {
        "moerl": set(),
        "moerl.sub": {"moerl.sub.a"},
        "moerl.sub.a": {"moerl.other"},
        "moerl.sub.b": {"moerl.sub.a", "moerl.other"},
        "moerl.other": {"moerl.sub", "moerl.sub.a"},
    }
    assert find_cycles(graph) == [["moerl.other", "moerl.sub", "moerl.sub.a"]]
    text = describe_cycles(find_cycles(graph), graph, edges)
    assert f"{Path(PKG, 'sub', 'a.py')}:6: moerl.sub.a -> moerl.other" in text
    assert f"{Path(PKG, 'other.py')}:5: moerl.other -> moerl.sub.a" in text


def test_moerl_has_no_import_cycles():
    graph, edges = build_graph()
    assert len(graph) > 20, "module discovery found too little; is the path right?"
    cycles = find_cycles(graph)
    assert not cycles, "\n" + describe_cycles(cycles, graph, edges)


if __name__ == "__main__":  # python tests/test_import_cycles.py: print the cycles without pytest
    g, es = build_graph()
    cs = find_cycles(g)
    print(describe_cycles(cs, g, es) if cs else f"no import cycles among {len(g)} modules")


def test_rl_loop_reads_like_the_algorithm_in_at_most_250_lines():
    """moerl/train/loop.py holds the algorithm only (rollout -> reward -> advantages -> log-probs ->
    update -> weight sync -> log); checkpointing, weight-sync plumbing, batch assembly and the rollout
    manager live in their own modules (shared/design/ARCHITECTURE.md)."""
    loop = Path(__file__).resolve().parents[1] / "moerl" / "train" / "loop.py"
    n = len(loop.read_text().splitlines())
    assert n <= 250, f"moerl/train/loop.py has {n} lines (budget 250): move plumbing to its own module"
