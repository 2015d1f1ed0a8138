"""`multihead study --out DIR`: the report appears whole or not at all. It is written into a folder next to
DIR and swapped in at the end; an error or Ctrl-C leaves DIR as it was; a folder of other files is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from multihead.study import run
from multihead.study.context import Section, StudyContext
from multihead.study.sections.kv_cache import kv_cache


def _interrupting(ctx: StudyContext) -> Section:
    """A section that is interrupted after the one before it drew its figures."""
    raise KeyboardInterrupt


_interrupting.__name__ = "interrupting"


def _old_report(folder: Path) -> dict[str, str]:
    folder.mkdir()
    files = {"report.md": "# the old report\n", "report.html": "<p>old</p>", "old-figure.png": "png"}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def _contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_study_leaves_the_old_report_whole(stop, tmp_path, monkeypatch):
    def stopping(ctx: StudyContext) -> Section:
        raise stop("stop")

    stopping.__name__ = "stopping"
    out = tmp_path / "report"
    old = _old_report(out)
    monkeypatch.setattr(run, "SECTIONS", [kv_cache, stopping])
    with pytest.raises(stop):
        run.run_study(out_dir=out, progress=False)
    assert _contents(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"], "a temporary folder was left"


def test_a_finished_study_replaces_the_old_report(tmp_path, monkeypatch):
    out = tmp_path / "report"
    _old_report(out)
    monkeypatch.setattr(run, "SECTIONS", [kv_cache])
    doc = run.run_study(out_dir=out, progress=False)
    names = {p.name for p in out.iterdir()}
    assert {"report.md", "report.html", "kv-cache.png"} <= names and "old-figure.png" not in names
    assert "KV" in (out / "report.md").read_text() and doc["report"] == str(out / "report.md")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_a_new_folder_is_created_with_the_usual_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "SECTIONS", [kv_cache])
    run.run_study(out_dir=tmp_path / "a" / "b", progress=False)
    assert (tmp_path / "a" / "b" / "report.md").is_file()
    (tmp_path / "plain").mkdir()  # what mkdir gives under this umask
    assert (tmp_path / "a" / "b").stat().st_mode == (tmp_path / "plain").stat().st_mode
    (tmp_path / "a" / "b").chmod(0o750)
    run.run_study(out_dir=tmp_path / "a" / "b", progress=False)  # a replaced folder keeps its mode
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o750


def test_a_folder_of_other_files_is_refused_before_the_work(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "src").mkdir()
    monkeypatch.setattr(run, "SECTIONS", [_interrupting])  # would raise KeyboardInterrupt if it ran
    with pytest.raises(ValueError, match=r"holds files that are not a report's \(notes.txt, src\)"):
        run.run_study(out_dir=tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "src"]
