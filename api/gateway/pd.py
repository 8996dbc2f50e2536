"""Disaggregated prefill: how a request ``/route`` split over a prefill and a decode pod
reaches them, in one of two modes that must not be mixed (the prompt would be
prefilled twice).

``kv-transfer`` (the default; vLLM's NixlConnector proxies): the gateway runs the prefill
leg itself (:func:`prefill_body`: one token, not streamed), and sends the client's body
to the decode pod with the ``kv_transfer_params`` the prefill pod answered, which say
where the KV blocks wait; both legs carry the same ``x-request-id``. (Checked against
vLLM's ``toy_proxy_server.py`` and llm-d's routing sidecar ``nixlv2`` connector.)
``sidecar`` (llm-d): the request goes unchanged to the decode pod's routing sidecar with
``x-prefiller-host-port: <prefill pod>``, and the sidecar runs the prefill leg. P/D never
fails a request: when the prefill leg fails, the decode pod gets the client's body
unchanged and prefills itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

from kvindex.api.gateway.pod_http import Header, PodBroken, PodConnections, PodUnreachable

log = logging.getLogger(__name__)

PREFILLER_HEADER = b"x-prefiller-host-port"
REQUEST_ID_HEADER = b"x-request-id"

# What vLLM's NixlConnector expects on the prefill leg (vLLM 0.9 to 0.33).
_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Not supported by a prefill-only request (vLLM's proxies drop them for that leg).
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
_MAX_PREFILL_ANSWER = 1 << 20

_decode = msgspec.json.Decoder(dict[str, Any])
_encode = msgspec.json.Encoder().encode


class PdMode(StrEnum):
    KV_TRANSFER = "kv-transfer"
    SIDECAR = "sidecar"


class PrefillOutcome(StrEnum):
    """How a P/D request's prefill went (the ``kvindex_gateway_prefill`` label)."""

    REMOTE = "remote"  # prefilled on the prefill pod; the decode pod pulls the KV
    SIDECAR = "sidecar"  # the decode pod's sidecar was told the prefill pod
    FAILED = "failed"  # the prefill leg failed: the decode pod prefills itself


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """What goes to the decode pod, and how the prefill went."""

    prefill_pod: str  # the pod the route chose to prefill on
    body: bytes
    headers: list[Header]
    outcome: PrefillOutcome
    prefill_seconds: float = 0.0  # time spent waiting on the prefill pod (pod time)


def prefill_body(request: dict[str, Any]) -> bytes:
    """The prefill leg's body: one token (``max_tokens``, and ``max_completion_tokens``
    when the body has it), not streamed, without the fields a prefill-only request
    refuses, asking the pod to keep the KV for a remote decode (``kv_transfer_params``)."""
    leg = {k: v for k, v in request.items() if k not in _NOT_FOR_PREFILL}
    leg["kv_transfer_params"] = _PREFILL_PARAMS
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return _encode(leg)


def decode_body(request: dict[str, Any], kv_transfer_params: Any) -> bytes:
    """The client's request with the prefill pod's ``kv_transfer_params``."""
    return _encode({**request, "kv_transfer_params": kv_transfer_params})


async def prepare_decode(
    mode: PdMode,
    pods: PodConnections,
    prefill_pod: str,
    path: str,
    body: bytes,
    headers: list[Header],
    request_id: str,
    *,
    prefill_extra: list[Header] | None = None,
) -> DecodeLeg:
    """The decode leg of a P/D request (running the prefill leg first in ``kv-transfer``
    mode, with ``prefill_extra`` headers added to it: its data-parallel rank). Never
    raises for the prefill pod's failures (unreachable, an error status, no
    ``kv_transfer_params``): the leg's outcome is then FAILED and the decode pod gets the
    client's body unchanged."""
    if mode is PdMode.SIDECAR:
        prefiller = (PREFILLER_HEADER, prefill_pod.encode("latin-1"))
        return DecodeLeg(prefill_pod, body, [*headers, prefiller], PrefillOutcome.SIDECAR)
    if not any(name == REQUEST_ID_HEADER for name, _ in headers):
        headers = [*headers, (REQUEST_ID_HEADER, request_id.encode("latin-1"))]
    try:
        request = _decode.decode(body)
    except msgspec.DecodeError:  # the gateway already read it; a pod would refuse it anyway
        return DecodeLeg(prefill_pod, body, headers, PrefillOutcome.FAILED)
    started = time.perf_counter()
    leg_headers = headers + prefill_extra if prefill_extra else headers
    params = await _prefill(pods, prefill_pod, path, prefill_body(request), leg_headers)
    spent = time.perf_counter() - started
    if params is None:
        return DecodeLeg(prefill_pod, body, headers, PrefillOutcome.FAILED, spent)
    leg = decode_body(request, params)
    return DecodeLeg(prefill_pod, leg, headers, PrefillOutcome.REMOTE, spent)


async def _prefill(
    pods: PodConnections, pod: str, path: str, body: bytes, headers: list[Header]
) -> Any:
    """The prefill pod's ``kv_transfer_params``, or None (logged) when there are none."""
    try:
        answer = await pods.send(pod, path, headers, body)
        try:
            size = 0
            pieces = []
            async for piece in answer.iter_body():
                size += len(piece)
                if size > _MAX_PREFILL_ANSWER:
                    raise PodBroken(f"{pod}: prefill answer over {_MAX_PREFILL_ANSWER} bytes")
                pieces.append(piece)
        finally:
            answer.close()
    except (PodUnreachable, PodBroken) as exc:
        log.warning("gateway: prefill on %s failed (%s); the decode pod prefills", pod, exc)
        return None
    if answer.status != 200:
        log.warning(
            "gateway: prefill on %s answered HTTP %d; the decode pod prefills", pod, answer.status
        )
        return None
    try:
        params = _decode.decode(b"".join(pieces)).get("kv_transfer_params")
    except msgspec.DecodeError:
        params = None
    if not params:
        log.warning(
            "gateway: prefill pod %s named no kv_transfer_params (is its vLLM started with "
            "--kv-transfer-config?); the decode pod prefills",
            pod,
        )
        return None
    return params
