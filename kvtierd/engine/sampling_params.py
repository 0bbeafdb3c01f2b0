"""How to pick each next token of a request, and when to stop."""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.engine.errors import RequestError

MAX_TOP_LOGPROBS = 20
MIN_SAMPLING_TEMPERATURE = 1e-4  # below it, sampling is greedy (its limit)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 (or under MIN_SAMPLING_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise RequestError("temperature must be between 0 and 2", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p must be in (0, 1]", "top_p")
        if self.top_k < 0:
            raise RequestError("top_k must be 0 (off) or positive", "top_k")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty", "stop")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch.Generator accepts
            raise RequestError("seed must be a 64-bit integer", "seed")

    @property
    def greedy(self) -> bool:
        # Below this, dividing the logits overflows float32 to inf (NaN probabilities); greedy is the limit.
        return self.temperature < MIN_SAMPLING_TEMPERATURE
