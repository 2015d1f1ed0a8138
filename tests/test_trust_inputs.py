"""Files and sizes a user names, one row per reproduction: each gives a clear ValueError that names the file
(or the sizes) and the fix, or the right result, and leaves no partial file behind.

Rows: allocations with no bound (a KV cache past the model's positions or the machine's memory, a config
much larger than its weights, a dense score matrix of many GiB); loader errors that must name the file
and the key; garbage in masked positions; writes interrupted half-way; shard names outside the folder;
torch.nn.MultiheadAttention's own edge cases run against mh.compat.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import multihead as mh
from multihead.cli.main import main as cli_main
from multihead.pretrained.files import atomic_write

from .checkpoints import CONFIG, tiny_state_dict, write_tiny


def _files_left(folder: Path) -> list[str]:
    """Hidden temporaries of atomic writes left in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and "-" in p.name)


# -- item 3: allocations with no bound -------------------------------------------------------------
def _generate_past_max_len(tmp: Path):
    mh.pretrained.random_lm("llama-tiny").generate(torch.tensor([[1, 2, 3]]), 20_000_000)


def _cache_beyond_memory(tmp: Path):
    mh.pretrained.random_lm("llama-tiny").make_cache(100_000, 1_000_000)


def _config_vocab_6m(tmp: Path):
    mh.pretrained.load(write_tiny(tmp, {**CONFIG, "vocab_size": 6_000_000}))


def _config_2000_layers(tmp: Path):
    mh.pretrained.load(write_tiny(tmp, {**CONFIG, "num_hidden_layers": 2000}))


def _weights_40k(backend: str, **kw) -> Callable[[Path], None]:
    def run(tmp: Path):
        q = torch.randn(1, 1, 40_000, 4)
        mh.attention(q, q, q, backend=backend, **kw)

    return run


# -- item 4: loader errors that name the file and the key ------------------------------------------
def _converted(tmp: Path) -> Path:
    lm = mh.heads.to_gqa(mh.pretrained.random_lm("llama-tiny"), 1)
    return mh.heads.save_converted(
        lm, [{"to": "gqa", "n_kv_heads": 1}], tmp / "c", base={"preset": "llama-tiny"}
    )


