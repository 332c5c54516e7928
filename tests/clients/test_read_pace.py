"""ReadPace: how long a batch read's thread sleeps before Mooncake's spinning wait."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clients.mooncake_engine import MooncakeConfig, ReadPace

MIB = 1 << 20
PEER = "10.0.0.2:15001"


def learnt(pace: ReadPace, nbytes: int, seconds: float, peer: str = PEER) -> ReadPace:
    """A peer's first read (unlearnt), then one read of `nbytes` in `seconds`."""
    pace.observe(peer, nbytes, 0.0, 1.0)
    pace.observe(peer, nbytes, 0.0, seconds)
    return pace


def test_no_sleep_before_a_peer_has_taught_anything() -> None:
    pace = ReadPace()
    assert pace.sleep_s(PEER, 256 * MIB) == 0.0
    pace.observe(PEER, 16 * MIB, 0.0, 5.0)  # the first read set up the connection
    assert pace.seconds_per_byte(PEER) is None
    assert pace.sleep_s(PEER, 256 * MIB) == 0.0


def test_sleeps_its_share_of_the_predicted_time() -> None:
    pace = learnt(ReadPace(share=0.5), 16 * MIB, 0.010)  # 10 ms for 16 MiB
    assert pace.sleep_s(PEER, 16 * MIB) == pytest.approx(0.005)
    assert pace.sleep_s(PEER, 32 * MIB) == pytest.approx(0.010)


def test_each_peer_has_its_own_estimate() -> None:
    pace = learnt(ReadPace(), 16 * MIB, 0.010)
    learnt(pace, 16 * MIB, 0.100, peer="10.0.0.3:15001")  # a slow link
    assert pace.sleep_s(PEER, 16 * MIB) == pytest.approx(0.005)
    assert pace.sleep_s("10.0.0.3:15001", 16 * MIB) == pytest.approx(0.050)
    assert pace.sleep_s("10.0.0.4:15001", 16 * MIB) == 0.0


def test_short_reads_are_not_slept_on_and_long_ones_are_capped() -> None:
    pace = learnt(ReadPace(share=0.5, min_sleep_s=0.001, max_sleep_s=0.1), MIB, 0.001)
    assert pace.sleep_s(PEER, MIB) == 0.0  # 0.5 ms: below the floor, a sleep would oversleep
    assert pace.sleep_s(PEER, 4 * MIB) == pytest.approx(0.002)
    assert pace.sleep_s(PEER, 1024 * MIB) == 0.1


def test_share_zero_never_sleeps() -> None:
    pace = learnt(ReadPace(share=0.0), MIB, 1.0)
    assert pace.sleep_s(PEER, 1024 * MIB) == 0.0


def test_the_estimate_follows_the_reads() -> None:
    pace = learnt(ReadPace(share=0.5, alpha=0.5), MIB, 0.008)
    pace.observe(PEER, MIB, 0.002, 0.002)  # 4 ms in all: halfway to 6 ms per MiB
    assert pace.sleep_s(PEER, MIB) == pytest.approx(0.003)


def test_a_read_that_ended_during_its_sleep_halves_the_estimate() -> None:
    """A too-slow estimate (a stalled read) costs a few reads, not dozens: a wait that
    returns at once means the sleep was too long by an unknown amount."""
    pace = learnt(ReadPace(share=0.5, oversleep_s=0.0002), MIB, 0.100)
    assert pace.sleep_s(PEER, MIB) == pytest.approx(0.050)
    pace.observe(PEER, MIB, 0.050, 0.00001)  # done before the sleep ended
    assert pace.sleep_s(PEER, MIB) == pytest.approx(0.025)
    pace.observe(PEER, MIB, 0.025, 0.00001)
    assert pace.sleep_s(PEER, MIB) == pytest.approx(0.0125)


def test_the_peers_kept_are_bounded() -> None:
    pace = ReadPace(max_peers=2)
    for peer in ("a:1", "b:1", "c:1"):
        learnt(pace, MIB, 0.01, peer=peer)
    assert pace.seconds_per_byte("a:1") is None  # the least recently read, dropped
    assert pace.seconds_per_byte("c:1") is not None


def test_nonsense_observations_change_nothing() -> None:
    pace = ReadPace()
    pace.observe(PEER, 0, 0.0, 0.01)
    pace.observe(PEER, MIB, -1.0, 0.01)
    pace.observe(PEER, MIB, 0.0, -1.0)
    pace.observe(PEER, MIB, 0.0, 0.01)  # now the first read
    assert pace.seconds_per_byte(PEER) is None


@pytest.mark.parametrize(
    "kwargs", [{"share": 1.0}, {"share": -0.1}, {"alpha": 0.0}, {"alpha": 1.5}, {"max_peers": 0}]
)
def test_bad_pace_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ReadPace(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("share", [1.0, -0.5])
def test_the_engine_config_refuses_a_bad_share(share: float) -> None:
    with pytest.raises(ValueError, match="read_sleep_share"):
        MooncakeConfig(read_sleep_share=share)


@given(
    reads=st.lists(
        st.tuples(
            st.integers(1, 1 << 32),
            st.floats(0.0, 0.1, allow_nan=False),
            st.floats(0.0, 120.0, allow_nan=False),
        ),
        min_size=1,
        max_size=50,
    ),
    nbytes=st.integers(1, 1 << 32),
)
def test_a_sleep_is_zero_or_between_the_floor_and_the_cap(
    reads: list[tuple[int, float, float]], nbytes: int
) -> None:
    """Whatever reads taught it (a minute-long stall included), a read waits at most the
    cap before it starts waiting for real."""
    pace = ReadPace(share=0.5, min_sleep_s=0.001, max_sleep_s=0.1)
    for size, slept, waited in reads:
        pace.observe(PEER, size, slept, waited)
    sleep = pace.sleep_s(PEER, nbytes)
    assert sleep == 0.0 or 0.001 <= sleep <= 0.1
