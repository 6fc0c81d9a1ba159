"""No module of tpserve imports a module that imports it back (scripts/import_cycles.py).

Module-level cycles are never allowed; a cycle through an import inside a function only when
that edge is in the script's ALLOWED_LAZY, with its reason."""
from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    """scripts/import_cycles.py as a module."""
    if "import_cycles" not in sys.modules:
        spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["import_cycles"] = mod  # its dataclass resolves annotations through it
        spec.loader.exec_module(mod)
    return sys.modules["import_cycles"]


def test_no_import_cycle_inside_tpserve():
    ic = _checker()
    edges = ic.import_graph(ROOT / "tpserve", "tpserve")
    assert len({e.src for e in edges}) > 50  # the walk saw the package
    bad = ic.cycles(edges, allowed=set(ic.ALLOWED_LAZY))
    assert not bad, "import cycles:\n" + "\n".join(ic.describe(c, edges) for c in bad)


def test_every_allowed_lazy_edge_exists_is_lazy_and_says_why():
    ic = _checker()
    edges = ic.import_graph(ROOT / "tpserve", "tpserve")
    lazy = {(e.src, e.dst) for e in edges if e.lazy}
    eager = {(e.src, e.dst) for e in edges if not e.lazy}
    for edge, reason in ic.ALLOWED_LAZY.items():
        assert edge in lazy and edge not in eager, f"{edge}: not a lazy import (any more)"
        assert len(reason) > 20, f"{edge}: say why the import is lazy"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path / "pkg"


def test_the_checker_finds_eager_and_lazy_cycles_and_spares_package_inits(tmp_path):
    ic = _checker()
    root = _package(tmp_path, {
        # A package importing its children, which import a sibling: not a cycle.
        "__init__.py": "from pkg.sub import a\nfrom pkg import lone\n",
        "lone.py": "import os\n",
        "sub/__init__.py": "from pkg.sub.a import A\n",
        "sub/a.py": "from pkg.sub import b\nA = 1\n",
        "sub/b.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.sub import a  # never runs: no edge
            def late():
                from . import c  # lazy, relative
            """,
        "sub/c.py": "import pkg.sub.b\n",  # c -> b eagerly; b -> c lazily: a cycle
        "x.py": "from pkg import y\n",
        "y.py": "from pkg.x import *\n",  # x <-> y, both module-level
    })
    edges = ic.import_graph(root, "pkg")
    pairs = {(e.src, e.dst, e.lazy) for e in edges}
    assert ("pkg.sub.b", "pkg.sub.c", True) in pairs and ("pkg.sub.c", "pkg.sub.b", False) in pairs
    assert not any(e.src == "pkg.sub.b" and e.dst == "pkg.sub.a" for e in edges)  # TYPE_CHECKING
    found = sorted(sorted(c[:-1]) for c in ic.cycles(edges))
    assert found == [["pkg.sub.b", "pkg.sub.c"], ["pkg.x", "pkg.y"]]
    # Allowing the lazy edge leaves the module-level cycle only; nothing allows that one.
    left = ic.cycles(edges, allowed={("pkg.sub.b", "pkg.sub.c")})
    assert [sorted(c[:-1]) for c in left] == [["pkg.x", "pkg.y"]]
    assert ic.cycles(edges, allowed={("pkg.x", "pkg.y"), ("pkg.y", "pkg.x")}) != []
    assert "line 1" in ic.describe(left[0], edges)


def test_a_module_importing_another_package_runs_that_packages_init(tmp_path):
    ic = _checker()
    root = _package(tmp_path, {
        "__init__.py": "",
        "p/__init__.py": "from pkg.q.m import f\n",  # p's init imports q.m ...
        "p/inner.py": "",
        "q/__init__.py": "",
        "q/m.py": "from pkg.p import inner\n",      # ... which runs p's init: a cycle
    })
    assert [sorted(c[:-1]) for c in ic.cycles(ic.import_graph(root, "pkg"))] == [["pkg.p", "pkg.q.m"]]
