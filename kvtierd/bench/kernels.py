"""`kvtierd bench kernels`: paged attention, CUDA kernels vs the torch reference (gather + SDPA).

A decode step reads every cached K and V byte of every sequence once per layer,
so memory bandwidth is its speed limit:

    kv_bytes = batch * context_len * kv_heads * head_dim * 2 (K and V) * element_size
    GB/s     = kv_bytes / time

and its yardstick is the device's own copy bandwidth, measured in the same run
(a 1 GiB device-to-device copy: bytes read + written over time). Prefill rows
time a chunk of new tokens over a cached prefix, causal. Each configuration is
checked against the reference before it is timed. Small working sets can stay
in L2, which shows as more GB/s than HBM gives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtierd.kernels import cuda_backend, reference
from kvtierd.kernels.paged_batch import PagedBatch

_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Device-to-device copy: bytes read + written per second, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time_ms(lambda: dst.copy_(src), iters, warmup=2) / 1e6


def run_kernel_bench(
    batch_sizes: tuple[int, ...] = (1, 8, 32),
    context_lens: tuple[int, ...] = (512, 4096, 16384),
    prefill_shapes: tuple[tuple[int, int], ...] = ((512, 512), (4096, 512), (16384, 2048)),
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    iters: int = 20,
    warmup: int = 3,
    with_reference: bool = True,
    print_fn: Callable[[str], None] = print,
) -> dict:
    """Decode rows per (context_len, batch_size) and prefill rows per (context_len, query_len):
    latencies in ms, bandwidths in GB/s, beside the device's copy bandwidth."""
    if not cuda_backend.cuda_kernels_available():
        raise RuntimeError("kernel benchmarks need a CUDA GPU, a CUDA build of torch and cupy (pip install 'kvtierd[cuda]')")
    device = torch.device("cuda")
    element_size = torch.empty((), dtype=dtype).element_size()
    print_fn(f"decode attention on {torch.cuda.get_device_name(device)}: {num_heads} heads, {num_kv_heads} kv heads, "
             f"head_dim {head_dim}, block_size {block_size}, {dtype}")  # fmt: skip
    copy_gbps = copy_bandwidth_gbps(device)
    print_fn(f"device copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    rows = []
    for context_len in context_lens:
        for batch_size in batch_sizes:
            geometry = (batch_size, context_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
            row = _bench_one(*geometry, iters=iters, warmup=warmup, with_reference=with_reference)
            row["share_of_copy_bandwidth"] = row["kernel_gbps"] / copy_gbps
            line = (f"batch {batch_size:>3} x ctx {context_len:>6}: {row['kv_bytes'] / 1e6:9.1f} MB"
                    f" = {batch_size} x {context_len} tokens x {num_kv_heads} kv heads x {head_dim} dims"
                    f" x 2 (K,V) x {element_size} B; kernel {row['kernel_ms']:.3f} ms"
                    f" -> {row['kernel_gbps']:.0f} GB/s (split-K x{row['num_partitions']})")  # fmt: skip
            if row["reference_ms"] is not None:
                line += (f"; reference {row['reference_ms']:.3f} ms -> {row['reference_gbps']:.0f} GB/s"
                         f" ({row['speedup']:.1f}x)")  # fmt: skip
            print_fn(line + f"; {row['share_of_copy_bandwidth']:.0%} of copy bandwidth")
            rows.append(row)
    prefill = []
    for context_len, query_len in prefill_shapes:
        row = _bench_prefill(context_len, query_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                             iters=iters, warmup=warmup)
        print_fn(f"prefill {query_len} new tokens over {context_len} in context: kernel {row['kernel_ms']:.3f} ms, "
                 f"reference {row['reference_ms']:.3f} ms ({row['speedup']:.1f}x)")
        prefill.append(row)
    return {"device": torch.cuda.get_device_name(device), "dtype": str(dtype).removeprefix("torch."),
            "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size,
            "copy_gbps": copy_gbps, "decode": rows, "prefill": prefill}


def _bench_prefill(context_len, query_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device, *,
                   iters, warmup) -> dict:
    """One sequence: `query_len` new tokens at the end of `context_len`, over scattered pages."""
    pages_per_seq = -(-context_len // block_size)
    table = torch.randperm(pages_per_seq).tolist()
    start = context_len - query_len
    slots = [table[p // block_size] * block_size + p % block_size for p in range(start, context_len)]
    batch = PagedBatch.build(block_size, 0, [query_len], [context_len], [table], slots, device)
    k_cache = torch.randn(pages_per_seq, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(query_len, num_heads, head_dim, device=device, dtype=dtype)
    scale = head_dim**-0.5
    plan, ref_plan = cuda_backend.CudaPlan.build(batch), reference.ReferencePlan.build(batch)
    error = (cuda_backend.paged_attention(plan, q, k_cache, v_cache, scale).float()
             - reference.paged_attention(ref_plan, q, k_cache, v_cache, scale).float()).abs().max().item()
    if error > 4 * _TOLERANCE[dtype]:
        raise RuntimeError(f"prefill kernel disagrees with the reference by {error:.2e} at ctx {context_len}; not timing")
    kernel_ms = _time_ms(lambda: cuda_backend.paged_attention(plan, q, k_cache, v_cache, scale), iters, warmup)
    reference_ms = _time_ms(lambda: reference.paged_attention(ref_plan, q, k_cache, v_cache, scale), iters, warmup)
    return {"context_len": context_len, "query_len": query_len, "max_abs_error": error, "kernel_ms": kernel_ms,
            "reference_ms": reference_ms, "speedup": reference_ms / kernel_ms}


def _bench_one(batch_size, context_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device, *,
               iters, warmup, with_reference) -> dict:  # fmt: skip
    pages_per_seq = -(-context_len // block_size)
    num_blocks = batch_size * pages_per_seq
    pages = torch.randperm(num_blocks).view(batch_size, pages_per_seq).tolist()  # scattered, as in a used pool
    slots = [t[(context_len - 1) // block_size] * block_size + (context_len - 1) % block_size for t in pages]
    batch = PagedBatch.build(block_size, batch_size, [1] * batch_size, [context_len] * batch_size, pages, slots, device)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch_size, num_heads, head_dim, device=device, dtype=dtype)
    scale = head_dim**-0.5
    kv_bytes = 2 * batch_size * context_len * num_kv_heads * head_dim * k_cache.element_size()

    plan = cuda_backend.CudaPlan.build(batch)
    out = cuda_backend.paged_attention(plan, q, k_cache, v_cache, scale)
    ref_plan = reference.ReferencePlan.build(batch)
    expect = reference.paged_attention(ref_plan, q, k_cache, v_cache, scale)
    error = (out.float() - expect.float()).abs().max().item()
    if error > 4 * _TOLERANCE[dtype]:  # the reference rounds its own scores in dtype, hence the slack
        where = f"batch {batch_size}, ctx {context_len}"
        raise RuntimeError(f"kernel disagrees with the reference by {error:.2e} at {where}; not timing")

    kernel_ms = _time_ms(lambda: cuda_backend.paged_attention(plan, q, k_cache, v_cache, scale), iters, warmup)
    reference_ms = None
    if with_reference:
        reference_ms = _time_ms(lambda: reference.paged_attention(ref_plan, q, k_cache, v_cache, scale), iters, warmup)
    return {
        "batch_size": batch_size,
        "context_len": context_len,
        "kv_bytes": kv_bytes,
        "num_partitions": plan.num_partitions,
        "max_abs_error": error,
        "kernel_ms": kernel_ms,
        "kernel_gbps": kv_bytes / kernel_ms / 1e6,
        "reference_ms": reference_ms,
        "reference_gbps": kv_bytes / reference_ms / 1e6 if reference_ms else None,
        "speedup": reference_ms / kernel_ms if reference_ms else None,
    }


def _time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
