"""benchmarks/native_layers_ab.py: the other tree's native sources are found, built with this tree's
flags and loaded with its declarations; a folder without them is refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from multihead import native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import native_layers_ab

SRC = Path(__file__).resolve().parents[1] / "src"
REASON = native.unavailable()


def test_a_folder_without_native_sources_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a multihead source tree: missing"):
        native_layers_ab.build_other(tmp_path, tmp_path)


@pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
def test_this_trees_sources_build_and_load_as_the_other(tmp_path):
    lib = native.open_library(native_layers_ab.build_other(SRC, tmp_path))
    assert lib.mh_decode_layer_q8.restype is not None and lib.mh_q8_isa() == native.library().mh_q8_isa()
