"""vLLM's own hashing of one prompt, timed inside the vLLM venv (`make bench-index`).

Run with the vLLM venv's python (tests/support/vllm_env.py), never kvrc's. Reads
{"algo", "block_size", "seed", "tokens", "repeats"} as JSON on stdin and prints one
JSON line: `request_us` (a vLLM `Request` built with the request block hasher, as
vLLM hashes each new request: the hashing vLLM itself runs) and `loop_us` (the bare
`hash_block_tokens` chain over the prompt's full blocks), each a list of microseconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> None:
    spec: dict[str, Any] = json.load(sys.stdin)
    os.environ["PYTHONHASHSEED"] = spec["seed"]
    from vllm.sampling_params import SamplingParams  # type: ignore[import-not-found]
    from vllm.utils.hashing import get_hash_fn_by_name  # type: ignore[import-not-found]
    from vllm.v1.core import kv_cache_utils  # type: ignore[import-not-found]
    from vllm.v1.request import Request  # type: ignore[import-not-found]

    hash_fn = get_hash_fn_by_name(spec["algo"])
    kv_cache_utils.init_none_hash(hash_fn)
    tokens: list[int] = spec["tokens"]
    block_size: int = spec["block_size"]
    hasher = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
    request_us: list[float] = []
    loop_us: list[float] = []
    for n in range(spec["repeats"]):
        started = time.perf_counter()
        request = Request(
            request_id=f"bench-{n}",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=hasher,
        )
        request_us.append((time.perf_counter() - started) * 1e6)
        assert len(request.block_hashes) == len(tokens) // block_size
        started = time.perf_counter()
        parent = kv_cache_utils.NONE_HASH
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = kv_cache_utils.hash_block_tokens(
                hash_fn, parent, tokens[start : start + block_size], None
            )
        loop_us.append((time.perf_counter() - started) * 1e6)
    print(json.dumps({"request_us": request_us, "loop_us": loop_us}), flush=True)


if __name__ == "__main__":
    main()
