"""P/D handoff through KvrcConnector between two real vLLM engines (tp=1, one core each).

One kvrc with reuse OFF, a prefill engine P (`kv_producer`, core 0) and a decode
engine D (`kv_consumer`, core 1), both KvrcConnector; D asks for `reuse: true` (so
the coordinator's switch is what says no). P cannot: a `kv_producer` with reuse is a
configuration error (vLLM defers block frees for consumers only).

Where the KV came from is proven by the connector's own counters (the
scheduler side's stats file): D's `handoff_tokens_loaded` / `handoff_blocks_loaded`
(requests whose pull succeeded on every rank) and `workers_handoff_bytes` (bytes
Mooncake moved); P's `handoffs_freed` counts handoffs whose blocks vLLM freed
(finished_sending) after kvrc's release at quiescence.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    BLOCK_SIZE,
    Kvrc,
    VllmEngine,
    engines,
    metric_sum,
    open_leases,
    python_of_tests,
    random_prompt,
    workdir,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

KV_BYTES_PER_TOKEN = 1024  # the tiny model: 2 layers x (K, V) x 2 heads x 64 x bf16


class Pair:
    def __init__(self, kvrc: Kvrc, prefill: VllmEngine, decode: VllmEngine) -> None:
        self.kvrc, self.prefill, self.decode = kvrc, prefill, decode


@pytest.fixture(scope="module")
def pair(vllm_python: str, tiny_model: Path) -> Iterator[Pair]:
    work = workdir("pd")
    kvrc = Kvrc(python_of_tests(), work, "--reuse", "off")
    extra = {"kvrc_target": kvrc.target, "reuse": True, "test_faults": True}
    try:
        prefill = VllmEngine(
            vllm_python,
            work,
            "prefill-p",
            model=tiny_model,
            cores="0",
            kv_role="kv_producer",
            extra={**extra, "reuse": False},
            split_processes=True,  # the prefill frees its blocks while idle (vllm_harness)
        )
        decode = VllmEngine(
            vllm_python,
            work,
            "decode-d",
            model=tiny_model,
            cores="1",
            kv_role="kv_consumer",
            extra=extra,
            split_processes=True,  # the prefill frees its blocks while idle (vllm_harness)
        )
        with engines(prefill, decode):
            yield Pair(kvrc, prefill, decode)
    finally:
        kvrc.close()


def handoff(pair: Pair, prompt: list[int], *, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    """Prefill on P (max_tokens=1), then decode on D with P's kv_transfer_params."""
    first = pair.prefill.generate(
        prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "router_tag": "t1"}
    )
    params = first["kv_transfer_params"]
    assert params is not None, first
    return {
        "prefill": first,
        "params": params,
        "decode": pair.decode.generate(
            prompt, max_tokens=max_tokens, kv_transfer_params={**params, **extra}
        ),
    }


