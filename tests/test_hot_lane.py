"""``kvindex serve``'s lane (api/http/hot_lane.py): /score, /route and /route/{id}/done answered
from the HTTP protocol, without ASGI, over the memory backend (answered inline).

Driven over real loopback sockets with raw bytes: what the lane must keep of the ASGI
path (the answer's bytes, limits, metrics) and what an HTTP/1.1 server owes its clients
(keep-alive and its timeout, pipelined answers in order, Connection: close, HTTP/1.0,
chunked bodies, Expect: 100-continue).
"""

from __future__ import annotations

import json
import re

from kvindex.events.ingest.testing import wait_until
from kvindex.indexer.backend import Change, Op, Tier
from tests.lane_server import (
    Answer,
    Served,
    closed_by_server,
    get,
    post,
    read_answer,
    serving,
)

M = "acme/model-7b"
A, B = "127.0.0.1:8000", "127.0.0.2:8000"
KEYS = [11, 12, 13, 14]
OCTET = "application/octet-stream"
SCORE = json.dumps({"model": M, "block_hashes": KEYS}).encode()


def _fill(served: Served) -> None:
    served.service.backend.apply(
        [
            Change(Op.STORE, A, M, Tier.GPU, KEYS[:3]),
            Change(Op.STORE, B, M, Tier.GPU, KEYS[:1]),
        ]
    )


def _exchange(served: Served, *requests: bytes) -> list[Answer]:
    """Send ``requests`` in one write on one connection; their answers, in order."""
    with served.connect() as sock:
        sock.sendall(b"".join(requests))
        buffer = bytearray()
        return [read_answer(sock, buffer) for _ in requests]


def _metric(served: Served, name: str, labels: dict[str, str]) -> float:
    return served.service.registry.get_sample_value(name, labels) or 0.0


def _without_date(head: bytes) -> bytes:
    return re.sub(rb"\r\ndate: [^\r]*", b"", head)


REQUESTS = [
    post("/score", SCORE),
    post("/score/", SCORE),
    post("/route", json.dumps({"model": M, "block_hashes": KEYS, "request_id": "r1"}).encode()),
    post("/route/r1/done", b""),
    post("/route/r1/done", b""),  # 404: already done
    post("/score", b'{"model": '),  # 400: not JSON
    post("/score", json.dumps({"model": "nope", "token_ids": [1, 2]}).encode()),  # 404
    post("/score", SCORE, content_type="text/plain"),  # 415
    post("/score?model=acme%2Fmodel-7b", b"\x01\x00\x00\x00" * 40, content_type=OCTET),
    get("/score"),  # 405, from the ASGI hot path
]  # fmt: skip


def test_the_lane_answers_byte_for_byte_as_the_asgi_path() -> None:
    answers = {}
    for lane in (True, False):
        with serving(lane=lane, model=M) as served:
            _fill(served)
            answers[lane] = _exchange(served, *REQUESTS)
    statuses = [a.status for a in answers[True]]
    assert statuses == [200, 200, 200, 200, 404, 400, 404, 415, 200, 405], answers[True]
    for with_lane, without in zip(answers[True], answers[False], strict=True):
        assert with_lane.body == without.body
        assert _without_date(with_lane.head) == _without_date(without.head)
    score = json.loads(answers[True][0].body)
    assert [(p["pod"], p["matched_blocks"]) for p in score["pods"]] == [(A, 3), (B, 1)]


def test_pipelined_requests_mixing_both_paths_are_answered_in_order() -> None:
    with serving(model=M) as served:
        _fill(served)
        answers = _exchange(
            served,
            post("/score", SCORE),
            get("/healthz"),  # ASGI: a task, while the next ones are already parsed
            post("/score", SCORE, content_type="text/plain"),
            get("/index/pods"),
            post("/route/nope/done", b""),
            post("/score", SCORE),
            get("/metrics"),
            post("/score", SCORE),
        )
    assert [a.status for a in answers] == [200, 200, 415, 200, 404, 200, 200, 200]
    assert json.loads(answers[1].body) == {"status": "ok"}
    assert "pods" in json.loads(answers[3].body)
    assert json.loads(answers[4].body)["error"] == "unknown_route"
    for i in (0, 5, 7):
        assert json.loads(answers[i].body)["prompt_blocks"] == 4


def test_connection_close_and_http_1_0_close_after_the_answer() -> None:
    with serving(model=M) as served:
        _fill(served)
        for request in (
            post("/score", SCORE, "Connection: close"),
            post("/score", SCORE).replace(b"HTTP/1.1", b"HTTP/1.0", 1),
        ):
            with served.connect() as sock:
                sock.sendall(request)
                buffer = bytearray()
                answer = read_answer(sock, buffer)
                assert answer.status == 200 and answer.headers["connection"] == "close"
                assert closed_by_server(sock, buffer) and not buffer


def test_keep_alive_holds_and_the_idle_connection_closes_at_its_timeout() -> None:
    with serving(model=M, keep_alive_s=1.0) as served:
        _fill(served)
        with served.connect() as sock:
            buffer = bytearray()
            for _ in range(3):  # one connection, one request after another
                sock.sendall(post("/score", SCORE))
                answer = read_answer(sock, buffer)
                assert answer.status == 200 and "connection" not in answer.headers
            assert closed_by_server(sock, buffer, timeout_s=10.0)


