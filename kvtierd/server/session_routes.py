"""The chat-session store over HTTP: /v1/sessions..."""

from __future__ import annotations

from aiohttp import web

from kvtierd.server.chat_routes import respond_chat
from kvtierd.server.conversation import prepare_session_message
from kvtierd.server.errors import ApiError, bad_request
from kvtierd.server.middleware import read_json
from kvtierd.server.schemas import (PRIORITIES, SESSION_CREATE_FIELDS, SESSION_MESSAGE_FIELDS, parse_options,
                                    require_object, session_id_param)
from kvtierd.server.state import STATE, DaemonState
from kvtierd.server.tenant_limits import check_session_room, limits_of
from kvtierd.storage.session_store import MessageRecord, SessionRecord

routes = web.RouteTableDef()


def session_json(s: SessionRecord, num_messages: int | None = None) -> dict:
    body = {
        "id": s.id, "object": "session", "tenant": s.tenant, "qos_class": s.qos_class, "title": s.title,
        "system_prompt": s.system_prompt, "created_at": s.created_at.isoformat(),
        "last_used_at": s.last_used_at.isoformat(), "token_count": s.token_count, "pinned": s.pinned,
    }
    if num_messages is not None:
        body["num_messages"] = num_messages
    return body


def message_json(m: MessageRecord) -> dict:
    return {"seq": m.seq, "role": m.role, "content": m.content, "status": m.status,
            "created_at": m.created_at.isoformat(), "prompt_tokens": m.prompt_tokens,
            "completion_tokens": m.completion_tokens}


def _optional_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{name} must be a string", param=name)
    return value


@routes.post("/v1/sessions")
async def create_session(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request) if request.can_read_body else {}
    body = require_object(body, SESSION_CREATE_FIELDS)
    priority = _optional_str(body, "priority")
    priority = "normal" if priority is None else priority  # an empty string is a bad priority, not the default
    if priority not in PRIORITIES:
        raise bad_request(f"priority must be one of {', '.join(PRIORITIES)}", param="priority")
    session_id = session_id_param(body, "id")  # a bad body is a 400 before any limit
    await check_session_room(request["tenant"], limits_of(state.settings.tenant_limits, request["tenant"]),
                             state.store.list_sessions)
    session = await state.db(state.store.create_session, request["tenant"], session_id=session_id,
                             system_prompt=_optional_str(body, "system_prompt"),
                             title=_optional_str(body, "title"), qos_class=priority)
    return web.json_response(session_json(session), status=201)


@routes.get("/v1/sessions")
async def list_sessions(request: web.Request) -> web.Response:
    state = request.app[STATE]
    sessions = await state.db(state.store.list_sessions, request["tenant"], query_limit(request))
    return web.json_response({"object": "list", "data": [session_json(s) for s in sessions]})


def query_limit(request: web.Request) -> int:
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError:
        raise bad_request("limit must be an integer", param="limit") from None
    if not 1 <= limit <= 1000:
        raise bad_request("limit must be between 1 and 1000", param="limit")
    return limit


async def _owned_session(request: web.Request) -> SessionRecord:
    state = request.app[STATE]
    sid = request.match_info["session_id"]
    session = await state.db(state.store.get_session, request["tenant"], sid)
    if session is None:
        raise ApiError(404, f"no session {sid!r}", code="session_not_found")
    return session


@routes.get("/v1/sessions/{session_id}")
async def get_session(request: web.Request) -> web.Response:
    state = request.app[STATE]
    session = await _owned_session(request)
    messages = await state.db(state.store.messages, request["tenant"], session.id)
    return web.json_response({**session_json(session, len(messages)), "messages": [message_json(m) for m in messages]})


@routes.post("/v1/sessions/{session_id}/messages")
async def post_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = require_object(await read_json(request), SESSION_MESSAGE_FIELDS)
    content = body.get("content")
    if not isinstance(content, str) or not content:
        raise bad_request("content must be a non-empty string", param="content")
    options = parse_options(body, state.settings.default_max_tokens)
    session = await _owned_session(request)
    turn = await prepare_session_message(state, request["tenant"], session.id, content, options.params.max_tokens)
    return await respond_chat(request, state, turn, options)


@routes.delete("/v1/sessions/{session_id}")
async def delete_session(request: web.Request) -> web.Response:
    state = request.app[STATE]
    session = await _owned_session(request)
    freed = await drop_session_kv(request, session)
    await state.db(state.store.delete_session, request["tenant"], session.id)
    return web.json_response({"id": session.id, "object": "session.deleted", "deleted": True, "freed_blocks": freed})


async def drop_session_kv(request: web.Request, session: SessionRecord) -> int:
    """Drops the session's context pool and the pages it computed (pages other requests hold stay)."""
    state = request.app[STATE]
    state.truncation_cuts.pop((session.tenant, session.id), None)
    return await state.engine.call(lambda: state.engine.engine.invalidate_session(session.id, session.tenant))


async def session_tenant(state: DaemonState, sid: str, tenant: str | None, param: str | None = None) -> str:
    """Whose session `sid` is: `tenant` when the admin named one, else its one owner. Frontends choose
    their ids, so two tenants may share one: then the admin must name the tenant (409)."""
    if tenant:
        owners = [tenant] if await state.db(state.store.get_session, tenant, sid) else []
    else:
        owners = await state.db(state.store.tenants_of, sid)
    if not owners:
        raise ApiError(404, f"no session {sid!r}", param=param, code="session_not_found")
    if len(owners) > 1:
        raise ApiError(409, f"tenants {', '.join(owners)} each have a session {sid!r}: name the tenant",
                       param="tenant", code="session_ambiguous")
    return owners[0]
