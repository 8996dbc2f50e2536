"""The lane (api/http/hot_lane.py) over the Redis backend: the index work is awaited on its
threads (``--backend-deadline``, ``--backend-max-in-flight``), so a lane answer is a task
of its own and pipelined answers must still leave in request order. Real Redis: the
shared server, and a hung one (a loopback server that never answers), as in
tests/test_redis_event_loop.py.
"""

from __future__ import annotations

import json
import uuid

import pytest

from kvindex.api.testing import free_port
from kvindex.events.ingest.testing import wait_until
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.redis.backend import RedisBackend
from tests.lane_server import closed_by_server, get, post, read_answer, serving
from tests.redis_fixtures import REDIS_URL, delete_prefix, shared_redis
from tests.test_redis_event_loop import HungServer

M = "acme/model-7b"
POD = "127.0.0.1:8000"
KEYS = [11, 12, 13, 14]
SCORE = json.dumps({"model": M, "block_hashes": KEYS}).encode()


@pytest.fixture
def redis_prefix() -> str:
    client = shared_redis()
    prefix = f"kvtest-{uuid.uuid4().hex[:12]}"
    backend = RedisBackend.from_url(REDIS_URL, prefix=prefix)
    try:
        backend.apply([Change(Op.STORE, POD, M, Tier.GPU, KEYS[:3])])
        yield prefix
    finally:
        backend.close()
        delete_prefix(client, prefix)
        client.close()


def test_awaited_answers_leave_in_request_order(redis_prefix: str) -> None:
    mixes = [
        [  # an ASGI request first: the lane requests behind it wait their turn
            get("/healthz"),
            post("/score", SCORE),
            get("/index/pods"),  # an ASGI request behind an awaited lane answer
            post("/score", SCORE),
            post("/score", SCORE, content_type="text/plain"),
            post("/score", SCORE),
            post("/route/nope/done", b""),
            post("/score", SCORE),
        ],
        [  # a lane request first: the ASGI requests behind it wait theirs
            post("/score", SCORE),
            get("/healthz"),
            post("/score", SCORE),
            get("/index/pods"),
            get("/healthz"),
            post("/score", SCORE),
        ],
    ]
    with serving(model=M, backend=REDIS_URL, redis_prefix=redis_prefix) as served:
        assert not served.service.index_work.inline
        for requests in mixes * 2:  # each mix twice, each time on a new connection
            with served.connect() as sock:
                sock.sendall(b"".join(requests))
                buffer = bytearray()
                answers = [read_answer(sock, buffer) for _ in requests]
            for request, answer in zip(requests, answers, strict=True):
                body = json.loads(answer.body)
                if request.startswith(b"GET /healthz"):
                    assert body == {"status": "ok"}
                elif request.startswith(b"GET /index/pods"):
                    assert [p["pod"] for p in body["pods"]] == [POD]
                elif b"/done" in request:
                    assert answer.status == 404 and body["error"] == "unknown_route"
                elif b"text/plain" in request:
                    assert answer.status == 415
                else:
                    assert answer.status == 200, body
                    assert [(p["pod"], p["matched_blocks"]) for p in body["pods"]] == [(POD, 3)]
        assert served.service.index_work.in_flight == 0


def test_a_stuck_lookup_gets_503_at_its_deadline_while_healthz_answers() -> None:
    port = free_port()
    backend = f"redis://127.0.0.1:{port}/0?cluster=no&timeout=60"
    flags = {"backend_deadline": 0.3, "backend_max_in_flight": 2}
    with serving(model=M, backend=backend, **flags) as served:
        hung = HungServer(port)
        try:
            stuck = served.connect(timeout_s=20)
            buffer = bytearray()
            stuck.sendall(post("/score", SCORE, "Connection: close"))
            with served.connect() as probe:  # meanwhile, on another connection
                probe.sendall(get("/healthz"))
                assert read_answer(probe, bytearray()).status == 200
            answer = read_answer(stuck, buffer, timeout_s=20)
            assert answer.status == 503 and json.loads(answer.body)["error"] == "backend_timeout"
            assert closed_by_server(stuck, buffer)
            stuck.close()
            # One more stuck past its deadline fills the cap of two: then refused at once.
            with served.connect(timeout_s=20) as sock:
                sock.sendall(post("/score", SCORE) * 2)
                buffer = bytearray()
                errors = [json.loads(read_answer(sock, buffer, 20).body)["error"] for _ in "ab"]
            assert errors == ["backend_timeout", "backend_busy"]
        finally:
            hung.close()  # the stuck calls fail now
        assert wait_until(lambda: served.service.index_work.in_flight == 0, 10.0)
