"""The cost gate in the runtime (I9-cost-gate), on a manual clock.

Loads are measured from their reports; a link measured slow stops getting grants
(`recompute_cheaper`, and its holder is not even asked to pin) while a fast one keeps
them; `min_blocks` stays the floor; a short pin below the worthwhile length misses;
the grant carries its prediction, status shows the estimates, and the outcome feeds
the prediction-error histogram.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from manual_rig import CHAIN, PROFILE, Rig, drain_outbound, manual_coordinator, settle

from coordinator.core.cost_model import CostConfig, DeclaredLink
from coordinator.core.grants import PrefixLoadAnswer, PrefixLoadRequest, TransferReport
from coordinator.core.leases import Outcome, SendAbort, SendPin, SendRelease
from coordinator.core.registry import RankPartRegistration
from coordinator.runtime.coordinator import Session
from kvrc.vocabulary import KvRegion, Tier, TransferEndpoint

BLOCK_BYTES = 65536
CHAIN_BYTES = BLOCK_BYTES * len(CHAIN)  # 8 blocks of 16 tokens: 128 tokens
# 1000 tokens/s: recomputing the chain is predicted at 128 ms.
COST = CostConfig(default_prefill_tokens_per_s=1000.0)


def register(rig: Rig, child: str) -> Session:
    endpoint = TransferEndpoint(regions=(KvRegion(0x1000, BLOCK_BYTES, 64),))
    reg = RankPartRegistration(child, 0, child, (0, 0, 0), PROFILE, endpoint=endpoint)
    return rig.coordinator.open_session(reg)


async def load(
    rig: Rig,
    holder: Session,
    request_id: str,
    *,
    pinned: int = len(CHAIN),
    duration_us: int = 0,
    min_blocks: int = 1,
    prefill: tuple[int, int] = (0, 0),
    report: bool = True,
    requester: str = "r",
    local_blocks: int = 0,
) -> PrefixLoadAnswer:
    """One prefix load by `requester`: the holder pins `pinned` (at most what it is asked
    for); a grant is reported done (`report=False`: left ACTIVE)."""
    c = rig.coordinator
    request = PrefixLoadRequest(
        request_id, requester, CHAIN, "", min_blocks, 0, 2_000, 10_000, local_blocks
    )
    drain_outbound(holder)
    task = asyncio.ensure_future(c.leases.request_prefix_load(request))
    await settle()
    pins = [m for m in drain_outbound(holder) if isinstance(m, SendPin)]
    if pins:
        pinned = min(pinned, len(pins[0].block_hashes))  # a holder pins what it is asked for
        c.leases.on_pin_result(
            holder.registration.child_engine_id, (0, 0, 0), pins[0].lease_id, pinned, b"d", ""
        )
    answer = await task
    if report and answer.view is not None and answer.view.prefix_load_grant is not None:
        rig.clock.advance(-(-duration_us // 1000))  # the read took that long
        c.leases.complete_prefix_load(
            TransferReport(
                answer.view.lease_id,
                requester,
                (0, 0, 0),
                Outcome.SUCCEEDED,
                BLOCK_BYTES * pinned,
                duration_us,
                "",
                *prefill,
            )
        )
    return answer


def granted(answer: PrefixLoadAnswer) -> str | None:
    grant = answer.view.prefix_load_grant if answer.view is not None else None
    return grant.source_child_engine_id if grant is not None else None


async def test_a_slow_measured_link_stops_getting_grants_and_a_fast_one_keeps_them() -> None:
    async with manual_coordinator(cost=COST) as rig:
        c = rig.coordinator
        register(rig, "r")
        slow, fast = register(rig, "slow"), register(rig, "fast")
        rig.store(slow)

        # Cold: the defaults (10 GB/s, 1 ms) make loading the chain worth it.
        first = await load(rig, slow, "s0", duration_us=400_000)
        assert granted(first) == "slow"
        assert first.prediction is not None and first.prediction.link.samples == 0
        assert first.prediction.worth_loading
        # Measured at 400 ms per load, the link soon loses to a 128 ms recompute.
        answers = [await load(rig, slow, f"s{i}", duration_us=400_000) for i in range(1, 6)]
        missed = [a for a in answers if a.miss_reason]
        assert missed, [granted(a) for a in answers]
        miss = missed[0]
        assert miss.miss_reason == "recompute_cheaper" and miss.view is None  # nothing pinned
        assert miss.prediction is not None and not miss.prediction.worth_loading
        assert "recompute" in miss.miss_detail and "slow->r" in miss.miss_detail
        assert not [m for m in drain_outbound(slow) if isinstance(m, SendPin)]

        # A fast holder of the same chain is chosen over the slow one, again and again.
        rig.store(fast)
        for i in range(4):
            answer = await load(rig, fast, f"f{i}", duration_us=2_000)
            assert granted(answer) == "fast", answer.miss_detail
        status = c.status().cost
        assert status is not None
        links = {key: estimate for key, estimate, _age_ms in status.links}
        assert (
            links[("slow", "r", Tier.GPU)].latency_ms
            + CHAIN_BYTES / (links[("slow", "r", Tier.GPU)].bandwidth_bytes_per_s / 1000)
            > 128 / COST.safety_margin
        )
        assert links[("fast", "r", Tier.GPU)].samples == 4
        metrics = c.metrics.registry
        assert metrics.get_sample_value(
            "kvrc_prefix_load_misses_total", {"reason": "recompute_cheaper"}
        )
        count = metrics.get_sample_value(
            "kvrc_cost_prediction_error_ratio_count", {"link": "measured"}
        )
        assert count is not None and count >= 4


async def test_with_the_gate_off_a_slow_link_still_gets_its_grants() -> None:
    # Negative control of the test above: the same reports, no gate, no misses.
    off = CostConfig(gate=False, default_prefill_tokens_per_s=1000.0)
    async with manual_coordinator(cost=off) as rig:
        register(rig, "r")
        slow = register(rig, "slow")
        rig.store(slow)
        answers = [await load(rig, slow, f"s{i}", duration_us=400_000) for i in range(6)]
        assert [granted(a) for a in answers] == ["slow"] * 6
        # The prediction is still made and carried: it says loading is not worth it.
        last = answers[-1].prediction
        assert last is not None and not last.worth_loading


async def test_min_blocks_stays_the_floor_and_a_short_pin_below_the_worthwhile_length_misses() -> (
    None
):
    # 40 ms latency x 1.5 against 16 ms per block: a load needs at least 4 blocks.
    cost = CostConfig(default_latency_ms=40.0, default_prefill_tokens_per_s=1000.0)
    async with manual_coordinator(cost=cost) as rig:
        register(rig, "r")
        holder = register(rig, "h")
        rig.store(holder, CHAIN[:4])
        # The cost would pay off, but min_blocks asks for more than is retained.
        floor = await load(rig, holder, "floor", min_blocks=5)
        assert floor.miss_reason == "below_min_blocks"
        # The holder pins fewer than the 4 worth loading: a miss, its pin released.
        drain_outbound(holder)
        short = await load(rig, holder, "short", pinned=3)
        assert short.miss_reason == "recompute_cheaper", short
        assert "4 blocks" in short.miss_detail
        assert any(isinstance(m, SendRelease) for m in drain_outbound(holder))
        # Four pinned blocks are worth it: granted, with the prediction for those four.
        enough = await load(rig, holder, "enough", pinned=4)
        assert granted(enough) == "h" and enough.prediction is not None
        assert enough.prediction.num_tokens == 64 and enough.prediction.num_bytes == 4 * BLOCK_BYTES


async def test_measured_prefill_rates_move_the_decision() -> None:
    # A slow default prefill makes a 50 ms link worth it; the engine then reports that it
    # prefills 100x faster, and recomputing wins.
    cost = CostConfig(default_latency_ms=50.0, default_prefill_tokens_per_s=1000.0)
    async with manual_coordinator(cost=cost) as rig:
        c = rig.coordinator
        register(rig, "r")
        holder = register(rig, "h")
        rig.store(holder)
        assert (await load(rig, holder, "a")).miss_reason == ""
        for i in range(20):
            # 1000 tokens in 10 ms: 100,000 tokens/s.
            answer = await load(rig, holder, f"b{i}", prefill=(1000, 10_000))
            if answer.miss_reason:
                break
        assert c.leases.cost_model.prefill("r").source == "measured"
        assert answer.miss_reason == "recompute_cheaper"
        assert answer.prediction is not None and answer.prediction.prefill.source == "measured"


async def test_a_measured_prefill_rate_expires_in_the_decision_and_in_status() -> None:
    """A measured rate never expired: an engine that got slower (or a stale sample)
    kept refusing loads, and `kvrc status` showed the rate as "measured" for ever."""
    cost = CostConfig(
        default_latency_ms=50.0, default_prefill_tokens_per_s=1000.0, measurement_ttl_s=60.0
    )
    async with manual_coordinator(cost=cost) as rig:
        c = rig.coordinator
        r = register(rig, "r")
        holder = register(rig, "h")
        rig.store(holder)
        for i in range(20):
            answer = await load(rig, holder, f"b{i}", prefill=(1000, 10_000))  # 100k tokens/s
            if answer.miss_reason:
                break
        assert answer.miss_reason == "recompute_cheaper"
        await rig.advance(60_000, r, holder)
        status = c.status().cost
        assert status is not None
        rates = dict(status.prefill_rates)
        assert (rates["r"].source, rates["r"].tokens_per_s) == ("default", 1000.0)
        again = await load(rig, holder, "after")
        assert granted(again) == "h", again.miss_detail
        assert again.prediction is not None and again.prediction.prefill.source == "default"


async def test_predict_load_sizes_a_prediction_from_the_registered_engines() -> None:
    # What the Score API asks: no lease, no pin, nothing changes.
    async with manual_coordinator(cost=COST) as rig:
        register(rig, "r")
        register(rig, "h")
        flow = rig.coordinator.leases
        p = flow.predict_load("h", "r", Tier.GPU, 8)
        assert p is not None
        assert (p.num_tokens, p.num_bytes) == (128, CHAIN_BYTES)
        assert p.saving_ms == p.recompute_ms - p.load_ms and p.recompute_ms == 128
        assert flow.predict_load("h", "nobody", Tier.GPU, 8) is None
        assert flow.cost_model.pair_count == 0 and not flow.open_leases()


async def test_predict_load_sees_a_fit_past_its_ttl_as_stale() -> None:
    """`predict_load` priced without the clock: a fit past its TTL still counted as
    measured there, while the grant made for the same load saw it as stale."""
    config = dataclasses.replace(COST, measurement_ttl_s=60.0)
    async with manual_coordinator(cost=config) as rig:
        r, h = register(rig, "r"), register(rig, "h")
        rig.store(h)
        assert granted(await load(rig, h, "a", duration_us=2_000)) == "h"
        flow = rig.coordinator.leases
        fresh = flow.predict_load("h", "r", Tier.GPU, 8)
        assert fresh is not None and fresh.link.samples == 1
        await rig.advance(60_000, r, h)
        stale = flow.predict_load("h", "r", Tier.GPU, 8)
        assert stale is not None
        assert (stale.link.samples, stale.link.prior) == (0, "stale")


async def test_a_cold_links_first_load_still_open_past_its_prediction_refuses_the_next() -> None:
    # Until the first report the cold link is only its prior (10 GB/s, 1 ms: 512 KiB in
    # ~1 ms). A load still open after 200 ms says the link is far slower than that:
    # a second load over it is refused before any pin. Counted on a manual clock.
    async with manual_coordinator(cost=COST) as rig:
        c = rig.coordinator
        r = register(rig, "r")
        slow = register(rig, "slow")
        rig.store(slow)
        first = await load(rig, slow, "s0", report=False)
        assert granted(first) == "slow"
        assert c.leases.core.cost.open_first_loads == 1
        # Negative control: open for 10 ms, still within what a 128 ms recompute allows.
        await rig.advance(10, r, slow)
        early = await load(rig, slow, "s1", report=False)
        assert granted(early) == "slow", early.miss_detail
        # Granted on the bound as of its request (s0: 512 KiB not moved in 10 - 1 ms), and
        # it carries that prediction: 10 ms, not the prior's 1.05 ms.
        assert early.prediction is not None and early.prediction.link.samples == 0
        assert early.prediction.load_ms == pytest.approx(10.0)
        await rig.advance(190, r, slow)  # s0 open for 200 ms, s1 for 190 ms
        refused = await load(rig, slow, "s2")
        assert refused.miss_reason == "recompute_cheaper" and refused.view is None
        assert refused.prediction is not None and refused.prediction.link.samples == 0
        assert refused.prediction.load_ms > 128 / COST.safety_margin
        assert not [m for m in drain_outbound(slow) if isinstance(m, SendPin)]
        # The first report is fast after all: the fit takes over and grants resume.
        for answer in (first, early):
            assert answer.view is not None
            c.leases.complete_prefix_load(
                TransferReport(
                    answer.view.lease_id, "r", (0, 0, 0), Outcome.SUCCEEDED,
                    CHAIN_BYTES, 2_000, "", 0, 0,
                )
            )  # fmt: skip
        await settle()
        assert c.leases.core.cost.open_first_loads == 0  # ended with their leases
        assert granted(await load(rig, slow, "s3", duration_us=2_000)) == "slow"


async def pin_asked(
    rig: Rig, holder: Session, request_id: str, requester: str = "r"
) -> tuple[int, PrefixLoadAnswer]:
    """One prefix load by `requester` whose holder pins all it is asked for, reported
    done: the number of chain blocks the pin asked for, and the answer."""
    c = rig.coordinator
    drain_outbound(holder)
    request = PrefixLoadRequest(request_id, requester, CHAIN, "", 1, 0, 2_000, 10_000)
    task = asyncio.ensure_future(c.leases.request_prefix_load(request))
    await settle()
    (pin,) = [m for m in drain_outbound(holder) if isinstance(m, SendPin)]
    child = holder.registration.child_engine_id
    c.leases.on_pin_result(child, (0, 0, 0), pin.lease_id, len(pin.block_hashes), b"", "")
    answer = await task
    assert answer.view is not None and answer.view.prefix_load_grant is not None
    rig.clock.advance(1)  # the read took 1 ms
    c.leases.complete_prefix_load(
        TransferReport(
            answer.view.lease_id, requester, (0, 0, 0), Outcome.SUCCEEDED,
            BLOCK_BYTES * len(pin.block_hashes), 1_000, "", 0, 0,
        )
    )  # fmt: skip
    await settle()
    return len(pin.block_hashes), answer


async def test_a_cold_undeclared_links_first_load_is_a_probe_of_probe_bytes() -> None:
    # 2 blocks' worth of probe: the holder is asked to pin the chain's first 2 blocks only,
    # the grant says why, and the probe's report is the link's first sample, after which
    # the whole chain is asked for. A declared link is trusted at once (the control).
    probing = CostConfig(default_prefill_tokens_per_s=1000.0, probe_bytes=2 * BLOCK_BYTES)
    async with manual_coordinator(cost=probing) as rig:
        register(rig, "r")
        cold = register(rig, "cold")
        rig.store(cold)
        blocks, probe = await pin_asked(rig, cold, "p0")
        assert blocks == 2 and probe.view is not None
        grant = probe.view.prefix_load_grant
        assert grant is not None and grant.matched_blocks == 2
        assert "a probe: 2 of the chain's 8 blocks" in probe.view.reason
        assert probe.prediction is not None and probe.prediction.num_bytes == 2 * BLOCK_BYTES
        probes = rig.coordinator.metrics.registry.get_sample_value
        assert probes("kvrc_cost_probes_total") == 1
        blocks, full = await pin_asked(rig, cold, "p1")  # measured now: the whole chain
        assert blocks == len(CHAIN) and full.view is not None and "probe" not in full.view.reason
        assert probes("kvrc_cost_probes_total") == 1
    declared = DeclaredLink(("known",), ("r",), bandwidth_bytes_per_s=1e10, latency_ms=1.0)
    async with manual_coordinator(cost=probing, declared_links=(declared,)) as rig:
        register(rig, "r")
        known = register(rig, "known")
        rig.store(known)
        blocks, trusted = await pin_asked(rig, known, "d0")
        assert blocks == len(CHAIN) and granted(trusted) == "known"
        assert rig.coordinator.metrics.registry.get_sample_value("kvrc_cost_probes_total") == 0


@pytest.mark.parametrize("reverse_prior", [True, False])
async def test_a_probed_links_reverse_is_not_probed_again(reverse_prior: bool) -> None:
    # cold -> r is probed (2 of 8 blocks) and measured; then r -> cold, the same pair the
    # other way, starts from that measurement and is asked for whole. With reverse_prior
    # off (the control) it is probed on its own.
    probing = CostConfig(
        default_prefill_tokens_per_s=1000.0,
        probe_bytes=2 * BLOCK_BYTES,
        reverse_prior=reverse_prior,
    )
    async with manual_coordinator(cost=probing) as rig:
        r = register(rig, "r")
        cold = register(rig, "cold")
        rig.store(cold)
        rig.store(r)
        blocks, _ = await pin_asked(rig, cold, "p0")
        assert blocks == 2
        blocks, back = await pin_asked(rig, r, "p1", requester="cold")
        assert back.prediction is not None and back.view is not None
        probes = rig.coordinator.metrics.registry.get_sample_value("kvrc_cost_probes_total")
        if reverse_prior:
            assert blocks == len(CHAIN) and "probe" not in back.view.reason
            assert back.prediction.link.prior == "reverse" and probes == 1
        else:
            assert blocks == 2 and "a probe: 2 of the chain's 8 blocks" in back.view.reason
            assert back.prediction.link.prior == "default" and probes == 2


# A probe of 2 of the chain's 8 blocks; a recompute of the chain is 128 ms.
PROBING = CostConfig(default_prefill_tokens_per_s=1000.0, probe_bytes=2 * BLOCK_BYTES)


async def test_a_slow_reverse_spares_no_probe_and_the_fast_direction_is_measured() -> None:
    # r -> h is measured slow first. h -> r, cold, would be refused on its reverse's
    # word and never measured; it is probed instead (priced on the defaults), found
    # fast, and then loads the whole chain.
    async with manual_coordinator(cost=PROBING) as rig:
        r, h = register(rig, "r"), register(rig, "h")
        rig.store(r)
        rig.store(h)
        back = await load(rig, r, "b0", requester="h", duration_us=400_000)
        assert granted(back) == "r" and back.view is not None and "a probe" in back.view.reason
        assert (await load(rig, r, "b1", requester="h")).miss_reason == "recompute_cheaper"
        forward = await load(rig, h, "f0", duration_us=1_000)
        assert granted(forward) == "h", forward.miss_detail
        assert (
            forward.view is not None and "a probe: 2 of the chain's 8 blocks" in forward.view.reason
        )
        assert forward.prediction is not None and forward.prediction.link.prior == "default"
        whole = await load(rig, h, "f1", duration_us=1_000)
        assert whole.view is not None and whole.view.prefix_load_grant is not None
        assert whole.view.prefix_load_grant.matched_blocks == len(CHAIN)
        assert whole.prediction is not None and whole.prediction.link.samples == 1


@pytest.mark.parametrize("ttl_s", [60.0, 0.0])
async def test_a_link_refused_as_slow_is_probed_again_once_its_fit_expires(ttl_s: float) -> None:
    # ttl 0 (fits never expire) is the control: the link stays refused for good.
    config = dataclasses.replace(PROBING, measurement_ttl_s=ttl_s)
    async with manual_coordinator(cost=config) as rig:
        r, slow = register(rig, "r"), register(rig, "slow")
        rig.store(slow)
        assert granted(await load(rig, slow, "s0", duration_us=400_000)) == "slow"  # a probe
        assert (await load(rig, slow, "s1")).miss_reason == "recompute_cheaper"
        await rig.advance(60_000, r, slow)
        status = rig.coordinator.status().cost
        assert status is not None
        ((_key, _estimate, age_ms),) = status.links
        assert age_ms is not None and age_ms >= 60_000
        again = await load(rig, slow, "s2", duration_us=1_000)  # the link got faster
        if not ttl_s:
            assert again.miss_reason == "recompute_cheaper"
            return
        assert granted(again) == "slow", again.miss_detail
        assert again.view is not None and "a probe: 2 of the chain's 8 blocks" in again.view.reason
        whole = await load(rig, slow, "s3", duration_us=1_000)
        assert whole.view is not None and whole.view.prefix_load_grant is not None
        assert whole.view.prefix_load_grant.matched_blocks == len(CHAIN)


async def test_the_blocks_the_requester_holds_are_not_priced() -> None:
    # A declared link of 30 ms latency; 16 ms to recompute a block. The whole chain (8
    # blocks, 128 ms) pays; the 2 blocks past a requester's 6 (32 ms) do not: 45 > 32.
    declared = DeclaredLink(("lat",), ("r",), bandwidth_bytes_per_s=1e12, latency_ms=30.0)
    async with manual_coordinator(cost=COST, declared_links=(declared,)) as rig:
        register(rig, "r")
        holder = register(rig, "lat")
        rig.store(holder)
        whole = await load(rig, holder, "w")
        assert granted(whole) == "lat" and whole.prediction is not None
        assert whole.prediction.num_tokens == 16 * len(CHAIN)
        tail = await load(rig, holder, "t", min_blocks=7, local_blocks=6)
        assert tail.miss_reason == "recompute_cheaper", tail
        assert tail.prediction is not None and tail.prediction.num_tokens == 16 * 2
        assert "recompute 32.00 ms" in tail.miss_detail


async def test_a_holder_with_no_more_than_the_requester_holds_is_not_asked() -> None:
    """A holder whose match ends where the requester's own does has nothing to move: it
    was asked to pin (gate off) or priced at 0 tokens as "recompute cheaper" (gate on)."""
    for gate in (COST, dataclasses.replace(COST, gate=False)):
        async with manual_coordinator(cost=gate) as rig:
            register(rig, "r")
            holder = register(rig, "h")
            rig.store(holder)
            answer = await load(rig, holder, "same", local_blocks=len(CHAIN))
            assert answer.miss_reason == "no_candidate" and answer.prediction is None, answer
            assert not [m for m in drain_outbound(holder) if isinstance(m, SendPin)]
            assert granted(await load(rig, holder, "one-more", local_blocks=len(CHAIN) - 1))


# --- what failed, quarantined or absurd loads teach the link (I9-cost-gate) ------------


def report(rig: Rig, answer: PrefixLoadAnswer, outcome: Outcome, **kw: int) -> None:
    """The requester's one part reports its load."""
    assert answer.view is not None
    values = {"bytes_moved": 0, "duration_us": 0, "rank": 0, **kw}
    rig.coordinator.leases.complete_prefix_load(
        TransferReport(
            answer.view.lease_id, answer.view.target_child_engine_id or "r",
            (values["rank"], 0, 0), outcome, values["bytes_moved"], values["duration_us"],
            "", 0, 0,
        )
    )  # fmt: skip


