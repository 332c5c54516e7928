"""Ordering of inventory publishing streams (I7-ordered-streams). Pure and synchronous.

A *stream* is one publisher of inventory events: the child engine in
per-child-engine mode (`StreamKey(child_engine_id, None)`), or one rank part in
per-rank-part mode (`StreamKey(child_engine_id, rank_key)`). Each batch carries
the stream's incarnation (from RegisterAck) and a sequence number that grows by
one per batch and starts at 0 in every incarnation.

State machine of one stream, per incarnation::

    FRESH --seq 0, or dump_begin (any seq)--> LIVE (or DUMPING if not dump_end)
    FRESH --other seq--> STALE (gap, expected 0)
    LIVE --seq == next--> LIVE
    LIVE --seq < next--> LIVE (DUPLICATE: dropped)
    LIVE --seq > next, dump_begin--> DUMPING (a dump repairs any gap)
    LIVE --seq > next--> STALE (GAP: resync asked once, expected = next)
    STALE --seq < next--> STALE (DUPLICATE)
    STALE --seq >= next, dump_begin--> DUMPING
    STALE --anything else--> STALE (REFUSED: dropped; the service resends the
                                    ResyncRequest on its own timer until a dump begins)
    DUMPING --seq == next--> DUMPING, or LIVE on dump_end
    DUMPING --seq == next, dump_begin--> DUMPING (the dump restarts)
    DUMPING --seq < next--> DUMPING (DUPLICATE)
    DUMPING --seq > next--> STALE (GAP: the dump is incomplete)

Incarnations: a batch of an older incarnation is FENCED (dropped, nothing
changes). A newer incarnation (a re-registered rank part) replaces the stream:
the decision says `reset_stream`, and the caller drops that stream's old
inventory before applying; the new incarnation starts FRESH. `open_stream` does
the same at registration time, before any batch arrives.

What the caller (the service facade) does with a decision::

    d = streams.accept(key, incarnation, sequence, dump_begin=..., dump_end=...)
    if d.action is StreamAction.APPLY:
        if d.dump_begins:
            inventory.begin_dump(key.child_engine_id, key.rank_key)   # drops old state
        elif d.reset_stream:
            inventory.clear_stream(key.child_engine_id, key.rank_key)
        inventory.apply(key.child_engine_id, events, rank_key=key.rank_key, now_ms=now)
        if d.dump_ends:
            inventory.end_dump(key.child_engine_id, key.rank_key)
    elif d.action is StreamAction.GAP:
        inventory.mark_stale(key.child_engine_id, key.rank_key)
        send ResyncRequest(expected_sequence=d.expected_sequence)
    # DUPLICATE, FENCED, REFUSED: drop the batch, count it (metric result = d.action.value)

`dump_end` outside a dump is ignored (the batch applies as a plain one).
When a GAP is reported, `reset_stream` may also be set (a newer incarnation
whose first batch is not 0): the caller then clears the old inventory too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.core.errors import invalid
from coordinator.core.events import RankKey


class StreamAction(enum.Enum):
    """What to do with a batch. Values are the `kvrc_event_batches_total` results."""

    APPLY = "applied"
    DUPLICATE = "duplicate"
    FENCED = "fenced"
    GAP = "gap"  # first batch past a gap: mark stale, send ResyncRequest
    REFUSED = "refused"  # stale stream, not a dump: drop (resync asked, resent on a timer)


class StreamPhase(enum.Enum):
    FRESH = "fresh"  # no batch yet in this incarnation
    LIVE = "live"
    STALE = "stale"  # lost events; waits for a dump
    DUMPING = "dumping"


@dataclass(frozen=True, slots=True)
class StreamKey:
    child_engine_id: str
    rank_key: RankKey | None = None  # None: the stream of a per-child-engine publisher


@dataclass(frozen=True, slots=True)
class StreamDecision:
    action: StreamAction
    # A newer incarnation replaced the stream: drop its old inventory first.
    reset_stream: bool = False
    # APPLY only: a full dump starts with this batch (drop the stream's state first).
    dump_begins: bool = False
    # APPLY only: the dump completes with this batch (the stream is fresh after it).
    dump_ends: bool = False
    # GAP only: the sequence the coordinator expected (for ResyncRequest).
    expected_sequence: int = 0


@dataclass(slots=True)
class _Stream:
    incarnation: int
    phase: StreamPhase = StreamPhase.FRESH
    next_sequence: int = 0


_DUPLICATE = StreamDecision(StreamAction.DUPLICATE)
_FENCED = StreamDecision(StreamAction.FENCED)
_REFUSED = StreamDecision(StreamAction.REFUSED)
_APPLY = StreamDecision(StreamAction.APPLY)


class EventStreams:
    """Incarnation and sequence of every publishing stream. Not thread-safe."""

    def __init__(self) -> None:
        self._streams: dict[StreamKey, _Stream] = {}
        self._by_engine: dict[str, set[StreamKey]] = {}

    def open_stream(self, key: StreamKey, incarnation: int) -> bool:
        """A rank part (re-)registered with this incarnation. True if it replaced an
        older incarnation whose inventory the caller must drop."""
        _check_number("incarnation", incarnation)
        st = self._streams.get(key)
        if st is not None and incarnation < st.incarnation:
            raise invalid(
                f"incarnation {incarnation} of stream {key} is older than {st.incarnation}"
            )
        if st is not None and incarnation == st.incarnation:
            return False
        self._put(key, _Stream(incarnation))
        return st is not None

    def accept(
        self,
        key: StreamKey,
        incarnation: int,
        sequence: int,
        *,
        dump_begin: bool = False,
        dump_end: bool = False,
    ) -> StreamDecision:
        """Decide what to do with one batch and advance the stream's state."""
        _check_number("incarnation", incarnation)
        _check_number("sequence", sequence)
        st = self._streams.get(key)
        if st is not None and incarnation < st.incarnation:
            return _FENCED
        new = st is None or incarnation > st.incarnation
        expected = 0 if new or st is None else st.next_sequence
        if sequence > expected + MAX_SEQUENCE_JUMP:  # before anything changes
            raise invalid(
                f"sequence {sequence} is {sequence - expected} batches past the next one "
                f"expected ({expected}): a publisher counts its batches one by one"
            )
        reset = False
        if new:
            reset = st is not None
            st = _Stream(incarnation)
            self._put(key, st)
        assert st is not None
        phase = st.phase
        if phase is StreamPhase.FRESH:
            if sequence == 0 or dump_begin:
                return self._apply(st, sequence, dump_begin, dump_end, reset)
            return self._gap(st, 0, reset)
        if sequence < st.next_sequence:
            return _DUPLICATE
        if phase is StreamPhase.LIVE:
            if sequence == st.next_sequence or dump_begin:
                return self._apply(st, sequence, dump_begin, dump_end, reset)
            return self._gap(st, st.next_sequence, reset)
        if phase is StreamPhase.STALE:
            if dump_begin:
                return self._apply(st, sequence, dump_begin, dump_end, reset)
            return _REFUSED
        # DUMPING
        if sequence == st.next_sequence:
            return self._apply(st, sequence, dump_begin, dump_end, reset)
        return self._gap(st, st.next_sequence, reset)

    def phase(self, key: StreamKey) -> StreamPhase | None:
        st = self._streams.get(key)
        return None if st is None else st.phase

    def incarnation(self, key: StreamKey) -> int | None:
        st = self._streams.get(key)
        return None if st is None else st.incarnation

    def is_engine_stale(self, child_engine_id: str) -> bool:
        """Any stream of the child engine lost events or runs a dump."""
        return any(
            self._streams[k].phase in (StreamPhase.STALE, StreamPhase.DUMPING)
            for k in self._by_engine.get(child_engine_id, ())
        )

    def close_stream(self, key: StreamKey) -> None:
        """The stream's rank part left for good."""
        if self._streams.pop(key, None) is not None:
            keys = self._by_engine[key.child_engine_id]
            keys.discard(key)
            if not keys:
                del self._by_engine[key.child_engine_id]

    def remove_engine(self, child_engine_id: str) -> None:
        for key in self._by_engine.pop(child_engine_id, set()):
            del self._streams[key]

    def __len__(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ internals

    def _put(self, key: StreamKey, st: _Stream) -> None:
        self._streams[key] = st
        self._by_engine.setdefault(key.child_engine_id, set()).add(key)

    @staticmethod
    def _apply(
        st: _Stream, sequence: int, dump_begin: bool, dump_end: bool, reset: bool
    ) -> StreamDecision:
        dumping = st.phase is StreamPhase.DUMPING or dump_begin
        ends = dumping and dump_end
        st.phase = StreamPhase.DUMPING if dumping and not ends else StreamPhase.LIVE
        st.next_sequence = sequence + 1
        if not (reset or dump_begin or ends):
            return _APPLY
        return StreamDecision(
            StreamAction.APPLY, reset_stream=reset, dump_begins=dump_begin, dump_ends=ends
        )

    @staticmethod
    def _gap(st: _Stream, expected: int, reset: bool) -> StreamDecision:
        st.phase = StreamPhase.STALE
        st.next_sequence = expected
        return StreamDecision(StreamAction.GAP, reset_stream=reset, expected_sequence=expected)


# A publisher counts its batches from 0, one by one. A batch far ahead of the next one
# expected is a client's bug: past MAX_SEQUENCE_JUMP (over 4 billion batches lost) it
# is refused, since one near 2**64 would leave nothing after it (every later batch a
# duplicate, a new dump too) until the engine re-registered.
MAX_SEQUENCE = (1 << 63) - 1
MAX_SEQUENCE_JUMP = 1 << 32


def _check_number(name: str, value: int) -> None:
    if value < 0:
        raise invalid(f"{name} {value} is negative")
    if value > MAX_SEQUENCE:
        raise invalid(f"{name} {value} is past 2**63 - 1: a publisher counts from 0")
