"""Every refusal the HTTP API gives, in one shape and decided in one place.

Packages raise their own exception types, each derived from one kind in
``kvindex.events.errors``; :func:`status_of` maps the kind to a status code and the
handlers installed by :func:`install_error_handlers` answer ``{"error": code, "detail":
text}`` for them and for what FastAPI and Starlette raise themselves (unknown route,
wrong method, a missing query parameter), so a client parses one shape everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvindex.api.http.schemas import ErrorBody
from kvindex.events.errors import (
    ClientError,
    Forbidden,
    KvindexError,
    NotFound,
    RequestTimeout,
    TooLarge,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
)

log = logging.getLogger(__name__)

JSON = "application/json"
_encoder = msgspec.json.Encoder()

# Most specific first: NotFound, TooLarge, ... are ClientErrors too.
_STATUS: tuple[tuple[type[KvindexError], int], ...] = (
    (Unauthorized, 401),
    (Forbidden, 403),
    (NotFound, 404),
    (RequestTimeout, 408),
    (TooLarge, 413),
    (UnsupportedMediaType, 415),
    (ClientError, 400),
    (TooManyRequests, 429),
    (Unavailable, 503),
)

# What each status means to a client, for the OpenAPI document.
DESCRIPTIONS = {
    400: "Invalid request: the detail says which field and why",
    401: "Missing or wrong 'Authorization: Bearer <admin token>'",
    403: "Switched off: no admin token is configured (KVINDEX_ADMIN_TOKEN)",
    404: "Unknown pod, model or route (for /score: fall back to default balancing)",
    405: "Method not allowed on this path",
    408: "The request body arrived too slowly (--body-timeout)",
    413: "Body or list larger than the configured limit",
    415: "Content-Type is neither JSON nor (on /score and /route) application/octet-stream; "
    "a form-urlencoded or missing one is read as JSON",
    429: "Too many requests in flight (--max-in-flight); retry shortly",
    503: "Index backend unavailable, too slow (backend_timeout) or busy (backend_busy), "
    "or tokenizer unavailable; fall back to default balancing",
}


def status_of(exc: KvindexError) -> int:
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return 500


def error_body(code: str, detail: str) -> bytes:
    return _encoder.encode(ErrorBody(code, detail))


def refusal(exc: KvindexError, method: str, path: str) -> tuple[int, bytes]:
    """The status and body answering ``exc`` (a server-side one is logged): the one
    mapping the FastAPI handlers and ``api/http/hot_path.py`` share."""
    status = status_of(exc)
    if status >= 500:
        log.warning("%s %s: %s", method, path, exc.detail)
    return status, error_body(exc.code, exc.detail)


def error_response(
    status: int, code: str, detail: str, headers: dict[str, str] | None = None
) -> Response:
    return Response(error_body(code, detail), status_code=status, media_type=JSON, headers=headers)


def _http_code(status: int) -> str:
    """A stable code for Starlette's own HTTP errors: 404 not_found, 405 method_not_allowed."""
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "http_error"


def _validation_detail(errors: list[dict[str, Any]]) -> str:
    """FastAPI's validation errors as one sentence: 'query parameter model: Field required'."""
    parts = []
    for error in errors:
        where = [str(p) for p in error.get("loc", ())]
        place = f"{where[0]} parameter {'.'.join(where[1:])}" if len(where) > 1 else ".".join(where)
        parts.append(f"{place}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI, on_refusal: Callable[[Request, str], None]) -> None:
    """Answer every error in kvindex's shape; ``on_refusal(request, code)`` counts it."""

    @app.exception_handler(KvindexError)
    async def _kvindex_error(request: Request, exc: KvindexError) -> Response:
        on_refusal(request, exc.code)
        status, body = refusal(exc, request.method, request.url.path)
        return Response(body, status_code=status, media_type=JSON)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        on_refusal(request, "invalid_request")
        return error_response(400, "invalid_request", _validation_detail(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        code = _http_code(exc.status_code)
        on_refusal(request, code)
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path} (see /docs)"
        elif exc.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path}"
        else:
            detail = str(exc.detail)
        return error_response(exc.status_code, code, detail, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # A bug: log it with its traceback for us, give the client no traceback.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        on_refusal(request, "internal_error")
        return error_response(500, "internal_error", f"internal error ({type(exc).__name__})")


def error_responses(error_schema: dict[str, Any], *statuses: int) -> dict[str, Any]:
    """OpenAPI ``responses`` entries for the statuses a route really answers."""
    return {
        str(status): {
            "description": DESCRIPTIONS[status],
            "content": {JSON: {"schema": error_schema}},
        }
        for status in sorted(statuses)
    }


def drop_validation_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Remove FastAPI's generated 422 answers: kvindex answers 400 in its own shape."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    return schema


def decode_json(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """A JSON body decoded into its request type, every failure a 400 in kvindex's shape
    (``invalid_json`` for bytes that are not JSON or nest too deeply)."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ClientError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ClientError(f"body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ClientError("body is nested too deeply", code="invalid_json") from None
