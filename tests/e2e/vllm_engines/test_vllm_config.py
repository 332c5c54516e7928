"""Engine start and kvrc outages (items 1 and 4): two single-core engines, one per core.

* A bad `kv_connector_extra_config` fails the engine start with one message
  naming the field.
* With kvrc unreachable, the engine starts (after `register_timeout_s`) and
  serves: a handoff it is asked to take fails cleanly and the prompt is
  recomputed (`handoff_grant_failures`, `handoff_tokens_recomputed`), the workers
  count `kvrc_unavailable`; once kvrc comes up on its address, the engine's rank
  part registers by itself (reconnect with backoff) and kvrc shows it READY.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import free_port
from vllm_harness import Kvrc, VllmEngine, python_of_tests, random_prompt, workdir

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def bad_engine(vllm_python: str, tiny_model: Path) -> Iterator[VllmEngine]:
    """An engine with a bad config, started on core 1 while the other test runs on core 0
    (its start takes as long as a good one's: vLLM builds the connector with the KV caches)."""
    engine = VllmEngine(
        vllm_python,
        workdir("badconfig"),
        "bad",
        model=tiny_model,
        cores="1",
        extra={"min_blocks": 0},
    )
    try:
        yield engine
    finally:
        engine.close()


def test_kvrc_unreachable_the_engine_serves_then_reconnects(
    vllm_python: str, tiny_model: Path, bad_engine: VllmEngine
) -> None:
    work = workdir("nokvrc")
    port = free_port()
    extra = {"kvrc_target": f"127.0.0.1:{port}", "reuse": True, "register_timeout_s": 2}
    engine = VllmEngine(vllm_python, work, "lonely", model=tiny_model, cores="0", extra=extra)
    kvrc = None
    try:
        engine.wait_ready()
        prompt = random_prompt(61, 200)
        params = {
            "do_remote_prefill": True,
            "kvrc_handoff": True,
            "remote_engine_id": "prefill-nowhere",
            "transfer_id": "t-1",
        }
        started = time.monotonic()
        taken = engine.generate(prompt, max_tokens=12, kv_transfer_params=params)
        assert time.monotonic() - started < 60, "a handoff without kvrc must fail fast"
        assert engine.command({"op": "reset_prefix_cache"})["ok"]
        local = engine.generate(prompt, max_tokens=12)
        assert taken["tokens"] == local["tokens"]  # recomputed, same greedy output
        stats = engine.wait_stats("handoff_load_failures")
        assert stats["handoff_grant_failures"] == 1
        assert stats["handoff_tokens_recomputed"] == len(prompt)
        assert stats.get("prefix_load_loads", 0) == 0
        assert stats.get("workers_kvrc_unavailable", 0) >= 1

        kvrc = Kvrc(python_of_tests(), work, listen=f"127.0.0.1:{port}")
        give_up = time.monotonic() + 60
        while True:
            children = kvrc.status(python_of_tests())["child_engines"]
            if any(c["child_engine_id"] == "lonely" and c["ready"] for c in children):
                break
            assert time.monotonic() < give_up, f"the engine never registered: {children}"
            time.sleep(0.5)
        assert engine.generate(prompt, max_tokens=4)["tokens"] == local["tokens"][:4]
    finally:
        engine.close()
        if kvrc is not None:
            kvrc.close()


def test_a_bad_config_fails_engine_start_naming_the_field(bad_engine: VllmEngine) -> None:
    with pytest.raises(AssertionError):
        bad_engine.wait_ready(within_s=300)
    bad_engine.process.wait(60)
    assert bad_engine.process.returncode != 0
    assert "kv_connector_extra_config.min_blocks: must be >= 1, got 0" in bad_engine.stderr_tail(
        400
    )
