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
    with pytest.raises(ValueError, match="not a multihead source tree: no "):
        native_layers_ab.build_other(tmp_path, tmp_path)


@pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
def test_this_trees_sources_build_and_load_as_the_other(tmp_path):
    lib = native.open_library(native_layers_ab.build_other(SRC, tmp_path))
    assert lib.mh_decode_layers.restype is not None and lib.mh_q8_isa() == native.library().mh_q8_isa()


@pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
def test_layouts_compare_blocked_rows_with_a_copy_in_column_order():
    """--layouts: the copy holds every int8 row in column order (the tied embedding too), the same
    numbers; a model without blocked rows is refused with the reason."""
    import torch

    import multihead as mh
    from multihead.models import quant
    from multihead.native import int8 as native_int8

    torch.manual_seed(0)
    lm = mh.TransformerLM(100, 512, 1, 4, 640, n_kv_heads=2).eval()
    model = quant.quantize(lm, weights="int8", kv="int8", kernel="native", group_size=32)
    if not native_int8.reads_blocked():  # an AVX2 / portable kernel: rows in column order already
        with pytest.raises(ValueError, match="no blocked int8 rows"):
            native_layers_ab.in_column_order(model)
        return
    plain = native_layers_ab.in_column_order(model)
    pairs = [(a, b) for a, b in zip(model.modules(), plain.modules()) if isinstance(a, quant.Int8GemvLinear)]
    assert pairs and all(a.blocked and not b.blocked for a, b in pairs)
    assert all(torch.equal(b.weight_int8, a.int8_weight) for a, b in pairs)
    assert not plain.embed.blocked and torch.equal(plain.embed.weight_int8, model.embed.int8_weight)
    with pytest.raises(ValueError, match="no blocked int8 rows"):
        native_layers_ab.in_column_order(quant.quantize(lm, weights="fp32", kernel="native"))


@pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
@pytest.mark.parametrize("weights", ["int8", "fp32", "bf16"])
def test_products_mode_binds_every_linear_and_the_head(weights):
    """--products: one native product per linear layer and the output head, the weights' bytes counted
    (int8 scales included), and the products run through either build."""
    import torch

    import multihead as mh
    from multihead.models import quant

    torch.manual_seed(0)
    lm = mh.TransformerLM(100, 512, 2, 4, 640, n_kv_heads=2).eval()
    group = 32 if weights == "int8" else None
    model = quant.quantize(lm, weights=weights, kv=None, kernel="native", group_size=group)
    bounds, nbytes = native_layers_ab.product_bounds(model)
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, quant.Int8GemvLinear))]
    assert len(bounds) == len(linears) >= 2 * 4 + 1  # each layer's projections (4 or more), the head
    size = {"int8": 1, "fp32": 4, "bf16": 2}[weights]
    weights_only = sum(m.in_features * m.out_features * size for m in linears)
    assert nbytes == weights_only + (weights_only // 32 * 4 if weights == "int8" else 0)
    native.products(native.library(), bounds)()  # runs
