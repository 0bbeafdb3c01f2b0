"""What a session's prompt keeps when the conversation outgrows the context window.

Policies (setting `truncation`):

    off     nothing is dropped; a prompt that does not fit is refused (400)
    turns   the system prompt and the last `truncation_keep_turns` turns (fewer
            if even those do not fit)
    tokens  the system prompt and as many recent turns as fit in
            `truncation_keep_tokens` tokens (0: the window less max_tokens)

A turn starts at a user message and runs to the next one, so a cut never
splits a question from its answer, and the new user message is always kept.
A cut that still fits is kept for the next turns (`previous_cut`): moving it
every turn would shift every kept token's position and force a recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

TRUNCATION_POLICIES = ("off", "turns", "tokens")

Messages = list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class Truncation:
    policy: str
    dropped_messages: int  # the oldest messages after the system prompt
    dropped_tokens: int  # prompt tokens the whole conversation had beyond the kept part

    def as_json(self) -> dict:
        return {"policy": self.policy, "dropped_messages": self.dropped_messages,
                "dropped_tokens": self.dropped_tokens}


def truncate(messages: Messages, encode: Callable[[Messages], list[int]], budget: int, policy: str,
             keep_turns: int, keep_tokens: int, previous_cut: int = 0) -> tuple[list[int], Truncation | None]:
    """The prompt's token ids, and what was left out (None: nothing) to fit `budget` tokens."""
    ids = encode(messages)
    if len(ids) <= budget or policy == "off":
        return ids, None  # "off": the engine refuses a prompt that does not fit, naming the numbers
    system = messages[:1] if messages[0]["role"] == "system" else []
    rest = messages[len(system):]
    starts = [i for i, m in enumerate(rest) if m["role"] == "user"]  # where each turn begins
    limit = min(budget, keep_tokens) if policy == "tokens" and keep_tokens else budget

    def kept(cut: int) -> list[int]:
        return encode(system + rest[cut:])

    if previous_cut in starts[1:]:
        prompt = kept(previous_cut)
        if len(prompt) <= limit:
            return prompt, Truncation(policy, previous_cut, len(ids) - len(prompt))
    cuts = starts[max(0, len(starts) - keep_turns):] if policy == "turns" else starts
    # Fewer tokens the later the cut: the earliest cut that fits keeps the most.
    lo, hi = 0, len(cuts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(kept(cuts[mid])) <= limit:
            hi = mid
        else:
            lo = mid + 1
    cut = cuts[lo]  # the last turn alone when nothing fits: the engine's check then names the numbers
    prompt = kept(cut)
    return prompt, Truncation(policy, cut, len(ids) - len(prompt)) if cut else None
