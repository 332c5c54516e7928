"""A probe of a cold link with real processes: kvrc, two reference engines, Mooncake.

kvrc runs with probes of 1 MiB (`--cost-probe-mib 1`) and nothing declared. A block
of the reference engine (tp=1, 4 layers, 4 KV heads of 64, bf16, 16 tokens) is 64 KiB,
so a probe is 16 blocks. The first load over the p0 -> p1 link is a probe: p1 loads
the first 16 blocks of a 48-block prefix through Mooncake and recomputes the rest, and
its cache equals the test's own recomputation block for block (a probe must not leave
a seam between what was loaded and what was computed). The probe's report is the
link's first sample: the next load over the link moves the whole prefix. So does the
first load the other way, p1 -> p0: its reverse is measured (`--cost-reverse-prior`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import get_status
from refengine_blocks import assert_blocks_exact, call, connect, tokens

from clients.refengine.channel import Channel
from clients.refengine.demo import BLOCK_SIZE, Cluster, EngineGroup

pytestmark = pytest.mark.timeout(180)

PROBE_BLOCKS = 16  # 1 MiB of 64 KiB blocks
PREFIX_BLOCKS = 48


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Cluster, dict[str, EngineGroup]]]:
    c = Cluster(Path(tmp_path_factory.mktemp("probe")))
    try:
        c.start_coordinator("--cost-probe-mib", "1")
        extra = ["--mooncake-ports", "26000-26499"]
        groups: list[EngineGroup] = c.start_engines(
            [("p0", "prefill", 1, extra), ("p1", "prefill", 1, extra)]
        )
        yield c, {g.engine_id: g for g in groups}
    finally:
        c.stop()
    assert c.coordinator is not None
    assert "Traceback" not in c.coordinator.stderr_path.read_text(errors="replace")


@pytest.fixture
async def engines(
    cluster: tuple[Cluster, dict[str, EngineGroup]],
) -> AsyncIterator[dict[str, Channel]]:
    channels = await connect(cluster[1])
    yield channels
    for channel in channels.values():
        await channel.close()


async def prefill(engine: Channel, request_id: str, prompt: list[int]) -> Any:
    return await call(engine, "prefill", request_id=request_id, tokens=prompt)


async def test_a_cold_links_first_load_is_a_probe_and_the_next_loads_the_whole_prefix(
    cluster: tuple[Cluster, dict[str, EngineGroup]], engines: dict[str, Channel]
) -> None:
    kvrc, _ = cluster
    p0, p1 = engines["p0"], engines["p1"]
    tail = 10  # tokens past the prefix: the request's own
    first = tokens(1, PREFIX_BLOCKS * BLOCK_SIZE)
    computed = await prefill(p0, "probe-0", [*first, *tokens(2, tail)])
    assert computed["blocks_loaded"] == 0

    prompt = [*first, *tokens(3, tail)]
    probe = await prefill(p1, "probe-1", prompt)
    assert probe["load"] == "loaded" and probe["source"] == "p0", probe
    assert probe["blocks_loaded"] == PROBE_BLOCKS  # the probe, not the 48 blocks p0 holds
    assert probe["mismatches"] == 0
    assert await assert_blocks_exact(p1, prompt, tp_size=1) == len(prompt) // BLOCK_SIZE

    # Measured now: a second prefix over the same link loads whole.
    second = tokens(4, PREFIX_BLOCKS * BLOCK_SIZE)
    await prefill(p0, "whole-0", [*second, *tokens(5, tail)])
    whole = await prefill(p1, "whole-1", [*second, *tokens(6, tail)])
    assert whole["load"] == "loaded" and whole["blocks_loaded"] == PREFIX_BLOCKS, whole

    # The same pair the other way, p1 -> p0, has no sample of its own, but its reverse
    # is measured (--cost-reverse-prior, on by default): not probed, loaded whole.
    third = tokens(7, PREFIX_BLOCKS * BLOCK_SIZE)
    await prefill(p1, "back-1", [*third, *tokens(8, tail)])
    back_prompt = [*third, *tokens(9, tail)]
    back = await prefill(p0, "back-0", back_prompt)
    assert back["load"] == "loaded" and back["source"] == "p1", back
    assert back["blocks_loaded"] == PREFIX_BLOCKS, back
    assert await assert_blocks_exact(p0, back_prompt, tp_size=1) == len(back_prompt) // BLOCK_SIZE
    status = await get_status(kvrc.target)
    links = {
        (x.holder_child_engine_id, x.requester_child_engine_id) for x in status.cost_model.links
    }
    assert {("p0", "p1"), ("p1", "p0")} <= links
    assert status.cost_model.probe_bytes == 1 << 20 and status.cost_model.reverse_prior
