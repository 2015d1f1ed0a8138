"""Product text (the package's code and docstrings, README, BENCHMARKS, ARCHITECTURE, docs/) speaks to
users: it never cites documents a user cannot see (internal design notes, issue threads, source notes);
it writes the fact, names the paper, or cites the project's own docs (docs/equations.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "an internal source note": re.compile(r"\bseeds? ?\d{3}\b|\bthe seed's\b", re.I),
    "the design contract": re.compile(r"DESIGN\.md"),
    "an issue": re.compile(r"\bthe issue\b|\bissue's\b|\bkernels issue\b|\bissue \d+\b", re.I),
    "the source notes' equation numbers": re.compile(r"\beq\. 9\.\d\d|\(9\.\d\d[)-]"),
}


def _files() -> list[Path]:
    files = [*ROOT.joinpath("src", "multihead").rglob("*.py"), *ROOT.joinpath("docs").rglob("*.md")]
    return files + [ROOT / name for name in ("README.md", "BENCHMARKS.md", "ARCHITECTURE.md")]


def test_product_text_cites_only_what_users_can_read():
    found = []
    for path in _files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: cites {what}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_the_cited_equations_exist():
    """Every 'eq. (n)' the code cites is an equation docs/equations.md numbers."""
    numbered = set(re.findall(r"\((\d+)\)\s*$", (ROOT / "docs" / "equations.md").read_text(), flags=re.M))
    assert numbered == {str(i) for i in range(1, 14)}
    cited = set()
    for path in _files():
        for m in re.finditer(r"\beq\. \((\d+)\)(?:-\((\d+)\))?", path.read_text(encoding="utf-8")):
            cited.update(g for g in m.groups() if g)
    assert cited and cited <= numbered, sorted(cited - numbered)
