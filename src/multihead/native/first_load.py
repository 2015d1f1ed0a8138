"""The first load of a build, in a separate Python process.

Loading a shared library maps it into memory and runs its code: a library truncated or overwritten on
disk (a full disk, a crash in the middle of a copy) dies there with SIGBUS, SIGSEGV or SIGTRAP, and
takes the process with it. So the first load of each build, and its self-check, run in a child
interpreter; the user's process loads the library only after the child exited cleanly (the caller then
records the checked digest, so this runs once per build). The child imports torch first, as the user's
process has: the library then shares torch's OpenMP runtime there too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from . import build

__all__ = ["TIMEOUT_S", "check_apart"]

TIMEOUT_S = 300
#: the child: torch, then this package loaded from its files under another name (the library's own
#: package need not be importable there), then its loader's ``probe(library, digest)`` as the exit status
_CHILD = """
import importlib.util, os, sys
import torch
init, library, digest = sys.argv[1:]
spec = importlib.util.spec_from_file_location(
    "multihead_native_probe", init, submodule_search_locations=[os.path.dirname(init)]
)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
sys.exit(sys.modules[spec.name + ".loader"].probe(library, digest))
"""


def check_apart(package_init: Path, library: Path, digest: str) -> str | None:
    """Run ``loader.probe(library, digest)`` of the package whose ``__init__.py`` is ``package_init`` in a
    separate Python process; what went wrong ("crashed its self-check (signal SIGBUS)", "failed its
    self-check (...)"), or None when it exited with status 0."""
    if not sys.executable:
        return "could not be checked: no Python executable to run the check in"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the same torch
    argv = [sys.executable, "-c", _CHILD, str(package_init), str(library), digest]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=TIMEOUT_S,
            cwd=library.parent,  # private: nothing importable planted next to the child
            env=env,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not be checked in a separate process: {e}"
    if done.returncode < 0:
        return f"crashed its self-check (signal {build.signal_name(-done.returncode)})"
    if done.returncode != 0:
        lines = (done.stdout.strip() or done.stderr.strip() or "no message").splitlines()
        return f"failed its self-check (status {done.returncode}: {lines[-1][-300:]})"
    return None
