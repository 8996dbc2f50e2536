"""The kinds of failure every kvindex package shares, so one place can answer them.

Each package keeps its own exception types (IdentityError, KeyConfigError,
BackendUnavailable, ...) but derives them from one of the few kinds below. The HTTP
layer maps a *kind* to a status code in a single handler; it never needs to know every
concrete class, and a new error type is answered correctly as soon as it picks its kind.
``code`` is the stable, machine-readable name clients see in ``{"error": code}``.

This module sits in ``events/`` only because that is the bottom of the dependency
chain (api -> scoring -> indexer -> events): every package can import it.
"""

from __future__ import annotations


class KvindexError(Exception):
    """Base of every error kvindex raises on purpose; ``code`` names it for clients."""

    code = "internal_error"

    def __init__(self, detail: str = "", *, code: str | None = None) -> None:
        super().__init__(detail)
        if code is not None:
            self.code = code

    @property
    def detail(self) -> str:
        return str(self.args[0]) if self.args else self.code


class ClientError(KvindexError, ValueError):
    """The request (or input) is wrong; asking again unchanged fails again."""

    code = "invalid_request"


class Unauthorized(ClientError):
    """No or wrong credentials for an operation that needs them."""

    code = "unauthorized"


class Forbidden(ClientError):
    """The operation is switched off by configuration."""

    code = "forbidden"


class NotFound(ClientError, LookupError):
    """The thing asked about does not exist (yet)."""

    code = "not_found"


class TooLarge(ClientError):
    """The request is larger than a configured limit."""

    code = "too_large"


class UnsupportedMediaType(ClientError):
    """The body is not in a format the endpoint reads."""

    code = "unsupported_media_type"


class RequestTimeout(ClientError):
    """The client sent its request too slowly."""

    code = "request_timeout"


class TooManyRequests(KvindexError):
    """A capacity limit is reached; retry later."""

    code = "too_many_requests"


class Unavailable(KvindexError):
    """A dependency (index backend, tokenizer) cannot answer now; retry or fall back."""

    code = "unavailable"
