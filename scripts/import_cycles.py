#!/usr/bin/env python3
"""Import cycles inside a package: every module's imports read with ``ast`` (nothing is
imported), the graph's strongly connected components printed with one cycle each.

    python scripts/import_cycles.py [--package tpserve] [--root DIR] [--all]

An edge A -> B means module A imports module B: ``import a.b`` and ``from a import b`` (when
``a.b`` is a module; else ``a``), relative imports resolved; importing ``p.q.m`` also runs the
``__init__`` of ``p`` and ``p.q``, so those packages are targets too, except A's own enclosing
packages (a package importing its children, which import their siblings, is how packages work,
not a cycle). Imports under ``if TYPE_CHECKING:`` never run and are left out.

Module-level imports run when a module is imported; imports inside a function run when it is
called (lazy). A cycle of module-level edges is always an error. A cycle that needs a lazy edge
is an error unless that edge is in ALLOWED_LAZY with the reason it is lazy (keeping a light
module light: the CLI and the client must not import the engine until a command needs it).
``--all`` lists the cycles the allowed edges close too. Exit status 1 when an error is found.
"""
from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (importing module, imported module): why the import is inside a function. Only edges that
# close a cycle need to be here; each must still exist (tests/test_import_cycles.py).
ALLOWED_LAZY: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    lazy: bool  # inside a function (runs when called, not when the module is imported)


def module_names(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).with_suffix("")
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(node, lazy) for every import statement, skipping ``if TYPE_CHECKING:`` bodies."""
    def walk(node, lazy):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, lazy
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    yield from walk(ast.Module(body=[sub], type_ignores=[]), lazy)
            else:
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(child, inner)
    yield from walk(tree, False)


def import_graph(package_dir: Path, package: str) -> list[Edge]:
    """Every import edge between the package's modules (see the module docstring)."""
    modules = module_names(package_dir, package)
    edges = []
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        own = name.split(".")
        enclosing = {".".join(own[:i]) for i in range(1, len(own))}
        tree = ast.parse(path.read_text(), str(path))
        for node, lazy in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = own if is_pkg else own[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                if target not in modules:
                    continue
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # the target and the packages it runs
                    dst = ".".join(parts[:i])
                    if dst != name and (dst == target or dst not in enclosing):
                        edges.append(Edge(name, dst, node.lineno, lazy))
    return edges


def strongly_connected(nodes, succ) -> list[list[str]]:
    """Tarjan's components of more than one node (iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(succ.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def one_cycle(comp: list[str], succ) -> list[str]:
    """A cycle through the component's first module (shortest, by breadth-first search)."""
    members, start = set(comp), comp[0]
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(succ.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def cycles(edges: list[Edge], allowed=frozenset()) -> list[list[str]]:
    """One cycle per strongly connected component of the graph of module-level edges and
    the lazy edges not in ``allowed`` (a set of (src, dst))."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        if not e.lazy or (e.src, e.dst) not in allowed:
            succ.setdefault(e.src, set()).add(e.dst)
    nodes = sorted({e.src for e in edges} | {e.dst for e in edges})
    return [one_cycle(c, succ) for c in strongly_connected(nodes, succ)]


def describe(cycle: list[str], edges: list[Edge]) -> str:
    """``a -> b (line 3) -> a (line 9, lazy)``"""
    out = [cycle[0]]
    for a, b in zip(cycle, cycle[1:]):
        hits = [e for e in edges if e.src == a and e.dst == b]
        eager = [e for e in hits if not e.lazy]
        e = (eager or hits)[0]
        out.append(f"{b} (line {e.line}{', lazy' if e.lazy else ''})")
    return " -> ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default="tpserve")
    ap.add_argument("--root", type=Path, default=ROOT, help="the directory holding the package")
    ap.add_argument("--all", action="store_true", help="also the cycles that allowed lazy edges close")
    args = ap.parse_args()
    edges = import_graph(args.root / args.package, args.package)
    bad = cycles(edges, allowed=set(ALLOWED_LAZY))
    for c in bad:
        print("cycle:", describe(c, edges))
    if args.all:
        for c in cycles(edges):
            if c not in bad:
                print("allowed (lazy):", describe(c, edges))
    print(f"import_cycles package={args.package} modules={len({e.src for e in edges})} "
          f"edges={len(edges)} cycles={len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
