"""CUDA kernels for paged attention and page moves, compiled at run time by NVRTC through CuPy.

The API mirrors `reference.py`, so the model picks a backend with one line:
`write_kv`, `CudaPlan.build(batch)`, `paged_attention(plan, q, k_cache, v_cache, scale)`.
Page moves for copy-on-write and tier moves sit beside them: `copy_blocks`,
`gather_blocks`, `scatter_blocks`. Everything takes torch CUDA tensors, passes
their addresses to the kernels and launches on torch's current stream.

cupy is imported on first use, so this module imports on any machine;
`cuda_kernels_available()` says whether the kernels can run here. The sources
are `cuda/*.cu`; each is compiled once per device (CuPy also caches the
binary on disk, keyed by the source text and options).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np
import torch

from kvtierd.kernels.paged_batch import PagedBatch

Tensor = torch.Tensor
BlockIds = Tensor | Sequence[int]  # page ids: an int64 CUDA tensor, or a host list (bounds-checked)

_DTYPE_SUFFIX = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
_UNIT_SUFFIX = {16: "16b", 4: "4b", 2: "2b"}  # page-copy unit size in bytes


def _names(kernels: tuple[str, ...], suffixes) -> tuple[str, ...]:
    return tuple(f"{k}_{s}" for k in kernels for s in suffixes)


# Each source under cuda/ and the extern "C" kernels it defines.
KERNEL_FILES: dict[str, tuple[str, ...]] = {
    "paged_decode.cu": _names(("paged_decode_attention", "paged_decode_reduce"), _DTYPE_SUFFIX.values()),
    "paged_prefill.cu": _names(("paged_prefill_attention",), _DTYPE_SUFFIX.values()),
    "reshape_and_cache.cu": _names(("reshape_and_cache",), _DTYPE_SUFFIX.values()),
    "page_copy.cu": _names(("copy_blocks", "gather_blocks", "scatter_blocks"), _UNIT_SUFFIX.values()),
}
# Given to RawModule; CuPy adds its include paths, -ftz=true and -arch=sm_XX of the device.
COMPILE_OPTIONS: tuple[str, ...] = ("--std=c++17",)

MAX_HEAD_DIM = 256  # the kernels keep head_dim / 32 <= 8 values per lane in registers
DEFAULT_PARTITION_SIZE = 512  # decode tokens per thread block before the context is split
MAX_PARTITION_SIZE = 4096  # keeps the decode kernel's scores inside shared memory
_GRID_YZ_LIMIT = 65535

# Launch geometry; each must match the #defines of its .cu file.
_DECODE_THREADS, _DECODE_WARPS = 128, 4
_PREFILL_THREADS, _PREFILL_ROWS, _KEY_TILE = 128, 16, 32
_CACHE_WRITE_THREADS = 128
_COPY_THREADS = 256
_DEFAULT_SHARED_MEM = 48 * 1024  # more needs an explicit opt-in per kernel


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message names the kernel and carries NVRTC's log."""


