"""Response bodies in the OpenAI wire format (chat, chat chunks, completions, logprobs)."""

from __future__ import annotations

from kvtierd.engine.request import TokenLogprob
from kvtierd.model.tokenizer import ChatTokenizer


def _token_entry(tok: ChatTokenizer, token_id: int, logprob: float) -> dict:
    text = tok.decode([token_id], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok: ChatTokenizer, logprobs: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {**_token_entry(tok, lp.token_id, lp.logprob), "top_logprobs": [_token_entry(tok, t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }


def completion_logprobs(tok: ChatTokenizer, logprobs: list[TokenLogprob], text_offset: int = 0) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for lp in logprobs:
        text = tok.decode([lp.token_id], skip_special_tokens=False)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({tok.decode([t], skip_special_tokens=False): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_completion(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                    logprobs: dict | None, usage: dict, kvtierd: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": usage,
        "kvtierd": kvtierd,
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, created: int, model: str, usage: dict, kvtierd: dict, obj: str) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage, "kvtierd": kvtierd}


def text_completion(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                    logprobs: dict | None, usage: dict | None, kvtierd: dict | None) -> dict:
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = usage
    if kvtierd is not None:
        body["kvtierd"] = kvtierd
    return body
