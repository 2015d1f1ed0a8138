"""The layering of the package, read from the source with ``ast`` (nothing is imported).

Rules (ARCHITECTURE.md):
- the library never imports the application: ``study``, ``cli``, ``bench``, ``train`` and every
  ``__main__`` sit on top of the library and may import it, never the other way round;
- there are no import cycles between modules (imports under ``if TYPE_CHECKING:`` count too: mypy
  follows them, and a cycle there is a cycle in the design);
- no module imports a private name (``_x``) or a private module from another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "multihead"
APPLICATION = ("study", "cli", "bench", "train", "__main__")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every module under src/multihead."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every ``multihead`` import in module ``name``."""
    path, is_pkg = MODULES[name]
    pkg = name if is_pkg else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("multihead")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base == "multihead" or base.startswith("multihead."):
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    found.append((sub, None, node.lineno) if sub in MODULES else (base, a.name, node.lineno))
    return found


def _owner(target: str) -> str:
    """The module that defines ``target`` (the longest known prefix)."""
    while target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name in MODULES:
        deps = {_owner(t) for t, _, _ in _imports(name)}
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def is_application(name: str) -> bool:
    return any(part in APPLICATION for part in name.split(".")[1:])


def test_the_package_has_both_layers():
    # The checks below would pass vacuously on an empty tree.
    assert len(MODULES) > 50
    assert any(is_application(m) for m in MODULES) and any(not is_application(m) for m in MODULES)


def test_library_never_imports_the_application():
    leaks = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        if not is_application(m)
        for d in deps
        if is_application(d)
    ]
    assert leaks == [], "library modules import the application layer:\n" + "\n".join(leaks)


def _cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, or None (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_cycles():
    graph = _graph()
    cycles = [c for m in graph if (c := _cycle_from(graph, m)) is not None]
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def test_no_private_names_across_modules():
    bad = []
    for name in MODULES:
        for target, imported, line in _imports(name):
            owner = _owner(target)
            if owner == name:
                continue
            if any(_private(p) for p in target.split(".")) or (imported is not None and _private(imported)):
                bad.append(f"{MODULES[name][0].relative_to(SRC)}:{line} imports {target}.{imported or ''}")
    assert bad == [], "private names imported across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, expected):
    # A negative control for test_no_import_cycles.
    assert _cycle_from(graph, "a") == expected
