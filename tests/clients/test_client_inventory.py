"""clients/inventory.py: batching, sequence numbering per incarnation, dump chunking.

Chunking is pure and tested on values; numbering and dumps are tested against a
real coordinator: what the publisher sends must be accepted in order (no gap,
no duplicate, no fence) and must land in the inventory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from harness import (
    CoordinatorProcess,
    child_engine_status,
    metric_value,
    start_coordinator,
    wait_until,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.errors import InvalidArgumentError
from clients.inventory import (
    AllCleared,
    InventoryEvent,
    InventoryPublisher,
    PublishingHandler,
    RemovedBlocks,
    StoredBlocks,
    chunk_events,
)
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from kvrc.vocabulary import MAX_CHAIN_BLOCKS, Tier


def hs(tag: int, n: int) -> tuple[bytes, ...]:
    return tuple(bytes([tag]) + i.to_bytes(4, "big") for i in range(n))


# --- chunking (pure) -------------------------------------------------------------------


def _flatten(batches: list[list[InventoryEvent]]) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for batch in batches:
        for ev in batch:
            if isinstance(ev, AllCleared):
                out.append(("clear", b""))
            else:
                kind = "store" if isinstance(ev, StoredBlocks) else "remove"
                out.extend((kind, h) for h in ev.block_hashes)
    return out


events_strategy = st.lists(
    st.one_of(
        st.builds(
            lambda tag, n: StoredBlocks(hs(tag, n), num_tokens=16 * n),
            st.integers(0, 255),
            st.integers(1, 40),
        ),
        st.builds(lambda tag, n: RemovedBlocks(hs(tag, n)), st.integers(0, 255), st.integers(0, 9)),
        st.just(AllCleared()),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(events_strategy, st.integers(1, 7), st.integers(1, 25))
def test_chunks_keep_order_and_respect_both_limits(
    events: list[InventoryEvent], max_events: int, max_blocks: int
) -> None:
    batches = list(chunk_events(events, max_events, max_blocks))
    assert _flatten(batches) == _flatten([events])
    for batch in batches:
        assert 1 <= len(batch) <= max_events
        assert sum(0 if isinstance(e, AllCleared) else len(e.block_hashes) for e in batch) <= max(
            max_blocks, 0
        )


def test_a_long_stored_chain_is_split_into_chained_segments() -> None:
    chain = hs(1, 10)
    batches = list(chunk_events([StoredBlocks(chain, b"parent", 160, Tier.CPU, 2, 99)], 8, 4))
    segments = [ev for b in batches for ev in b]
    assert all(isinstance(s, StoredBlocks) for s in segments)
    stored = [s for s in segments if isinstance(s, StoredBlocks)]
    assert [s.block_hashes for s in stored] == [chain[0:4], chain[4:8], chain[8:10]]
    # Each segment's parent is the last block of the one before; the first keeps the original.
    assert [s.parent_block_hash for s in stored] == [b"parent", chain[3], chain[7]]
    assert [s.num_tokens for s in stored] == [64, 64, 32]
    assert {(s.tier, s.group_idx, s.expiry_unix_ms) for s in stored} == {(Tier.CPU, 2, 99)}


def test_chunk_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        list(chunk_events([AllCleared()], 0, 1))
    assert MAX_CHAIN_BLOCKS == 4096


# --- against a real coordinator ---------------------------------------------------------------


@pytest.fixture(scope="module")
def kvrc_on(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    profiles = tmp_path_factory.mktemp("p") / "profiles.toml"
    profiles.write_text('[[profile]]\nname = "m"\nmodel = "m"\n')
    with start_coordinator(
        "--reuse", "on", "--profiles", str(profiles), "--session-grace-ms", "100"
    ) as kvrc:
        yield kvrc


def batches_metric(kvrc: CoordinatorProcess, result: str) -> float:
    return metric_value(kvrc, "kvrc_event_batches_total", source="grpc", result=result)


async def entries(target: str, child_engine_id: str) -> int:
    status = await child_engine_status(target, child_engine_id)
    return -1 if status is None else int(status.inventory_entries)


async def test_sequences_count_per_batch_and_dumps_are_chunked(
    kvrc_on: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    t = kvrc_on.grpc_target
    reg = RankPartRegistration("pub-a", EngineProfile("m", 16, reuse_opt_in=True))
    session = EngineSession(t, reg, reconnect=False)
    retained = [StoredBlocks(hs(7, 9)), StoredBlocks(hs(8, 6))]
    publisher = InventoryPublisher(
        session, dump=lambda: retained, max_events_per_batch=2, max_blocks_per_batch=4
    )
    session.handler = PublishingHandler(publisher)
    await session.start()
    sessions.append(session)
    assert session.ack is not None
    bad_before = sum(batches_metric(kvrc_on, r) for r in ("gap", "duplicate", "fenced"))
    applied_before = batches_metric(kvrc_on, "applied")

    assert await publisher.publish([StoredBlocks(hs(1, 10))]) == 3  # 4 + 4 + 2 blocks
    assert publisher.next_sequence == 3
    assert publisher.incarnation == session.ack.incarnation
    await publisher.removed(hs(1, 10)[5:])
    await publisher.cleared()
    assert publisher.next_sequence == 6
    # 9 + 6 blocks in segments of <= 4 hashes: 4, 4, 1 | 4, 2; at most 4 blocks a batch, so
    # 4 | 4 | 1 | 4 | 2 -> 5 batches, dump_begin on the first, dump_end on the last.
    assert await publisher.send_dump() == 5
    assert publisher.next_sequence == 11

    async def dumped() -> bool:
        return await entries(t, "pub-a") == 15

    await wait_until(dumped, 10)
    assert batches_metric(kvrc_on, "applied") == applied_before + 11
    assert sum(batches_metric(kvrc_on, r) for r in ("gap", "duplicate", "fenced")) == bad_before


async def test_an_empty_dump_still_replaces_the_state(
    kvrc_on: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    t = kvrc_on.grpc_target
    session = EngineSession(
        t, RankPartRegistration("pub-b", EngineProfile("m", 16)), reconnect=False
    )
    publisher = InventoryPublisher(session, dump=list)
    await session.start()
    sessions.append(session)
    await publisher.stored(hs(3, 5))

    async def five() -> bool:
        return await entries(t, "pub-b") == 5

    await wait_until(five, 10)
    assert await publisher.send_dump() == 1

    async def empty() -> bool:
        return await entries(t, "pub-b") == 0

    await wait_until(empty, 10)


@pytest.mark.parametrize(
    ("event", "refused"),
    [
        (StoredBlocks(()), ""),  # nothing to say: not sent
        (RemovedBlocks(()), ""),
        (StoredBlocks((b"x" * 65,)), "block hashes are 1..64"),
        (StoredBlocks((b"",)), "block hashes are 1..64"),
        (StoredBlocks(hs(4, 2), parent_block_hash=b"p" * 65), "parent block hash of 65"),
        (StoredBlocks(hs(4, 2), group_idx=1024), "group_idx 1024 is outside 0..1023"),
    ],
)
async def test_what_kvrc_would_refuse_is_refused_here_and_the_session_stays(
    kvrc_on: CoordinatorProcess, sessions: list[EngineSession], event: Any, refused: str
) -> None:
    """Sent, kvrc refused it by ending the rank part's session; the dump after the
    re-registration sent it again and ended the next one: the part flapped."""
    t = kvrc_on.grpc_target
    retained = [StoredBlocks(hs(5, 3)), event]
    session = EngineSession(
        t, RankPartRegistration(f"pub-x{abs(hash(repr(event))) % 10**6}", EngineProfile("m", 16))
    )
    publisher = InventoryPublisher(session, dump=lambda: retained)
    session.handler = PublishingHandler(publisher)
    await session.start()
    sessions.append(session)
    if refused:
        with pytest.raises(InvalidArgumentError, match=refused):
            await publisher.publish([StoredBlocks(hs(6, 2)), event])
        assert publisher.next_sequence == 0  # nothing of it was sent
        with pytest.raises(InvalidArgumentError):
            await publisher.send_dump()
    else:
        assert await publisher.publish([event]) == 0
        assert await publisher.send_dump() == 1  # the empty event left out
        cid = session.registration.resolved_child_engine_id

        async def three() -> bool:
            return await entries(t, cid) == 3

        await wait_until(three, 10)
    assert session.connected and session.registrations == 1


async def test_numbering_restarts_and_a_dump_follows_a_re_registration(
    sessions: list[EngineSession],
) -> None:
    # One fixed port so that the engine reconnects to a restarted coordinator.
    from harness import free_port

    port = free_port()
    retained = [StoredBlocks(hs(9, 3))]
    reg = RankPartRegistration("pub-c", EngineProfile("m", 16))
    session = EngineSession(
        f"127.0.0.1:{port}", reg, reconnect=True, backoff_initial_s=0.05, backoff_max_s=0.2
    )
    publisher = InventoryPublisher(session, dump=lambda: retained)
    session.handler = PublishingHandler(publisher)
    with start_coordinator(listen=f"127.0.0.1:{port}"):
        await session.start()
        sessions.append(session)
        first = publisher.incarnation
        await publisher.stored(hs(9, 1))
        await publisher.stored(hs(10, 1))
        assert publisher.next_sequence == 2
    with start_coordinator(listen=f"127.0.0.1:{port}") as second:

        async def back() -> bool:
            return session.registrations == 2

        await wait_until(back, 20)
        await publisher.wait_dump()
        # A new incarnation: numbering from 0, and the dump (one batch) went first.
        assert publisher.incarnation != first
        assert publisher.next_sequence == 1
        assert publisher.dumps_sent == 1

        async def dumped() -> bool:
            return await entries(second.grpc_target, "pub-c") == 3

        await wait_until(dumped, 10)
        await session.close()
