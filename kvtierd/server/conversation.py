"""Chat turns bound to a stored session: building the prompt and recording the turn.

A request with `session_id` may carry the full history (as plain OpenAI clients
do) or only the new message(s):

- it starts with the stored history: taken as is, the rest is new;
- it starts like the stored history (same first message) but departs from it:
  an edited history. Its messages from the first difference replace the stored
  ones, which stay in the store marked superseded (a resent history that stops
  at a user message, e.g. to regenerate a reply, replaces from that message);
- otherwise its messages are new, appended to the stored history.

The engine starts the prompt from the session's context pool, so only the
tokens after the first difference are computed. A turn is recorded with its
whole reply, or marked interrupted.

When a session outgrows the context window (its prompt plus max_tokens), the
truncation policy (`kvtierd/server/truncation.py`) drops its oldest turns from
the prompt; the stored messages stay whole. The cut is remembered and moves
only when the window overflows again, so the turns in between reuse the KV of
the kept part instead of recomputing it at new positions every turn.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from kvtierd.server.errors import ApiError, bad_request
from kvtierd.server.generation import GenerationResult
from kvtierd.server.state import DaemonState
from kvtierd.server.tenant_limits import check_session_room, limits_of
from kvtierd.server.truncation import Truncation, truncate
from kvtierd.storage.session_store import MessageRecord, SessionRecord

log = logging.getLogger(__name__)

ADD_A_USER_MESSAGE = "a session request must add a user message after the stored history"


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_ids: list[int]
    session_id: str | None = None
    user_content: str | None = None  # the new user message, recorded with the reply
    truncated: Truncation | None = None  # what the truncation policy left out of the prompt
    supersede_from: int | None = None  # an edit: the stored messages from this seq on are replaced
    earlier: tuple[tuple[str, str], ...] = ()  # (role, content) new messages before the user message
    qos_class: str | None = None  # the session's class, used when the request names no priority


def session_history(session: SessionRecord, messages: list[MessageRecord]) -> list[dict[str, str]]:
    """The messages a session's next prompt starts with (interrupted turns left out)."""
    history = [{"role": "system", "content": session.system_prompt}] if session.system_prompt else []
    history += [{"role": m.role, "content": m.content} for m in messages if m.status == "complete"]
    return history


async def load_session(state: DaemonState, tenant: str, session_id: str) -> tuple[SessionRecord, list[MessageRecord]]:
    session = await state.db(state.store.get_session, tenant, session_id)
    if session is None:
        raise ApiError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
    return session, await state.db(state.store.messages, tenant, session_id)


async def chat_session(state: DaemonState, tenant: str, session_id: str,
                       messages: list[dict[str, str]]) -> tuple[SessionRecord, list[MessageRecord]]:
    """The session a chat request names. A frontend's own conversation id may be new to us: with
    `[sessions] create_on_first_use` the session is created then, the request's system message its system prompt."""
    if not state.settings.session_create_on_first_use:
        return await load_session(state, tenant, session_id)
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    limits = limits_of(state.settings.tenant_limits, tenant)
    if limits.sessions is not None and await state.db(state.store.get_session, tenant, session_id) is None:
        await check_session_room(tenant, limits, state.store.list_sessions)
    session, created = await state.db(state.store.get_or_create_session, tenant, session_id, system_prompt=system)
    if created:
        log.info("session %r of tenant %r created on first use", session_id, tenant)
        return session, []
    return session, await state.db(state.store.messages, tenant, session_id)


async def prepare_chat_turn(
    state: DaemonState, tenant: str, messages: list[dict[str, str]], session_id: str | None, max_tokens: int
) -> Turn:
    tok = state.loaded.tokenizer
    if session_id is None:
        return Turn(tok.encode_chat(messages))
    if messages[-1]["role"] != "user" or any(m["role"] == "system" for m in messages[1:]):
        raise bad_request(ADD_A_USER_MESSAGE, param="messages")  # before a session is created on first use
    session, records = await chat_session(state, tenant, session_id, messages)
    history = session_history(session, records)
    supersede_from = None
    if messages[: len(history)] == history:
        full, new = messages, messages[len(history) :]
    elif len(messages) > 1 and history and messages[0] == history[0]:
        differs = next((i for i, (m, h) in enumerate(zip(messages, history)) if m != h), len(messages))
        k = min(differs, len(messages) - 1)
        stored = [r for r in records if r.status == "complete"]
        offset = len(history) - len(stored)  # the system prompt, which is the session's, not a message
        full, new, supersede_from = messages, messages[k:], stored[k - offset].seq
    elif messages[0]["role"] == "system":
        raise bad_request("this session's system prompt differs: it is set when the session is created; send the "
                          "stored history (edited or not) or only new messages", param="messages[0]")
    else:
        full, new = history + messages, messages
    if not new or new[-1]["role"] != "user" or any(m["role"] == "system" for m in new):
        raise bad_request(ADD_A_USER_MESSAGE, param="messages")
    earlier = tuple((m["role"], m["content"]) for m in new[:-1])
    turn = session_turn(state, tenant, session_id, full, max_tokens, supersede_from, earlier)
    return replace(turn, qos_class=session.qos_class)


async def prepare_session_message(state: DaemonState, tenant: str, session_id: str, content: str,
                                  max_tokens: int) -> Turn:
    session, records = await load_session(state, tenant, session_id)
    history = session_history(session, records)
    turn = session_turn(state, tenant, session_id, history + [{"role": "user", "content": content}], max_tokens)
    return replace(turn, qos_class=session.qos_class)


def session_turn(state: DaemonState, tenant: str, session_id: str, messages: list[dict[str, str]], max_tokens: int,
                 supersede_from: int | None = None, earlier: tuple[tuple[str, str], ...] = ()) -> Turn:
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
    return Turn(prompt, session_id, messages[-1]["content"], truncated, supersede_from, earlier)


async def record_turn(state: DaemonState, tenant: str, turn: Turn, result: GenerationResult) -> None:
    """Stores the turn in one transaction; shielded so a cancelled request still records it."""
    if turn.session_id is None:
        return
    status = "complete" if result.finish_reason is not None else "interrupted"
    chunk_store = state.chunk_store  # None without a disk tier: nothing to catalog
    write = state.db(
        state.store.append_turn, tenant, turn.session_id, turn.user_content or "", result.text,
        status=status, prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
        token_count=result.prompt_tokens + result.completion_tokens,
        supersede_from=turn.supersede_from, earlier=turn.earlier,
        chunk_store=chunk_store or "", chunk_keys=result.stored_chunks if chunk_store else (),
    )
    await asyncio.shield(write)
