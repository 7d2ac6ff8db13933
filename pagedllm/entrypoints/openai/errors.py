"""OpenAI-shaped errors: every failure is ``{"error": {"message", "type", "param", "code"}}``.

Request problems are raised as :class:`APIError` anywhere in the serving code and turned into a
JSON response by one exception handler, so no route builds error bodies by hand.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai.sse import sse_event

logger = logging.getLogger(__name__)

# Engine-side field names that the API knows under another name.
_PARAM_ALIASES = {"prompt_token_ids": "prompt", "request_id": None, "sampling_params": None}


class APIError(Exception):
    """A request the server refuses; ``status`` is the HTTP status code."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse_event(self) -> bytes:
        """The error as one server-sent event, for failures after a stream has begun."""
        return sse_event(self.body())


def from_value_error(
    exc: ValueError, *, default_param: str | None = None, aliases: dict[str, str] | None = None
) -> APIError:
    """Map the engine's ``ValueError("field: message")`` to a 400 naming that field."""
    text = str(exc)
    field, sep, _ = text.partition(": ")
    if sep and field.isidentifier():
        names = {**_PARAM_ALIASES, **(aliases or {})}
        param = names.get(field, field)
        return APIError(text, param=param if param is not None else default_param)
    return APIError(text, param=default_param)


def model_not_found(name: str | None, served: list[str]) -> APIError:
    return APIError(
        f"The model '{name}' does not exist; this server serves {served}",
        status=404,
        param="model",
        code="model_not_found",
    )


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A pydantic failure: malformed JSON, a missing field or a value of the wrong type."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(f"malformed JSON body: {first.get('msg', '')}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    if kind == "missing":
        return APIError(
            f"missing required field '{where}'", param=param, code="missing_required_field"
        )
    if kind in ("model_type", "dict_type") and not loc:
        return APIError("the request body must be a JSON object", code="invalid_json")
    message = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg"))
    return APIError(message, param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to an OpenAI-shaped JSON error."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        if status == 404:
            message = f"no route {request.method} {request.url.path}"
        err = APIError(message, status=status, type=kind, code=HTTPStatus(status).name.lower())
        return JSONResponse(err.body(), status_code=status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        err = APIError(
            f"internal server error: {type(exc).__name__}: {exc}",
            status=500,
            type="internal_server_error",
        )
        return err.response()
