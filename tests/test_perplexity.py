"""Perplexity by transformers' sliding-window method: a tiny TransformerLM against the guide's loop
written out in float64, SmolLM2 against transformers' own model read from the same GGUF file, the
windows' properties, argument checks, the Wikipedia text (markup stripping on constructed markup, the
fixed split) and ``multihead eval --perplexity``."""

from __future__ import annotations

import bz2
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.cli.main import main
from multihead.eval import wikipedia
from multihead.eval.perplexity import windows

from . import smollm2_oracle

VOCAB = 97


class Bytes:
    """A tokenizer of the tests: one id per UTF-8 byte, modulo the tiny vocabulary."""

    def encode(self, text):
        return [b % VOCAB for b in text.encode("utf-8")]


def tiny_lm(dropout: float = 0.0) -> mh.TransformerLM:
    torch.manual_seed(0)
    return mh.TransformerLM(VOCAB, 32, 2, 4, 64, n_kv_heads=2, dropout=dropout).eval()


def guide_perplexity(model, ids: torch.Tensor, context: int, stride: int) -> tuple[float, int]:
    """transformers' "Perplexity of fixed-length models" loop, in float64, with each scored token
    counted once (the guide weights a window's mean loss by one token fewer than it scores)."""
    seq_len = ids.size(1)
    nll_sum, n_tokens, prev_end_loc = torch.zeros((), dtype=torch.float64), 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + context, seq_len)
        trg_len = end_loc - prev_end_loc  # may differ from stride on the last loop
        input_ids = ids[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            logits = model(input_ids).double()  # (1, L, V)
        shift_logits, shift_labels = logits[:, :-1], target_ids[:, 1:]  # the model's internal shift
        nll_sum += F.cross_entropy(
            shift_logits.reshape(-1, logits.size(-1)),
            shift_labels.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        n_tokens += int((shift_labels != -100).sum())
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return math.exp(float(nll_sum) / n_tokens), n_tokens


TEXTS = ["The quick brown fox jumps over the lazy dog.", "Perplexity is exp of the mean loss; " * 3]


@pytest.mark.parametrize(
    "context, stride", [(16, 8), (16, 16), (9, 4), (40, 13), (512, 256)], ids=lambda v: str(v)
)
def test_tiny_model_matches_the_guide_loop_in_float64(context, stride):
    model = tiny_lm()
    ids = torch.tensor([Bytes().encode("\n\n".join(TEXTS))])  # the texts joined as the guide joins them
    want, n = guide_perplexity(model.double(), ids, context, stride)
    s = mh.eval.perplexity_scores(model, TEXTS, context=context, stride=stride, tokenizer=Bytes())
    assert s.scored == n and s.perplexity == pytest.approx(want, rel=1e-12)


def test_fp32_model_within_1e_5_of_the_float64_loop():
    model = tiny_lm()
    ids = torch.tensor([Bytes().encode("\n\n".join(TEXTS))])
    fp32 = mh.eval.perplexity(model, TEXTS, context=16, stride=8, tokenizer=Bytes())
    want, _ = guide_perplexity(model.double(), ids, 16, 8)
    assert type(fp32) is float and fp32 == pytest.approx(want, rel=1e-5)


def test_any_module_returning_logits_and_the_tokenizer_default():
    model = tiny_lm()

    class Logits(torch.nn.Module):  # transformers' output: an object with .logits
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, ids):
            return type("Out", (), {"logits": self.lm(ids)})()

    wrapped = Logits()
    wrapped.tokenizer = Bytes()
    model.tokenizer = Bytes()
    assert mh.eval.perplexity(wrapped, TEXTS, context=16, stride=8) == pytest.approx(
        mh.eval.perplexity(model, TEXTS, context=16, stride=8), rel=1e-6
    )


def test_scored_in_eval_mode_and_the_modes_restored():
    model = tiny_lm(dropout=0.5)
    want = mh.eval.perplexity(model, TEXTS, context=16, stride=8, tokenizer=Bytes())
    model.train()
    model.layers[0].eval()  # a mixed state comes back as it was
    got = mh.eval.perplexity(model, TEXTS, context=16, stride=8, tokenizer=Bytes())
    assert got == want  # dropout off: the same number
    assert model.training and not model.layers[0].training and model.layers[1].training


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"context": 1}, r"context must be an int >= 2, got 1"),
        ({"stride": 0}, r"stride must be an int in \[1, 16\], got 0"),
        ({"stride": 17}, r"stride must be an int in \[1, 16\], got 17"),
        ({"texts": []}, r"texts is empty"),
        ({"texts": "one text"}, r"texts must be a list of strings, got a str"),
        ({"texts": ["ok", 3]}, r"texts\[1\] is a int"),
        ({"texts": ["a"]}, r"tokenize to 1 token"),
        ({"tokenizer": None}, r"has no tokenizer; pass tokenizer="),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"texts": TEXTS, "context": 16, "stride": 8, "tokenizer": Bytes(), **kwargs}
    with pytest.raises(ValueError, match=match):
        mh.eval.perplexity(tiny_lm(), args.pop("texts"), **args)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 300), st.integers(2, 64), st.data())
