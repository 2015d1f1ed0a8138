"""Ctrl-C and SIGTERM leave no compiler running and no temporaries behind, from any thread.

Each test runs a small program in a separate Python process (the victim), waits until it is inside the
work (a marker file), sends the signal and then looks for what it left: the fake compiler's processes
(a shell script that starts a ``sleep``, as ``cc`` starts ``cc1``) and files. The native kernels are
built into a temporary ``MULTIHEAD_CACHE``, never the real cache.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

START_S = 120  # the victim imports torch first: seconds on a busy machine
EXIT_S = 60


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent has stopped running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@pytest.fixture
def place(tmp_path):
    """Folders for one victim: ``tmp`` (its TMPDIR), ``cache`` (its MULTIHEAD_CACHE), ``mark`` (what the
    fake compiler reports), and its environment with a fake compiler that never finishes by itself."""
    for name in ("tmp", "cache", "mark", "out"):
        (tmp_path / name).mkdir()
    cc = tmp_path / "slow-cc"
    cc.write_text(
        textwrap.dedent(
            """\
            #!/bin/sh
            echo $$ >> "$MARK/pids"
            : > "${TMPDIR:-/tmp}/cc-temp.$$"
            sleep 300 &
            echo $! >> "$MARK/pids"
            touch "$MARK/started"
            wait
            """
        )
    )
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, CC=str(cc), MULTIHEAD_CACHE=str(tmp_path / "cache"), TMPDIR=str(tmp_path / "tmp"))
    env.update(MARK=str(tmp_path / "mark"), MULTIHEAD_NATIVE="1")
    return tmp_path, env


def _victim(code: str, env: dict[str, str], marker: Path, *args: str) -> subprocess.Popen[str]:
    """Start ``code`` and wait until ``marker`` exists (the victim is inside its work)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for _ in range(START_S * 10):
        if marker.exists():
            return proc
        if proc.poll() is not None:
            pytest.fail(f"the victim ended before its work started: {proc.communicate()[0]}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the victim did not reach its work in {START_S} s: {proc.communicate()[0]}")


def _end(proc: subprocess.Popen[str], sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        out = proc.communicate(timeout=EXIT_S)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the victim did not end within {EXIT_S} s of the signal: {proc.communicate()[0]}")
    return proc.returncode, out


def _left_behind(root: Path, env: dict[str, str]) -> tuple[list[int], list[str]]:
    """The fake compiler's processes still running and the temporaries left under ``root``."""
    pids = [int(p) for p in (root / "mark" / "pids").read_text().split()]
    running = [p for p in pids if _alive(p)]
    for _ in range(50):  # a killed process is reaped by its new parent a moment later
        if not running:
            break
        time.sleep(0.1)
        running = [p for p in running if _alive(p)]
    for p in running:  # this test's own mess: do not leave it to the next test
        os.kill(p, signal.SIGKILL)
    files = [str(p.relative_to(root)) for sub in ("tmp", "cache", "out") for p in (root / sub).rglob("*")]
    return running, [f for f in files if not f.endswith("/")]


BUILD_ON_MAIN = """
    from multihead import native
    print(native.unavailable())
"""

BUILD_ON_A_THREAD = """
    import threading
    from multihead import native, startup
    startup.end_on_termination()
    worker = threading.Thread(target=native.unavailable, daemon=True)
    worker.start()
    worker.join()
"""


def test_ctrl_c_during_the_first_build_stops_the_compiler_and_removes_its_temporaries(place):
    root, env = place
    proc = _victim(BUILD_ON_MAIN, env, root / "mark" / "started")
    rc, out = _end(proc, signal.SIGINT)
    assert rc != 0 and "KeyboardInterrupt" in out
    running, files = _left_behind(root, env)
    assert running == [] and files == [], out


def test_sigterm_during_a_build_on_another_thread_stops_the_compiler_and_removes_its_temporaries(place):
    root, env = place
    proc = _victim(BUILD_ON_A_THREAD, env, root / "mark" / "started")
    rc, out = _end(proc, signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, out
    running, files = _left_behind(root, env)
    assert running == [] and files == [], out


STUDY = """
    import sys, time
    from pathlib import Path
    from multihead import startup
    from multihead.study import run

    def slow(ctx):
        Path(sys.argv[2]).touch()
        time.sleep(300)

    run.SECTIONS[:] = [slow]
    startup.end_on_termination()
    run.run_study(out_dir=sys.argv[1], progress=False)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_study_leaves_no_partial_report(place, sig):
    root, env = place
    (root / "mark" / "pids").write_text("")
    inside = root / "mark" / "inside"
    proc = _victim(STUDY, env, inside, str(root / "out" / "report"), str(inside))
    assert any(p.name.startswith(".report.partial-") for p in (root / "out").iterdir())
    rc, out = _end(proc, sig)
    assert rc != 0
    assert list((root / "out").iterdir()) == [], out


def test_the_command_line_ends_on_sigterm_and_sighup_and_a_library_user_keeps_its_handlers():
    code = """
        import signal
        from multihead import startup
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # importing the library sets none
        startup.release()  # not the command line: nothing changes
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        startup.launched_as_command = lambda: True
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a signal the program ignores stays ignored
        startup.release()
        assert signal.getsignal(signal.SIGTERM) is startup._terminated
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        print("ok")
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr


WRITE_ON_A_THREAD = """
    import sys, threading, time
    from pathlib import Path
    from multihead import startup
    from multihead.pretrained.files import atomic_write

    def write():
        with atomic_write(Path(sys.argv[1])) as tmp:
            tmp.write_text("half of it")
            Path(sys.argv[2]).touch()
            time.sleep(300)

    startup.end_on_termination()
    worker = threading.Thread(target=write, daemon=True)
    worker.start()
    worker.join()
"""


def test_sigterm_during_an_atomic_write_on_another_thread_leaves_no_temporary(place):
    root, env = place
    (root / "mark" / "pids").write_text("")
    inside = root / "mark" / "inside"
    proc = _victim(WRITE_ON_A_THREAD, env, inside, str(root / "out" / "emb.npy"), str(inside))
    assert [p.name.startswith(".emb.tmp-") for p in (root / "out").iterdir()] == [True]
    rc, out = _end(proc, signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, out
    assert list((root / "out").iterdir()) == [], out
