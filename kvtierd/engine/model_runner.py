"""Turns a StepPlan into tensors, runs the forward, returns the logits to sample from.

A step with a split join (engine/scheduler.py) runs in two parts: the first
half of the layers over every row but a second part's, then the rest over
every row but a first part's. The first parts' residual rows are kept on their
requests for the next step; the second parts' join the others' rows there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.engine.scheduler import ScheduledRequest, StepPlan
from kvtierd.kernels.paged_batch import PagedBatch
from kvtierd.model.llama import LlamaModel
from kvtierd.storage.device_pool import DeviceKVPool


@dataclass(slots=True)
class _Rows:
    """Some of a step's scheduled requests as the forward takes them: their tokens flattened, and attention's
    view of them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: PagedBatch
    starts: list[int]  # each request's first row


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: DeviceKVPool, block_tables: KVCacheManager) -> None:
        self.model = model
        self.pool = pool
        self.block_tables = block_tables

    def execute(self, plan: StepPlan) -> tuple[list[int], torch.Tensor | None]:
        """Runs one step. Returns the indices into `plan.scheduled` of the requests
        whose pending tokens are all computed after it, and their logits `[n, vocab]`."""
        scheduled = plan.scheduled
        self.pool.copy_blocks([c for s in scheduled for c in s.allocation.copies])
        model, kv_caches = self.model, self.pool.kv_caches
        if any(s.join_half for s in scheduled):
            hidden, starts = self._split(scheduled)
        else:
            rows = self._rows(scheduled)
            hidden, starts = model.forward(rows.input_ids, rows.positions, kv_caches, rows.batch), rows.starts
        sample_idx, sample_rows = [], []
        for i, (s, start) in enumerate(zip(scheduled, starts)):
            req = s.request
            if start is not None and req.num_computed_tokens + s.num_new_tokens == req.num_tokens:
                sample_idx.append(i)
                sample_rows.append(start + s.num_new_tokens - 1)
        if not sample_idx:
            return [], None
        index = torch.tensor(sample_rows, dtype=torch.int64, device=model.device)
        return sample_idx, model.compute_logits(hidden[index]).cpu()

    def _split(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, list[int | None]]:
        """A step with split joins: the final hidden states of the second half's rows, and each scheduled
        request's first row among them (None for a first part, which ends at the first half)."""
        model, kv_caches = self.model, self.pool.kv_caches
        at = model.config.num_layers // 2
        first = [s for s in scheduled if s.join_half != 2]
        second = [s for s in scheduled if s.join_half != 1]
        parts: list[torch.Tensor] = []  # the second half's input rows, in `second`'s order
        if first:
            rows = self._rows(first)
            h = model.run_layers(model.embed(rows.input_ids), rows.positions, kv_caches, rows.batch, range(at))
            row_of = {id(s): start for s, start in zip(first, rows.starts)}
        for s in second:
            if s.join_half == 2:
                parts.append(s.request.join_hidden)
                s.request.join_hidden = None
            else:
                parts.append(h[row_of[id(s)] : row_of[id(s)] + s.num_new_tokens])
        for s in first:
            if s.join_half == 1:
                s.request.join_hidden = h[row_of[id(s)] : row_of[id(s)] + 1].clone()
        rows = self._rows(second)
        h = model.run_layers(torch.cat(parts), rows.positions, kv_caches, rows.batch,
                             range(at, model.config.num_layers))
        start_of = {id(s): start for s, start in zip(second, rows.starts)}
        return model.final_norm(h), [start_of.get(id(s)) for s in scheduled]

    def _rows(self, scheduled: list[ScheduledRequest]) -> _Rows:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens, context_lens, tables, starts = [], [], [], []
        for s in scheduled:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            starts.append(len(input_ids))
            input_ids.extend(req.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slot_mapping.extend(s.allocation.slots)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(self.block_tables.block_ids(req.request_id))
        device = self.model.device
        batch = PagedBatch.build(
            block_size=self.pool.geometry.block_size,
            num_decodes=sum(n == 1 for n in query_lens),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
            slot_mapping=slot_mapping,
            device=device,
        )
        return _Rows(torch.tensor(input_ids, dtype=torch.int64, device=device),
                     torch.tensor(positions, dtype=torch.int64, device=device), batch, starts)
