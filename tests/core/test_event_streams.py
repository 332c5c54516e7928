"""Ordering of publishing streams: fencing, duplicates, gaps, resync, incarnations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.event_streams import (
    EventStreams,
    StreamAction,
    StreamDecision,
    StreamKey,
    StreamPhase,
)

KEY = StreamKey("engine-a_dp0")


def test_in_order_batches_apply_and_repeats_are_duplicates() -> None:
    s = EventStreams()
    for seq in range(5):
        assert s.accept(KEY, 1, seq).action is StreamAction.APPLY
    for seq in (0, 3, 4):
        assert s.accept(KEY, 1, seq).action is StreamAction.DUPLICATE
    assert s.accept(KEY, 1, 5).action is StreamAction.APPLY
    assert s.phase(KEY) is StreamPhase.LIVE


def test_first_batch_of_an_incarnation_must_be_zero_or_a_dump() -> None:
    s = EventStreams()
    d = s.accept(KEY, 1, 3)
    assert d == StreamDecision(StreamAction.GAP, expected_sequence=0)
    assert s.phase(KEY) is StreamPhase.STALE
    other = StreamKey("engine-b")
    d = s.accept(other, 1, 7, dump_begin=True, dump_end=True)
    assert d.action is StreamAction.APPLY and d.dump_begins and d.dump_ends
    assert s.accept(other, 1, 8).action is StreamAction.APPLY


def test_older_incarnation_is_fenced_and_changes_nothing() -> None:
    s = EventStreams()
    s.accept(KEY, 2, 0)
    s.accept(KEY, 2, 1)
    assert s.accept(KEY, 1, 2).action is StreamAction.FENCED
    assert s.accept(KEY, 1, 0, dump_begin=True).action is StreamAction.FENCED
    assert s.incarnation(KEY) == 2
    assert s.phase(KEY) is StreamPhase.LIVE
    # The fenced batches did not move the sequence: 2 is still the next one.
    assert s.accept(KEY, 2, 2).action is StreamAction.APPLY


def test_gap_marks_stale_asks_resync_once_and_refuses_until_a_dump() -> None:
    s = EventStreams()
    s.accept(KEY, 1, 0)
    s.accept(KEY, 1, 1)
    gap = s.accept(KEY, 1, 4)
    assert gap.action is StreamAction.GAP and gap.expected_sequence == 2
    assert s.is_engine_stale(KEY.child_engine_id)
    # Later plain batches are refused without a second resync request.
    assert s.accept(KEY, 1, 5).action is StreamAction.REFUSED
    assert s.accept(KEY, 1, 6, dump_end=True).action is StreamAction.REFUSED
    assert s.accept(KEY, 1, 1).action is StreamAction.DUPLICATE
    begin = s.accept(KEY, 1, 7, dump_begin=True)
    assert begin.action is StreamAction.APPLY and begin.dump_begins and not begin.dump_ends
    assert s.phase(KEY) is StreamPhase.DUMPING
    assert s.is_engine_stale(KEY.child_engine_id)
    assert s.accept(KEY, 1, 8).action is StreamAction.APPLY
    end = s.accept(KEY, 1, 9, dump_end=True)
    assert end.action is StreamAction.APPLY and end.dump_ends
    assert s.phase(KEY) is StreamPhase.LIVE
    assert not s.is_engine_stale(KEY.child_engine_id)
    assert s.accept(KEY, 1, 10).action is StreamAction.APPLY


def test_gap_inside_a_dump_goes_stale_again() -> None:
    s = EventStreams()
    s.accept(KEY, 1, 0, dump_begin=True)
    d = s.accept(KEY, 1, 2, dump_end=True)
    assert d == StreamDecision(StreamAction.GAP, expected_sequence=1)
    assert s.phase(KEY) is StreamPhase.STALE
    assert s.accept(KEY, 1, 3, dump_end=True).action is StreamAction.REFUSED


def test_dump_begin_repairs_a_gap_in_a_live_stream() -> None:
    s = EventStreams()
    s.accept(KEY, 1, 0)
    d = s.accept(KEY, 1, 5, dump_begin=True, dump_end=True)
    assert d.action is StreamAction.APPLY and d.dump_begins and d.dump_ends
    assert s.phase(KEY) is StreamPhase.LIVE
    assert s.accept(KEY, 1, 6).action is StreamAction.APPLY


def test_dump_end_outside_a_dump_is_a_plain_batch() -> None:
    s = EventStreams()
    d = s.accept(KEY, 1, 0, dump_end=True)
    assert d == StreamDecision(StreamAction.APPLY)


def test_newer_incarnation_resets_the_stream() -> None:
    s = EventStreams()
    s.accept(KEY, 1, 0)
    s.accept(KEY, 1, 1)
    d = s.accept(KEY, 2, 0)
    assert d == StreamDecision(StreamAction.APPLY, reset_stream=True)
    assert s.incarnation(KEY) == 2
    # A newer incarnation that does not start at 0 is a gap that also resets.
    d = s.accept(KEY, 3, 4)
    assert d == StreamDecision(StreamAction.GAP, reset_stream=True, expected_sequence=0)


def test_open_stream_at_registration() -> None:
    s = EventStreams()
    assert s.open_stream(KEY, 1) is False
    s.accept(KEY, 1, 0)
    assert s.open_stream(KEY, 1) is False  # same incarnation: nothing to drop
    assert s.phase(KEY) is StreamPhase.LIVE
    assert s.open_stream(KEY, 2) is True
    assert s.phase(KEY) is StreamPhase.FRESH
    assert s.accept(KEY, 1, 1).action is StreamAction.FENCED
    with pytest.raises(KvrcError) as err:
        s.open_stream(KEY, 1)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert s.incarnation(KEY) == 2


def test_negative_numbers_are_rejected_and_change_nothing() -> None:
    s = EventStreams()
    s.accept(KEY, 1, 0)
    for inc, seq in ((-1, 1), (1, -1)):
        with pytest.raises(KvrcError) as err:
            s.accept(KEY, inc, seq)
        assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert s.accept(KEY, 1, 1).action is StreamAction.APPLY


def test_a_sequence_far_past_the_next_one_is_refused_and_changes_nothing() -> None:
    """A batch at 2**63 - 1 was applied (as a dump, or first) and every later batch, a
    new dump too, was a silent duplicate until the engine re-registered (a review's
    finding): a jump of more than 2**32 batches is refused now, wherever it lands."""
    s = EventStreams()
    s.accept(KEY, 1, 0)
    for seq, dump in (((1 << 63) - 1, True), ((1 << 32) + 2, False)):
        with pytest.raises(KvrcError, match="batches past the next one expected") as err:
            s.accept(KEY, 1, seq, dump_begin=dump)
        assert err.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(KvrcError):  # a new incarnation counts from 0 too
        s.accept(KEY, 2, (1 << 32) + 1, dump_begin=True)
    assert s.accept(KEY, 1, 1).action is StreamAction.APPLY  # nothing changed
    # A gap within the bound is a gap, as before.
    assert s.accept(KEY, 1, (1 << 32) + 2).action is StreamAction.GAP


def test_per_rank_part_streams_are_independent_and_any_stale_part_marks_the_engine() -> None:
    s = EventStreams()
    p0 = StreamKey("e", (0, 0, 0))
    p1 = StreamKey("e", (1, 0, 0))
    s.accept(p0, 1, 0)
    s.accept(p1, 1, 0)
    assert s.accept(p1, 1, 2).action is StreamAction.GAP
    assert s.phase(p0) is StreamPhase.LIVE
    assert s.is_engine_stale("e")
    assert s.accept(p0, 1, 1).action is StreamAction.APPLY
    s.accept(p1, 1, 3, dump_begin=True, dump_end=True)
    assert not s.is_engine_stale("e")


def test_departure_forgets_streams() -> None:
    s = EventStreams()
    s.accept(StreamKey("e", (0, 0, 0)), 1, 0)
    s.accept(StreamKey("e", (1, 0, 0)), 1, 0)
    s.accept(StreamKey("f"), 1, 0)
    s.close_stream(StreamKey("e", (0, 0, 0)))
    assert len(s) == 2
    s.remove_engine("e")
    assert len(s) == 1
    assert s.phase(StreamKey("e", (1, 0, 0))) is None
    assert not s.is_engine_stale("e")


# --------------------------------------------------------------------------- end to end


class Publisher:
    """An engine's true inventory and the batches it sends (with full dumps on request)."""

    def __init__(self) -> None:
        self.state: set[int] = set()
        self.next_sequence = 0
        self.history: dict[int, frozenset[int]] = {}  # state after each sequence

    def batch(self, adds: set[int], removes: set[int]) -> tuple[int, tuple[str, ...], bool, bool]:
        self.state |= adds
        self.state -= removes
        return self._send(tuple(f"+{b}" for b in sorted(adds)) + tuple(f"-{b}" for b in removes))

    def dump(self, parts: int) -> list[tuple[int, tuple[str, ...], bool, bool]]:
        items = sorted(self.state)
        chunks = [items[i::parts] for i in range(parts)]
        out = []
        for i, chunk in enumerate(chunks):
            out.append(self._send(tuple(f"+{b}" for b in chunk), i == 0, i == parts - 1))
        return out

    def _send(
        self, ops: tuple[str, ...], begin: bool = False, end: bool = False
    ) -> tuple[int, tuple[str, ...], bool, bool]:
        seq = self.next_sequence
        self.next_sequence += 1
        self.history[seq] = frozenset(self.state)
        return seq, ops, begin, end


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_lossy_duplicating_channel_converges_to_the_publishers_state(data: st.DataObject) -> None:
    """Whatever is dropped or repeated, a LIVE receiver equals the publisher as of the last
    applied batch, and after a reliable tail it equals the publisher's state."""
    streams = EventStreams()
    pub = Publisher()
    received: set[int] = set()
    sent: list[tuple[int, tuple[str, ...], bool, bool]] = []
    outbox: list[tuple[int, tuple[str, ...], bool, bool]] = []

    def deliver(batch: tuple[int, tuple[str, ...], bool, bool]) -> None:
        seq, ops, begin, end = batch
        d = streams.accept(KEY, 1, seq, dump_begin=begin, dump_end=end)
        if d.action is StreamAction.APPLY:
            if d.dump_begins:
                received.clear()
            for op in ops:
                (received.add if op[0] == "+" else received.discard)(int(op[1:]))
            if streams.phase(KEY) is StreamPhase.LIVE:
                assert received == pub.history[seq]
        elif d.action is StreamAction.GAP:
            assert d.expected_sequence <= seq
            outbox.extend(pub.dump(data.draw(st.integers(1, 3))))

    steps = data.draw(st.integers(1, 30))
    for _ in range(steps):
        if not outbox:
            adds = data.draw(st.sets(st.integers(0, 20), max_size=4))
            removes = data.draw(st.sets(st.integers(0, 20), max_size=2))
            outbox.append(pub.batch(adds, removes))
        batch = outbox.pop(0)
        sent.append(batch)
        fate = data.draw(st.sampled_from(("deliver", "deliver", "drop", "twice", "replay")))
        if fate == "deliver":
            deliver(batch)
        elif fate == "twice":
            deliver(batch)
            deliver(batch)
        elif fate == "replay":
            deliver(batch)
            deliver(data.draw(st.sampled_from(sent)))
        # "drop": lost on the way
    # Reliable tail: deliver what is queued, then one more batch; resyncs are served.
    outbox.append(pub.batch(set(), set()))
    while outbox:
        deliver(outbox.pop(0))
    if streams.phase(KEY) is StreamPhase.STALE:
        # The dump answering the only resync request was lost: the facade asks again.
        assert streams.accept(KEY, 1, pub.next_sequence).action is StreamAction.REFUSED
        pub.next_sequence += 1
        for batch in pub.dump(2):
            deliver(batch)
    assert streams.phase(KEY) is StreamPhase.LIVE
    assert received == pub.state