def _converted_with(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    def run(tmp: Path):
        folder = _converted(tmp)
        edit(folder)
        mh.heads.load_converted(folder)

    return run


def _truncate(name: str, n: int) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes((folder / name).read_bytes()[:n])


def _surgery(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def run(folder: Path):
        meta = json.loads((folder / "surgery.json").read_text())
        (folder / "surgery.json").write_text(json.dumps(edit(meta)))

    return run


def _config_with(**over) -> Callable[[Path], None]:
    return lambda tmp: mh.pretrained.load(write_tiny(tmp, {**CONFIG, **over}))


def _without_k_proj(tmp: Path):
    sd = tiny_state_dict()
    del sd["model.layers.1.self_attn.k_proj.weight"]
    mh.pretrained.load(write_tiny(tmp, sd=sd))


def _k_proj_of_another_width(tmp: Path):
    sd = tiny_state_dict()
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.randn(8, 12)
    mh.pretrained.load(write_tiny(tmp, sd=sd))


def _shard_index(name: str) -> Callable[[Path], None]:
    def run(tmp: Path):
        write_tiny(tmp)
        (tmp / "model.safetensors").rename(tmp / "model-00001-of-00001.safetensors")
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": name}}))
        mh.pretrained.load(tmp)

    return run


def _nested_query(tmp: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch calls its nested tensors a prototype
        nt = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    mh.compat.MultiheadAttention(8, 2, batch_first=True)(nt, nt, nt)


ROWS: dict[str, tuple[Callable[[Path], None], str]] = {
    "generate --max-new-tokens 20000000": (
        _generate_past_max_len,
        r"20000003 positions exceed the model's max_len=1024 .* at most 1021 new tokens",
    ),
    "a KV cache larger than the free memory": (
        _cache_beyond_memory,
        r"KV cache of 2 layers x 100000 rows x 1000000 positions needs .* TiB, but only .* is free",
    ),
    "vocab_size=6000000 for a small checkpoint": (
        _config_vocab_6m,
        r"config\.json with model\.safetensors\): .*embed\.weight: checkpoint \(32, 16\) "
        r"vs model \(6000000, 16\)",
    ),
    "num_hidden_layers=2000 for 2 layers": (
        _config_2000_layers,
        r"config\.json says num_hidden_layers=2000 but the weights hold 2 layers",
    ),
    "return_weights at N=40000": (
        _weights_40k("auto", return_weights=True),
        r"'matrix' would materialise .* \(1, 1, 40000, 40000\) .* 6\.0 GiB, over the limit "
        r".* drop return_weights",
    ),
    "backend='matrix' at N=40000": (
        _weights_40k("matrix"),
        r"float32: 6\.0 GiB, over the limit of 4\.0 GiB .* backend='tiled' .* MULTIHEAD_MAX_SCORE_BYTES",
    ),
    "backend='reference' at N=40000": (_weights_40k("reference"), r"float64: 11\.9 GiB, over the limit"),
    "load_converted: truncated model.safetensors": (
        _converted_with(_truncate("model.safetensors", 5000)),
        r"model\.safetensors' \(5000 bytes\) is not a readable safetensors file .* convert the model again",
    ),
    "load_converted: truncated surgery.json": (
        _converted_with(_truncate("surgery.json", 30)),
        r"surgery file '.*surgery\.json' is not valid JSON \(line \d+, column \d+: Unterminated string",
    ),
    "load_converted: a step without its key": (
        _converted_with(_surgery(lambda m: {**m, "steps": [{"to": "gqa"}]})),
        r"surgery\.json': step 0 \(gqa\) needs 'n_kv_heads' as an int >= 1, got None",
    ),
    "load_converted: no steps": (
        _converted_with(_surgery(lambda m: {"base": m["base"]})),
        r"surgery\.json' has no 'steps' list",
    ),
    "load_converted: a JSON list": (
        _converted_with(_surgery(lambda m: [m])),
        r"surgery file '.*surgery\.json' holds a JSON list, expected an object",
    ),
    "load_converted: an unknown base preset": (
        _converted_with(_surgery(lambda m: {**m, "base": {"preset": "llama-tinx"}})),
        r"surgery\.json': its base cannot be built: unknown preset 'llama-tinx'",
    ),
    "load_converted: weights from another save": (
        _converted_with(_surgery(lambda m: {**m, "weights_id": "other"})),
        r"model\.safetensors' and '.*surgery\.json' come from different saves",
    ),
    "num_attention_heads: 0": (
        _config_with(num_attention_heads=0),
        r"config\.json': num_attention_heads must be an int >= 1, got 0",
    ),
    "hidden_size: 128.0": (
        _config_with(hidden_size=128.0),
        r"config\.json': hidden_size .* got 128\.0 \(a float\)",
    ),
    'hidden_size: "128"': (
        _config_with(hidden_size="128"),
        r"hidden_size .* got '128' \(a str\); write 128 without",
    ),
    'rms_norm_eps: "x"': (
        _config_with(rms_norm_eps="x"),
        r"config\.json': rms_norm_eps must be a finite number > 0",
    ),
    "heads that do not divide": (
        _config_with(num_attention_heads=3),
        r"hidden_size=16 is not divisible by num_at",
    ),
    "a missing k_proj": (
        _without_k_proj,
        r"config\.json with model\.safetensors\): .*layers\.1\.self_attn\.q_proj\.weight but no "
        r"layers\.1\.self_attn\.k_proj\.weight",
    ),
    "a k_proj of another width than q_proj": (
        _k_proj_of_another_width,
        r"model\.safetensors\): the weights do not fit together .*Expected 16 in dimension 1 but got 12",
    ),
    "a shard named ../": (
        _shard_index("../x.safetensors"),
        r"index\.json' names the shard '\.\./x\.safetensors' outside",
    ),
    "a shard named by an absolute path": (
        _shard_index("/etc/passwd"),
        r"names the shard '/etc/passwd' outside the",
    ),
    "a nested tensor query in mh.compat": (
        _nested_query,
        r"query is a nested tensor, .* torch\.nested\.to_padded",
    ),
}


@pytest.mark.parametrize("case", list(ROWS))
def test_each_reproduction_gives_a_clear_error_and_no_partial_file(case, tmp_path):
    run, message = ROWS[case]
    with pytest.raises(ValueError, match=message):
        run(tmp_path)
    for folder in [tmp_path, *(p for p in tmp_path.rglob("*") if p.is_dir())]:
        assert _files_left(folder) == []


def test_a_truncated_config_is_named_by_explain_hf(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 12')
    assert cli_main(["explain", "--hf", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert f"config file {str(tmp_path / 'config.json')!r} is not valid JSON" in err


def test_generate_model_with_a_bad_config_names_the_file(tmp_path, capsys):
    write_tiny(tmp_path, {**CONFIG, "num_attention_heads": 0})
    assert cli_main(["generate", "--model", str(tmp_path), "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err
    assert "config.json': num_attention_heads must be an int >= 1, got 0" in err
    assert "Traceback" not in err


def test_mixed_dtypes_are_cast_to_the_majority_with_a_warning(tmp_path):
    sd = tiny_state_dict()
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].half()
    config = {k: v for k, v in CONFIG.items() if k != "torch_dtype"}
    with pytest.warns(
        UserWarning, match=r"mixes float dtypes .* casting model\.layers\.0\.mlp\.up_proj\.weight"
    ):
        lm = mh.pretrained.load(write_tiny(tmp_path, config, sd))
    assert {p.dtype for p in lm.parameters()} == {torch.float32}


def test_the_declared_dtype_wins_over_the_majority(tmp_path):
    sd = tiny_state_dict()
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].bfloat16()  # the largest tensor
    with pytest.warns(UserWarning, match=r"to torch\.float32"):
        lm = mh.pretrained.load(write_tiny(tmp_path, CONFIG, sd))
    assert lm.embed.weight.dtype == torch.float32


def test_the_tiny_checkpoint_loads_and_runs(tmp_path):
    lm = mh.pretrained.load(write_tiny(tmp_path))
    assert lm(torch.tensor([[1, 2, 3]])).shape == (1, 3, 32)


def test_the_score_limit_can_be_raised(monkeypatch):
    q = torch.randn(1, 1, 64, 4)
    monkeypatch.setenv("MULTIHEAD_MAX_SCORE_BYTES", "1000")
    with pytest.raises(ValueError, match=r"16\.0 KiB, over the limit of 1000 B"):
        mh.attention(q, q, q, backend="matrix")
    monkeypatch.setenv("MULTIHEAD_MAX_SCORE_BYTES", str(1 << 20))
    assert mh.attention(q, q, q, backend="matrix").shape == (1, 1, 64, 4)
    monkeypatch.setenv("MULTIHEAD_MAX_SCORE_BYTES", "lots")
    with pytest.raises(ValueError, match=r"MULTIHEAD_MAX_SCORE_BYTES='lots' must be a whole number of bytes"):
        mh.attention(q, q, q, backend="matrix")


# -- item 5: garbage in masked positions (the full grid is tests/test_masked_garbage.py) ------------
@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
def test_nan_in_padded_keys_does_not_leak_at_64_rows(backend):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 64, 8), torch.randn(2, 2, 64, 8), torch.randn(2, 2, 64, 8)
    mask = mh.padding([40, 17])
    clean = mh.attention(q, k, v, mask=mask, backend=backend)
    k[0, :, 40:], v[1, :, 17:] = float("nan"), float("nan")
    assert torch.allclose(mh.attention(q, k, v, mask=mask, backend=backend), clean, atol=1e-6)


# -- item 6: interrupted writes leave the old files and no temporary --------------------------------
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_or_ctrl_c_inside_atomic_write_keeps_the_old_file(tmp_path, error):
    target = tmp_path / "emb.npy"
    target.write_bytes(b"old")
    with pytest.raises(error, match="disk full"), atomic_write(target) as tmp:
        tmp.write_bytes(b"half of the new")
        raise error("disk full")
    assert target.read_bytes() == b"old"
    assert _files_left(tmp_path) == []


def test_save_converted_twice_gives_a_matching_pair(tmp_path):
    first = _converted(tmp_path)
    again = mh.heads.save_converted(
        mh.heads.to_gqa(mh.pretrained.random_lm("llama-tiny", seed=1), 1),
        [{"to": "gqa", "n_kv_heads": 1}],
        first,
        base={"preset": "llama-tiny"},
    )
    lm = mh.heads.load_converted(again)
    assert isinstance(lm, mh.TransformerLM)
    assert sorted(p.name for p in again.iterdir()) == ["model.safetensors", "surgery.json"]


_SIGTERM_CHILD = textwrap.dedent(
    """
    import sys, time
    import safetensors.torch as st
    import multihead as mh

    real = st.save_file

    def slow_save(state, path, metadata=None):
        real(state, path, metadata=metadata)
        print("written", flush=True)
        time.sleep(60)  # SIGTERM arrives here, the weights half-way into place

    st.save_file = slow_save
    mh.startup.end_on_termination()  # as the command line does: SIGTERM ends it with an exception
    lm = mh.heads.to_gqa(mh.pretrained.random_lm("llama-tiny"), 1)
    mh.heads.save_converted(lm, [{"to": "gqa", "n_kv_heads": 1}], sys.argv[1], base={"preset": "llama-tiny"})
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM semantics are POSIX")
def test_sigterm_during_save_converted_leaves_the_old_pair_and_no_temporary(tmp_path):
    folder = _converted(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", _SIGTERM_CHILD, str(folder)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "written"
    assert len(_files_left(folder.parent)) == 1  # the new folder, still a temporary beside the old one
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 128 + signal.SIGTERM  # the signal still ends the process
    assert _files_left(folder.parent) == [] and _files_left(folder) == []
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert isinstance(mh.heads.load_converted(folder), mh.TransformerLM)


# -- item 7: torch.nn.MultiheadAttention's own edge cases ---------------------------------------------
def test_a_double_query_with_a_half_in_proj_bias_matches_torch():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(4, 4, batch_first=True, dtype=torch.double).eval()
    ours = mh.compat.MultiheadAttention(4, 4, batch_first=True, dtype=torch.double).eval()
    ours.load_state_dict(ref.state_dict())
    for m in (ref, ours):
        m.in_proj_bias = torch.nn.Parameter(m.in_proj_bias.detach().to(torch.half))
    query = torch.randn(4, 4, 4, dtype=torch.double)
    with torch.no_grad():
        (out_ref, w_ref), (out, w) = ref(query, query, query), ours(query, query, query)
    assert out.dtype == out_ref.dtype == torch.double
    torch.testing.assert_close(out, out_ref)
    assert w is not None and w_ref is not None
    torch.testing.assert_close(w, w_ref)
