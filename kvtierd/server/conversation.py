"""Chat turns bound to a stored session: building the prompt and recording the turn.

A request with `session_id` may carry the full history (as plain OpenAI clients
do) or only the new message(s). When the request starts with the stored
history, it is taken as is; otherwise its messages are appended to the stored
history. Either way the prompt begins with the session's earlier turns, and the
engine starts it from the session's context pool, so only the new tokens are
computed. A turn is recorded with its whole reply, or marked interrupted.

When a session outgrows the context window (its prompt plus max_tokens), the
truncation policy (`kvtierd/server/truncation.py`) drops its oldest turns from
the prompt; the stored messages stay whole. The cut is remembered and moves
only when the window overflows again, so the turns in between reuse the KV of
the kept part instead of recomputing it at new positions every turn.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kvtierd.server.errors import ApiError, bad_request
from kvtierd.server.generation import GenerationResult
from kvtierd.server.state import DaemonState
from kvtierd.server.truncation import Truncation, truncate
from kvtierd.storage.session_store import MessageRecord, SessionRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_ids: list[int]
    session_id: str | None = None
    user_content: str | None = None  # the new user message, recorded with the reply
    truncated: Truncation | None = None  # what the truncation policy left out of the prompt


def session_history(session: SessionRecord, messages: list[MessageRecord]) -> list[dict[str, str]]:
    """The messages a session's next prompt starts with (interrupted turns left out)."""
    history = [{"role": "system", "content": session.system_prompt}] if session.system_prompt else []
    history += [{"role": m.role, "content": m.content} for m in messages if m.status == "complete"]
    return history


async def load_history(state: DaemonState, tenant: str, session_id: str) -> list[dict[str, str]]:
    session = await state.db(state.store.get_session, tenant, session_id)
    if session is None:
        raise ApiError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
    return session_history(session, await state.db(state.store.messages, tenant, session_id))


async def prepare_chat_turn(
    state: DaemonState, tenant: str, messages: list[dict[str, str]], session_id: str | None, max_tokens: int
) -> Turn:
    tok = state.loaded.tokenizer
    if session_id is None:
        return Turn(tok.encode_chat(messages))
    history = await load_history(state, tenant, session_id)
    if messages[: len(history)] == history:
        full, new = messages, messages[len(history) :]
    else:
        full, new = history + messages, messages
    if not new or new[-1]["role"] != "user":
        raise bad_request("a session request must add a user message after the stored history", param="messages")
    return session_turn(state, tenant, session_id, full, max_tokens)


async def prepare_session_message(state: DaemonState, tenant: str, session_id: str, content: str,
                                  max_tokens: int) -> Turn:
    history = await load_history(state, tenant, session_id)
    return session_turn(state, tenant, session_id, history + [{"role": "user", "content": content}], max_tokens)


def session_turn(state: DaemonState, tenant: str, session_id: str, messages: list[dict[str, str]],
                 max_tokens: int) -> Turn:
    """The turn's prompt: the whole conversation, or what the truncation policy keeps of it."""
    s = state.settings
    budget = state.engine.engine.max_model_len - max_tokens
    key = (tenant, session_id)
    prompt, truncated = truncate(messages, state.loaded.tokenizer.encode_chat, budget, s.truncation,
                                 s.truncation_keep_turns, s.truncation_keep_tokens, state.truncation_cuts.get(key, 0))
    if truncated is None:
        state.truncation_cuts.pop(key, None)
    else:
        state.truncation_cuts[key] = truncated.dropped_messages
    return Turn(prompt, session_id, messages[-1]["content"], truncated)


async def record_turn(state: DaemonState, tenant: str, turn: Turn, result: GenerationResult) -> None:
    """Stores the turn in one transaction; shielded so a cancelled request still records it."""
    if turn.session_id is None:
        return
    status = "complete" if result.finish_reason is not None else "interrupted"
    write = state.db(
        state.store.append_turn, tenant, turn.session_id, turn.user_content or "", result.text,
        status=status, prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
        token_count=result.prompt_tokens + result.completion_tokens,
    )
    await asyncio.shield(write)
