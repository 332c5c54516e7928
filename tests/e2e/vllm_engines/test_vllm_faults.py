"""Prefix loads whose holder freezes (SIGSTOP) or dies (kill -9) mid-load, real vLLM engines.

Holder H (core 0) and requester R (core 1), reuse on. R's request carries the
test fault `delay-before-pull=S` (KvrcConnectorConfig.test_faults), so that
the holder can be stopped or killed between the grant (its pin) and R's read.

* (g) late writes: H is frozen while R reads; R's read passes its deadline
  (UNKNOWN) but Mooncake's call is still inside the frozen peer and may write
  later. R must not hand the destination blocks back for recompute (or to another
  request) until that read returned and settled: R's request stays waiting while
  H is stopped, finishes only after SIGCONT, recomputes, and its output equals
  the single-engine run. Counters: R's `workers_prefix_load_held_until_quiet`,
  `prefix_load_load_failures`, `prefix_load_tokens_recomputed`.
* (c) H is killed: R's read fails, R recomputes (same output), kvrc's lease ends
  (kvrc_leases gauge back to 0), nothing hangs.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    Kvrc,
    VllmEngine,
    engines,
    generate_published,
    open_leases,
    random_prompt,
    reuse_on_kvrc,
    workdir,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

DELAY_S = 3.0
TRANSFER_TIMEOUT_MS = 1500


class Cluster:
    def __init__(self, kvrc: Kvrc, holder: VllmEngine, requester: VllmEngine) -> None:
        self.kvrc, self.holder, self.requester = kvrc, holder, requester


@pytest.fixture(scope="module")
def cluster(vllm_python: str, tiny_model: Path) -> Iterator[Cluster]:
    work = workdir("faults")
    kvrc = reuse_on_kvrc(
        work,
        "--heartbeat-interval-ms",
        "200",
        "--heartbeat-timeout-ms",
        "2000",
        "--session-grace-ms",
        "500",
    )
    extra = {
        "kvrc_target": kvrc.target,
        "reuse": True,
        "test_faults": True,
        "transfer_timeout_ms": TRANSFER_TIMEOUT_MS,
    }

    def engine(name: str, core: str) -> VllmEngine:
        return VllmEngine(
            vllm_python,
            work,
            name,
            model=tiny_model,
            cores=core,
            extra=extra,
            kv_events=True,
        )

    try:
        holder, requester = engine("holder-h", "0"), engine("requester-r", "1")
        with engines(holder, requester):
            yield Cluster(kvrc, holder, requester)
    finally:
        kvrc.close()


def generate_in_background(
    engine: VllmEngine, prompt: list[int], **kw: Any
) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = engine.generate(prompt, within_s=180, **kw)
        except BaseException as e:
            box["error"] = e
        box["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def wait_until(predicate: Any, within_s: float, what: str) -> None:
    give_up = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"not within {within_s} s: {what}")
        time.sleep(0.1)


def test_late_writes_hold_the_blocks_until_the_read_is_quiet(cluster: Cluster) -> None:
    """(g): a holder under SIGSTOP during R's read."""
    prompt = random_prompt(21, 320)
    reference = generate_published(cluster.kvrc, cluster.holder, prompt, max_tokens=16)["tokens"]
    before = cluster.requester.stats()

    thread, box = generate_in_background(
        cluster.requester,
        prompt,
        max_tokens=16,
        kv_transfer_params={"kvrc_test_fault": f"delay-before-pull={DELAY_S}"},
    )
    wait_until(
        lambda: cluster.requester.stats().get("prefix_grants", 0) > before.get("prefix_grants", 0),
        30,
        "R was granted the prefix load",
    )
    cluster.holder.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        # R's read starts against the frozen H, passes its deadline, and stays unquiet:
        # R must keep the request (and its blocks) waiting.
        time.sleep(DELAY_S + TRANSFER_TIMEOUT_MS / 1000 + 3.0)
        assert "out" not in box, "R used or recomputed blocks a frozen read may still write"
    finally:
        cluster.holder.signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    thread.join(120)
    assert "error" not in box, box.get("error")
    assert box["at"] >= resumed_at > stopped_at
    assert box["out"]["tokens"] == reference
    stats = cluster.requester.wait_stats(
        "prefix_load_load_failures", before.get("prefix_load_load_failures", 0) + 1
    )
    assert stats["prefix_load_load_failures"] == before.get("prefix_load_load_failures", 0) + 1
    assert stats.get("workers_prefix_load_held_until_quiet", 0) == (
        before.get("workers_prefix_load_held_until_quiet", 0) + 1
    )
    assert stats.get("prefix_load_tokens_recomputed", 0) > before.get(
        "prefix_load_tokens_recomputed", 0
    )
    wait_until(lambda: open_leases(cluster.kvrc) == 0, 60, "kvrc's lease ended")


def test_holder_killed_mid_load_requester_recomputes(cluster: Cluster) -> None:
    """(c): kill -9 of the holder between the grant and R's read (the last test: H is gone)."""
    prompt = random_prompt(22, 320)
    reference = generate_published(cluster.kvrc, cluster.holder, prompt, max_tokens=16)["tokens"]
    before = cluster.requester.stats()

    thread, box = generate_in_background(
        cluster.requester,
        prompt,
        max_tokens=16,
        kv_transfer_params={"kvrc_test_fault": f"delay-before-pull={DELAY_S}"},
    )
    wait_until(
        lambda: cluster.requester.stats().get("prefix_grants", 0) > before.get("prefix_grants", 0),
        30,
        "R was granted the prefix load",
    )
    cluster.holder.signal(signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive(), "R's request hangs after its holder died"
    assert "error" not in box, box.get("error")
    assert box["out"]["tokens"] == reference
    stats = cluster.requester.wait_stats(
        "prefix_load_load_failures", before.get("prefix_load_load_failures", 0) + 1
    )
    assert stats["prefix_load_load_failures"] == before.get("prefix_load_load_failures", 0) + 1
    # The read failed and settled: nothing could still land, so no block was held.
    assert stats.get("workers_prefix_load_held_until_quiet", 0) == before.get(
        "workers_prefix_load_held_until_quiet", 0
    )
    wait_until(lambda: open_leases(cluster.kvrc) == 0, 60, "kvrc's lease ended")
    # R still serves, with nothing to load from.
    assert cluster.requester.generate(random_prompt(23, 64), max_tokens=4)["tokens"]
