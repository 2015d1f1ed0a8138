"""What the native build trusts, tried as another local account or a damaged disk would (SECURITY.md,
"Native kernels"): a cache directory that another account owns or may write is never used and a library
planted there never loaded; a corrupt cached library never takes the process down (it is rebuilt); every
compiler failure says what ran and how it failed; hooks registered after a generation are honoured.

The tests run the loader for real: another account is simulated with ``os.chown`` (root only), the good
library is one build copied into each test's directory, and the corrupt-library cases run in one separate
Python process (the victim) whose exit status must be 0.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import multihead as mh
from multihead import native
from multihead.models import native_step, quant
from multihead.native import cache
from tests.native_counts import count_native_steps

REASON = native.unavailable()
needs_native = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
NOBODY = 65534  # the uid of the account that plants things
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="simulating another account's directory needs root (os.chown to uid 65534)",
)
SIDECARS = ("sha256", "checked")


@pytest.fixture
def fresh_load():
    """The loader runs again in the test (and once more for the tests after it)."""
    native.loader.load.cache_clear()
    yield
    native.loader.load.cache_clear()


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A checked build (the library with its digest and checked records), copied from where this
    process loaded the kernels."""
    native.loader.load.cache_clear()  # another test may have left a load from its own directory
    so = native.location()
    assert so is not None
    keep = tmp_path_factory.mktemp("good")
    for path in (so, *(cache.sidecar(so, k) for k in SIDECARS)):
        shutil.copy2(path, keep / path.name)
    return keep / so.name