def cuda_kernels_available() -> bool:
    """True when the kernels can run here: torch sees a GPU and cupy imports and sees it too."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


# --- sources and compilation ------------------------------------------------------------------

_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.MULTILINE)


def load_source(filename: str) -> str:
    """A kernel source with its local headers inlined.

    CuPy's cache key hashes only the source text it is given, so a header
    edited alone would otherwise be served stale from the cache. `#line`
    keeps NVRTC's messages pointing at the real files and lines.
    """
    cuda_dir = resources.files("kvtierd.kernels") / "cuda"
    text = (cuda_dir / filename).read_text()

    def inline(match: re.Match[str]) -> str:
        header = match.group(1)
        next_line = text.count("\n", 0, match.start()) + 2
        return f'#line 1 "{header}"\n{(cuda_dir / header).read_text()}\n#line {next_line} "{filename}"'

    return _LOCAL_INCLUDE.sub(inline, text)


_modules: dict[tuple[str, int], Any] = {}  # (file, device index) -> cupy.RawModule
_kernels: dict[tuple[str, int], Any] = {}  # (kernel, device index) -> cupy.RawKernel
_streams: dict[tuple[int, int], Any] = {}  # (device index, torch stream handle) -> cupy Stream wrapping it


def _file_of(kernel: str) -> str:
    for filename, names in KERNEL_FILES.items():
        if kernel in names:
            return filename
    raise KeyError(kernel)


def _kernel(name: str, device_index: int) -> Any:
    """The compiled kernel on a device (the caller has made that device current)."""
    found = _kernels.get((name, device_index))
    if found is not None:
        return found
    import cupy
    from cupy.cuda.compiler import CompileException

    filename = _file_of(name)
    module = _modules.get((filename, device_index))
    if module is None:
        module = cupy.RawModule(code=load_source(filename), options=COMPILE_OPTIONS)
        _modules[(filename, device_index)] = module
    try:
        kernel = module.get_function(name)  # NVRTC runs here, on first use
    except CompileException as e:
        raise KernelCompileError(f"NVRTC could not compile kernel {name} (kernels/cuda/{filename}):\n{e}") from e
    _kernels[(name, device_index)] = kernel
    return kernel


def _launch(name: str, device: torch.device, grid: tuple[int, ...], block: int, args: tuple, shared_mem: int = 0) -> None:
    import cupy

    torch_stream = torch.cuda.current_stream(device)
    key = (device.index, torch_stream.cuda_stream)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = cupy.cuda.Stream.from_external(torch_stream)
    with cupy.cuda.Device(device.index), stream:
        kernel = _kernel(name, device.index)
        if shared_mem > _DEFAULT_SHARED_MEM and kernel.max_dynamic_shared_size_bytes < shared_mem:
            kernel.max_dynamic_shared_size_bytes = shared_mem
        kernel(grid, (block,), args, shared_mem=shared_mem)


# Kernel arguments: addresses and scalars with the exact C types of the parameters.
def _ptr(t: Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


_i32, _i64, _f32 = np.int32, np.int64, np.float32


# --- argument checks, run before every launch: a wrong shape or stride reads or writes out of bounds ---


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"cuda_backend: {message}")


def _check_caches(caches: Sequence[Tensor]) -> None:
    _check(len(caches) > 0, "no caches given")
    first = caches[0]
    _check(first.is_cuda, "caches must be CUDA tensors")
    _check(first.dim() == 4, f"caches are [num_blocks, block_size, kv_heads, head_dim], got {tuple(first.shape)}")
    _check(first.dtype in _DTYPE_SUFFIX, f"unsupported cache dtype {first.dtype}")
    for c in caches:
        same = c.shape == first.shape and c.dtype == first.dtype and c.device == first.device
        _check(same, "caches differ in shape, dtype or device")
        _check(c.is_contiguous(), "caches must be contiguous")


def _check_rows(x: Tensor, name: str, rows: int, heads: int, head_dim: int, like: Tensor) -> None:
    """`x [rows, heads, head_dim]`, contiguous within a row; the row stride goes to the kernel."""
    _check(tuple(x.shape) == (rows, heads, head_dim), f"{name} is {tuple(x.shape)}, expected {(rows, heads, head_dim)}")
    _check(x.dtype == like.dtype and x.device == like.device, f"{name} must match the cache's dtype and device")
    _check(x.stride(2) == 1 and x.stride(1) == head_dim, f"{name} must be contiguous within each token")
    _check(rows <= 1 or x.stride(0) >= heads * head_dim, f"{name}'s token rows overlap")


def _check_index(t: Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
    _check(t.dtype == dtype and t.device == device, f"{name} must be {dtype} on {device}, got {t.dtype} on {t.device}")
    _check(tuple(t.shape) == shape, f"{name} is {tuple(t.shape)}, expected {shape}")
    _check(t.is_contiguous(), f"{name} must be contiguous")


# --- cache write ------------------------------------------------------------------------------


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Scatters new K/V `[num_tokens, kv_heads, head_dim]` into their slots (a negative slot is skipped)."""
    _check_caches((k_cache, v_cache))
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_tokens = k.shape[0]
    _check_rows(k, "k", num_tokens, kv_heads, head_dim, k_cache)
    _check_rows(v, "v", num_tokens, kv_heads, head_dim, k_cache)
    _check_index(slot_mapping, "slot_mapping", torch.int64, (num_tokens,), k_cache.device)
    if num_tokens == 0:
        return
    args = (_ptr(k_cache), _ptr(v_cache), _ptr(k), _ptr(v), _ptr(slot_mapping),
            _i64(k.stride(0)), _i64(v.stride(0)), _i32(kv_heads * head_dim))  # fmt: skip
    _launch(f"reshape_and_cache_{_DTYPE_SUFFIX[k.dtype]}", k.device, (num_tokens,), _CACHE_WRITE_THREADS, args)


