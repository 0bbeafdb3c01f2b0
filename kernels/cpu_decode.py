"""The CPU decode attention kernel (`cpu/paged_decode.c`): built for the host CPU on first use, called by ctypes.

Decode attention is where the torch path spends most of a decode step once
contexts grow: it gathers each sequence's pages into a copy and runs SDPA over
it. The C kernel reads the pages in place, once per KV head. It is compiled
with the system C compiler (`cc`, or `$CC`) for this CPU (`-march=native`),
once per head_dim; the library is kept in `$KVTIERD_KERNEL_CACHE_DIR` (the
systemd units: /var/cache/kvtierd/cpu-kernels) or else under the user's cache
directory (`$XDG_CACHE_HOME/kvtierd/cpu-kernels`), named by a digest of the
source, the flags, the compiler and the CPU's flags, so a host that shares a
home with a different CPU builds its own. Without a compiler the model keeps
the torch path (`kvtierctl status` names the backend in use).

The kernel shares its (sequence, KV head) items among OpenMP threads, as many
as torch computes with at the call (`engine/step_threads.py` may leave one to
the tiers), or one for a call too small to pay for waking the others. Built
with `-fopenmp`, the library binds to the libgomp torch loaded first, so they
are torch's own threads, not a second pool spinning beside it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = "paged_decode.c"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
# Linked apart, without -ffast-math: linked with it, gcc adds a start-up routine that makes the loading thread
# flush subnormal floats to zero for everything else the process computes there.
LINK_FLAGS = ("-shared", "-fopenmp")
HEAD_DIMS = (64, 128)  # built on demand, one library each
MAX_GROUP = 16  # the kernel's bound on query heads per KV head
# Context tokens x KV heads below which a call runs on one thread: ~35 ns each, so a smaller call costs less
# than waking a second thread and joining it (a short chat's decode).
PARALLEL_MIN_WORK = 1024

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _P, _I64, _P, _P, _P, _I64, _P, _I64, _I32, _I32, _I32, _F32, _I32, _I32]


class CpuDecodeKernel:
    """`kvt_paged_decode_bf16` for one head_dim."""

    def __init__(self, library: Path) -> None:
        self._fn = ctypes.CDLL(str(library)).kvt_paged_decode_bf16
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = _ARGTYPES

    def decode(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, context_lens_host: list[int],
               scale: float) -> None:
        """Attention of the decode rows `q [n, heads, head_dim]` (rows may be strided) into `out` (contiguous,
        same shape): row s over the pages `block_tables[s]`, `context_lens[s]` tokens. bfloat16 throughout."""
        n, num_heads, head_dim = q.shape
        if not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16
                and block_tables.dtype == context_lens.dtype == torch.int32
                and q.stride(1) == head_dim and q.stride(2) == 1 and out.is_contiguous()
                and k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
                and context_lens.is_contiguous()):  # the kernel reads raw memory in exactly these layouts
            raise ValueError("CPU decode attention takes bfloat16 rows of contiguous heads, contiguous page pools "
                             "and int32 block tables")
        num_kv_heads = k_cache.shape[2]
        threads = torch.get_num_threads() if sum(context_lens_host) * num_kv_heads >= PARALLEL_MIN_WORK else 1
        status = self._fn(out.data_ptr(), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                          block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), n, num_heads,
                          num_kv_heads, k_cache.shape[1], scale, max(context_lens_host, default=0), threads)
        if status != 0:
            raise MemoryError(f"CPU decode attention: no memory for its scores, or more than {MAX_GROUP} query "
                              "heads share a KV head")


_kernels: dict[int, CpuDecodeKernel | None] = {}
_lock = threading.Lock()


def cpu_decode_kernel(head_dim: int) -> CpuDecodeKernel | None:
    """The kernel for `head_dim`, built (or found built) now; None where it cannot be (the torch path then)."""
    with _lock:
        if head_dim not in _kernels:
            _kernels[head_dim] = _load(head_dim)
        return _kernels[head_dim]


def _load(head_dim: int) -> CpuDecodeKernel | None:
    if head_dim not in HEAD_DIMS:
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc): CPU decode attention stays on the torch path")
        return None
    try:
        return CpuDecodeKernel(_build(compiler, head_dim))
    except subprocess.CalledProcessError as e:
        log.warning("building the CPU decode kernel failed, keeping the torch path: %s\n%s", e,
                    (e.stderr or b"").decode(errors="replace")[-2000:])
    except OSError as e:
        log.warning("the CPU decode kernel cannot be built or loaded here, keeping the torch path: %s", e)
    return None


def _build(compiler: str, head_dim: int) -> Path:
    source = resources.files("kvtierd.kernels").joinpath("cpu", SOURCE).read_bytes()
    flags = (*COMPILE_FLAGS, f"-DHEAD_DIM={head_dim}")
    version = subprocess.run([compiler, "--version"], capture_output=True, check=True).stdout
    digest = hashlib.sha256(b"\0".join([source, " ".join((*flags, *LINK_FLAGS)).encode(), version,
                                         _cpu_flags()])).hexdigest()[:16]
    cache = Path(os.environ.get("KVTIERD_KERNEL_CACHE_DIR") or
                 Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvtierd" / "cpu-kernels")
    library = cache / f"paged_decode_{head_dim}_{digest}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, obj, built = Path(tmp) / SOURCE, Path(tmp) / "paged_decode.o", Path(tmp) / library.name
        src.write_bytes(source)
        subprocess.run([compiler, *flags, "-c", "-o", str(obj), str(src)], capture_output=True, check=True)
        subprocess.run([compiler, *LINK_FLAGS, "-o", str(built), str(obj), "-lm"], capture_output=True, check=True)
        os.replace(built, library)  # atomic: a daemon starting beside this one sees all of it or none
    log.info("built the CPU decode kernel for head_dim %d: %s", head_dim, library)
    return library


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
