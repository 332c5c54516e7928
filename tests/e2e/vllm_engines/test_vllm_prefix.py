"""Prefix loads between two real vLLM engines through kvrc (reuse on), tp=1, one core each.

kvrc probes a link neither measured nor declared with 1 MiB (`--cost-probe-mib 1`):
the first test's load is such a probe, shorter than what the holder could lend.

Engine A (core 0) and engine B (core 1) both run KvrcConnector with `reuse: true`
and vLLM's own ZMQ KV-event publisher, which kvrc ingests: the inventory holds
vLLM's block hashes (the 64-bit int form of vLLM's KV events), and B's lookup
converts its `request.block_hashes` with vLLM's `maybe_convert_block_hash`.

Where KV came from: B's connector counters `prefix_grants`, `prefix_load_loads`,
`prefix_load_tokens_loaded` (scheduler side: grants taken and loads whose every
rank part succeeded) and `workers_prefix_load_bytes` (bytes Mooncake moved);
A's `pins` / `pins_released` (pins taken in vLLM's block pool and released at
kvrc's ReleaseRequest). vLLM's own `num_cached_tokens` of B's request counts
the loaded tokens as cached.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    BLOCK_SIZE,
    Kvrc,
    VllmEngine,
    engines,
    generate_published,
    python_of_tests,
    random_prompt,
    reuse_on_kvrc,
    workdir,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

KV_BYTES_PER_TOKEN = 1024
# kvrc probes a link neither measured nor declared with 1 MiB: 32 blocks of 32 tokens.
PROBE_BLOCKS = (1 << 20) // (BLOCK_SIZE * KV_BYTES_PER_TOKEN)


class Cluster:
    def __init__(self, kvrc: Kvrc, a: VllmEngine, b: VllmEngine) -> None:
        self.kvrc, self.a, self.b = kvrc, a, b


@pytest.fixture(scope="module")
def cluster(vllm_python: str, tiny_model: Path) -> Iterator[Cluster]:
    work = workdir("prefix")
    kvrc = reuse_on_kvrc(work, "--cost-probe-mib", "1")
    # A lookup may wait for kvrc over several steps (`delay-lookup` below).
    extra = {
        "kvrc_target": kvrc.target,
        "reuse": True,
        "min_blocks": 2,
        "test_faults": True,
        "lookup_timeout_ms": 5_000,
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
        a, b = engine("engine-a", "0"), engine("engine-b", "1")
        with engines(a, b):
            yield Cluster(kvrc, a, b)
    finally:
        kvrc.close()


def links_measured(cluster: Cluster) -> set[tuple[str, str]]:
    cost = cluster.kvrc.status(python_of_tests())["cost_model"]
    return {(x["holder_child_engine_id"], x["requester_child_engine_id"]) for x in cost["links"]}


def test_a_cold_links_first_load_is_a_probe_and_vllm_computes_the_rest(cluster: Cluster) -> None:
    """First in the module: no load has used B -> A yet (the other tests load A -> B,
    and the local-hit test B -> A only after this one). A 48-block prompt that B holds:
    A's load over the cold link is a probe of 32 blocks, not the 47 B could lend, and
    vLLM computes the rest; the output is B's own."""
    assert ("engine-b", "engine-a") not in links_measured(cluster), "not the link's first load"
    prompt = random_prompt(15, 48 * BLOCK_SIZE)
    reference = generate_published(cluster.kvrc, cluster.b, prompt, max_tokens=16)["tokens"]
    before = cluster.a.stats()

    out = cluster.a.generate(prompt, max_tokens=16)

    assert out["tokens"] == reference
    stats = cluster.a.wait_stats("prefix_load_loads", before.get("prefix_load_loads", 0) + 1)
    loaded = stats["prefix_load_tokens_loaded"] - before.get("prefix_load_tokens_loaded", 0)
    assert loaded == PROBE_BLOCKS * BLOCK_SIZE, stats  # not (48 - 1) blocks
    moved = stats["workers_prefix_load_bytes"] - before.get("workers_prefix_load_bytes", 0)
    assert moved == PROBE_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN
    assert ("engine-b", "engine-a") in links_measured(cluster)  # the probe measured it


