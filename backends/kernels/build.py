"""Builds a kernel's C source with the system compiler at first use (about a second) into
$MOONCAKE_HOME/kernels, keyed by its source, the compiler and this CPU's flags, and loads it with ctypes:
no torch headers, no build step at install. Its OpenMP is the libgomp torch already loaded (the same
soname), so its threads are torch's."""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from mooncake.env import cpu_flags, mooncake_home

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120.0


def load_library(source: Path, what: str, fallback: str) -> ctypes.CDLL | bool:
    """The library built from `source`, or False where it cannot be had: no compiler, a failed build, or a
    kernel directory another user could write. The log names `what` and says what runs instead (`fallback`)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler on PATH: %s", fallback)
        return False
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([source.read_text(), " ".join(FLAGS), version,
                                        " ".join(sorted(cpu_flags()))]).encode()).hexdigest()[:16]
        target = mooncake_home() / "kernels" / f"{source.stem}-{key}.so"
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _owned_by_us(target.parent)  # NOTE: loading a library runs its code: none that another user placed
        if not target.exists():
            _compile(compiler, source, target)
            log.info("built the %s kernel: %s", what, target)
        _owned_by_us(target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not build the %s kernel (%s); %s", what, exc, fallback)
        return False


def _owned_by_us(path: Path) -> None:
    """OSError unless `path` is this user's and no one else may write it."""
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{path} belongs to another user or others may write it (mode {info.st_mode & 0o777:o}); "
                      f"set MOONCAKE_HOME to a directory of your own")


def _compile(compiler: str, source: Path, target: Path) -> None:
    # NOTE: built beside its final name and renamed into place, so engines starting together never load a
    # half-written file.
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", partial, str(source), "-lm"], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise OSError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
