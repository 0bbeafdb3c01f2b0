"""The OpenAPI document served at /openapi.json (a test checks it covers every route)."""

from __future__ import annotations

from aiohttp import web

from kvtierd import __version__

routes = web.RouteTableDef()

_ERROR = {"description": "an OpenAI-shaped error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_JSON = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "description": "kvtierd extension; 0 is off"},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "n": {"type": "integer", "enum": [1]},
    "user": {"type": "string"},
    "frequency_penalty": {"type": "number", "enum": [0]},
    "presence_penalty": {"type": "number", "enum": [0]},
    "priority": {"type": "string", "enum": ["high", "normal", "low"], "description": "kvtierd extension"},
    "prefix_tag": {"type": "string", "pattern": "^[A-Za-z0-9._:@/-]{1,128}$",
                   "description": "kvtierd extension: marks the prompt's cached pages (e.g. doc:v3) for invalidation"},
    "retention": {"type": "object", "additionalProperties": False, "required": ["priority", "duration_s"],
                  "properties": {"priority": {"type": "integer", "minimum": 1, "maximum": 10},
                                 "duration_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400}},
                  "description": "kvtierd extension: soft retention, keeps the prompt's cached pages ahead of the "
                                 "tenant's ordinary ones in eviction for duration_s (a hint, not a pin)"},
}
_TAG = {"type": "string", "pattern": "^[A-Za-z0-9._:@/-]{1,128}$"}
_PREFIX = {"text": {"type": "string"}, "messages": {"type": "array"},
           "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}}}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}}


def _body(properties: dict, required: list[str], optional: bool = False) -> dict:
    """A JSON object body; `optional`: the request may come without one (all its fields have defaults)."""
    schema = {"type": "object", "additionalProperties": False, "properties": properties, "required": required}
    return {"required": not optional, "content": {"application/json": {"schema": schema}}}


def _op(summary: str, body: dict | None = None, errors: tuple[int, ...] = (400,)) -> dict:
    op: dict = {"summary": summary, "responses": {"200": _JSON, **{str(e): _ERROR for e in errors}}}
    if body is not None:
        op["requestBody"] = body
    return op


_SESSION_ID = [{"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}]
# schemas.SESSION_ID; null is taken as absent (schemas._typed), as for every optional field the server reads
_CHOSEN_ID = {"type": ["string", "null"], "pattern": "^[A-Za-z0-9._:-]{1,128}$"}
_OWNER = [{"name": "tenant", "in": "query", "schema": {"type": "string"},
           "description": "the session's tenant, needed when several tenants have a session with this id"}]
_LIMIT = [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}]

DOCUMENT = {
    "openapi": "3.1.0",
    "info": {"title": "kvtierd", "version": __version__,
             "description": "OpenAI-compatible chat over a Unix socket, a chat-session store, and admin routes."},
    "paths": {
        "/v1/chat/completions": {"post": _op("Chat completion (SSE when stream is true)", _body(
            {"model": {"type": "string"}, "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
             "session_id": {**_CHOSEN_ID, "description": "kvtierd extension: bind to a stored session (an unknown id "
                            "is created on first use, with the request's system message, unless [sessions] "
                            "create_on_first_use is off: then 404)"},
             **_SAMPLING}, ["messages"]), (400, 404, 413, 503))},
        "/v1/completions": {"post": _op("Text completion from text or token ids", _body(
            {"model": {"type": "string"}, "echo": {"type": "boolean", "enum": [False]},
             "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
             **_SAMPLING, "logprobs": {"oneOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 20}],
                                       "description": "a count, as in the legacy API: that many top alternatives"}},
            ["prompt"]), (400, 404, 413, 503))},
        "/v1/models": {"get": _op("The served model", errors=())},
        "/v1/sessions": {
            "post": _op("Create a chat session", _body(
                {"id": {**_CHOSEN_ID, "description": "the client's own id for it (default: a new random one); 409 "
                        "when this tenant has it already"},
                 "system_prompt": {"type": ["string", "null"]}, "title": {"type": ["string", "null"]},
                 "priority": {"type": ["string", "null"], "enum": ["high", "normal", "low", None]}}, [],
                optional=True), (400, 409)),
            "get": {**_op("This tenant's sessions"), "parameters": _LIMIT},
        },
        "/v1/sessions/{session_id}": {
            "get": {**_op("A session with its messages", errors=(404,)), "parameters": _SESSION_ID},
            "delete": {**_op("Delete a session and its cached KV", errors=(404,)), "parameters": _SESSION_ID},
        },
        "/v1/sessions/{session_id}/messages": {"post": {**_op("Append a user message and get the reply", _body(
            {"content": {"type": "string", "minLength": 1}, **_SAMPLING}, ["content"]), (400, 404, 503)),
            "parameters": _SESSION_ID}},
        "/healthz": {"get": _op("Liveness and readiness", errors=(503,))},
        "/openapi.json": {"get": _op("This document", errors=())},
        "/metrics": {"get": {"summary": "Prometheus metrics (text format); open to every peer, like /healthz",
                             "responses": {"200": {"description": "OK", "content": {"text/plain": {
                                 "schema": {"type": "string"}}}}, "503": _ERROR}}},
        "/admin/status": {"get": _op("Daemon, model and engine state", errors=(403,))},
        "/admin/tiers": {"get": _op("Per-tier capacity, use and hit rate", errors=(403,))},
        "/admin/compact": {"post": _op("Move live KV pages together between two steps: free pages in one run, "
                                       "each sequence's pages in order. Returns pages moved, ms and fragmentation "
                                       "before and after", errors=(403,))},
        "/admin/stats": {"get": _op("Request and token counters", errors=(403,))},
        "/admin/workload": {"get": _op("Recorded workload (prompt, session and idle-gap distributions, cache hits by "
                                       "source and tier, page demand per class, page fit per block size) and the "
                                       "cache configuration: what kvtierctl advise reads", errors=(403,))},
        "/admin/prefixes": {
            "get": {**_op("Cached prefixes: each chain's last page, most hit first", errors=(403,)),
                    "parameters": _LIMIT + [{"name": "tenant", "in": "query", "schema": {"type": "string"},
                                             "description": "only this tenant's (\"public\": the public namespace)"}]},
            "post": {**_op("Publish a prefix to the public namespace, which every tenant may hit", errors=(400, 403, 503)),
                     "requestBody": _body({**_PREFIX, "tag": _TAG}, [])},
        },
        "/admin/invalidate": {"post": {
            **_op("Invalidate cached KV: one of session_id, prefix (in tenant's namespace), hash, tag, tenant, model",
                  errors=(400, 403, 404)),
            "requestBody": _body({"session_id": {"type": "string"}, "prefix": {"type": "object", "properties": _PREFIX},
                                  "hash": {"type": "string", "pattern": "^[0-9a-f]+$"}, "tag": _TAG,
                                  "tenant": {"type": "string"}, "model": {"type": "string"}}, [])}},
        "/admin/pins": {
            "get": _op("Pins (prefixes and sessions kept in a tier) and the pin budget of each tier", errors=(403,)),
            "post": {**_op("Pin a session or a prefix (in tenant's namespace or \"public\") on the device, the host "
                           "or the disk tier, for ttl_s or until unpinned", errors=(400, 403, 404, 409, 503)),
                     "requestBody": _body({**_PREFIX, "session_id": {"type": "string"}, "tenant": {"type": "string"},
                                           "ttl_s": {"type": "number", "exclusiveMinimum": 0,
                                                     "maximum": 315360000},
                                           "tier": {"type": "string", "enum": ["device", "host", "disk"]}}, [])},
        },
        "/admin/pins/{pin_id}": {"delete": {**_op("Unpin", errors=(403, 404)), "parameters": [
            {"name": "pin_id", "in": "path", "required": True, "schema": {"type": "string"}}]}},
        "/admin/sessions": {"get": {**_op("Sessions of every tenant", errors=(403,)), "parameters": _LIMIT + [
            {"name": "tenant", "in": "query", "schema": {"type": "string"}}]}},
        "/admin/sessions/{session_id}": {
            "get": {**_op("Any session with its messages", errors=(403, 404, 409)), "parameters": _SESSION_ID + _OWNER},
            "delete": {**_op("Delete any session and its cached KV", errors=(403, 404, 409)),
                       "parameters": _SESSION_ID + _OWNER},
        },
    },
    "components": {"schemas": {"Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}}},
}


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(DOCUMENT)
