"""Builds a C kernel of `kernels/cpu/` for the host CPU on first use, and keeps the library for the next start.

Compiled with the system C compiler (`cc`, or `$CC`) for this CPU (`-march=native`); the library is kept in
`$KVTIERD_KERNEL_CACHE_DIR` (the systemd units: /var/cache/kvtierd/cpu-kernels) or else under the user's
cache directory (`$XDG_CACHE_HOME/kvtierd/cpu-kernels`), named by a digest of the source, the headers the
sources share (`cpu/*.h`), the flags, the compiler and the CPU's flags, so a host that shares a home with a
different CPU builds its own. Built with `-fopenmp`, a library binds to the libgomp torch loaded first, so its
threads are torch's own, not a second pool spinning beside it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import ParamSpec, TypeVar

log = logging.getLogger(__name__)

COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
# Linked apart, without -ffast-math: linked with it, gcc adds a start-up routine that makes the loading thread
# flush subnormal floats to zero for everything else the process computes there.
LINK_FLAGS = ("-shared", "-fopenmp")


P = ParamSpec("P")
K = TypeVar("K")
_load_lock = threading.Lock()


def loaded_once(load: Callable[P, K | None]) -> Callable[P, K | None]:
    """`load` (build a kernel, wrap its library; None where it cannot be) run once for each arguments, under
    one lock, so two threads asking first do not compile it twice; its answer, None included, kept."""
    cached = functools.cache(load)

    @functools.wraps(load)
    def get(*args: P.args, **kwargs: P.kwargs) -> K | None:
        with _load_lock:
            return cached(*args, **kwargs)

    return get


def build_kernel(source_name: str, defines: tuple[str, ...] = ()) -> Path | None:
    """The library of `cpu/<source_name>` built with `defines` (`-D...` flags), built now or found built;
    None (logged) where it cannot be: no compiler, or the source refuses this CPU."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc): %s stays on the torch path", source_name)
        return None
    try:
        return _build(compiler, source_name, defines)
    except subprocess.CalledProcessError as e:
        log.warning("building %s failed, keeping the torch path: %s\n%s", source_name, e,
                    (e.stderr or b"").decode(errors="replace")[-2000:])
    except OSError as e:
        log.warning("%s cannot be built here, keeping the torch path: %s", source_name, e)
    return None


def _build(compiler: str, source_name: str, defines: tuple[str, ...]) -> Path:
    cpu = resources.files("kvtierd.kernels").joinpath("cpu")
    source = cpu.joinpath(source_name).read_bytes()
    headers = {h.name: h.read_bytes() for h in sorted(cpu.iterdir(), key=lambda h: h.name) if h.name.endswith(".h")}
    flags = (*COMPILE_FLAGS, *defines)
    version = subprocess.run([compiler, "--version"], capture_output=True, check=True).stdout
    digest = hashlib.sha256(b"\0".join([source, *headers.values(), " ".join((*flags, *LINK_FLAGS)).encode(), version,
                                         cpu_flags()])).hexdigest()[:16]
    cache = Path(os.environ.get("KVTIERD_KERNEL_CACHE_DIR") or
                 Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvtierd" / "cpu-kernels")
    stem = Path(source_name).stem
    library = cache / ("_".join([stem, *(d.split("=")[-1] for d in defines), digest]) + ".so")
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, obj, built = Path(tmp) / source_name, Path(tmp) / f"{stem}.o", Path(tmp) / library.name
        src.write_bytes(source)
        for name, text in headers.items():  # the sources' shared parts (`#include "bf16.h"`)
            (Path(tmp) / name).write_bytes(text)
        subprocess.run([compiler, *flags, "-c", "-o", str(obj), str(src)], capture_output=True, check=True)
        subprocess.run([compiler, *LINK_FLAGS, "-o", str(built), str(obj), "-lm"], capture_output=True, check=True)
        os.replace(built, library)  # atomic: a daemon starting beside this one sees all of it or none
    log.info("built %s for this CPU: %s", source_name, library)
    return library


def cpu_flags() -> bytes:
    """The CPU's flags line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
