"""KV-cache event wire: vLLM structs, subscriber, replay, engine-side publisher.

Everything the rest of kvindex needs from the wire is importable from here; the modules
behind it are small and each holds one concept (see their docstrings).
"""

from kvindex.events.capture import CaptureError, read_capture, record, replay_capture
from kvindex.events.config import SubscriberConfig
from kvindex.events.discovery import DiscoveryError, KubernetesDiscovery
from kvindex.events.endpoints import PodEndpoint, is_bind_endpoint, offset_endpoint_port
from kvindex.events.identity import (
    IdentityError,
    StreamId,
    Topic,
    make_topic,
    member_pod,
    normalize_pod,
    parse_topic,
)
from kvindex.events.k8s_pods import DiscoveryConfig, DiscoveryMode
from kvindex.events.layouts import (
    RELEASES,
    EngineBlockRemoved,
    EngineBlockStored,
    WireFormat,
    wire_format,
)
from kvindex.events.pod_roster import DiscoveryTarget
from kvindex.events.publisher import EnginePublisher
from kvindex.events.replay import ReplayResult, fetch_replay
from kvindex.events.sequence import Action, SequenceTracker, Verdict
from kvindex.events.sink import BatchSink, Delivery
from kvindex.events.status import StreamStatus
from kvindex.events.subscriber import Subscriber
from kvindex.events.wire import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    DecodeError,
    Event,
    EventBatch,
    Layout,
    hash_to_int,
    hashes_to_ints,
)

__all__ = [
    "RELEASES",
    "Action",
    "AllBlocksCleared",
    "BatchDecoder",
    "BatchSink",
    "BlockRemoved",
    "BlockStored",
    "CaptureError",
    "DecodeError",
    "DecodedBatch",
    "Delivery",
    "DiscoveryConfig",
    "DiscoveryError",
    "DiscoveryMode",
    "DiscoveryTarget",
    "EngineBlockRemoved",
    "EngineBlockStored",
    "EnginePublisher",
    "Event",
    "EventBatch",
    "IdentityError",
    "KubernetesDiscovery",
    "Layout",
    "PodEndpoint",
    "ReplayResult",
    "SequenceTracker",
    "StreamId",
    "StreamStatus",
    "Subscriber",
    "SubscriberConfig",
    "Topic",
    "Verdict",
    "WireFormat",
    "fetch_replay",
    "hash_to_int",
    "hashes_to_ints",
    "is_bind_endpoint",
    "make_topic",
    "member_pod",
    "normalize_pod",
    "offset_endpoint_port",
    "parse_topic",
    "read_capture",
    "record",
    "replay_capture",
    "wire_format",
]
