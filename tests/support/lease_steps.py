"""Fixed names and one-call openers for lease-core tests (used by several test modules)."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.core.events import RankKey
from coordinator.core.leases import LeaseStep, LeaseTable

REQ = "prefill-b_dp1"  # requester of a prefix load
HOLD = "decode-a_dp0"  # holder of a prefix load
PRE = "prefill-p"  # handoff prefill
DEC = "decode-d_dp2"  # handoff decode
TP2: tuple[RankKey, ...] = ((0, 0, 0), (1, 0, 0))
CHAIN = tuple(bytes([i]) * 8 for i in range(8))
T0 = 1_000_000
PARAMS = b"\x81\xa4tpsz\x02opaque\x00\xff"


def open_load_step(
    t: LeaseTable,
    request_id: str = "r1",
    *,
    min_blocks: int = 1,
    requester: str = REQ,
    holder: str = HOLD,
    requester_grid: Sequence[RankKey] = TP2,
    holder_grid: Sequence[RankKey] = TP2,
    chain: Sequence[bytes] = CHAIN,
    now: int = T0,
    pin_timeout_ms: int = 500,
    transfer_ttl_ms: int = 5_000,
    group_idx: int = 0,
) -> LeaseStep:
    return t.open_prefix_load(
        request_id=request_id,
        requester_child_engine_id=requester,
        requester_rank_keys=requester_grid,
        holder_child_engine_id=holder,
        holder_rank_keys=holder_grid,
        block_hashes=chain,
        min_blocks=min_blocks,
        pin_timeout_ms=pin_timeout_ms,
        transfer_ttl_ms=transfer_ttl_ms,
        now_ms=now,
        group_idx=group_idx,
    )
