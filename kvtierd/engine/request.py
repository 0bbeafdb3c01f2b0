"""A request's state inside the engine, and what it streams out."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvtierd.cache.block_hash import BlockHash, BlockHashes
from kvtierd.cache.loading import LoadTicket
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.model.detokenizer import IncrementalDetokenizer
from kvtierd.tiers.restore_planner import NOTHING_BELOW, RestorePlan


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client
    REJECTED = "rejected"  # waited past its class's max_queue_s without being admitted (overload)
    SHED = "shed"  # a low request refused unadmitted while a high one waited (overload, shed_low_after_s)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one request; `text` and `token_ids` are deltas."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the cache, not recomputed
    cached_tokens_by_tier: dict[str, int]  # num_cached_tokens by the tier they came from: device, host, disk, remote
    cache_source: str  # "session" (its context pool), "prefix" (the tenant's index), "public" or "none"
    queue_s: float  # from arrival to first being scheduled
    restore: RestorePlan = NOTHING_BELOW  # whether chunks found below the device were loaded or recomputed
    stored_chunks: tuple[bytes, ...] = ()  # a finished session turn: its chunks' disk keys, for the SQL catalog


@dataclass(slots=True)
class Request:
    """Scheduling invariant: there is no prefill or decode phase. Each step
    computes up to `num_tokens - num_computed_tokens` pending tokens (all of
    them for a decode: exactly one); when none remain, the last computed
    position's logits give the next token, which makes one more pending."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    cache_root: BlockHash  # the namespace (model + tenant) its pages are hashed under
    session_id: str | None = None  # its session's context pool is tried first, and kept after it
    tag: str | None = None  # marks the pages of its prefix (e.g. "doc:v3") for invalidation
    qos_class: str = "normal"  # high, normal or low: admission order, the reserved region, preemption
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found cached at first admission; -1 before it
    cache_source: str = "none"  # where they came from: "session", "prefix", "public" or "none"
    tokens_from_below: dict[str, int] = field(default_factory=dict)  # of them, loaded from "host" / "disk" / "remote"
    restore: RestorePlan = NOTHING_BELOW  # at first admission: chunks found below, loaded or left to recompute
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    prefix_loaded: bool = False  # its prefix was loaded from below for this admission: recompute what did not come
    loaded: LoadTicket | None = None  # what its loads brought, from their arrival to its admission
    block_hashes: BlockHashes | None = None  # its pages' hashes in its namespace, each computed once
    # A split join (engine/scheduler.py): its prompt's last token went through the first part of the layers in
    # the last step, which left this residual row `[1, hidden]` for the rest to take up in the next.
    join_hidden: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def high(self) -> bool:
        return self.qos_class == "high"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