def test_windows_score_each_token_once_as_the_guide_does(n_tokens, context, data):
    stride = data.draw(st.integers(1, context))
    spans = windows(n_tokens, context, stride)
    scored = [t for begin, end, n in spans for t in range(end - n, end)]
    assert scored == sorted(set(scored))  # in order, none twice
    assert all(n >= 1 and end - begin <= context and end - n > begin for begin, end, n in spans)
    assert spans[-1][1] in (n_tokens, n_tokens - 1)  # the last token, or one before a lone last token
    assert [b for b, _, _ in spans] == list(range(0, stride * len(spans), stride))
    if stride < context:
        assert scored == list(range(1, n_tokens))  # every token but the first
    else:  # no overlap: each window's first token has no context (the guide skips it too)
        assert len(scored) == n_tokens - math.ceil(n_tokens / stride)


def test_interval_brackets_the_point_and_is_seeded():
    s = mh.eval.perplexity_scores(tiny_lm(), TEXTS * 3, context=16, stride=8, tokenizer=Bytes())
    lo, hi = s.interval(samples=200)
    assert lo < s.perplexity < hi and (lo, hi) == s.interval(samples=200)
    assert float(s) == s.perplexity == pytest.approx(math.exp(s.mean_nll))
    one = mh.eval.perplexity_scores(tiny_lm(), ["short"], context=16, stride=8, tokenizer=Bytes())
    assert one.interval() == pytest.approx((one.perplexity, one.perplexity))


# -- Wikipedia text -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "markup, text",
    [
        ("'''Anarchism''' is a [[political philosophy]].", "Anarchism is a political philosophy."),
        ("[[self-governance|self-governed]] [[bus]]es", "self-governed buses"),
        ("a{{cite|x={{inner|y}}}} b", "a b"),
        ("a<ref name=x>{{cite web|url=u}}</ref> b<ref name=y/> c", "a b c"),
        ("intro\n{| class=wikitable\n|-\n| cell || {{t|1}}\n|}\nafter", "intro\n\nafter"),
        ("==History==\nText.\n=== Later ===\nMore.", "Text.\n\nMore."),
        ("Text.\n==See also==\n* [[Other]]\n==References==\n{{reflist}}", "Text."),
        ("[[File:X.png|thumb|A [[caption]] link]]Body [[Category:Things]][[de:Ding]]", "Body"),
        ("[http://example.org the site] and [https://x.org]", "the site and"),
        ("* one\n# two\n: three", "one\ntwo\nthree"),
        ("x &amp; y&nbsp;z <!-- hidden --> <small>w</small> <math>x^2</math>", "x & y z w"),
        ("open {{ never closed", "open never closed"),
        ("open [[ never closed", "open never closed"),
        ("a\n\n\n\nb", "a\n\nb"),
    ],
)
def test_strip_markup(markup, text):
    assert wikipedia.strip_markup(markup) == text


