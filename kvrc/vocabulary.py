"""The values both sides of kvrc share, each defined once.

Engines (`clients/`) and the coordinator (`coordinator/`) import these; neither
side defines its own copy. Protocol conversions live here too, so that the two
sides cannot drift: `to_proto` builds the `kvrc.v1` message, `from_proto` reads
one that the caller has already validated (the coordinator checks sizes first,
in `coordinator/edges/grpc_wire.py`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvrc.v1 import kvrc_pb2 as pb

# The protocol revision both sides speak (`Register.protocol_version`; the revisions are
# listed in proto/kvrc/v1/kvrc.proto's header). A Register without the field is revision 1.
PROTOCOL_VERSION = 4

# How a stopping coordinator's UNAVAILABLE begins: a client that reads it retries at the
# next coordinator with a fresh budget (clients/leases.py, `begin_handoff`).
# Where a coordinator listens, and where its clients look for it, by default.
DEFAULT_COORDINATOR = "127.0.0.1:50051"
COORDINATOR_SHUTTING_DOWN = "the coordinator is shutting down"
RETRY_AT_THE_NEXT_COORDINATOR = f"{COORDINATOR_SHUTTING_DOWN}: retry at the next one"

# Wire limits both sides share: the coordinator refuses more (INVALID_ARGUMENT,
# I8-bad-input), and the engine library cuts its batches and chains below them.
MAX_CHAIN_BLOCKS = 4096  # block hashes in one chain (events, Lookup, RequestPrefixLoad)
MAX_EVENTS_PER_BATCH = 1024
MAX_BLOCKS_PER_BATCH = 8192
MAX_BLOCK_HASH_BYTES = 64  # a block hash (or a parent's) is 1..64 bytes
MAX_GROUP_IDX = 1023  # a KV-cache group index (vLLM's hybrid models)


def protocol_mismatch(client_version: int) -> str | None:
    """Why a client of `client_version` (0 = absent = 1) may not register, or None."""
    client = client_version or 1
    if client == PROTOCOL_VERSION:
        return None
    upgrade = "the kvrc client library" if client < PROTOCOL_VERSION else "this coordinator"
    return (
        f"client speaks kvrc protocol v{client}, this coordinator speaks "
        f"v{PROTOCOL_VERSION}; upgrade {upgrade}"
    )


# A rank part inside its child engine's grid: (tp_rank, pp_rank, pcp_rank).
RankKey = tuple[int, int, int]

# A block hash as engines publish it: opaque bytes, compared for equality only.
BlockHash = bytes


def vllm_int_hash_key(digest: bytes) -> BlockHash:
    """vLLM's int form of a block hash (`maybe_convert_block_hash` under
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default: the digest's low 64 bits) as kvrc
    keys it, 8 bytes big-endian: the digest's last 8 bytes."""
    return digest[-8:].rjust(8, b"\0")


# DeploymentProfile.extra keys through which an engine declares how it hashes its
# blocks, so that kvrc can hash a router's token ids the same way (Score only,
# docs/score.md): vLLM's --prefix-caching-hash-algo; its PYTHONHASHSEED verbatim, or
# PROFILE_HASH_SEED_UNSET when it runs without one (Python itself accepts only an
# integer or "random" there, so the word cannot be a real value); and
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES ("1", vLLM's default, or "0").
PROFILE_EXTRA_HASH_ALGO = "vllm_prefix_caching_hash_algo"
PROFILE_EXTRA_HASH_SEED = "vllm_hash_seed"
PROFILE_EXTRA_INT_HASHES = "vllm_int_block_hashes"
PROFILE_HASH_SEED_UNSET = "unset"


class Tier(enum.IntEnum):
    """Where a block lives; lower is faster. Values match `kvrc.v1.Tier`."""

    GPU = 1
    CPU = 2
    DISK = 3
    EXTERNAL = 4


class PublishMode(enum.IntEnum):
    """How a child engine publishes inventory. Values match `kvrc.v1.PublishMode`."""

    PER_CHILD_ENGINE = 1  # one stream for the child engine (vLLM's scheduler-side events)
    PER_RANK_PART = 2  # one stream per rank part; a block counts once every part has it


@dataclass(frozen=True, slots=True)
class KvRegion:
    """One registered memory region of a rank part's KV cache."""

    base_addr: int
    block_len: int
    num_blocks: int
    layer: int = 0
    kv_index: int = 0


@dataclass(frozen=True, slots=True)
class TransferEndpoint:
    """How a peer's transfer engine reaches a rank part.

    Opaque to the coordinator: kept and returned to peers byte for byte
    (NIXL / Mooncake agent metadata, `extra` in the order received).
    """

    backend: str = ""
    session_name: str = ""
    agent_metadata: bytes = b""
    regions: tuple[KvRegion, ...] = ()
    extra: tuple[tuple[str, bytes], ...] = ()

    def to_proto(self) -> pb.TransferEndpoint:
        return pb.TransferEndpoint(
            backend=self.backend,
            session_name=self.session_name,
            agent_metadata=self.agent_metadata,
            regions=[
                pb.KvRegion(
                    base_addr=r.base_addr,
                    block_len=r.block_len,
                    num_blocks=r.num_blocks,
                    layer=r.layer,
                    kv_index=r.kv_index,
                )
                for r in self.regions
            ],
            extra=dict(self.extra),
        )

    @classmethod
    def from_proto(cls, msg: pb.TransferEndpoint) -> TransferEndpoint:
        return cls(
            backend=msg.backend,
            session_name=msg.session_name,
            agent_metadata=bytes(msg.agent_metadata),
            regions=tuple(
                KvRegion(r.base_addr, r.block_len, r.num_blocks, r.layer, r.kv_index)
                for r in msg.regions
            ),
            extra=tuple((k, bytes(v)) for k, v in msg.extra.items()),
        )
