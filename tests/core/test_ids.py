"""kvrc/ids.py: vLLM's child-engine naming, read back the same way it is written."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvrc.ids import child_engine_id, format_rank, parse_child_engine_id, rank_grid


@given(
    st.text(alphabet="abcdefghij-_0123456789", min_size=1, max_size=20),
    st.integers(0, 63),
    st.integers(2, 64),
)
def test_a_dp_child_engine_id_parses_back(engine_id: str, dp_rank: int, dp_size: int) -> None:
    child = child_engine_id(engine_id, dp_rank, dp_size)
    assert child == f"{engine_id}_dp{dp_rank}"
    assert parse_child_engine_id(child) == (engine_id, dp_rank)


def test_one_dp_rank_is_the_bare_id_and_odd_suffixes_are_not_ranks() -> None:
    assert child_engine_id("prefill-0", 0, 1) == "prefill-0"
    assert parse_child_engine_id("prefill-0") == ("prefill-0", None)
    assert parse_child_engine_id("e_dp01") == ("e_dp01", None)  # vLLM never writes 01
    assert parse_child_engine_id("_dp3") == ("_dp3", None)


def test_the_grid_is_tp_outermost() -> None:
    assert list(rank_grid(2, 1, 2)) == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert format_rank((1, 0, 2)) == "(tp=1, pp=0, pcp=2)"