def test_a_chunked_body_is_read_whole() -> None:
    chunks = [SCORE[:7], SCORE[7:20], SCORE[20:]]
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    request = (
        b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + body
    )
    with serving(model=M) as served:
        _fill(served)
        with served.connect() as sock:
            buffer = bytearray()
            sock.sendall(request[:60])  # the headers, and the body, in pieces
            sock.sendall(request[60:90])
            sock.sendall(request[90:])
            answer = read_answer(sock, buffer)
    assert answer.status == 200, answer.body
    assert json.loads(answer.body)["prompt_blocks"] == 4


def test_expect_100_continue_gets_its_100_before_the_answer() -> None:
    head = post("/score", b"", "Expect: 100-continue").replace(b"Content-Length: 0", b"")
    head = head[: -len(b"\r\n\r\n")] + b"Content-Length: %d\r\n\r\n" % len(SCORE)
    with serving(model=M) as served:
        _fill(served)
        with served.connect() as sock:
            buffer = bytearray()
            sock.sendall(head)
            interim = read_answer(sock, buffer)
            assert interim.status == 100
            sock.sendall(SCORE)
            answer = read_answer(sock, buffer)
    assert answer.status == 200 and json.loads(answer.body)["prompt_blocks"] == 4


def test_a_declared_oversized_body_is_refused_unread_and_the_connection_closed() -> None:
    with serving(model=M, max_body_bytes=1000) as served:
        with served.connect() as sock:
            buffer = bytearray()
            sock.sendall(
                b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 5000\r\n\r\n{"
            )
            answer = read_answer(sock, buffer)
            assert answer.status == 413 and answer.headers["connection"] == "close"
            assert json.loads(answer.body)["error"] == "too_large"
            assert closed_by_server(sock, buffer)
        outcome = {"outcome": "too_large"}
        assert _metric(served, "kvindex_score_requests_total", outcome) == 1


def test_lane_answers_and_refusals_are_counted_as_before() -> None:
    with serving(model=M) as served:
        _fill(served)
        _exchange(
            served,
            post("/score", SCORE),
            post("/score", SCORE),
            post("/score", SCORE, content_type="text/plain"),
            post("/route/nope/done", b""),
        )
        score = "kvindex_score_requests_total"
        assert _metric(served, score, {"outcome": "ok"}) == 2
        assert _metric(served, score, {"outcome": "unsupported_media_type"}) == 1
        refused = {"code": "unknown_route"}
        assert _metric(served, "kvindex_http_refused_total", refused) == 1
        assert _metric(served, "kvindex_score_seconds_count", {}) == 2


def test_requests_past_max_in_flight_get_429_and_a_client_gone_frees_its_slot() -> None:
    with serving(model=M, max_in_flight=1) as served:
        _fill(served)
        waiting = served.connect()
        try:  # a request waiting for the rest of its body holds the only slot
            waiting.sendall(post("/score", SCORE)[:-5])
            answers = []
            for _ in range(50):  # until the server has read it; bounded
                answers = _exchange(served, post("/score", SCORE))
                if answers[0].status == 429:
                    break
            assert answers[0].status == 429, answers[0].body
            assert answers[0].headers["connection"] == "close"
            assert b"--max-in-flight" in answers[0].body
            assert _exchange(served, get("/healthz"))[0].status == 200  # probes are exempt
        finally:
            waiting.close()
        # Gone mid-body: its slot is free again.
        assert wait_until(lambda: _exchange(served, post("/score", SCORE))[0].status == 200, 10.0)


def test_a_refused_body_that_never_ends_is_cut_off_at_the_body_deadline() -> None:
    with serving(model=M, body_timeout=1.0) as served:
        with served.connect() as sock:
            buffer = bytearray()
            sock.sendall(post("/score", SCORE, content_type="text/plain")[:-10])
            answer = read_answer(sock, buffer)  # 415 before the body: it is skipped
            assert answer.status == 415 and "connection" not in answer.headers
            assert closed_by_server(sock, buffer, timeout_s=15.0)
        with served.connect() as sock:  # and a body that never ends gets its 408
            buffer = bytearray()
            sock.sendall(post("/score", SCORE)[:-10])
            answer = read_answer(sock, buffer, timeout_s=15.0)
            assert answer.status == 408 and answer.headers["connection"] == "close"
            assert b"--body-timeout" in answer.body
            assert closed_by_server(sock, buffer)


def test_headers_past_the_cap_get_431_and_the_connection_closed() -> None:
    big = "X-Filler: " + "a" * 70_000  # past the 64 KiB cap of request line and headers
    with serving(model=M) as served:
        _fill(served)
        for request in (post("/score", SCORE, big), get("/healthz", big)):
            for pieces in (1, 8):  # in one read, and growing over several
                with served.connect() as sock:
                    step = -(-len(request) // pieces)
                    try:
                        for i in range(0, len(request), step):
                            sock.sendall(request[i : i + step])
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # refused while it was still sending
                    buffer = bytearray()
                    answer = read_answer(sock, buffer)
                    assert answer.status == 431, request[:40]
                    assert closed_by_server(sock, buffer)
        assert _exchange(served, post("/score", SCORE))[0].status == 200