def test_pd_output_is_the_single_engine_output_and_kv_was_loaded(pair: Pair) -> None:
    prompt = random_prompt(1, 300)
    reference = pair.prefill.generate(prompt, max_tokens=24)["tokens"]  # single engine, greedy
    assert len(set(reference)) > 1, f"a degenerate reference output proves little: {reference}"
    before_d, before_p = pair.decode.stats(), pair.prefill.stats()

    result = handoff(pair, prompt)

    params = result["params"]
    # vLLM's Mooncake/NIXL field names, unknown fields passed through.
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-p"
    assert params["router_tag"] == "t1"
    assert params["tp_size"] == 1 and params["transfer_id"]
    assert len(params["remote_block_ids"]) == -(-len(prompt) // BLOCK_SIZE)
    assert result["prefill"]["tokens"] == reference[:1]
    assert result["decode"]["tokens"] == reference

    after = pair.decode.wait_stats("handoff_loads", before_d.get("handoff_loads", 0) + 1)
    # D loaded the whole prompt from P (its own counters), none recomputed.
    assert after.get("handoff_tokens_loaded", 0) - before_d.get("handoff_tokens_loaded", 0) == len(
        prompt
    )
    blocks = -(-len(prompt) // BLOCK_SIZE)
    assert after.get("workers_handoff_bytes", 0) - before_d.get("workers_handoff_bytes", 0) == (
        blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN
    )
    assert after.get("handoff_load_failures", 0) == before_d.get("handoff_load_failures", 0)
    # P freed the handoff's blocks only after kvrc's release (finished_sending).
    p_after = pair.prefill.wait_stats("handoffs_freed", before_p.get("handoffs_freed", 0) + 1)
    assert p_after["handoffs_freed"] == before_p.get("handoffs_freed", 0) + 1
    assert p_after.get("handoff_hold_expired", 0) == 0
    assert p_after.get("handoffs_published", 0) >= 1  # from the scheduler side, every rank


def test_corrupted_loaded_kv_changes_the_output(pair: Pair) -> None:
    """Negative control (e): the comparison above can fail."""
    prompt = random_prompt(2, 300)
    reference = pair.prefill.generate(prompt, max_tokens=24)["tokens"]
    before = pair.decode.stats()

    result = handoff(pair, prompt, kvrc_test_fault="corrupt")

    stats = pair.decode.wait_stats(
        "workers_test_corrupted_loads", before.get("workers_test_corrupted_loads", 0) + 1
    )
    assert (
        stats["workers_test_corrupted_loads"] == before.get("workers_test_corrupted_loads", 0) + 1
    )
    assert result["decode"]["tokens"] != reference


def test_reuse_off_means_no_prefix_loads_but_handoffs_work(pair: Pair) -> None:
    """(d): kvrc's reuse switch is off; D asks (reuse: true) and gets no prefix load."""
    prompt = random_prompt(3, 320)
    reference = pair.prefill.generate(prompt, max_tokens=16)["tokens"]  # P now holds it
    out = pair.decode.generate(prompt, max_tokens=16)  # no handoff params: a plain request
    assert out["tokens"] == reference
    stats = pair.decode.stats()
    assert stats.get("prefix_grants", 0) == 0
    assert stats.get("prefix_load_loads", 0) == 0
    assert out["num_cached_tokens"] == 0  # computed locally, nothing loaded
    # ... while handoffs keep working on the same engines.
    assert handoff(pair, random_prompt(4, 100), max_tokens=8)["decode"]["tokens"]


def test_decode_killed_mid_pull_the_prefill_frees_its_blocks(pair: Pair) -> None:
    """A prefill whose decode peer vanished frees the handoff's blocks once kvrc ends the
    lease: P's `handoffs_freed` (vLLM's finished_sending), kvrc's lease gauge back to 0.
    The last test of the module: D is gone after it."""
    prompt = random_prompt(5, 300)
    first = pair.prefill.generate(
        prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    before_p = pair.prefill.stats()
    params = {**first["kv_transfer_params"], "kvrc_test_fault": "delay-before-pull=5"}
    assert pair.decode.process.stdin is not None
    command = {
        "op": "generate",
        "prompts": [prompt],
        "max_tokens": 8,
        "kv_transfer_params": [params],
    }
    pair.decode.process.stdin.write(json.dumps(command) + "\n")  # no answer will come
    pair.decode.process.stdin.flush()
    give_up = time.monotonic() + 30
    # D took the handoff (the lease is ACTIVE); its worker waits before the read
    while metric_sum(pair.kvrc, "kvrc_leases", flow="handoff", state="active") == 0:
        assert time.monotonic() < give_up, "D never took the handoff"
        time.sleep(0.05)
    pair.decode.signal(signal.SIGKILL)
    freed = pair.prefill.wait_stats(
        "handoffs_freed", before_p.get("handoffs_freed", 0) + 1, within_s=90
    )
    assert freed["handoffs_freed"] == before_p.get("handoffs_freed", 0) + 1
    # kvrc released it, not the safety timer
    assert freed.get("handoff_hold_expired", 0) + freed.get("workers_handoff_hold_expired", 0) == 0
    give_up = time.monotonic() + 60
    while open_leases(pair.kvrc) > 0:
        assert time.monotonic() < give_up, "kvrc's handoff lease never ended"
        time.sleep(0.2)
