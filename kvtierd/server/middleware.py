"""Request middleware: peer and tenant, draining, and one mapping from errors to responses."""

from __future__ import annotations

import json
import logging
import re

from aiohttp import web

from kvtierd.cache.pins import PinBudgetError, PinError
from kvtierd.engine.errors import EngineStoppedError, OverloadedError, RequestError
from kvtierd.model.errors import ChatTemplateError
from kvtierd.server.errors import ApiError, bad_request, forbidden, unavailable
from kvtierd.server.peer import peer_of
from kvtierd.server.placement import refusal
from kvtierd.server.state import STATE
from kvtierd.server.tenant_limits import limits_of
from kvtierd.storage.store_errors import (SessionExistsError, SessionNotFoundError, StoreArgumentError,
                                          StoreUnavailableError)

log = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"^[A-Za-z0-9._@:-]{1,128}$")
GENERATES = re.compile(r"^/v1/(chat/completions|completions|sessions/[^/]+/messages)$")  # what [qos] tenant_limits inflight counts


async def read_json(request: web.Request) -> object:
    """The body as JSON; 413 past the size limit, 400 when it does not parse."""
    raw = await request.read()  # aiohttp raises 413 beyond client_max_size
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError:
        raise bad_request("the body is nested too deeply", code="invalid_json") from None
    try:  # a "\ud800" escape parses to a lone surrogate, which the tokenizer and the store cannot take
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad_request("the body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
                          code="invalid_json") from None
    return body


def _as_api_error(e: Exception) -> ApiError | None:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestError):
        return bad_request(str(e), param=e.param)
    if isinstance(e, ChatTemplateError):
        return bad_request(f"the chat template refused the messages: {e}", param="messages")
    if isinstance(e, SessionNotFoundError):
        return ApiError(404, f"no session {e.args[0]!r}", code="session_not_found")
    if isinstance(e, SessionExistsError):
        return ApiError(409, f"this tenant already has a session {e.args[0]!r}", param="id", code="session_exists")
    if isinstance(e, StoreArgumentError):
        return bad_request(str(e))
    if isinstance(e, StoreUnavailableError):
        return unavailable(f"the session store is unavailable: {e}")
    if isinstance(e, EngineStoppedError):
        return unavailable(str(e))
    if isinstance(e, PinBudgetError):
        return ApiError(409, str(e), code="pin_budget_exceeded")
    if isinstance(e, PinError):
        return bad_request(str(e), param="prefix")
    if isinstance(e, OverloadedError):
        return unavailable(str(e), retry_after_s=e.retry_after_s)
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return ApiError(413, f"the request body is too large: {e.text}", code="request_too_large")
    if isinstance(e, web.HTTPException) and e.status >= 400:
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # a 405 must say what is allowed
        return ApiError(e.status, e.reason, type="invalid_request_error" if e.status < 500 else "server_error",
                        headers=allow)
    return None


@web.middleware
async def errors_middleware(request: web.Request, handler):
    state = request.app[STATE]
    try:
        response = await handler(request)
    except Exception as e:  # mapped once here: handlers raise, never format errors
        api = _as_api_error(e)
        if api is None:
            log.exception("unexpected error on %s %s", request.method, request.path)
            api = ApiError(500, "internal error; see the daemon's log", type="server_error", code="internal")
        response = api.response()
    if 400 <= response.status < 500:
        state.counters.errors_4xx += 1
    elif response.status >= 500:
        state.counters.errors_5xx += 1
    return response


@web.middleware
async def peer_middleware(request: web.Request, handler):
    """Who is asking (SO_PEERCRED), for which tenant; refuses new work while draining."""
    state = request.app[STATE]
    if state.draining:
        raise unavailable("kvtierd is shutting down", retry_after_s=10)
    sock = request.transport.get_extra_info("socket") if request.transport else None
    peer = peer_of(sock, state.settings.admin_group)
    tenant = peer.user
    named = request.headers.get(state.settings.tenant_header)
    if named is not None:
        if not peer.is_admin:
            raise forbidden(f"only root or the admin group may name a tenant in {state.settings.tenant_header}")
        if not TENANT_NAME.match(named):
            raise bad_request(f"{state.settings.tenant_header} must be 1-128 of A-Z a-z 0-9 . _ @ : -")
        tenant = named
    if request.path.startswith("/admin/") and not peer.is_admin:
        raise forbidden("admin routes answer only to root or the admin group")
    settings = state.settings
    misplaced = refusal(tenant, settings.instance, settings.placement, settings.tenants) \
        if request.path.startswith("/v1/") else None
    if misplaced is not None:
        raise misplaced
    request["peer"] = peer
    request["tenant"] = tenant
    state.in_flight += 1
    state.idle.clear()
    try:
        if request.method == "POST" and GENERATES.match(request.path):
            with state.tenant_inflight.admit(tenant, limits_of(state.settings.tenant_limits, tenant)):
                return await handler(request)
        return await handler(request)
    finally:
        state.in_flight -= 1
        if state.in_flight == 0:
            state.idle.set()
