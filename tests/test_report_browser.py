"""report.html in a real browser: headless Chromium renders it, the page is not blank, every image loads.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it); without it the test skips and says so.
The page is the study's own renderer on two real sections (the walk and the KV cache, which draw figures);
the full quick study's report is checked structurally in tests/test_cli.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from multihead.study.context import StudyContext
from multihead.study.render import render_html
from multihead.study.sections.kv_cache import kv_cache
from multihead.study.sections.walk import walk

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
# Appended to a copy of the page: once everything has loaded, the title reports what the browser saw.
PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = Array.from(document.images);
  const ok = imgs.filter((i) => i.complete && i.naturalWidth > 0).length;
  document.title = "PROBE images=" + ok + "/" + imgs.length + " text=" + document.body.innerText.length;
});
</script>"""


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    profile = tmp_path / "profile"
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    ctx = StudyContext(quick=True, out_dir=out)
    sections = [walk(ctx), kv_cache(ctx)]
    assert sum(len(s.figures) for s in sections) >= 2
    (out / "report.html").write_text(render_html(sections, "multihead study (test)", "two sections"))
    return out


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)")
def test_report_renders_in_headless_chromium(report_dir, tmp_path):
    page = (report_dir / "report.html").read_text()
    probe = report_dir / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"))
    proc = _chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r"PROBE images=(\d+)/(\d+) text=(\d+)", proc.stdout)
    assert found, f"the page did not finish loading: {proc.stdout[:500]!r}"
    ok, total, text = (int(g) for g in found.groups())
    assert total >= 2 and ok == total, f"{total - ok} of {total} images did not load"
    assert text > 500  # tables and notes rendered as text

    shot = tmp_path / "shot.png"
    proc = _chromium(
        tmp_path, "--window-size=1200,1600", f"--screenshot={shot}", (report_dir / "report.html").as_uri()
    )
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    import matplotlib.image

    pixels = np.asarray(matplotlib.image.imread(shot))  # (H, W, 3|4) in [0, 1]
    assert pixels.std() > 0.02, "the screenshot is blank"
    dark = (pixels[..., :3].mean(-1) < 0.5).mean()
    assert 0.005 < dark < 0.6, f"{dark:.3f} of the pixels are dark: not a page of text, tables and plots"