@pytest.mark.parametrize(("timeouts", "learnt"), [(2, True), (1, False), (0, False)])
async def test_loads_kvrc_aborted_at_their_deadline_teach_their_link(
    timeouts: int, learnt: bool
) -> None:
    """Loads that always time out used to be granted again and again on the prior: only
    a COMPLETED load was a sample. Two deadline aborts in a row teach the link; one (a
    requester's hiccup) does not, nor does a load that failed otherwise (a FAILED report
    5 s in, as when its holder died: the `timeouts == 0` control)."""
    async with manual_coordinator(cost=COST) as rig:
        r, h = register(rig, "r"), register(rig, "h")
        rig.store(h)
        for i in range(max(timeouts, 1)):
            first = await load(rig, h, f"f{i}", report=False)
            assert granted(first) == "h" and first.view is not None
            if timeouts:
                await rig.advance(10_500, r, h)  # past the load's 10 s transfer deadline
                aborts = [m for m in drain_outbound(r) if isinstance(m, SendAbort)]
                assert [a.lease_id for a in aborts] == [first.view.lease_id]
                rig.coordinator.leases.on_abort_ack("r", (0, 0, 0), first.view.lease_id)
            else:
                await rig.advance(5_000, r, h)
                report(rig, first, Outcome.FAILED)
            await settle()
        after = await load(rig, h, "after")
        assert (after.miss_reason == "recompute_cheaper") is learnt, after.miss_detail
        if not learnt:
            assert granted(after) == "h"


