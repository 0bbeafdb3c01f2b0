"""Turns a StepPlan into tensors, runs the forward, returns the logits to sample from."""

from __future__ import annotations

import torch

from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.engine.scheduler import StepPlan
from kvtierd.kernels.paged_batch import PagedBatch
from kvtierd.model.llama import LlamaModel
from kvtierd.storage.device_pool import DeviceKVPool


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

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens, context_lens, tables, sample_rows, sample_idx = [], [], [], [], []
        for i, s in enumerate(scheduled):
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            input_ids.extend(req.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slot_mapping.extend(s.allocation.slots)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(self.block_tables.block_ids(req.request_id))
            if start + n == req.num_tokens:
                sample_idx.append(i)
                sample_rows.append(len(input_ids) - 1)

        device = self.model.device
        batch = PagedBatch.build(
            block_size=self.pool.geometry.block_size,
            num_decodes=len(plan.decodes),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
            slot_mapping=slot_mapping,
            device=device,
        )
        hidden = self.model.forward(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.pool.kv_caches,
            batch,
        )
        if not sample_idx:
            return [], None
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=device)
        return sample_idx, self.model.compute_logits(hidden[rows]).cpu()
