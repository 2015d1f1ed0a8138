"""The scripts in benchmarks/, read with ``ast`` (none is imported or run): every name they take from
multihead exists, they import one another only inside benchmarks/ and no other source tree, and no test
imports them (tests test the library functions the scripts call)."""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
NAMES = {p.stem for p in SCRIPTS}
PATH_CALLS = {"insert", "append", "syspath_prepend"}  # sys.path.insert / append, monkeypatch's


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _top_imports(tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(module, names taken from it, line) for every absolute import anywhere in the file."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> multihead module for ``import multihead as mh`` / ``from multihead import heads``."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("multihead") and a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("multihead"):
            for a in node.names:
                if isinstance(_resolve(f"{node.module}.{a.name}"), types.ModuleType):
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _resolve(dotted: str) -> object | None:
    """The module or the module attribute ``dotted`` names, None where it names nothing."""
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None


def _chains(tree: ast.Module, roots: set[str]) -> list[tuple[list[str], int]]:
    """Attribute chains ``mh.a.b.c`` read from a multihead alias: (["mh", "a", "b", "c"], line)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in roots:
                out.append(([cur.id, *reversed(parts)], node.lineno))
    return out


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_multihead_name_a_script_uses_exists(path):
    tree = _tree(path)
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]
    missing = []
    for module, names, line in _top_imports(tree):
        if module.startswith("multihead"):
            wanted = [f"{module}.{n}" for n in names] or [module]
            missing += [f"{w} (line {line})" for w in wanted if _resolve(w) is None]
    aliases = _aliases(tree)
    for parts, line in _chains(tree, set(aliases)):
        obj: object = importlib.import_module(aliases[parts[0]])
        for i, attr in enumerate(parts[1:], 1):
            if not isinstance(obj, types.ModuleType):
                break  # past a module: an object's attribute, not checked here
            if not hasattr(obj, attr):
                missing.append(f"{aliases[parts[0]]}.{'.'.join(parts[1 : i + 1])} (line {line})")
                break
            obj = getattr(obj, attr)
    assert not missing, f"{path.name} uses names multihead does not have: {missing}"


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_scripts_import_only_each_other_and_no_other_tree(path):
    text = path.read_text()
    assert "spec_from_file_location" not in text and "worktree" not in text, path.name
    local = {m.split(".")[0] for m, _, _ in _top_imports(_tree(path))} & NAMES
    assert all((ROOT / "benchmarks" / f"{m}.py").exists() for m in local)


@pytest.mark.parametrize("path", sorted((ROOT / "tests").glob("*.py")), ids=lambda p: p.name)
def test_no_test_imports_a_benchmark_script(path):
    tree = _tree(path)
    imported = {m.split(".")[0] for m, _, _ in _top_imports(tree)} & NAMES
    assert not imported, f"{path.name} imports benchmark scripts {sorted(imported)}: test the library instead"
    text = path.read_text()
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    onto_path = [ast.get_source_segment(text, c) or "" for c in calls if c.func.attr in PATH_CALLS]
    assert not [c for c in onto_path if "benchmarks" in c], f"{path.name} puts benchmarks/ on sys.path"


DOCS = [
    *(ROOT / name for name in ("README.md", "BENCHMARKS.md", "ARCHITECTURE.md", "SECURITY.md")),
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "benchmarks").glob("*.md")),
    *SCRIPTS,
    *sorted((ROOT / "src" / "multihead").rglob("*.py")),
]


def _text(path: Path) -> str:
    """The file with line breaks, comment marks and indentation folded to single spaces."""
    return re.sub(r"\s*\n\s*(#:?\s*)?", " ", path.read_text())


def _expand(pattern: str) -> list[str]:
    """``a-{x,y}.json`` -> ``a-x.json``, ``a-y.json``."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [e for alt in m[1].split(",") for e in _expand(pattern[: m.start()] + alt + pattern[m.end() :])]


def test_every_benchmark_path_the_docs_name_exists():
    missing = []
    for path in DOCS:
        for found in re.findall(r"benchmarks/[\w./{},*-]+", path.read_text()):
            for name in _expand(found.rstrip(".,")):
                if not list(ROOT.glob(name)):
                    missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_every_result_file_is_cited_by_benchmarks_md():
    text = (ROOT / "BENCHMARKS.md").read_text()
    cited = {p for found in re.findall(r"benchmarks/results/[\w./{},*-]+", text) for p in _expand(found)}
    kept = {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks" / "results").iterdir()}
    uncited = {k for k in kept if not any(Path(k).match(c) for c in cited)}
    assert not uncited, f"result files no table cites (git rm them): {sorted(uncited)}"


def test_every_benchmarks_md_section_the_docs_quote_exists():
    headings = [
        line.lstrip("#").strip()
        for line in (ROOT / "BENCHMARKS.md").read_text().splitlines()
        if line[:1] == "#"
    ]
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    missing = []
    for path in DOCS:
        text = _text(path)
        for quoted in re.findall(r'BENCHMARKS\.md, "([^"]+)"', text):
            if not any(h.startswith(quoted) for h in headings):
                missing.append(f"{path.relative_to(ROOT)}: {quoted!r}")
        missing += [
            f"{path.relative_to(ROOT)}: #{a}"
            for a in re.findall(r"BENCHMARKS\.md#([\w-]+)", text)
            if a not in anchors
        ]
        if path.name == "BENCHMARKS.md":
            missing += [
                f"BENCHMARKS.md: #{a}" for a in re.findall(r"\]\(#([\w-]+)\)", text) if a not in anchors
            ]
    assert not missing, missing