@pytest.mark.parametrize(
    ("failures", "duration_us", "learnt"),
    [(2, 5_000_000, True), (1, 5_000_000, False), (2, 0, False), (2, 500, False)],
)
async def test_loads_the_requester_gave_up_on_teach_their_link(
    failures: int, duration_us: int, learnt: bool
) -> None:
    """A requester whose own transfer timeout (shorter than kvrc's deadline) fired
    reported FAILED and taught nothing: the link kept being granted. Two such reports
    in a row, each past its prediction, teach it a censored sample, as two deadline
    aborts do; one (a hiccup), or ones without a duration or no slower than predicted
    (0.5 ms against ~1 ms), do not."""
    async with manual_coordinator(cost=COST) as rig:
        r, h = register(rig, "r"), register(rig, "h")
        rig.store(h)
        for i in range(failures):
            first = await load(rig, h, f"f{i}", report=False)
            assert granted(first) == "h"
            await rig.advance(-(-duration_us // 1000), r, h)  # it ran that long
            report(rig, first, Outcome.FAILED, duration_us=duration_us)
            await settle()
        after = await load(rig, h, "after")
        assert (after.miss_reason == "recompute_cheaper") is learnt, after.miss_detail
        if not learnt:
            assert granted(after) == "h"


async def test_failed_loads_of_a_holder_that_died_teach_nothing() -> None:
    """The same two slow FAILED reports, each after its holder's session closed (a
    holder killed): they say nothing of the link, and its restart loads again."""
    async with manual_coordinator(cost=COST) as rig:
        c = rig.coordinator
        r = register(rig, "r")
        for i in range(2):
            h = register(rig, "h")
            rig.store(h)
            first = await load(rig, h, f"k{i}", report=False)
            assert granted(first) == "h"
            await rig.advance(5_000, r, h)
            c.close_session(h, "killed")
            report(rig, first, Outcome.FAILED, duration_us=5_000_000)
            await settle()
        h = register(rig, "h")
        rig.store(h)
        after = await load(rig, h, "after")
        assert granted(after) == "h", after.miss_detail


async def test_failed_loads_kvrc_aborted_for_a_drain_teach_nothing() -> None:
    """A part told to stop by kvrc (a drain's deadline) ran as long as kvrc let it: its
    FAILED report says nothing of the link, however slow it looks."""
    async with manual_coordinator(cost=COST) as rig:
        c = rig.coordinator
        r, h = register(rig, "r"), register(rig, "h")
        rig.store(h)
        for i in range(2):
            first = await load(rig, h, f"d{i}", report=False)
            assert granted(first) == "h" and first.view is not None
            await c.leases.drain("r", 1_000, wait=False)  # r's loads aborted at 1 s
            await rig.advance(5_000, r, h)
            aborts = [m for m in drain_outbound(r) if isinstance(m, SendAbort)]
            assert [a.lease_id for a in aborts] == [first.view.lease_id]
            report(rig, first, Outcome.FAILED, duration_us=5_000_000)
            await settle()
            c.close_session(r, "restarted")  # gone past its grace: no longer draining
            await rig.advance(30_000, h)
            r = register(rig, "r")
        links = c.leases.cost_model.links(rig.clock.monotonic_ms())
        assert [key for key, *_ in links if key[:2] == ("h", "r")] == []


async def test_a_quarantined_load_does_not_lock_its_link_out() -> None:
    """A load whose read hangs (its outcome UNKNOWN, then quarantined) bounded its cold
    link's predictions while open: the bound shrank for ever, and the pair was refused
    every load, a probe included, until an operator resolved the quarantine."""
    async with manual_coordinator(cost=COST) as rig:
        c = rig.coordinator
        r, h = register(rig, "r"), register(rig, "h")
        rig.store(h)
        hung = await load(rig, h, "q0", report=False)
        assert granted(hung) == "h"
        report(rig, hung, Outcome.UNKNOWN)
        assert hung.view is not None
        await rig.advance(70_000, r, h)  # past the abort timeout: quarantined
        states = {v.lease_id: v.state.name for v in c.leases.open_leases()}
        assert states.get(hung.view.lease_id) == "QUARANTINED", states
        again = await load(rig, h, "q1")
        assert granted(again) == "h", again.miss_detail


@pytest.mark.parametrize(
    ("bytes_moved", "duration_us"), [(1 << 40, 1_000), (CHAIN_BYTES, 4_295_000_000)]
)
async def test_a_report_cannot_claim_more_bytes_or_time_than_its_load_had(
    bytes_moved: int, duration_us: int
) -> None:
    """One absurd report steered the fit for many loads: 2**40 bytes in 1 ms made the
    link look a thousand times faster than any load could show, 4,295 s reported 1 ms
    after the grant made it look too slow to load from."""
    async with manual_coordinator(cost=COST) as rig:
        c = rig.coordinator
        register(rig, "r")
        h = register(rig, "h")
        rig.store(h)
        model = c.leases.cost_model
        samples: list[tuple[int, int]] = []
        observe = model.observe_transfer

        def recorded(*args: Any, **kw: Any) -> bool:  # what the model is taught
            samples.append((args[3], args[4]))
            return observe(*args, **kw)

        model.observe_transfer = recorded  # type: ignore[method-assign]
        first = await load(rig, h, "a0", report=False)
        rig.clock.advance(1)
        report(rig, first, Outcome.SUCCEEDED, bytes_moved=bytes_moved, duration_us=duration_us)
        # At most the chain, in at most the 1 ms since it was asked for.
        assert samples == [(min(bytes_moved, CHAIN_BYTES), min(duration_us, 1_000))]
        assert granted(await load(rig, h, "a1", duration_us=1_000)) == "h"


async def test_a_holder_of_unknown_block_size_is_sized_by_its_first_load() -> None:
    """No regions, no layout: every load was priced on the link's latency alone and its
    report was capped at the 0 bytes it was predicted to move, so the link never
    learnt and a slow holder got every grant."""
    async with manual_coordinator(cost=COST) as rig:
        c = rig.coordinator
        register(rig, "r")
        unsized = RankPartRegistration("h", 0, "h", (0, 0, 0), PROFILE, endpoint=TransferEndpoint())
        h = c.open_session(unsized)
        rig.store(h)
        model = c.leases.cost_model
        assert model.block_bytes("h", 0) == 0

        first = await load(rig, h, "u0", duration_us=400_000)
        assert granted(first) == "h"
        assert first.prediction is not None and first.prediction.num_bytes == 0  # unknown
        assert model.block_bytes("h", 0) == BLOCK_BYTES  # CHAIN_BYTES over 8 blocks
        assert model.link("h", "r", Tier.GPU).samples == 1
        # Sized and measured at 400 ms a load, the link soon loses to a 128 ms recompute.
        answers = [await load(rig, h, f"u{i}", duration_us=400_000) for i in range(1, 6)]
        assert answers[0].prediction is not None
        assert answers[0].prediction.num_bytes == CHAIN_BYTES
        assert [a.miss_reason for a in answers if a.miss_reason][:1] == ["recompute_cheaper"]
        # A size the holder declares wins over the learnt one.
        assert model.block_bytes("h", 4096) == 4096


async def test_a_loads_prefill_sample_counts_once_whatever_its_parts() -> None:
    """Each requester part's report used to add the same prefill as one more sample."""
    tp2 = dataclasses.replace(PROFILE, tp_size=2)
    endpoint = TransferEndpoint(regions=(KvRegion(0x1000, BLOCK_BYTES, 64),))
    async with manual_coordinator(cost=COST) as rig:
        c = rig.coordinator
        sessions = {
            (child, rank): c.open_session(
                RankPartRegistration(child, 0, child, (rank, 0, 0), tp2, endpoint)
            )
            for child in ("r", "h")
            for rank in (0, 1)
        }
        rig.store(sessions["h", 0])
        rig.store(sessions["h", 1])
        request = PrefixLoadRequest("p0", "r", CHAIN, "", 1, 0, 2_000, 10_000)
        task = asyncio.ensure_future(c.leases.request_prefix_load(request))
        await settle()
        for rank in (0, 1):
            for pin in [m for m in drain_outbound(sessions["h", rank]) if isinstance(m, SendPin)]:
                c.leases.on_pin_result("h", (rank, 0, 0), pin.lease_id, len(CHAIN), b"d", "")
        answer = await task
        assert granted(answer) == "h" and answer.view is not None
        rig.clock.advance(1)
        for rank in (0, 1):
            c.leases.complete_prefix_load(
                TransferReport(
                    answer.view.lease_id, "r", (rank, 0, 0), Outcome.SUCCEEDED,
                    CHAIN_BYTES // 2, 1_000, "", 1000, 10_000,
                )
            )  # fmt: skip
        assert c.leases.cost_model.prefill("r").samples == 1
