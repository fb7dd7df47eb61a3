"""Guards in front of the routes: the request body size limit, 400s for invalid bodies, and
the checks a request passes against the loaded pipeline before it is queued.

Owns :class:`BodyLimitMiddleware` (a pure ASGI middleware, so it also works under streaming),
the translation of pydantic/FastAPI validation errors into one OpenAI-style message, the context
window check (:func:`fit_window`) and the method check (:func:`check_method`). Knows nothing about
generation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from verispec.engine import SpeculativeConfig
from verispec.errors import ContextLengthError, InvalidParameterError
from verispec.server.protocol import APIError
from verispec.server.schemas import ChatCompletionRequest, CompletionRequest

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class BodyLimitMiddleware:
    """Refuse request bodies above ``max_bytes`` with 413 (declared or streamed length).

    The body is read here in full (it is at most ``max_bytes``) and replayed to the app;
    later ``receive`` calls go to the server, so disconnects are still seen.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self._refuse(send)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = APIError(413, f"the request body exceeds {self.max_bytes} bytes", code="request_too_large").body()
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": data})


# OpenAI fields this server refuses, and why (the README's server section lists every field).
NOT_SUPPORTED = {
    "suffix": "insertion needs a fill-in-the-middle prompt format; send the whole prompt instead",
    "best_of": "use n and pick among the choices on the client",
    "audio": "text models only",
    "modalities": "text models only",
    "prediction": "predicted outputs are drafts: use speculative.method (ngram)",
    "web_search_options": "no web access",
    "functions": "deprecated by OpenAI: use tools",
    "function_call": "deprecated by OpenAI: use tool_choice",
}


# pydantic's bound errors, rewritten with the bound as written: a JSON number past 2**64 is read as
# a float, and pydantic then prints the seed limit 2**64 - 1 as 18446744073709552000
BOUNDS = {
    "less_than_equal": ("le", "less than or equal to"),
    "less_than": ("lt", "less than"),
    "greater_than_equal": ("ge", "greater than or equal to"),
    "greater_than": ("gt", "greater than"),
}


# what pydantic says of a body that is no JSON object: FastAPI hands a body that is not sent as JSON
# (``curl -d`` sends application/x-www-form-urlencoded) to the model as bytes or form fields
NOT_AN_OBJECT = ("model_attributes_type", "model_type", "dict_type")


def validation_error(errors: Sequence[dict[str, Any]], content_type: str | None = None) -> APIError:
    """One 400 from FastAPI's validation errors: the first error, named by its parameter.
    ``content_type``: the request's ``Content-Type`` header, so that a body sent as anything but
    JSON (FastAPI reads JSON only under ``application/json`` or ``*+json``) is told to send JSON."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    kind = first.get("type", "")
    if not loc and kind in NOT_AN_OBJECT and not _is_json(content_type):
        return APIError(
            400,
            "the body must be a JSON object sent with Content-Type: application/json; this request sent "
            f"Content-Type: {content_type} "
            "(curl -d sends form data: add -H 'Content-Type: application/json')",
        )
    if kind == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    if kind == "extra_forbidden":
        name = ".".join(loc)
        if name in NOT_SUPPORTED:
            return APIError(400, f"{name} is not supported by verispec: {NOT_SUPPORTED[name]}", param=param)
        return APIError(400, f"Unrecognized request argument supplied: {name}", param=param)
    if kind == "missing" and not loc:
        return APIError(400, "the request needs a JSON body")
    where = ".".join(_readable(loc)) or "body"
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    bound = BOUNDS.get(kind)
    if bound is not None and isinstance(first.get("ctx", {}).get(bound[0]), int):  # the exact integer, never a float
        message = f"Input should be {bound[1]} {first['ctx'][bound[0]]}"
    return APIError(400, f"{where}: {message}", param=param)


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this ``Content-Type`` as JSON (``application/json``, ``*+json``,
    or none given)."""
    if not content_type:
        return True
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _readable(loc: list[str]) -> list[str]:
    """Drop pydantic's union branch names (``str``, ``list[int]``...) from an error location."""
    return [
        part for part in loc if not (part in ("str", "int", "float", "bool") or part.startswith(("list[", "function-")))
    ]


def fit_window(
    pipeline,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    param: str,
) -> int:
    """The request's ``max_tokens`` inside the pipeline's context window (``--max-context``).

    Asked for (``max_tokens`` / ``max_completion_tokens``): a prompt plus it over the window is
    refused, as OpenAI and vLLM do, never cut at the window. Left to the default: lowered to the
    room the longest prompt leaves. Raises APIError 400 ``context_length_exceeded`` (``param``:
    ``prompt`` or ``messages``) with the prompt's tokens, max_tokens and the window
    (:meth:`verispec.engine.loader.SpeculativePipeline.check_window`).
    """
    asked = body.max_tokens is not None or (
        isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None
    )
    if not asked:
        max_tokens = max(1, min(max_tokens, pipeline.context_window - max(len(p) for p in prompts)))
    for prompt_ids in prompts:
        try:
            pipeline.check_window(len(prompt_ids), max_tokens)
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
    return max_tokens


def check_method(pipeline, prompt_ids: Sequence[int], spec: SpeculativeConfig) -> None:
    """Refuse, before queueing, a method the loaded drafters cannot run (its drafter not loaded,
    trees on a runner without them): APIError 400 naming ``speculative.method``."""
    try:
        pipeline.engine.check_request(prompt_ids, spec)
    except InvalidParameterError as exc:
        raise APIError(400, str(exc), param="speculative.method") from None
