"""`kvtierd bench cpu-attention`: decode attention on the CPU, over a model's layers of paged KV.

A decode step's attention reads each sequence's cached K and V once per layer,
from pages anywhere in the pool, so on a CPU its speed is the memory's. One
row per (context, batch): the C decode kernel (`kernels/cpu_decode.py`) over
every layer's pool, each layer its own pool as in a step (nothing left in
cache from the layer before), its pages scattered in a pool four times their
number; beside it, the same attention through the C prefill kernel (a cached
prompt's last token took that path before it went through the decode kernel)
and the torch reference (gather + SDPA), and the machine's read bandwidth.
GB/s are of KV bytes read. Then the step in which a long cached context's
last token joins short decodes: that token in the decodes' kernel call (as
`kernels/cpu_backend.py` sends it) beside a call of its own after theirs.
And runs of a few new tokens over the longest context (a piece of a prompt
beside decodes, a restored prompt's rest) through the prefill kernel, its
keys in segments (as the kernel splits such runs) beside one item per KV
head. Each configuration is checked against the reference before it is
timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvtierd.kernels import reference
from kvtierd.kernels.cpu_decode import cpu_decode_kernel
from kvtierd.kernels.cpu_prefill import cpu_prefill_kernel
from kvtierd.kernels.paged_batch import PagedBatch

TOLERANCE = 2e-2  # bfloat16 outputs: the reference rounds its scores in bfloat16 too
POOL_SHARE = 4  # a layer's pool holds this many times the pages read: they lie scattered in it


@dataclass(frozen=True, slots=True)
class CpuAttentionRow:
    context_len: int
    batch_size: int
    kv_mb: float  # KV bytes a step's attention reads over all layers
    decode_ms: float  # the decode kernel
    decode_gbps: float
    prefill_kernel_ms: float | None  # batch 1: the token as a one-token prefill (None: no such kernel here)
    reference_ms: float  # the torch reference


@dataclass(frozen=True, slots=True)
class RunRow:
    """A run of new tokens at the end of a long context, through the prefill kernel over every layer."""

    context_len: int
    num_tokens: int
    segments_ms: float  # its keys in segments, as the kernel splits a run of few items
    whole_ms: float  # each KV head's item over all of its keys


@dataclass(frozen=True, slots=True)
class JoinRow:
    """A long cached context's last token beside short decodes, over every layer."""

    context_len: int
    decode_lens: list[int]
    one_call_ms: float  # in the decodes' call
    own_call_ms: float  # in a call of its own after theirs


