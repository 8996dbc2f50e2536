"""Errors in OpenAI's shape, the gateway's own and the pods' retold.

OpenAI clients parse ``{"error": {"message", "type", "param", "code"}}`` (vLLM's
OpenAI server answers its errors that way too), and raise by status
(``openai.InternalServerError`` for a 500). The gateway's own refusals are built here,
and so is what the client sees of a pod's error: the pod's status, and a body the
gateway wrote, never the pod's bytes. A pod's 5xx body can hold anything (a traceback,
an internal address, a proxy's HTML page); only a 4xx in vLLM's error shape keeps its
message and type, which tell the client what was wrong with its request (a prompt over
the context length). The pod's raw body is logged at debug level, shortened.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Any)

# A pod's error body is read up to this (an error is a line of JSON) and logged shorter.
MAX_POD_ERROR_BYTES = 65_536
_LOGGED_BYTES = 1_024
_MAX_MESSAGE_CHARS = 2_000
_MAX_TYPE_CHARS = 100


def openai_error_body(status: int, kind: str, message: str, param: str | None = None) -> bytes:
    """The OpenAI error body: ``kind`` is the error's ``type``, ``status`` its ``code``."""
    return _encode({"error": {"message": message, "type": kind, "param": param, "code": status}})


def is_openai_path(path: str) -> bool:
    """A path under /v1: the gateway's, answered in OpenAI's shape in every mode."""
    return path == "/v1" or path.startswith("/v1/")


def pod_error_body(pod: str, status: int, raw: bytes) -> bytes:
    """What the client gets for a pod's error answer (``status`` >= 400, ``raw`` its body,
    possibly cut short): an OpenAI error under the pod's status."""
    log.debug("gateway: %s answered HTTP %d: %r", pod, status, raw[:_LOGGED_BYTES])
    if 400 <= status < 500:
        told = _vllm_error(raw)
        if told is not None:
            return openai_error_body(status, *told)
        refused = f"the pod refused the request (HTTP {status})"
        return openai_error_body(status, "pod_error", refused)
    return openai_error_body(
        status, "pod_error", f"the pod {pod} failed the request (HTTP {status}); see its logs"
    )


def _vllm_error(raw: bytes) -> tuple[str, str, str | None] | None:
    """(type, message, param) of an error in vLLM's shape: ``{"error": {...}}`` (vLLM
    0.10 on), or the same fields at the top with ``"object": "error"`` (before); None
    for anything else."""
    try:
        body = _decode.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    error = body.get("error") if "error" in body else body
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    kind, param = error.get("type"), error.get("param")
    return (
        kind[:_MAX_TYPE_CHARS] if isinstance(kind, str) and kind else "pod_error",
        error["message"][:_MAX_MESSAGE_CHARS],
        param[:_MAX_TYPE_CHARS] if isinstance(param, str) else None,
    )
