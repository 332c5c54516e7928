"""ReadPace: how long a batch read's thread sleeps before Mooncake's spinning wait."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clients.mooncake_engine import MooncakeConfig, ReadPace

MIB = 1 << 20


def test_no_sleep_before_a_read_has_succeeded() -> None:
    assert ReadPace().sleep_s(256 * MIB) == 0.0


def test_sleeps_its_share_of_the_predicted_time() -> None:
    pace = ReadPace(share=0.5)
    pace.observe(16 * MIB, 0.010)  # 10 ms for 16 MiB
    assert pace.sleep_s(16 * MIB) == pytest.approx(0.005)
    assert pace.sleep_s(32 * MIB) == pytest.approx(0.010)


def test_short_reads_are_not_slept_on_and_long_ones_are_capped() -> None:
    pace = ReadPace(share=0.5, min_sleep_s=0.001, max_sleep_s=0.1)
    pace.observe(MIB, 0.001)
    assert pace.sleep_s(MIB) == 0.0  # 0.5 ms: below the floor, a sleep would oversleep
    assert pace.sleep_s(4 * MIB) == pytest.approx(0.002)
    assert pace.sleep_s(1024 * MIB) == 0.1


def test_share_zero_never_sleeps() -> None:
    pace = ReadPace(share=0.0)
    pace.observe(MIB, 1.0)
    assert pace.sleep_s(1024 * MIB) == 0.0


def test_the_estimate_follows_the_reads() -> None:
    pace = ReadPace(share=0.5, alpha=0.5)
    pace.observe(MIB, 0.008)
    pace.observe(MIB, 0.004)  # halfway: 6 ms per MiB
    assert pace.sleep_s(MIB) == pytest.approx(0.003)


def test_nonsense_observations_change_nothing() -> None:
    pace = ReadPace()
    pace.observe(0, 0.01)
    pace.observe(MIB, -1.0)
    assert pace.seconds_per_byte is None


@pytest.mark.parametrize(
    "kwargs", [{"share": 1.0}, {"share": -0.1}, {"alpha": 0.0}, {"alpha": 1.5}]
)
def test_bad_pace_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ReadPace(**kwargs)


@pytest.mark.parametrize("share", [1.0, -0.5])
def test_the_engine_config_refuses_a_bad_share(share: float) -> None:
    with pytest.raises(ValueError, match="read_sleep_share"):
        MooncakeConfig(read_sleep_share=share)


@given(
    reads=st.lists(
        st.tuples(st.integers(1, 1 << 32), st.floats(0.0, 120.0, allow_nan=False)),
        min_size=1,
        max_size=50,
    ),
    nbytes=st.integers(1, 1 << 32),
)
def test_a_sleep_is_zero_or_between_the_floor_and_the_cap(
    reads: list[tuple[int, float]], nbytes: int
) -> None:
    """Whatever reads taught it (a minute-long stall included), a read waits at most the
    cap before it starts waiting for real."""
    pace = ReadPace(share=0.5, min_sleep_s=0.001, max_sleep_s=0.1)
    for size, seconds in reads:
        pace.observe(size, seconds)
    sleep = pace.sleep_s(nbytes)
    assert sleep == 0.0 or 0.001 <= sleep <= 0.1
