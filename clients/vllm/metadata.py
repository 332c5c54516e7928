"""What the scheduler side tells its workers each step, and what they answer.

Plain picklable dataclasses: vLLM ships the step's metadata to every worker
process (tp > 1) with the SchedulerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class LoadSpec:
    """Pull this request's slice of a kvrc grant into these local blocks.

    `source_parts` are the grant's serialized RankPartDescriptors (every rank
    part of the source); each worker reads from the one matching its own tp
    rank, skipping the first `skip` source blocks. `error` set: there is
    nothing to pull (the grant failed): the worker finishes the request with
    every block a load error.
    """

    request_id: str
    flow: str  # "handoff" | "prefix_load"
    lease_id: str
    source_parts: list[bytes]
    skip: int
    local_block_ids: list[int]
    deadline_s: float
    error: str = ""
    test_fault: str = ""  # tests only (KvrcConnectorConfig.test_faults)


@dataclass
class PublishSpec:
    """Publish this finished prefill request's blocks as a kvrc handoff."""

    request_id: str
    handoff_id: str
    block_ids: list[int]
    decode_child_engine_id: str
    kv_transfer_params: bytes


@dataclass
class KvrcConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadSpec] = field(default_factory=list)
    publishes: list[PublishSpec] = field(default_factory=list)
    # prefill requests whose handoff's blocks are freed now (released, failed, expired)
    free_now: list[str] = field(default_factory=list)
    # handoff leases the scheduler side published, each with its reserved decode engine
    # ("" = unreserved): re-announced after a kvrc restart
    held: list[tuple[str, str]] = field(default_factory=list)
    # leases the scheduler side freed on its own safety net: no longer announced as held
    unheld: list[str] = field(default_factory=list)
    # nothing is scheduled this step: the workers may wait for their running pulls
    idle_step: bool = False


# A worker's counter: its first publish of a handoff part was refused for a reason of
# the engine's (`refuses_the_engine`); the scheduler side then opens its handoff breaker.
HANDOFF_REFUSED_FOR_THE_ENGINE = "handoff_publish_refused_for_the_engine"


@dataclass
class KvrcWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Counters of one step, summed over the workers."""

    counters: dict[str, int] = field(default_factory=dict)
    # request id -> outcome of its load on this worker ("SUCCEEDED", "FAILED ...")
    outcomes: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvrcWorkerMetadata)
        counters: dict[str, int] = dict(self.counters)
        for key, count in other.counters.items():
            counters[key] = counters.get(key, 0) + count
        outcomes: dict[str, str] = dict(self.outcomes)
        for key, outcome in other.outcomes.items():
            if outcomes.get(key, "SUCCEEDED") == "SUCCEEDED":
                outcomes[key] = outcome
        return KvrcWorkerMetadata(counters, outcomes)


def as_dict(spec: Any) -> dict[str, Any]:
    return dict(spec.__dict__)
