"""Subscriber settings: one typed struct, decodable from the service's config file."""

from __future__ import annotations

import msgspec

from kvindex.events.ingest.admission import Allowlist


class SubscriberConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the subscriber listens, buffers, recovers and reports.

    Defaults suit a cluster of up to a few hundred engines on vLLM's default settings.
    """

    #: Bind mode subscribes to this topic prefix; topics must be ``kv@<pod>@<model>``.
    #: Connect mode subscribes to everything (vLLM's default topic is ``""``).
    topic_filter: str = "kv@"
    #: Messages waiting per stream (pod and DP rank). When full, the newest message is
    #: dropped and counted; the gap it leaves is recovered by replay, but only from the
    #: engine's last ``buffer_steps`` batches (10,000 by default), so a burst past both is
    #: lost. Sized to hold a burst of small batches (``bench_ingest.py --stream-queue``
    #: measures it); it costs memory only while a stream is behind.
    queue_capacity: int = 32_768
    #: Bytes the messages waiting in every stream's queue may hold together (payloads,
    #: what was read from them, about 640 bytes each besides). Past it, a stream holding
    #: more than its share (the budget over the streams with messages waiting) has its
    #: newest message dropped and counted (``queue_overflow``), as when its queue is full.
    #: 0: a quarter of the memory the process may use (its cgroup's limit, else the
    #: machine's), so a burst is kept while it fits in memory and never past it.
    queue_bytes: int = 0
    #: Payloads above this are skipped and counted (ZMQ's own hard cap is 256 MiB).
    max_payload_bytes: int = 16 * 1024 * 1024
    #: Bind mode: the engines' replay port (``replay_endpoint`` of ``--kv-events-config``)
    #: for rank 0; rank r uses ``replay_port + r``. None or 0: no replay in bind mode.
    replay_port: int | None = None
    #: Total time one replay fetch may take before the gap is declared unrecoverable.
    replay_timeout_s: float = 2.0
    #: Most batches one replay fetch accepts (vLLM buffers 10,000 by default).
    replay_max_batches: int = 20_000
    #: Replays run on this many worker threads, so one dead endpoint delays no other pod.
    replay_workers: int = 4
    #: On the first message of a stream with seq > 0, fetch seq 0.. by replay first.
    catch_up_on_first_contact: bool = True
    #: Serving port for pod addresses that carry none (topics, connect endpoints).
    default_serving_port: int | None = None
    #: Model for connect-mode messages whose topic and PodEndpoint name none.
    default_model: str | None = None
    #: Most batches the applier takes from one stream before turning to the next.
    batches_per_turn: int = 64
    #: ZMQ receive high-water mark per SUB socket (vLLM's PUB default is 100,000).
    receive_hwm: int = 100_000
    #: Most streams tracked at once. When the table is full a new stream takes the place
    #: of the least recently active unpinned one (its pod neither configured nor
    #: discovered) that never delivered a batch or was silent ``stream_evict_idle_s``;
    #: if there is none, the new stream's messages are skipped (``too_many_streams``).
    max_streams: int = 4096
    #: Unpinned streams silent this long are evicted and their pod forgotten (entries
    #: reset); a configured or discovered pod keeps its stream however long it idles.
    stream_idle_s: float = 3600.0
    #: How long a stream must have been silent before a new one may push it out of a
    #: full table.
    stream_evict_idle_s: float = 10.0
    #: A stream silent this long has its position verified (a replay of the last
    #: applied seq, whose digest must match) before its next batch applies: a restart
    #: during the silence may have left seqs that happen to continue the old ones.
    verify_after_silence_s: float = 10.0
    #: After ZMQ (re)connects a known pod (either topology), its streams prove their
    #: position this long later even when no batch comes to trigger it: a new
    #: incarnation may have published everything before the subscription reached it
    #: (ZMQ's slow joiner drops those batches at the publisher; only its replay buffer
    #: has them), and an idle stream must not read ``live`` on the old engine's blocks.
    verify_after_reconnect_s: float = 0.5
    #: First and longest wait before retrying a stream whose sink delivery failed.
    retry_initial_s: float = 0.5
    retry_max_s: float = 10.0
    #: After forget_pod, messages from that pod are ignored this long, so stragglers of
    #: a deleted pod cannot re-create its entries.
    forget_quiet_s: float = 2.0
    #: Each kind of bad-input log line is written at most once per interval.
    log_interval_s: float = 10.0
    #: Bind mode: pods whose topic may come from any sender address (pod ids, or CIDR
    #: networks of pod hosts); every other pod must send from its own host
    #: (:mod:`kvindex.events.ingest.admission`).
    bind_allow: tuple[str, ...] = ()
    #: Pods the operator configured (normalised ids). With these or ``bind_allow`` set
    #: and no discovery, bind mode accepts only these pods and the allowlisted ones.
    pods: tuple[str, ...] = ()
    #: Models the operator configured: always indexed, never counted in ``max_models``.
    models: tuple[str, ...] = ()
    #: Most other model names events may bring into the index; messages naming one more
    #: are skipped (``model_cap``). A cluster serves a handful of models, a few dozen with
    #: many fine-tunes; 256 leaves room for that and stops a sender inventing names
    #: from growing the index and every answer that lists models without limit.
    max_models: int = 256
    #: Models with SGLang pods (alone or beside vLLM ones): their events are decoded by
    #: :mod:`kvindex.events.wire.sglang` (signed hashes, SGLang's media and salt fields).
    sglang_models: tuple[str, ...] = ()
    #: Bind mode: most streams (pod, rank) one sender address may open; one node rarely
    #: runs more than a few dozen engines, a flood of fake pods stops here.
    max_streams_per_sender: int = 64

    def __post_init__(self) -> None:
        positive = {
            "queue_capacity": self.queue_capacity,
            "max_payload_bytes": self.max_payload_bytes,
            "replay_timeout_s": self.replay_timeout_s,
            "replay_max_batches": self.replay_max_batches,
            "replay_workers": self.replay_workers,
            "batches_per_turn": self.batches_per_turn,
            "receive_hwm": self.receive_hwm,
            "max_streams": self.max_streams,
            "stream_idle_s": self.stream_idle_s,
            "verify_after_silence_s": self.verify_after_silence_s,
            "verify_after_reconnect_s": self.verify_after_reconnect_s,
            "retry_initial_s": self.retry_initial_s,
            "retry_max_s": self.retry_max_s,
            "max_streams_per_sender": self.max_streams_per_sender,
            "max_models": self.max_models,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"SubscriberConfig.{name} must be > 0, got {value}")
        if self.replay_port is not None and not 0 <= self.replay_port < 65536:
            raise ValueError(f"SubscriberConfig.replay_port {self.replay_port} is not a port")
        if self.queue_bytes < 0:
            raise ValueError("SubscriberConfig.queue_bytes must be >= 0 (0: from memory)")
        if self.stream_evict_idle_s < 0:
            raise ValueError("SubscriberConfig.stream_evict_idle_s must be >= 0")
        if self.forget_quiet_s < 0:
            raise ValueError("SubscriberConfig.forget_quiet_s must be >= 0")
        Allowlist.parse(self.bind_allow, self.default_serving_port)  # raises on a bad entry
