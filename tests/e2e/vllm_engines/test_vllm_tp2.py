"""Tensor parallelism 2 (item 12): P/D between two tp=2 vLLM engines, and a tp=1 peer refused.

Both engines run tp=2 with one core per rank (`VLLM_CPU_OMP_THREADS_BIND="0|1"`):
four vLLM workers, each a kvrc rank part registering its own KV tensors (one KV
head of the two) and pulling its own slice from the matching prefill rank.

* kvrc shows each child engine READY with parts 2/2 (readiness over several rank parts);
* D's output equals a single-engine run; D's counters: `handoff_tokens_loaded`,
  `workers_handoff_bytes` (both ranks' slices: all the KV), `workers_handoff_loads` = 2
  (one pull per rank part);
* a tp=1 decode engine asked to take a tp=2 prefill's handoff refuses it by layout
  before any byte moves (`workers_handoff_refused`), recomputes, same output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_harness import (
    BLOCK_SIZE,
    Kvrc,
    VllmEngine,
    engines,
    python_of_tests,
    random_prompt,
    workdir,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

KV_BYTES_PER_TOKEN = 1024
SLOW_S = 400  # one request may wait out the 120 s handoff wait and then recompute


def test_pd_between_tp2_engines_and_a_tp1_peer_is_refused(
    vllm_python: str, tiny_model: Path
) -> None:
    work = workdir("tp2")
    # Four vLLM workers and two engine cores share the two cores here (load average
    # about 10): in CI runs of 2026-12-03 one rank's Mooncake read took over 10 s, and
    # once the prefill's publish came after the decode's 15 s handoff wait. Every bound
    # is generous; the test is about layouts, not speed.
    kvrc = Kvrc(python_of_tests(), work, "--reuse", "off", "--heartbeat-timeout-ms", "60000")
    extra = {
        "kvrc_target": kvrc.target,
        "transfer_timeout_ms": 60_000,
        "handoff_wait_ms": 120_000,
    }
    try:
        prefill = VllmEngine(
            vllm_python,
            work,
            "prefill-tp2",
            model=tiny_model,
            cores="0|1",
            tp=2,
            kv_role="kv_producer",
            extra=extra,
        )
        decode = VllmEngine(
            vllm_python,
            work,
            "decode-tp2",
            model=tiny_model,
            cores="0|1",
            tp=2,
            kv_role="kv_consumer",
            extra=extra,
        )
        prompt = random_prompt(41, 300)
        blocks = -(-len(prompt) // BLOCK_SIZE)
        with engines(prefill, decode):
            status = {
                c["child_engine_id"]: c for c in kvrc.status(python_of_tests())["child_engines"]
            }
            for name in ("prefill-tp2", "decode-tp2"):
                assert status[name]["ready"] is True
                assert (status[name]["parts_present"], status[name]["parts_expected"]) == (2, 2)
            # A first handoff (another prompt, outcome not asserted) opens the rank-to-rank
            # Mooncake TCP sessions. In a CI run of 2026-12-04 that first read stalled for
            # Mooncake's own 30 s transfer timeout under this load ("no transfer progress
            # within 30s"); kvrc's connector recomputed it correctly.
            warm = random_prompt(40, 100)
            warm_params = prefill.generate(
                warm, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, within_s=SLOW_S
            )["kv_transfer_params"]
            decode.generate(warm, max_tokens=1, kv_transfer_params=warm_params, within_s=SLOW_S)
            before = decode.stats()
            reference = prefill.generate(prompt, max_tokens=16, within_s=SLOW_S)["tokens"]
            first = prefill.generate(
                prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, within_s=SLOW_S
            )
            params = first["kv_transfer_params"]
            assert params["tp_size"] == 2
            out = decode.generate(prompt, max_tokens=16, kv_transfer_params=params, within_s=SLOW_S)
            assert out["tokens"] == reference
            loads = before.get("handoff_loads", 0) + 1
            stats = decode.wait_stats("handoff_loads", at_least=loads)

            def grew(key: str) -> int:
                return int(stats.get(key, 0)) - int(before.get(key, 0))

            # Not loaded means recomputed (the same tokens): say why, from every log.
            assert grew("handoff_tokens_loaded") == len(prompt), decode.diagnosis(kvrc)
            assert grew("workers_handoff_loads") == 2  # one pull per rank part
            assert grew("workers_handoff_bytes") == blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN
            assert grew("handoff_load_failures") == 0
            decode.close()  # two engines at most: the tp=1 peer takes D's place

            tp1 = VllmEngine(
                vllm_python,
                work,
                "decode-tp1",
                model=tiny_model,
                cores="1",
                kv_role="kv_consumer",
                extra=extra,
            )
            with engines(tp1):
                # published once the peer is up (kvrc fails a READY handoff nobody takes in 120 s)
                second = prefill.generate(
                    prompt,
                    max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True},
                    within_s=SLOW_S,
                )
                out = tp1.generate(
                    prompt,
                    max_tokens=16,
                    kv_transfer_params=second["kv_transfer_params"],
                    within_s=SLOW_S,
                )
                assert out["tokens"] == reference  # recomputed
                stats = tp1.wait_stats("handoff_load_failures")
                assert stats["handoff_load_failures"] == 1
                assert stats["workers_handoff_refused"] == 1
                assert stats.get("workers_handoff_bytes", 0) == 0  # refused before any byte moved
            # The first (warm-up) handoff, the asserted one, the refused one.
            assert prefill.wait_stats("handoffs_freed", 3)["handoffs_freed"] == 3
    finally:
        kvrc.close()