def _install(library: Path, directory: Path) -> Path:
    """``library`` and its records copied into ``directory`` (made private); the copy's path."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in (library, *(cache.sidecar(library, k) for k in SIDECARS)):
        shutil.copy2(path, directory / path.name)
    return directory / library.name


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[Path, Path]:
    """(a shared library whose constructor writes a marker file, the marker): what another account
    plants where the kernels are looked for."""
    where = tmp_path_factory.mktemp("planted")
    marker = where / "constructor-ran"
    source = where / "planted.c"
    source.write_text(
        textwrap.dedent(f"""
        #include <stdio.h>
        __attribute__((constructor)) static void planted(void) {{
            FILE *f = fopen("{marker}", "w");
            if (f) {{ fputs("ran", f); fclose(f); }}
        }}
        """)
    )
    compiler, _ = native.build.find_compiler()
    assert compiler is not None
    subprocess.run([*compiler, "-shared", "-fPIC", "-o", str(where / "planted.so"), str(source)], check=True)
    return where / "planted.so", marker


def _plant(library: Path, directory: Path, name: str) -> None:
    """Put ``library`` into ``directory`` under ``name``, with records that claim it was checked."""
    digest = cache.file_digest(library)
    shutil.copy2(library, directory / name)
    for kind in SIDECARS:
        (directory / f"{name}.{kind}").write_text(digest + "\n")


def _owned_by_nobody(d: Path) -> Path:
    os.chown(d, NOBODY, NOBODY)
    return d


def _open_to_all(d: Path) -> Path:
    os.chmod(d, 0o777)
    return d


def _a_link(d: Path) -> Path:
    link = d.with_name(d.name + "-link")
    link.symlink_to(d)
    return link


def _below_a_loose_parent(d: Path) -> Path:
    os.chmod(d.parent, 0o777)  # no sticky bit: anyone may rename the cache away and put another there
    return d


PLANTED_DIRS = [
    pytest.param(
        _owned_by_nobody, f"is owned by uid {NOBODY}, not by this user", id="another owner", marks=needs_root
    ),
    pytest.param(_open_to_all, r"can be written by its group or others \(mode 777\)", id="mode 0777"),
    pytest.param(_a_link, "is a symbolic link", id="a symbolic link"),
    pytest.param(_below_a_loose_parent, r"above the cache\) can be written by others", id="loose parent"),
]


@needs_native
@pytest.mark.parametrize(("plant", "why"), PLANTED_DIRS)
def test_a_planted_cache_directory_is_never_used(
    plant, why, good, planted, tmp_path, monkeypatch, fresh_load
):
    library, marker = planted
    d = tmp_path / "parent" / "cache"
    d.mkdir(mode=0o700, parents=True)
    _plant(library, d, good.name)  # where the kernels would be looked for, claiming to be checked
    given = plant(d)
    monkeypatch.setenv("MULTIHEAD_CACHE", str(given))
    monkeypatch.setattr(cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    fallback = _install(good, tmp_path / "tmp" / f"multihead-{os.getuid()}")
    with pytest.warns(RuntimeWarning, match=why):
        assert native.unavailable() is None
    assert native.location() == fallback  # the private fallback, not the planted directory
    assert len(native.notes()) == 1 and native.notes()[0].startswith(f"not building in {given}: ")
    assert not marker.exists()
    w, x = torch.randn(33, 70), torch.randn(70)
    torch.testing.assert_close(native.gemv(w, x), w @ x, rtol=1e-5, atol=1e-4)


@needs_native
@needs_root
def test_a_planted_shared_temporary_directory_is_never_used(planted, tmp_path, monkeypatch, fresh_load):
    """The home cannot be written and another account made ``<tmp>/multihead-<uid>`` first (mode 0777,
    a library with a constructor inside): the kernels are built in a fresh directory of their own."""
    library, marker = planted
    blocker = tmp_path / "a-file"
    blocker.write_text("the home cannot be written")
    monkeypatch.setenv("MULTIHEAD_CACHE", str(blocker / "cache"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)  # like /tmp: anyone may create, the sticky bit keeps others' entries theirs
    monkeypatch.setattr(cache.tempfile, "gettempdir", lambda: str(tmp))
    monkeypatch.setattr(cache.tempfile, "tempdir", str(tmp))  # mkdtemp's directory
    shared = tmp / f"multihead-{os.getuid()}"
    shared.mkdir()
    compiler, _ = native.build.find_compiler()
    assert compiler is not None
    _plant(library, shared, native.library_path(" ".join(compiler), shared).name)
    os.chmod(shared, 0o777)
    os.chown(shared, NOBODY, NOBODY)
    with pytest.warns(RuntimeWarning, match=f"{shared} is owned by uid {NOBODY}"):
        assert native.unavailable() is None
    so = native.location()
    assert so is not None and so.parent.parent == tmp and so.parent.name.startswith("multihead-native-")
    assert so.parent != shared and (so.parent.stat().st_mode & 0o777) == 0o700
    assert not marker.exists()


def _writable_by_others(p: Path) -> None:
    os.chmod(p, 0o666)


def _owned_by_another(p: Path) -> None:
    os.chown(p, NOBODY, NOBODY)


def _a_link_to_the_library(p: Path) -> None:
    real = p.with_name("elsewhere.so")
    p.rename(real)
    p.symlink_to(real)


def _no_digest(p: Path) -> None:
    cache.sidecar(p, "sha256").unlink()


def _another_digest(p: Path) -> None:
    cache.sidecar(p, "sha256").write_text("0" * 64 + "\n")


def _a_fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p, 0o600)


UNTRUSTED_FILES = [
    pytest.param(_writable_by_others, r"can be written by its group or others \(mode 666\)", id="mode 0666"),
    pytest.param(_owned_by_another, f"is owned by uid {NOBODY}", id="another owner", marks=needs_root),
    pytest.param(_a_link_to_the_library, "Too many levels of symbolic links", id="a symbolic link"),
    pytest.param(_a_fifo, "is not a regular file", id="a fifo"),
    pytest.param(_no_digest, "has no recorded digest", id="no digest"),
    pytest.param(_another_digest, "does not match its recorded digest", id="another digest"),
]


@needs_native
@pytest.mark.parametrize(("spoil", "why"), UNTRUSTED_FILES)
def test_a_cached_library_is_loaded_only_when_trusted_and_its_digest_matches(spoil, why, good, tmp_path):
    so = _install(good, tmp_path / "cache")
    assert cache.verify(so) == (cache.file_digest(good), None)
    spoil(so)
    digest, reason = cache.verify(so)
    assert digest is None and reason is not None
    assert re.search(why, reason), reason


# -- a corrupt cached library, in a separate process ---------------------------------------------------


def _text_section(data: bytes) -> tuple[int, int]:
    """(offset, size) of the ``.text`` section of a 64-bit little-endian ELF file."""
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]  # the section-name table's file offset
    for name, _type, _flags, _addr, offset, size in headers:
        if data[names + name : names + name + 6] == b".text\0":
            return offset, size
    raise AssertionError("no .text section")


def _truncate(n: int):
    return lambda data: data[:n]


def _zero_the_middle(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[: mid - 2048] + bytes(4096) + data[mid + 2048 :]


def _trap_the_code(data: bytes) -> bytes:
    offset, size = _text_section(data)
    return data[:offset] + b"\xcc" * size + data[offset + size :]  # int3: SIGTRAP where it runs


#: (id, corruption, digest rewritten to match the corrupt bytes, what the loader notes)
CORRUPT = [
    ("truncated to 4096 bytes", _truncate(4096), False, "does not match its recorded digest; rebuilt"),
    ("truncated to 16384 bytes", _truncate(16384), True, "crashed its self-check (signal SIGBUS)"),
    ("truncated to 30000 bytes", _truncate(30000), True, "crashed its self-check (signal SIGBUS)"),
    ("4 KB in the middle zeroed", _zero_the_middle, False, "does not match its recorded digest; rebuilt"),
    ("its code overwritten", _trap_the_code, True, "crashed its self-check (signal SIGTRAP)"),
]

_VICTIM = """
import json, os, sys, warnings
import torch
from multihead import native
out = {}
for name, directory in json.loads(sys.argv[1]).items():
    os.environ["MULTIHEAD_CACHE"] = directory
    native.loader.load.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reason = native.unavailable()
    w, x = torch.randn(50, 300), torch.randn(300)
    ok = reason is None and torch.allclose(native.gemv(w, x), w @ x, rtol=1e-5, atol=1e-4)
    out[name] = [reason, list(native.notes()), [str(c.message) for c in caught], ok]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def victim(good, tmp_path_factory) -> dict:
    """Each corruption of :data:`CORRUPT` in its own cache directory, loaded by one separate process."""
    data = good.read_bytes()
    if len(data) <= 30000 or data[:4] != b"\x7fELF" or data[4] != 2:
        pytest.skip(f"the built library is not a 64-bit ELF file above 30000 bytes ({len(data)} bytes)")
    dirs = {}
    for name, spoil, forge, _ in CORRUPT:
        so = _install(good, tmp_path_factory.mktemp("corrupt"))
        so.write_bytes(spoil(data))
        if forge:  # as if the digest were recorded for the bad bytes: only the first load can tell
            cache.sidecar(so, "sha256").write_text(cache.file_digest(so) + "\n")
            cache.sidecar(so, "checked").unlink()
        dirs[name] = str(so.parent)
    done = subprocess.run(
        [sys.executable, "-c", _VICTIM, json.dumps(dirs)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"the victim died (status {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.splitlines()[-1])


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize(("name", "noted"), [pytest.param(c[0], c[3], id=c[0]) for c in CORRUPT])
def test_a_corrupt_cached_library_is_rebuilt_and_never_crashes_the_process(name, noted, victim):
    reason, notes, warned, ok = victim[name]
    assert reason is None and ok  # rebuilt, checked, and it computes
    assert len(notes) == 1 and noted in notes[0] and notes[0].endswith("rebuilt")
    assert warned and noted in warned[0]


# -- the compiler ---------------------------------------------------------------------------------------


def _script(tmp: Path, body: str) -> str:
    path = tmp / "fake-cc"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


COMPILERS = [
    pytest.param(
        lambda t: "/nonexistent/cc",
        r"CC='/nonexistent/cc' is not an executable: no such file; ",
        id="missing",
    ),
    pytest.param(
        lambda t: "no-such-cc-here",
        "is not an executable: no program 'no-such-cc-here' on PATH",
        id="not on PATH",
    ),
    pytest.param(lambda t: str(t), "is not an executable: it is a directory", id="a directory"),
    pytest.param(lambda t: 'gcc "-O2', "cannot be split into words", id="an open quote"),
    pytest.param(
        lambda t: "false", r"`\S*false -o \S+ -O3 .*` exited with status 1 and printed nothing$", id="false"
    ),
    pytest.param(
        lambda t: _script(t, "echo 'cc1: out of memory' >&2; exit 3"),
        "exited with status 3: cc1: out of memory$",
        id="fails",
    ),
    pytest.param(
        lambda t: _script(t, "kill -SEGV $$"),
        "was killed by signal SIGSEGV and printed nothing$",
        id="killed",
    ),
    pytest.param(
        lambda t: "true",
        r"exited with status 0 but wrote an empty file; nothing was cached$",
        id="empty file",
    ),
    pytest.param(
        lambda t: _script(t, 'echo garbage > "$2"'),
        r"wrote a file that is not a shared library \(8 bytes starting b'garb'\)",
        id="not a library",
    ),
]


@pytest.mark.parametrize(("cc", "why"), COMPILERS)
def test_every_compiler_failure_says_what_ran_and_how_it_failed(cc, why, tmp_path, monkeypatch, fresh_load):
    monkeypatch.setenv("CC", cc(tmp_path))
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    for _ in range(2):  # nothing is cached: the second start says the same, not a stale entry's error
        native.loader.load.cache_clear()
        reason = native.unavailable()
        assert reason is not None and re.search(why, reason), reason
        assert native.library() is None
        assert not list(tmp_path.glob("cache/native-*")) and not list(tmp_path.glob("cache/.native-*"))


def test_a_full_disk_leaves_no_kernels_and_says_why(tmp_path, monkeypatch, fresh_load):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native.build, "compile_library", full)
    if native.build.find_compiler()[0] is None:
        pytest.skip("no C compiler here: the build is never reached")
    assert native.unavailable() == (
        f"building or loading the native kernels in {tmp_path / 'cache'} failed: "
        "[Errno 28] No space left on device"
    )
    assert native.library() is None and native.location() is None


# -- forward hooks registered after a generation --------------------------------------------------------


def _lm():
    torch.manual_seed(0)
    return mh.TransformerLM(300, 64, 2, 4, 96, n_kv_heads=2, norm_eps=1e-6).eval()


def _register(module: torch.nn.Module | None, kind: str, calls: list) -> torch.utils.hooks.RemovableHandle:
    """A hook of ``kind`` on ``module`` (None: on every module) that records its calls; the forward hook
    on one module also halves the module's output, so skipping it would change the numbers."""

    def forward(mod, args, output):
        calls.append(mod)
        return None if module is None else output * 0.5

    def pre(mod, args):
        calls.append(mod)

    if module is None:
        return torch.nn.modules.module.register_module_forward_hook(forward)
    return (
        module.register_forward_hook(forward) if kind == "forward" else module.register_forward_pre_hook(pre)
    )


HOOKS = [
    pytest.param(lambda m: m.layers[1], "forward", id="a layer"),
    pytest.param(lambda m: m.layers[0].ffn.w2, "forward", id="a linear inside a layer"),
    pytest.param(lambda m: m.layers[0].self_attn, "pre", id="a pre-hook on attention"),
    pytest.param(lambda m: m.embed, "forward", id="the embedding"),
    pytest.param(lambda m: m.final_norm, "forward", id="the final norm"),
    pytest.param(lambda m: None, "forward", id="every module"),
]


@needs_native
@pytest.mark.parametrize(("where", "kind"), HOOKS)
def test_hooks_registered_after_a_generation_are_honoured(where, kind, monkeypatch):
    fast = quant.quantize(_lm(), weights="fp32", kv=None, kernel="native")
    slow = quant.quantize(_lm(), weights="fp32", kv=None, kernel="native")
    slow.native_steps = False  # the eager twin: the same linears, every step through the modules
    steps = count_native_steps(monkeypatch)
    prompt = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = fast.generate(prompt, 8)
        assert len(steps) == 7  # native steps ran: the model's structure was checked and kept
        fast_calls, slow_calls = [], []
        handle = _register(where(fast), kind, fast_calls)
        try:
            hooked = fast.generate(prompt, 8)
            assert len(steps) == 7  # no native step while the hook is there
            assert "forward hook" in native_step.why_not_call(
                fast, prompt[:, :1], None, fast.make_cache(1, 4)
            )
            if where(fast) is not None:
                assert len(fast_calls) == 8  # the prefill and the 7 steps
                with _register(where(slow), kind, slow_calls):
                    assert torch.equal(hooked, slow.generate(prompt, 8))  # the eager model with the hook
            else:
                assert len(fast_calls) > 8 * len(fast.layers)
                assert torch.equal(hooked, before)  # a hook that changes nothing
        finally:
            handle.remove()
        assert torch.equal(fast.generate(prompt, 8), before) and len(steps) == 14  # native again


@needs_native
def test_a_hook_that_changes_the_output_changes_the_tokens_after_a_generation():
    fast = quant.quantize(_lm(), weights="fp32", kv=None, kernel="native")
    prompt = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = fast.generate(prompt, 8)
        with fast.final_norm.register_forward_hook(lambda m, a, out: torch.zeros_like(out)):
            after = fast.generate(prompt, 8)  # every logit 0: greedy picks token 0
    assert torch.equal(after[0, 9:], torch.zeros(8, dtype=after.dtype)) and not torch.equal(after, before)
