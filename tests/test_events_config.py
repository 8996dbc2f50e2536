"""Subscriber settings and the rate-limited log."""

from __future__ import annotations

import logging

import msgspec
import pytest

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.ratelog import RateLimitedLog


def test_config_defaults_and_decoding() -> None:
    config = SubscriberConfig()
    assert config.topic_filter == "kv@" and config.queue_capacity == 32_768
    assert config.max_payload_bytes == 16 * 1024 * 1024 and config.replay_port is None
    decoded = msgspec.json.decode(
        b'{"replay_port": 5558, "default_model": "m"}', type=SubscriberConfig
    )
    assert decoded.replay_port == 5558 and decoded.default_model == "m"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"replay_prot": 5558}', type=SubscriberConfig)


@pytest.mark.parametrize(
    "bad",
    [
        {"queue_capacity": 0},
        {"replay_timeout_s": 0},
        {"batches_per_turn": -1},
        {"replay_port": 70000},
        {"forget_quiet_s": -1},
        {"stream_idle_s": 0},
        {"stream_evict_idle_s": -1},
    ],
)
def test_config_rejects_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError):
        SubscriberConfig(**bad)


def test_rate_limited_log(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("t"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        for _ in range(5):
            log.warning("bad_topic", "bad topic %s", "x")
        log.warning("other", "another kind")
        now[0] = 10.0
        log.warning("bad_topic", "bad topic %s", "y")
    assert [r.getMessage() for r in caplog.records] == [
        "bad topic x",
        "another kind",
        "bad topic y (4 similar messages suppressed)",
    ]
