"""Identity: child engine ids and the rank-part grid, as both sides name them."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from kvrc.vocabulary import RankKey

# The most rank parts (tp x pp x pcp) one child engine may have. Registration
# refuses more, and the lease table holds grids up to it, so every READY engine
# can hold a lease.
MAX_GRID_PARTS = 4096

_DP_SUFFIX = re.compile(r"^(?P<engine>.+)_dp(?P<rank>0|[1-9][0-9]*)$")


def child_engine_id(engine_id: str, dp_rank: int, dp_size: int) -> str:
    """vLLM's naming: `<engine_id>_dp<dp_rank>`, or the bare id for one DP rank."""
    return f"{engine_id}_dp{dp_rank}" if dp_size > 1 else engine_id


def parse_child_engine_id(child: str) -> tuple[str, int | None]:
    """(engine_id, dp_rank) of a child engine id; dp_rank None for a bare id."""
    m = _DP_SUFFIX.match(child)
    if m is None:
        return child, None
    return m.group("engine"), int(m.group("rank"))


def rank_grid(tp_size: int, pp_size: int, pcp_size: int) -> Iterator[RankKey]:
    """Every rank part of a tp x pp x pcp grid, tp outermost."""
    return itertools.product(range(tp_size), range(pp_size), range(pcp_size))


def format_rank(rank: RankKey) -> str:
    return f"(tp={rank[0]}, pp={rank[1]}, pcp={rank[2]})"