# --- attention --------------------------------------------------------------------------------


@dataclass(slots=True)
class CudaPlan:
    """Launch geometry of one step, built once and shared by every layer (like `ReferencePlan`)."""

    batch: PagedBatch
    partition_size: int  # decode tokens per thread block
    num_partitions: int  # decode split-K factor: 1 means each block writes its output directly
    max_prefill_query_len: int
    # Split-K partials per (num_heads, head_dim); layers reuse them since they run in stream order.
    _partials: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)

    @classmethod
    def build(cls, batch: PagedBatch, partition_size: int = DEFAULT_PARTITION_SIZE) -> "CudaPlan":
        _check(0 < partition_size <= MAX_PARTITION_SIZE, f"partition_size must be in 1..{MAX_PARTITION_SIZE}")
        nd = batch.num_decodes
        max_decode_context = max(batch.context_lens_host[:nd], default=0)
        num_partitions = max(1, -(-max_decode_context // partition_size))
        max_prefill_query_len = max(batch.query_lens_host[nd:], default=0)
        return cls(batch, partition_size, num_partitions, max_prefill_query_len)

    def partials(self, num_heads: int, head_dim: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """(out [nd, heads, parts, head_dim], max [nd, heads, parts], sum [nd, heads, parts]), float32."""
        key = (num_heads, head_dim)
        if key not in self._partials:
            shape = (self.batch.num_decodes, num_heads, self.num_partitions)
            self._partials[key] = (
                torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device),
            )
        return self._partials[key]


def paged_attention(plan: CudaPlan, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
    """Causal attention of `q [num_tokens, heads, head_dim]` over each sequence's pages.

    Query token j of a sequence with q_len new tokens and context_len cached
    tokens sits at position context_len - q_len + j and sees positions <= its own.
    Decodes go to the split-K decode kernel, prefill chunks to the prefill kernel.
    """
    batch = plan.batch
    _check_caches((k_cache, v_cache))
    _, block_size, kv_heads, head_dim = k_cache.shape
    num_tokens, num_heads = q.shape[0], (q.shape[1] if q.dim() == 3 else -1)
    _check_rows(q, "q", num_tokens, num_heads, head_dim, k_cache)
    _check(block_size == batch.block_size, f"cache block_size {block_size} != batch block_size {batch.block_size}")
    _check(num_heads % kv_heads == 0, f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    _check(head_dim <= MAX_HEAD_DIM, f"head_dim {head_dim} > {MAX_HEAD_DIM}")
    _check(num_tokens == sum(batch.query_lens_host), "q's token count disagrees with the batch")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    num_seqs, max_blocks = batch.num_seqs, batch.block_tables.shape[-1]
    _check_index(batch.block_tables, "block_tables", torch.int32, (num_seqs, max_blocks), q.device)
    _check_index(batch.context_lens, "context_lens", torch.int32, (num_seqs,), q.device)
    _check_index(batch.query_start_loc, "query_start_loc", torch.int32, (num_seqs + 1,), q.device)
    _check(batch.max_context_len <= max_blocks * block_size, "a context is longer than its block table")
    _check(num_heads <= _GRID_YZ_LIMIT and num_seqs <= _GRID_YZ_LIMIT, "too many heads or sequences for one launch")

    suffix = _DTYPE_SUFFIX[q.dtype]
    geometry = (_i64(q.stride(0)), _f32(scale), _i32(num_heads), _i32(kv_heads), _i32(head_dim),
                _i32(block_size), _i32(max_blocks))  # fmt: skip
    tensors = (_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(batch.block_tables))
    nd = batch.num_decodes
    if nd:
        _decode(plan, suffix, out, tensors, geometry)
    num_prefills = num_seqs - nd
    num_tiles = -(-plan.max_prefill_query_len // _PREFILL_ROWS)
    if num_prefills and num_tiles:
        # key offsets (i64) + q rows + K tile (padded rows) + V tile, as laid out in paged_prefill.cu
        floats = _PREFILL_ROWS * head_dim + _KEY_TILE * (head_dim + 1) + _KEY_TILE * head_dim
        shared = 8 * _KEY_TILE + 4 * floats
        args = (_ptr(out), *tensors, _ptr(batch.query_start_loc), _ptr(batch.context_lens), *geometry, _i32(nd))
        grid = (num_tiles, num_heads, num_prefills)
        _launch(f"paged_prefill_attention_{suffix}", q.device, grid, _PREFILL_THREADS, args, shared)
    return out


def _decode(plan: CudaPlan, suffix: str, out: Tensor, tensors: tuple, geometry: tuple) -> None:
    batch, parts = plan.batch, plan.num_partitions
    nd, num_heads, head_dim = batch.num_decodes, out.shape[1], out.shape[2]
    _check(parts <= _GRID_YZ_LIMIT, "context too long for the decode partition size")
    part_out = part_max = part_sum = None
    if parts > 1:
        part_out, part_max, part_sum = plan.partials(num_heads, head_dim, out.device)
    # q + scores + per-warp outputs + reduction scratch, as laid out in paged_decode.cu
    shared = 4 * (head_dim + plan.partition_size + _DECODE_WARPS * head_dim + _DECODE_WARPS)
    args = (_ptr(out), _ptr(part_out), _ptr(part_max), _ptr(part_sum), *tensors, _ptr(batch.context_lens),
            *geometry, _i32(plan.partition_size), _i32(parts))  # fmt: skip
    _launch(f"paged_decode_attention_{suffix}", out.device, (num_heads, nd, parts), _DECODE_THREADS, args, shared)
    if parts > 1:
        args = (_ptr(out), _ptr(part_out), _ptr(part_max), _ptr(part_sum), _ptr(batch.context_lens),
                _i32(num_heads), _i32(head_dim), _i32(plan.partition_size), _i32(parts))  # fmt: skip
        shared = 4 * (parts + _DECODE_WARPS)  # partition weights + reduction scratch
        _launch(f"paged_decode_reduce_{suffix}", out.device, (num_heads, nd), _DECODE_THREADS, args, shared)


# --- page moves -------------------------------------------------------------------------------

_address_tables: dict[tuple[int, tuple[int, ...]], Tensor] = {}  # pools are long-lived: build each table once


def _addresses(caches: Sequence[Tensor]) -> Tensor:
    device = caches[0].device
    key = (device.index, tuple(c.data_ptr() for c in caches))
    table = _address_tables.get(key)
    if table is None:
        table = _address_tables[key] = torch.tensor(key[1], dtype=torch.int64, device=device)
    return table


def _block_ids(ids: BlockIds, name: str, caches: Sequence[Tensor]) -> Tensor:
    """Page ids as an int64 device tensor; ids given as a list are also bounds-checked here."""
    num_blocks = caches[0].shape[0]
    if not isinstance(ids, Tensor):
        _check(all(0 <= i < num_blocks for i in ids), f"{name} holds a page id outside 0..{num_blocks - 1}")
        ids = torch.tensor(list(ids), dtype=torch.int64, device=caches[0].device)
    _check_index(ids, name, torch.int64, (ids.numel(),), caches[0].device)
    return ids


def _copy_unit(caches: Sequence[Tensor], *others: Tensor) -> int:
    """16-byte units when every page and base address allows it, else the element size."""
    first = caches[0]
    page_bytes = first[0].numel() * first.element_size()
    aligned = all(t.data_ptr() % 16 == 0 for t in (*caches, *others))
    return 16 if page_bytes % 16 == 0 and aligned else first.element_size()


def _page_units(caches: Sequence[Tensor], unit: int) -> np.int64:
    return _i64(caches[0][0].numel() * caches[0].element_size() // unit)


def copy_blocks(caches: Sequence[Tensor], src_ids: BlockIds, dst_ids: BlockIds) -> None:
    """Copy-on-write: page src_ids[i] -> page dst_ids[i] in every cache.

    No page may be both a source and a destination in one call.
    """
    _check_caches(caches)
    src = _block_ids(src_ids, "src_ids", caches)
    dst = _block_ids(dst_ids, "dst_ids", caches)
    _check(src.numel() == dst.numel(), "src_ids and dst_ids differ in length")
    if src.numel() == 0:
        return
    unit = _copy_unit(caches)
    args = (_ptr(_addresses(caches)), _ptr(src), _ptr(dst), _page_units(caches, unit))
    _launch(f"copy_blocks_{_UNIT_SUFFIX[unit]}", caches[0].device, (src.numel(), len(caches)), _COPY_THREADS, args)


def gather_blocks(caches: Sequence[Tensor], block_ids: BlockIds, staging: Tensor | None = None) -> Tensor:
    """Copies pages `block_ids` of every cache into `staging [num_ids, num_caches, block_size, kv_heads, head_dim]`.

    Allocates `staging` when not given; returns it. One block's KV across all
    caches is `staging[i]`, contiguous, ready for one copy to a lower tier.
    """
    _check_caches(caches)
    ids = _block_ids(block_ids, "block_ids", caches)
    shape = (ids.numel(), len(caches), *caches[0].shape[1:])
    if staging is None:
        staging = torch.empty(shape, dtype=caches[0].dtype, device=caches[0].device)
    _check_staging(staging, shape, caches)
    if ids.numel():
        unit = _copy_unit(caches, staging)
        args = (_ptr(_addresses(caches)), _ptr(ids), _ptr(staging), _page_units(caches, unit))
        grid = (ids.numel(), len(caches))
        _launch(f"gather_blocks_{_UNIT_SUFFIX[unit]}", caches[0].device, grid, _COPY_THREADS, args)
    return staging


def scatter_blocks(caches: Sequence[Tensor], block_ids: BlockIds, staging: Tensor) -> None:
    """The inverse of `gather_blocks`: `staging[i, c]` -> page `block_ids[i]` of cache c."""
    _check_caches(caches)
    ids = _block_ids(block_ids, "block_ids", caches)
    _check_staging(staging, (ids.numel(), len(caches), *caches[0].shape[1:]), caches)
    if ids.numel():
        unit = _copy_unit(caches, staging)
        args = (_ptr(_addresses(caches)), _ptr(ids), _ptr(staging), _page_units(caches, unit))
        grid = (ids.numel(), len(caches))
        _launch(f"scatter_blocks_{_UNIT_SUFFIX[unit]}", caches[0].device, grid, _COPY_THREADS, args)


def _check_staging(staging: Tensor, shape: tuple[int, ...], caches: Sequence[Tensor]) -> None:
    _check(tuple(staging.shape) == shape, f"staging is {tuple(staging.shape)}, expected {shape}")
    same = staging.dtype == caches[0].dtype and staging.device == caches[0].device
    _check(same, "staging must match the caches' dtype and device")
    _check(staging.is_contiguous(), "staging must be contiguous")