def read_bandwidth_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes a sum over a large tensor reads per second, at torch's threads."""
    x = torch.ones(nbytes // 8, dtype=torch.int64)
    x.sum()
    return nbytes / min(_seconds(lambda: x.sum()) for _ in range(repeats)) / 1e9


def run_cpu_attention_bench(contexts: tuple[int, ...] = (512, 2560, 8192), batches: tuple[int, ...] = (1, 4),
                            num_layers: int = 30, num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64,
                            block_size: int = 16, repeats: int = 7,
                            join_decode_lens: tuple[int, ...] = (200, 180, 220),
                            run_tokens: tuple[int, ...] = (4, 16)) -> dict:
    """The bundled model's geometry by default (SmolLM2-135M: 30 layers, 9 heads over 3 KV heads of 64); the
    join row's long context is the longest of `contexts`, beside decodes over `join_decode_lens` tokens, and so
    is the runs' of `run_tokens` new tokens (none without the prefill kernel)."""
    decode, prefill = cpu_decode_kernel(head_dim), cpu_prefill_kernel(head_dim)
    if decode is None:
        raise RuntimeError("the CPU decode kernel could not be built here (a C compiler is needed)")
    rows = []
    for context_len in contexts:
        for batch_size in batches:
            rows.append(_row(decode, prefill, context_len, batch_size, num_layers, num_heads, num_kv_heads, head_dim,
                             block_size, repeats))
    join = _join_row(decode, max(contexts), list(join_decode_lens), num_layers, num_heads, num_kv_heads, head_dim,
                     block_size, repeats)
    runs = [] if prefill is None else [
        _run_row(prefill, max(contexts), n, num_layers, num_heads, num_kv_heads, head_dim, block_size, repeats)
        for n in run_tokens]
    return {"num_layers": num_layers, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "block_size": block_size, "threads": torch.get_num_threads(), "read_gbps": read_bandwidth_gbps(),
            "rows": [asdict(r) for r in rows], "join": asdict(join), "runs": [asdict(r) for r in runs]}


def _row(decode, prefill, context_len, batch_size, num_layers, num_heads, num_kv_heads, head_dim, block_size,
         repeats) -> CpuAttentionRow:
    gen = torch.Generator().manual_seed(context_len + batch_size)
    per_seq = -(-context_len // block_size)
    num_pages = POOL_SHARE * per_seq * batch_size
    tables = torch.randperm(num_pages, generator=gen)[: per_seq * batch_size].view(batch_size, per_seq).tolist()
    slots = [t[(context_len - 1) // block_size] * block_size + (context_len - 1) % block_size for t in tables]
    batch = PagedBatch.build(block_size, batch_size, [1] * batch_size, [context_len] * batch_size, tables, slots,
                             torch.device("cpu"))
    shape = (num_pages, block_size, num_kv_heads, head_dim)
    pools = [torch.randn((2, *shape), generator=gen).bfloat16() for _ in range(num_layers)]
    q = torch.randn(batch_size, num_heads, head_dim, generator=gen).bfloat16()
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    plan = reference.ReferencePlan.build(batch)
    expected = reference.paged_attention(plan, q, pools[0][0], pools[0][1], scale)
    decode.decode(out, q, pools[0][0], pools[0][1], batch.block_tables, batch.context_lens, batch.context_lens_host,
                  scale)
    error = (out.float() - expected.float()).abs().max().item()
    if error > TOLERANCE:
        raise RuntimeError(f"the decode kernel disagrees with the reference by {error:.2e} at ctx {context_len}")

    def over_layers(attend: Callable[[torch.Tensor, torch.Tensor], object]) -> float:
        return statistics.median(_seconds(lambda: [attend(kv[0], kv[1]) for kv in pools]) for _ in range(repeats))

    def kernel(k, v):
        decode.decode(out, q, k, v, batch.block_tables, batch.context_lens, batch.context_lens_host, scale)

    decode_s = over_layers(kernel)
    prefill_s = None
    if prefill is not None and batch_size == 1:
        prefill_s = over_layers(lambda k, v: prefill.attend(out, q, k, v, batch.block_tables[0], context_len, scale))
    reference_s = over_layers(lambda k, v: reference.paged_attention(plan, q, k, v, scale))
    kv_bytes = 2 * num_layers * batch_size * context_len * num_kv_heads * head_dim * 2
    return CpuAttentionRow(context_len, batch_size, kv_bytes / 1e6, decode_s * 1e3, kv_bytes / decode_s / 1e9,
                           None if prefill_s is None else prefill_s * 1e3, reference_s * 1e3)


def _join_row(decode, context_len, decode_lens, num_layers, num_heads, num_kv_heads, head_dim, block_size,
              repeats) -> JoinRow:
    gen = torch.Generator().manual_seed(context_len)
    lens = [*decode_lens, context_len]
    pages = [-(-n // block_size) for n in lens]
    num_pages = POOL_SHARE * sum(pages)
    order = torch.randperm(num_pages, generator=gen)[: sum(pages)].tolist()
    tables = [order[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(lens))]
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lens, strict=True)]
    batch = PagedBatch.build(block_size, len(decode_lens), [1] * len(lens), lens, tables, slots, torch.device("cpu"))
    shape = (num_pages, block_size, num_kv_heads, head_dim)
    pools = [torch.randn((2, *shape), generator=gen).bfloat16() for _ in range(num_layers)]
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).bfloat16()
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    d = len(decode_lens)

    def one_call(k, v):
        decode.decode(out, q, k, v, batch.block_tables, batch.context_lens, batch.context_lens_host, scale)

    def own_call(k, v):
        decode.decode(out[:d], q[:d], k, v, batch.block_tables[:d], batch.context_lens[:d],
                      batch.context_lens_host[:d], scale)
        decode.decode(out[d:], q[d:], k, v, batch.block_tables[d:], batch.context_lens[d:],
                      batch.context_lens_host[d:], scale)

    expected = reference.paged_attention(reference.ReferencePlan.build(batch), q, pools[0][0], pools[0][1], scale)
    times: dict[Callable, list[float]] = {one_call: [], own_call: []}
    for attend in times:
        attend(pools[0][0], pools[0][1])
        error = (out.float() - expected.float()).abs().max().item()
        if error > TOLERANCE:
            raise RuntimeError(f"the decode kernel disagrees with the reference by {error:.2e} (join)")
    for _ in range(repeats):  # alternating, so both see the same machine
        for attend, seconds in times.items():
            seconds.append(_seconds(lambda a=attend: [a(kv[0], kv[1]) for kv in pools]))
    return JoinRow(context_len, decode_lens, statistics.median(times[one_call]) * 1e3,
                   statistics.median(times[own_call]) * 1e3)


def _run_row(prefill, context_len, num_tokens, num_layers, num_heads, num_kv_heads, head_dim, block_size,
             repeats) -> RunRow:
    gen = torch.Generator().manual_seed(context_len + num_tokens)
    per_seq = -(-context_len // block_size)
    num_pages = POOL_SHARE * per_seq
    table = torch.randperm(num_pages, generator=gen)[:per_seq].tolist()
    slots = [table[t // block_size] * block_size + t % block_size for t in range(context_len - num_tokens,
                                                                                    context_len)]
    batch = PagedBatch.build(block_size, 0, [num_tokens], [context_len], [table], slots, torch.device("cpu"))
    shape = (num_pages, block_size, num_kv_heads, head_dim)
    pools = [torch.randn((2, *shape), generator=gen).bfloat16() for _ in range(num_layers)]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).bfloat16()
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    expected = reference.paged_attention(reference.ReferencePlan.build(batch), q, pools[0][0], pools[0][1], scale)
    times: dict[bool, list[float]] = {True: [], False: []}
    for split in times:
        prefill.attend(out, q, pools[0][0], pools[0][1], batch.block_tables[0], context_len, scale, split)
        error = (out.float() - expected.float()).abs().max().item()
        if error > TOLERANCE:
            raise RuntimeError(f"the prefill kernel disagrees with the reference by {error:.2e} ({num_tokens} tokens)")
    for _ in range(repeats):  # alternating, so both see the same machine
        for split, seconds in times.items():
            seconds.append(_seconds(lambda s=split: [prefill.attend(out, q, kv[0], kv[1], batch.block_tables[0],
                                                                    context_len, scale, s) for kv in pools]))
    return RunRow(context_len, num_tokens, statistics.median(times[True]) * 1e3,
                  statistics.median(times[False]) * 1e3)


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