def test_b_loads_the_prefix_that_a_holds(cluster: Cluster) -> None:
    prompt = random_prompt(11, 320)  # 10 blocks; 9 loadable (vLLM computes the last token)
    # Single engine; its KV events reach kvrc after the answer, so wait for them.
    reference = generate_published(cluster.kvrc, cluster.a, prompt, max_tokens=24)["tokens"]
    before_b, before_a = cluster.b.stats(), cluster.a.stats()

    # kvrc answers B's lookup half a second late: vLLM's scheduler goes on without the
    # request (the connector answers `None`, "ask again") and takes the grant later.
    slow = {"kvrc_test_fault": "delay-lookup=0.5"}
    out = cluster.b.generate(prompt, max_tokens=24, kv_transfer_params=slow)

    assert out["tokens"] == reference
    stats = cluster.b.wait_stats("prefix_load_loads", before_b.get("prefix_load_loads", 0) + 1)
    loaded_blocks = (len(prompt) - 1) // BLOCK_SIZE
    assert stats.get("prefix_grants", 0) == before_b.get("prefix_grants", 0) + 1, stats
    deferred = stats["prefix_lookups_deferred"] - before_b.get("prefix_lookups_deferred", 0)
    assert deferred == 1, stats  # vLLM asked again, and the answer was taken then
    assert stats["prefix_load_tokens_loaded"] - before_b.get("prefix_load_tokens_loaded", 0) == (
        loaded_blocks * BLOCK_SIZE
    )
    assert stats["workers_prefix_load_bytes"] - before_b.get("workers_prefix_load_bytes", 0) == (
        loaded_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN
    )
    assert out["num_cached_tokens"] >= loaded_blocks * BLOCK_SIZE, out
    # A pinned the blocks in its block pool for the lease and released them at quiescence.
    a_stats = cluster.a.wait_stats("pins_released", before_a.get("pins_released", 0) + 1)
    assert a_stats["pins"] == before_a.get("pins", 0) + 1
    assert a_stats["pins_released"] == before_a.get("pins_released", 0) + 1


def score(cluster: Cluster, tokens: list[int]) -> dict[str, dict[str, Any]]:
    """`kvrc score` by token ids: kvrc hashes them as the engines declared (docs/score.md)."""
    python = python_of_tests()
    model = cluster.kvrc.status(python)["child_engines"][0]["profile"]["model"]
    tokens_arg = ",".join(map(str, tokens))
    answer = cluster.kvrc.cli_json(python, "score", "--model", model, "--tokens", tokens_arg)
    return {e["child_engine_id"]: e for e in answer["engines"]}


def test_score_by_token_ids_finds_what_the_real_engine_published(cluster: Cluster) -> None:
    # Both engines computed this prompt above: kvrc's own hashing of the token ids
    # (the connector declares vLLM's algorithm and seed) must give the keys vLLM's
    # KV events published, or nothing would match.
    prompt = random_prompt(11, 320)
    full_blocks = len(prompt) // BLOCK_SIZE
    scores = score(cluster, prompt)
    for name in ("engine-a", "engine-b"):
        assert scores[name]["scored"] is True, scores[name]
        assert scores[name]["prompt_blocks"] == full_blocks
        assert scores[name]["local_matched_blocks"] >= full_blocks - 1, scores[name]
    # Negative control: a prompt neither engine saw matches nothing.
    unseen = score(cluster, random_prompt(99, 320))
    assert {e["local_matched_blocks"] for e in unseen.values()} == {0}


def test_a_local_hit_plus_a_remote_tail(cluster: Cluster) -> None:
    """B holds the first blocks itself; it loads only the blocks beyond its local hit."""
    shared = random_prompt(12, 128)
    prompt = shared + random_prompt(13, 192)  # 4 blocks B will hold, 10 in all
    # B caches the 4 shared blocks; then A computes all 10.
    generate_published(cluster.kvrc, cluster.b, shared + [7] * 40, max_tokens=4)
    reference = generate_published(cluster.kvrc, cluster.a, prompt, max_tokens=16)["tokens"]
    before = cluster.b.stats()

    out = cluster.b.generate(prompt, max_tokens=16)

    assert out["tokens"] == reference
    stats = cluster.b.wait_stats("prefix_load_loads", before.get("prefix_load_loads", 0) + 1)
    loaded = (len(prompt) - 1) // BLOCK_SIZE - len(shared) // BLOCK_SIZE
    assert stats["prefix_load_tokens_loaded"] - before.get("prefix_load_tokens_loaded", 0) == (
        loaded * BLOCK_SIZE
    )


def test_corrupted_prefix_load_changes_the_output(cluster: Cluster) -> None:
    """Negative control for the prefix path: wrong KV shows in the output."""
    prompt = random_prompt(14, 320)
    reference = generate_published(cluster.kvrc, cluster.a, prompt, max_tokens=24)["tokens"]
    before = cluster.b.stats()
    out = cluster.b.generate(
        prompt, max_tokens=24, kv_transfer_params={"kvrc_test_fault": "corrupt"}
    )
    stats = cluster.b.wait_stats(
        "workers_test_corrupted_loads", before.get("workers_test_corrupted_loads", 0) + 1
    )
    assert (
        stats["workers_test_corrupted_loads"] == before.get("workers_test_corrupted_loads", 0) + 1
    )
    assert out["tokens"] != reference
