"""Chat turns bound to a stored session: building the prompt and recording the turn.

A request with `session_id` may carry the full history (as plain OpenAI clients
do) or only the new message(s). When the request starts with the stored
history, it is taken as is; otherwise its messages are appended to the stored
history. Either way the prompt begins with the session's earlier turns, so
their KV pages are found in the prefix cache and only the new tokens are
computed. A turn is recorded with its whole reply, or marked interrupted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kvtierd.server.errors import ApiError, bad_request
from kvtierd.server.generation import GenerationResult
from kvtierd.server.state import DaemonState
from kvtierd.storage.session_store import MessageRecord, SessionRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_ids: list[int]
    session_id: str | None = None
    user_content: str | None = None  # the new user message, recorded with the reply


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
    state: DaemonState, tenant: str, messages: list[dict[str, str]], session_id: str | None
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
    return Turn(tok.encode_chat(full), session_id, new[-1]["content"])


async def prepare_session_message(state: DaemonState, tenant: str, session_id: str, content: str) -> Turn:
    history = await load_history(state, tenant, session_id)
    full = history + [{"role": "user", "content": content}]
    return Turn(state.loaded.tokenizer.encode_chat(full), session_id, content)


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
