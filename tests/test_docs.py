"""The docs stay true to the tree: docs/structure.md names every module and script, no file
points at a design page outside the repository, and the import rules of docs/design.md hold.

They read files only (no tpserve import): a second or two.
"""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRUCTURE = ROOT / "docs" / "structure.md"
DESIGN = ROOT / "docs" / "design.md"
# Written in two pieces so that this file does not name the outside page itself.
OUTSIDE_DESIGN = "DESIGN" + ".md"


def repo_files(*dirs: str) -> list[str]:
    """Tracked and untracked (not ignored) files under ``dirs``, as repository paths."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *dirs],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = out.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist)
        files = [str(p.relative_to(ROOT)) for d in dirs for p in (ROOT / d).rglob("*") if p.is_file()]
    return sorted(f for f in files if "__pycache__" not in f and (ROOT / f).is_file())


def mentioned(text: str) -> set[str]:
    """Every path written in backticks in ``text``."""
    return set(re.findall(r"`([A-Za-z0-9_./-]+)`", text))


def covered(path: str, names: set[str]) -> bool:
    """A file is covered by its own path; a package's ``__init__.py`` also by its folder
    (``tpserve/blockpool/``); a data file (not code) by any folder above it."""
    if path in names:
        return True
    parent = path.rsplit("/", 1)[0] + "/"
    if path.endswith("/__init__.py"):
        return parent in names
    if path.endswith((".py", ".sh", ".cpp", ".h")):
        return False
    parts = path.split("/")
    return any("/".join(parts[:i]) + "/" in names for i in range(2, len(parts)))


def test_structure_names_every_module_and_script():
    files = repo_files("tpserve", "scripts")
    assert "tpserve/engine.py" in files and "scripts/quickstart.py" in files  # the listing works
    names = mentioned(STRUCTURE.read_text())
    missing = [f for f in files if not covered(f, names)]
    assert not missing, f"docs/structure.md does not mention: {missing}"


def test_structure_gives_each_file_one_line():
    heads = re.findall(r"^- `([^`]+)`", STRUCTURE.read_text(), re.M)
    assert len(heads) > 100
    twice = sorted({h for h in heads if heads.count(h) > 1})
    assert not twice, f"docs/structure.md has more than one line for: {twice}"


def test_structure_names_no_file_that_is_gone():
    """A line for a module that was moved or deleted is as wrong as a missing one."""
    names = {n for n in mentioned(STRUCTURE.read_text()) if n.startswith(("tpserve/", "scripts/"))}
    gone = sorted(n for n in names if not (ROOT / n).exists())
    assert not gone, f"docs/structure.md names files that do not exist: {gone}"


def test_no_file_points_at_a_design_page_outside_the_repository():
    assert DESIGN.is_file()
    hits = []
    for f in repo_files("."):
        p = ROOT / f
        if p.suffix not in (".py", ".md", ".sh", ".toml", ".cfg", ".txt", ".yaml", ".yml", "") \
                and p.name != "Makefile":
            continue
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{f}:{i}" for i, line in enumerate(text.splitlines(), 1) if OUTSIDE_DESIGN in line]
    assert not hits, f"point these at docs/design.md: {hits}"


def test_docs_links_resolve():
    """Every docs/*.md page that a doc or the README names exists."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    wanted = {m for p in pages for m in re.findall(r"docs/[a-z_]+\.md", p.read_text())}
    assert "docs/design.md" in wanted
    assert not [w for w in sorted(wanted) if not (ROOT / w).is_file()]


# ---- import rules (docs/design.md, "Module map and import rules") -------------------------

CONTRACTS = ("tpserve.config", "tpserve.spec_config", "tpserve.quantization", "tpserve.errors",
             "tpserve.limits", "tpserve.sampling", "tpserve.request", "tpserve.plan", "tpserve.sample_plan",
             "tpserve.outputs", "tpserve.procs", "tpserve.tokenizer", "tpserve.gguf_file",
             "tpserve.kv_tiers.files", "tpserve.kv_tiers.connector")
SCHEDULER_SIDE = ("tpserve.blockpool", "tpserve.grammar", "tpserve.scheduler", "tpserve.kv_tiers.index")
ENGINE = ("tpserve.engine", "tpserve.llm", "tpserve.launch")
ABOVE_ENGINE = ("tpserve.server", "tpserve.fronts", "tpserve.client", "tpserve.cli")
DEVICE = ("torch", "triton", "tpserve.kernels", "tpserve.models", "tpserve.workers")

# module prefix -> prefixes it must never import (lazy imports inside functions included)
FORBIDDEN = {
    "tpserve.blockpool": DEVICE + ENGINE + ABOVE_ENGINE + ("tpserve.scheduler", "tpserve.grammar"),
    "tpserve.grammar": DEVICE + ENGINE + ABOVE_ENGINE + ("tpserve.scheduler", "tpserve.blockpool"),
    "tpserve.scheduler": DEVICE + ENGINE + ABOVE_ENGINE,
    "tpserve.kv_tiers.index": DEVICE + ENGINE + ABOVE_ENGINE + ("tpserve.scheduler", "tpserve.grammar"),
    "tpserve.kernels": SCHEDULER_SIDE + ENGINE + ABOVE_ENGINE + ("tpserve.models", "tpserve.workers"),
    "tpserve.models": SCHEDULER_SIDE + ENGINE + ABOVE_ENGINE + ("tpserve.workers",),
    "tpserve.workers": SCHEDULER_SIDE + ENGINE + ABOVE_ENGINE,
    "tpserve.client": DEVICE + SCHEDULER_SIDE + ENGINE + ("tpserve.server", "tpserve.fronts", "tpserve.cli",
                                                         "tpserve.detokenizer"),
    "tpserve.fronts": DEVICE + SCHEDULER_SIDE + ENGINE + ("tpserve.cli",),
    "tpserve.server": ("tpserve.cli", "tpserve.llm", "tpserve.launch"),
}
for _m in CONTRACTS:
    FORBIDDEN[_m] = DEVICE + SCHEDULER_SIDE + ENGINE + ABOVE_ENGINE + ("tpserve.detokenizer",)
# The gRPC front relays the daemon's KV events and reads their wire format from the server.
ALLOWED = {"tpserve.fronts": ("tpserve.server.kv_events",)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_in(source: str, mod: str, is_package: bool = False) -> set[str]:
    """Every module the source of module ``mod`` imports, at any depth of its code, relative
    imports resolved; ``from pkg import name`` counts as ``pkg.name`` when that is a module of
    tpserve."""
    pkg = mod if is_package else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source, mod)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                rel = Path(*sub.split("."))
                is_module = ((ROOT / rel).with_suffix(".py").is_file()
                             or (ROOT / rel / "__init__.py").is_file())
                found.add(sub if base.startswith("tpserve") and is_module else base)
    return found


def starts(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_import_rules_of_the_design():
    modules = sorted((ROOT / "tpserve").rglob("*.py"))
    assert len(modules) > 50
    broken = []
    for path in modules:
        mod = module_name(path)
        rules = [(p, bad) for p, bad in FORBIDDEN.items() if starts(mod, p)]
        for name in sorted(imports_of(path)):
            for prefix, bad in rules:
                allowed = any(starts(name, a) for a in ALLOWED.get(prefix, ()))
                if any(starts(name, b) for b in bad) and not allowed:
                    broken.append(f"{mod} imports {name}")
    assert not broken, "imports that docs/design.md's rules forbid:\n" + "\n".join(broken)


def test_import_rules_catch_a_violation():
    """The checker sees a lazy import deep inside a function, and a relative one."""
    source = "def f():\n    if True:\n        import torch\n    from ..workers import sampler\n"
    found = imports_in(source, "tpserve.scheduler.probe")
    assert "torch" in found and "tpserve.workers.sampler" in found
    assert all(any(starts(n, b) for b in FORBIDDEN["tpserve.scheduler"]) for n in found)
