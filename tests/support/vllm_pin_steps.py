"""A holder's pins against vLLM's real KV cache manager, step by step.

Runs with the cached vLLM venv's python (`tests/support/vllm_env.py`). vLLM caches a
prompt's full blocks in its prefix-cache map when it *schedules* the prefill
(`allocate_slots`), before the forward pass writes their KV; `PoolPins` must not hand
them to a remote reader until that step ran. For `steps_in_flight` 1 (sync scheduling)
and 2 (async), this schedules one request's prefill, then a second step, and prints
one JSON line: what a pin of the prompt's chain returns after each of vLLM's calls
(`allocate_slots`, `build_connector_meta` = `seal_step`, `update_connector_output` =
`step_done`), with the block ids vLLM allocated.
"""

from __future__ import annotations

import inspect
import json
import time
from typing import Any


def run(steps_in_flight: int) -> dict[str, Any]:
    import torch
    from vllm import SamplingParams  # type: ignore[import-not-found]
    from vllm.utils.hashing import sha256  # type: ignore[import-not-found]
    from vllm.v1.core.kv_cache_manager import KVCacheManager  # type: ignore[import-not-found]
    from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found]
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request  # type: ignore[import-not-found]

    from clients.vllm.pool import PoolPins
    from clients.vllm.scheduler import block_hash_key

    block_size = 16
    init_none_hash(sha256)
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    params = inspect.signature(KVCacheManager.__init__).parameters
    sizes = {k: block_size for k in ("scheduler_block_size", "hash_block_size") if k in params}
    deadline = int(time.time() * 1000) + 60_000
    manager = KVCacheManager(config, max_model_len=4096, enable_caching=True, **sizes)
    pins = PoolPins(block_hash_key, steps_in_flight=steps_in_flight)
    pins.bind(manager.block_pool, manager)
    hasher = get_request_block_hasher(block_size, sha256)

    def request(request_id: str, first_token: int) -> Any:
        return Request(
            request_id=request_id,
            prompt_token_ids=list(range(first_token, first_token + 8 * block_size + 1)),
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=hasher,
        )

    seen: list[list[int]] = []

    def pin(req: Any) -> None:
        keys = [block_hash_key(h) for h in req.block_hashes]
        lease = f"lease-{len(seen)}"
        seen.append(pins.pin(lease, keys, deadline))
        pins.release(lease)

    first = request("r1", 0)
    allocated = manager.allocate_slots(first, first.num_tokens).get_block_ids()[0]
    pin(first)  # scheduled, not run
    pins.seal_step()  # build_connector_meta of that step
    pin(first)
    second = request("r2", 10_000)  # the next step is scheduled (async: before ...
    manager.allocate_slots(second, second.num_tokens)
    pins.seal_step()
    pins.step_done()  # ... the first step's output came back)
    pin(first)
    pin(second)
    pins.step_done()  # the second step's output
    pin(second)
    return {"allocated": list(allocated), "pins": seen}


def run_duplicates() -> dict[str, Any]:
    """A second block of one hash, cached by a step that has not run: vLLM holds both
    under the hash (a request that skips reading the prefix cache recomputes its
    prompt); once the first is evicted, a pin must not take the second."""
    import torch
    from vllm import SamplingParams  # type: ignore[import-not-found]
    from vllm.utils.hashing import sha256  # type: ignore[import-not-found]
    from vllm.v1.core.kv_cache_manager import KVCacheManager  # type: ignore[import-not-found]
    from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found]
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request  # type: ignore[import-not-found]

    from clients.vllm.pool import PoolPins
    from clients.vllm.scheduler import block_hash_key

    block_size = 16
    init_none_hash(sha256)
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=40, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    params = inspect.signature(KVCacheManager.__init__).parameters
    sizes = {k: block_size for k in ("scheduler_block_size", "hash_block_size") if k in params}
    manager = KVCacheManager(config, max_model_len=4096, enable_caching=True, **sizes)
    pins = PoolPins(block_hash_key, steps_in_flight=1)
    pins.bind(manager.block_pool, manager)
    hasher = get_request_block_hasher(block_size, sha256)
    deadline = int(time.time() * 1000) + 60_000

    def request(request_id: str, first: int, blocks: int, skip: bool = False) -> Any:
        sampling = (
            SamplingParams(max_tokens=1, skip_reading_prefix_cache=True)
            if skip
            else SamplingParams(max_tokens=1)
        )
        return Request(
            request_id=request_id,
            prompt_token_ids=list(range(first, first + blocks * block_size + 1)),
            sampling_params=sampling,
            pooling_params=None,
            block_hasher=hasher,
        )

    def pin(req: Any, lease: str) -> list[int]:
        got = pins.pin(lease, [block_hash_key(h) for h in req.block_hashes], deadline)
        pins.release(lease)
        return got

    first = request("r1", 0, 4)
    first_blocks = manager.allocate_slots(first, first.num_tokens).get_block_ids()[0]
    pins.seal_step()
    pins.step_done()
    ran = pin(first, "a")
    manager.free(first)  # finished: its blocks stay cached, free
    again = request("r3", 0, 4, skip=True)  # the same prompt, recomputed: duplicates
    dup_blocks = manager.allocate_slots(again, again.num_tokens).get_block_ids()[0]
    big = request("r4", 50_000, 30)  # in the same step, evicts r1's free blocks
    manager.allocate_slots(big, big.num_tokens)
    mid_step = pin(first, "b")  # r3's step has not run
    return {
        "first": list(first_blocks),
        "duplicates": list(dup_blocks),
        "pins": [ran, mid_step],
    }


def main() -> None:
    out: dict[str, Any] = {str(n): run(n) for n in (1, 2)}
    out["duplicates"] = run_duplicates()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
