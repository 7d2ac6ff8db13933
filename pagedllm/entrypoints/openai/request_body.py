"""Reading a request before any handler runs: its API key, its content type, its JSON body.

The body is read in chunks up to the server's limit and parsed off the event loop when large, so
neither a huge body nor a slow parse holds up the other connections.
"""

from __future__ import annotations

import hmac
from typing import Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pagedllm.entrypoints.openai.errors import APIError, from_validation_error
from pagedllm.entrypoints.openai.offload import Offloader

B = TypeVar("B", bound=BaseModel)


def is_json_content_type(value: str | None) -> bool:
    """``application/json`` or ``application/<x>+json``, parameters (charset) allowed."""
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


_PARSE_IN_POOL_BYTES = 1 << 20  # bodies this large are parsed off the event loop


async def read_body(
    request: Request, model: type[B], limit: int, offload: Offloader | None = None
) -> B:
    """Parse the JSON body into ``model``; 413 past ``limit`` bytes, 400 when it is invalid.

    Only a JSON content type is read (415 otherwise): a web page on another origin can send
    text/plain, form or multipart bodies without a CORS preflight, never application/json.
    """
    if not is_json_content_type(request.headers.get("content-type")):
        raise APIError(
            "request bodies must be JSON, sent with 'Content-Type: application/json'",
            status=415,
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length")
    too_big = APIError(
        f"request body larger than {limit} bytes", status=413, code="request_too_large"
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError("client disconnected", status=499, code="client_closed_request") from None
    body = b"".join(chunks)
    try:
        if offload is not None and size >= _PARSE_IN_POOL_BYTES:
            return await offload.run(model.model_validate_json, body)
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def auth_dependency(api_key: str | None) -> Any:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                status=401,
                type="authentication_error",
                code="invalid_api_key",
            )

    return Depends(check)
