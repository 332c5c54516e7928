"""The "slow pairs" synthetic trace (issue 25, Benchmarks): where static thresholds fail.

Eight prefill engines in two groups of four. Within a group a load runs at 2 GB/s
after 0.5 ms; across groups at 0.1 GB/s after 5 ms. Every engine prefills 8,000
tokens/s, and a token's KV is 128 KiB, so a 512-token block (64 MiB) costs 64 ms to
recompute, ~34 ms to load within a group and ~676 ms to load across: a cross-group
load always loses and a within-group one always wins, whatever the prefix length,
and no `min_blocks` can tell the two apart.

The workload (`SlowPairsSpec`, every number fixed and seeded; `generate` is pure):
`documents` shared contexts (a system prompt, a document, a conversation so far) of
`doc_blocks_min`..`doc_blocks_max` blocks each, drawn with Zipf popularity
(`zipf_s`); every request is one document's blocks followed by a private tail of
`tail_tokens_min`..`tail_tokens_max` tokens (its own block ids), arriving as a
Poisson process of `rate_per_s` requests per second. The trace is generated at run
time from `seed` (nothing is checked in); `write_jsonl` writes it in the Mooncake
format for other tools.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.trace_sim import BLOCK_TOKENS, CostModel, Link, PairLinks, TraceRequest

__all__ = ["SLOW_PAIRS", "SlowPairsSpec", "generate", "write_jsonl"]

KIB = 1024


@dataclass(frozen=True, slots=True)
class SlowPairsSpec:
    """Every parameter of the slow-pairs trace and its cluster (docs/benchmarks.md)."""

    name: str = "slow_pairs"
    seed: int = 25
    # The cluster (the numbers).
    engines: int = 8
    group_size: int = 4
    within_bandwidth_bytes_per_s: float = 2e9
    within_latency_ms: float = 0.5
    across_bandwidth_bytes_per_s: float = 0.1e9
    across_latency_ms: float = 5.0
    prefill_tokens_per_s: float = 8_000.0
    kv_bytes_per_token: int = 128 * KIB
    capacity_tokens: int = 500_000  # per engine: 62.5 GiB of KV at 128 KiB a token
    # The workload.
    requests: int = 4_000
    rate_per_s: float = 12.0
    documents: int = 200
    zipf_s: float = 0.8
    doc_blocks_min: int = 4
    doc_blocks_max: int = 24
    tail_tokens_min: int = 128
    tail_tokens_max: int = 1_024

    def __post_init__(self) -> None:
        if self.engines < 2 or self.engines % self.group_size:
            raise ValueError("engines must be a multiple of group_size (two groups at least)")
        if not 1 <= self.doc_blocks_min <= self.doc_blocks_max:
            raise ValueError("1 <= doc_blocks_min <= doc_blocks_max")
        if not 1 <= self.tail_tokens_min <= self.tail_tokens_max:
            raise ValueError("1 <= tail_tokens_min <= tail_tokens_max")
        if self.requests < 1 or self.documents < 1 or self.rate_per_s <= 0:
            raise ValueError("requests, documents and rate_per_s must be positive")

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(i // self.group_size for i in range(self.engines))

    def cost(self) -> CostModel:
        """The simulator's cost model for this cluster (per-pair links)."""
        within = Link(self.within_bandwidth_bytes_per_s, self.within_latency_ms)
        return CostModel(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            # The routers count every load at the within-group rate: the one figure a
            # deployment that measured its own rack would configure.
            load_ms_per_block=within.latency_ms
            + BLOCK_TOKENS * self.kv_bytes_per_token * 1000.0 / within.bandwidth_bytes_per_s,
            kv_bytes_per_token=self.kv_bytes_per_token,
            pairs=PairLinks(
                groups=self.groups,
                within=within,
                across=Link(self.across_bandwidth_bytes_per_s, self.across_latency_ms),
            ),
        )


SLOW_PAIRS = SlowPairsSpec()


def generate(spec: SlowPairsSpec = SLOW_PAIRS) -> list[TraceRequest]:
    """The trace, in arrival order; the same spec always gives the same requests."""
    rng = random.Random(spec.seed)  # its own generator: nothing else moves the sequence
    doc_lengths = [
        rng.randint(spec.doc_blocks_min, spec.doc_blocks_max) for _ in range(spec.documents)
    ]
    weights = [1.0 / (rank + 1) ** spec.zipf_s for rank in range(spec.documents)]
    # Block ids: document d's k-th block is d * stride + k; tails count up above them all.
    stride = spec.doc_blocks_max
    next_private = spec.documents * stride
    out: list[TraceRequest] = []
    t_ms = 0.0
    for index in range(spec.requests):
        t_ms += rng.expovariate(spec.rate_per_s) * 1000.0
        doc = rng.choices(range(spec.documents), weights)[0]
        tail_tokens = rng.randint(spec.tail_tokens_min, spec.tail_tokens_max)
        tail_blocks = math.ceil(tail_tokens / BLOCK_TOKENS)
        blocks = [doc * stride + k for k in range(doc_lengths[doc])]
        blocks += range(next_private, next_private + tail_blocks)
        next_private += tail_blocks
        out.append(
            TraceRequest(
                request_index=index,
                arrival_ms=int(t_ms),
                input_tokens=doc_lengths[doc] * BLOCK_TOKENS + tail_tokens,
                output_tokens=1,
                block_ids=tuple(blocks),
            )
        )
    return out


def write_jsonl(requests: Sequence[TraceRequest], path: Path) -> None:
    """The Mooncake format (`timestamp`, `input_length`, `output_length`, `hash_ids`)."""
    with path.open("w", encoding="utf-8") as fh:
        for r in requests:
            obj = {
                "timestamp": r.arrival_ms,
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.block_ids),
            }
            fh.write(json.dumps(obj) + "\n")
