"""Picks the next token of each request from its logits row."""

from __future__ import annotations

import torch

from kvtierd.engine.request import TokenLogprob
from kvtierd.engine.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks to -inf every token outside the top k and outside the top-p nucleus."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest set whose mass reaches top_p: drop a token when the
        # mass before it already does. The best token always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False  # a top_p below float32's least value compares as 0 and would drop every token
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits [n, vocab]` (float32)."""
    # Greedy rows are done here; max() is several times faster than argmax() on CPU.
    tokens = logits.max(dim=-1).indices.tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprob]:
    """The model's log-probabilities (before temperature) of the chosen tokens and the best alternatives."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    k = max(top_n, default=0)
    top_vals, top_ids = torch.topk(logprobs, k) if k else (None, None)
    out = []
    for i, token in enumerate(tokens):
        top = ()
        if top_n[i]:
            top = tuple(zip(top_ids[i, : top_n[i]].tolist(), top_vals[i, : top_n[i]].tolist()))
        out.append(TokenLogprob(token, chosen[i], top))
    return out