MARKUP = st.lists(
    st.sampled_from(
        ["{{", "}}", "{|", "|}", "[[", "]]", "|", "<ref>", "</ref>", "'''", "==", "\n", "word", " "]
    ),
    max_size=40,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(MARKUP)
def test_strip_markup_never_leaves_link_or_template_brackets(markup):
    out = wikipedia.strip_markup(markup)
    assert "{{" not in out and "[[" not in out and "<ref" not in out
    assert wikipedia.strip_markup(out.replace("|}", "").replace("]]", "").replace("}}", "")) is not None


@given(st.text(alphabet=st.characters(whitelist_categories=("L", "N"), max_codepoint=0x2FF) | st.just(" ")))
def test_plain_text_comes_through(text):
    assert wikipedia.strip_markup(text) == " ".join(text.split())


def _dump(path, pages):
    body = "".join(
        f"<page><title>{t}</title><ns>{ns}</ns><revision><text>{x}</text></revision></page>"
        for t, ns, x in pages
    )
    xml = f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">{body}</mediawiki>'
    path.write_bytes(bz2.compress(xml.encode()))
    return path


def test_articles_skip_redirects_other_namespaces_and_stubs_and_split_disjointly(tmp_path):
    long = "word " * 60
    pages = [(f"A{i}", 0, f"'''A{i}''' {long}") for i in range(9)]
    pages += [("R", 0, "#REDIRECT [[A1]]"), ("Talk:A", 1, long), ("Stub", 0, "short")]
    path = _dump(tmp_path / "d.xml.bz2", pages)
    titles = [a.title for a in wikipedia.articles(path)]
    assert titles == [f"A{i}" for i in range(9)]
    held = [a.title for a in wikipedia.held_out(path)]
    train = [a.title for a in wikipedia.training(path)]
    assert held == ["A3", "A7"] and sorted(held + train) == sorted(titles) and not set(held) & set(train)
    texts = wikipedia.held_out_texts(1, 30, path)
    assert texts == ["A3 word word word word word"]  # cut at the last space within 30 characters
    with pytest.raises(ValueError, match=r"n must be an int in \[1, 2\], got 3; there are 2 held-out"):
        wikipedia.held_out_texts(3, path=path)


def test_a_file_that_is_not_a_dump(tmp_path):
    (tmp_path / "x.bz2").write_bytes(b"not bz2")
    with pytest.raises(ValueError, match=r"not a readable bz2 MediaWiki XML dump"):
        wikipedia.articles(tmp_path / "x.bz2")
    with pytest.raises(ValueError, match=r"does not exist"):
        wikipedia.articles(tmp_path / "missing.bz2")


def test_the_gensim_dump_held_out_slice_is_fixed():
    pytest.importorskip(
        "gensim", reason="the Wikipedia dump ships inside gensim: pip install multihead[eval]"
    )
    held = wikipedia.held_out()
    assert [a.title for a in held[:4]] == ["A", "Aristotle", "Actrius", "Ayn Rand"]
    assert len(held) == 26 and all("[[" not in a.text and "{{" not in a.text for a in held)
    assert held[1].text.startswith("Aristotle")


# -- SmolLM2 against transformers -----------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    """(multihead SmolLM2, transformers' model and tokenizer from the same GGUF file): one load, ~20 s."""
    why = smollm2_oracle.missing("gensim")
    if why:
        pytest.skip(why)
    return smollm2_oracle.pair()


def test_smollm2_perplexity_matches_transformers(smol):
    model, hf, tok = smol
    texts = wikipedia.held_out_texts(2, 400)
    ids = tok("\n\n".join(texts), return_tensors="pt").input_ids  # the guide's tokenization
    assert ids[0].tolist() == model.tokenizer.encode("\n\n".join(texts))
    want, n = guide_perplexity(lambda x: hf(x).logits, ids, context=96, stride=48)
    s = mh.eval.perplexity_scores(model, texts, context=96, stride=48)
    assert s.scored == n == ids.size(1) - 1
    assert s.perplexity == pytest.approx(want, rel=1e-4)


def test_cli_perplexity_json(tmp_path, capsys):
    pytest.importorskip("gguf", reason="a .gguf --model needs the gguf package: pip install multihead[lm]")
    pytest.importorskip(
        "gensim", reason="the Wikipedia dump ships inside gensim: pip install multihead[eval]"
    )
    from .gguf_files import write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    argv = ["eval", "--perplexity", "--model", str(path), "--texts", "2", "--chars", "300"]
    assert main([*argv, "--context", "64", "--stride", "32", "--json", "--bootstrap", "50"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = mh.pretrained.from_gguf(path)
    s = mh.eval.perplexity_scores(model, wikipedia.held_out_texts(2, 300), context=64, stride=32)
    assert out["perplexity"] == pytest.approx(s.perplexity, rel=1e-9) and out["tokens"] == s.scored
    assert out["low"] < out["perplexity"] < out["high"] and out["windows"] == s.tokens.numel() > 1
    assert main([*argv, "--context", "64", "--stride", "65"]) == 2
    assert "--stride (65) must be at most --context (64)" in capsys.readouterr().err


def test_a_gguf_model_copies_with_its_tokenizer_for_quantize(tmp_path):
    """Regression: quantize (a deep copy) of a GGUF-loaded model failed on the compiled chat template."""
    pytest.importorskip("gguf", reason="a .gguf model needs the gguf package: pip install multihead[lm]")
    pytest.importorskip("jinja2", reason="the chat template needs jinja2: pip install multihead[lm]")
    import pickle

    from .gguf_files import write_gguf

    write_gguf(tmp_path / "tiny.gguf")
    model = mh.pretrained.from_gguf(tmp_path / "tiny.gguf")
    messages = [{"role": "user", "content": "the cat"}]
    q = mh.quant.quantize(model, weights="bf16", kv=None)
    for tok in (q.tokenizer, pickle.loads(pickle.dumps(model.tokenizer))):
        assert tok.apply_chat_template(messages) == model.tokenizer.apply_chat_template(messages)
    assert mh.eval.perplexity(q, ["the cat sat on the mat"], context=8, stride=4) > 1
