"""The operator routes' answers (``/index/pods``, ``/index/pods/{pod}``, its blocks, the
probes) as msgspec types, for the OpenAPI document.

The pod directory (``indexer/pods.py``) builds these answers as plain dicts, being
below ``api/`` in the data path; these types are their contract. ``forbid_unknown_fields``
is there for the tests, which decode real answers with them: a field added to an answer
without a description here fails a test instead of going undocumented.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class _Schema(msgspec.Struct, forbid_unknown_fields=True):
    pass


class TierBlocks(_Schema):
    """Blocks held, by tier."""

    gpu: Annotated[int, _doc("Blocks in GPU memory.")]
    cpu: Annotated[int, _doc("Blocks offloaded to CPU memory.")]
    storage: Annotated[int, _doc("Blocks offloaded to storage.")]


class Replays(_Schema):
    ok: Annotated[int, _doc("Replays that filled a gap.")]
    failed: Annotated[int, _doc("Replays that could not (the gap stays; the stream is gapped).")]


class HashCheckReport(_Schema):
    """Whether kvindex reproduces this member's block hashes (sampled stored events)."""

    state: Annotated[str, _doc("unverified, ok or mismatch.")]
    checked_events: Annotated[int, _doc("Stored events whose hashes were recomputed.")]
    failed_events: Annotated[int, _doc("Of those, events whose hashes differed.")]
    skipped_events: Annotated[int, _doc("Stored events that could not be checked.")]
    skip_reason: Annotated[str | None, _doc("Why the last skipped event was skipped.")]
    diagnosis: Annotated[
        str | None, _doc("On a mismatch: which setting most likely differs from the pod's.")
    ]
    action: Annotated[str | None, _doc("On a mismatch: the setting to change.")]


class StreamReport(_Schema):
    """One engine stream (a data-parallel rank of the pod)."""

    member: Annotated[str, _doc("The index member: the pod, or pod|dp<rank> for rank > 0.")]
    model: Annotated[str, _doc("The model the stream's events are for.")]
    state: Annotated[
        str,
        _doc(
            "live, verifying, replaying, resync, gapped, incomplete, standby, stopped, "
            "restored or unheard (see docs/correctness.md)."
        ),
    ]
    rank: Annotated[int, _doc("Data-parallel rank.")] = 0
    last_seq: Annotated[int, _doc("Last sequence number applied (-1 before any).")] = -1
    first_seq: Annotated[
        int | None, _doc("First seq applied (> 0: joined after the engine started).")
    ] = None
    last_batch_ts: Annotated[float | None, _doc("Engine clock of the last batch.")] = None
    last_received_at: Annotated[
        float | None, _doc("kvindex's clock (Unix seconds) when the last batch arrived.")
    ] = None
    received: Annotated[int, _doc("Batches received.")] = 0
    delivered: Annotated[int, _doc("Batches applied to the index.")] = 0
    duplicates: Annotated[int, _doc("Batches received twice and dropped.")] = 0
    gaps: Annotated[int, _doc("Sequence gaps seen.")] = 0
    missed_batches: Annotated[int, _doc("Batches lost for good (not replayed).")] = 0
    replays_ok: Annotated[int, _doc("Replays that filled a gap.")] = 0
    replays_failed: Annotated[int, _doc("Replays that failed.")] = 0
    restarts: Annotated[int, _doc("Engine restarts seen (seq went back).")] = 0
    queue_overflows: Annotated[int, _doc("Batches dropped because the queue was full.")] = 0
    decode_errors: Annotated[int, _doc("Frames that did not decode.")] = 0
    sink_errors: Annotated[int, _doc("Batches the index backend failed to apply.")] = 0
    not_owner: Annotated[
        int, _doc("Batches dropped because another kvindex replica owns the stream.")
    ] = 0
    queue_depth: Annotated[int, _doc("Batches waiting to be applied.")] = 0
    layout: Annotated[str, _doc("The event wire layout the engine uses (by vLLM version).")] = ""
    replay_endpoint: Annotated[str | None, _doc("Where missed batches are fetched from.")] = None
    state_reason: Annotated[
        str | None, _doc("Why the state is not the stream's own (a restored snapshot).")
    ] = None


class PodReport(_Schema):
    """One pod: what the index holds for it, its streams and whether its hashes check."""

    pod: Annotated[str, _doc("The pod id, ip:port of its HTTP server.")]
    members: Annotated[list[str], _doc("Its index members: the pod and its DP ranks.")]
    models: Annotated[list[str], _doc("Models it holds blocks of or streams events for.")]
    blocks: Annotated[TierBlocks, _doc("Blocks held, all models.")]
    blocks_by_model: Annotated[dict[str, TierBlocks], _doc("Blocks held per model.")]
    last_event_ts: Annotated[float | None, _doc("Engine clock of its latest batch.")]
    last_seq: Annotated[dict[str, int], _doc("Last applied seq per member.")]
    gaps: Annotated[int, _doc("Sequence gaps over its streams.")]
    replays: Annotated[Replays, _doc("Replays over its streams.")]
    restarts: Annotated[int, _doc("Engine restarts over its streams.")]
    stream_state: Annotated[
        str | None,
        _doc(
            "The worst state of its streams; unheard for a configured or discovered pod "
            "not heard from since kvindex started (null: no stream here)."
        ),
    ]
    streams: Annotated[list[StreamReport], _doc("Each of its streams in this process.")]
    hash_check: Annotated[dict[str, HashCheckReport], _doc("Hash check per member.")]
    discovery: Annotated[
        dict[str, Any] | None,
        _doc("What Kubernetes discovery knows of it (name, namespace, state, endpoints ...)."),
    ] = None
    owners: Annotated[
        dict[str, str] | None,
        _doc("Redis backend: the kvindex replica applying each member's stream."),
    ] = None


class PodList(_Schema):
    pods: Annotated[list[PodReport], _doc("Every pod indexed, streaming or discovered.")]


class PodBlocks(_Schema):
    """The block keys a pod holds for one model."""

    pod: Annotated[str, _doc("The pod id.")]
    model: Annotated[str, _doc("The model asked for.")]
    tier: Annotated[str | None, _doc("The tier asked for (null: every tier).")]
    blocks: Annotated[
        dict[str, list[int]], _doc("Per member, its block keys (sorted, at most `limit`).")
    ]
    truncated: Annotated[bool, _doc("True when some member held more keys than `limit`.")]


class Health(_Schema):
    status: Annotated[
        str, _doc("ok: the process answers; failed (with a 503): KV-event ingestion stopped.")
    ]
    problems: Annotated[
        list[str] | None, _doc("Failed: why (the ingest thread that died and its error).")
    ] = None


class Readiness(_Schema):
    status: Annotated[str, _doc("ready, or unready (with a 503).")]
    problems: Annotated[
        list[str] | None, _doc("Unready: why, each naming the setting or part to fix.")
    ] = None
    notes: Annotated[
        list[str] | None, _doc("Ready: why a replica that looks idle is ready anyway.")
    ] = None
