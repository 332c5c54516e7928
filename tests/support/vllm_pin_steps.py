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

BLOCK_SIZE = 16


class _Rig:
    """vLLM's real KV cache manager with a holder's PoolPins bound to it."""

    def __init__(self, num_blocks: int, steps_in_flight: int) -> None:
        import torch
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

        from clients.vllm.pool import PoolPins
        from clients.vllm.scheduler import block_hash_key

        init_none_hash(sha256)
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float16
        )
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
        )
        params = inspect.signature(KVCacheManager.__init__).parameters
        sizes = {k: BLOCK_SIZE for k in ("scheduler_block_size", "hash_block_size") if k in params}
        self.manager = KVCacheManager(config, max_model_len=4096, enable_caching=True, **sizes)
        self.pins = PoolPins(block_hash_key, steps_in_flight=steps_in_flight)
        self.pins.bind(self.manager.block_pool, self.manager)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self._key = block_hash_key
        self._deadline = int(time.time() * 1000) + 60_000
        self._leases = 0

    def request(self, request_id: str, first: int, blocks: int, skip: bool = False) -> Any:
        from vllm import SamplingParams  # type: ignore[import-not-found]
        from vllm.v1.request import Request  # type: ignore[import-not-found]

        sampling = SamplingParams(max_tokens=1, skip_reading_prefix_cache=True if skip else None)
        return Request(
            request_id=request_id,
            prompt_token_ids=list(range(first, first + blocks * BLOCK_SIZE + 1)),
            sampling_params=sampling,
            pooling_params=None,
            block_hasher=self._hasher,
        )

    def schedule(self, req: Any) -> list[int]:
        """What scheduling the request's prefill does: its blocks allocated and cached."""
        return list(self.manager.allocate_slots(req, req.num_tokens).get_block_ids()[0])

    def pin(self, req: Any) -> list[int]:
        """A remote reader's pin of the request's chain (released at once)."""
        self._leases += 1
        lease = f"lease-{self._leases}"
        got = self.pins.pin(lease, [self._key(h) for h in req.block_hashes], self._deadline)
        self.pins.release(lease)
        return got


def run(steps_in_flight: int) -> dict[str, Any]:
    rig = _Rig(64, steps_in_flight)
    pins = rig.pins
    first = rig.request("r1", 0, 8)
    allocated = rig.schedule(first)
    seen = [rig.pin(first)]  # scheduled, not run
    pins.seal_step()  # build_connector_meta of that step
    seen.append(rig.pin(first))
    second = rig.request("r2", 10_000, 8)  # the next step is scheduled (async: before ...
    rig.schedule(second)
    pins.seal_step()
    pins.step_done()  # ... the first step's output came back)
    seen += [rig.pin(first), rig.pin(second)]
    pins.step_done()  # the second step's output
    seen.append(rig.pin(second))
    return {"allocated": allocated, "pins": seen}


def run_duplicates() -> dict[str, Any]:
    """A second block of one hash, cached by a step that has not run: vLLM holds both
    under the hash (a request that skips reading the prefix cache recomputes its
    prompt); once the first is evicted, a pin must not take the second."""
    rig = _Rig(40, 1)
    first = rig.request("r1", 0, 4)
    first_blocks = rig.schedule(first)
    rig.pins.seal_step()
    rig.pins.step_done()
    ran = rig.pin(first)
    rig.manager.free(first)  # finished: its blocks stay cached, free
    again = rig.request("r3", 0, 4, skip=True)  # the same prompt, recomputed: duplicates
    dup_blocks = rig.schedule(again)
    rig.schedule(rig.request("r4", 50_000, 30))  # the same step: evicts r1's free blocks
    mid_step = rig.pin(first)  # r3's step has not run
    return {"first": first_blocks, "duplicates": dup_blocks, "pins": [ran, mid_step]}


def main() -> None:
    out: dict[str, Any] = {str(n): run(n) for n in (1, 2)}
    out["duplicates"] = run_duplicates()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
