"""vLLM's own block hashes for a list of cases: the reference kvrc's Score hashing must equal.

Runs with the cached vLLM venv's python (`tests/support/vllm_env.py`), never with kvrc's.
Reads one JSON array of cases on stdin:

    {"algo": "sha256_cbor", "block_size": 16, "seed": "0" | null (PYTHONHASHSEED unset),
     "tokens": [...], "lora": ["name", "path"] | null, "cache_salt": str | null,
     "mm": [["identifier", offset, length], ...]}

and prints one JSON line, an array with one entry per case: {"digests": [hex, ...],
"ints": [...]}: the hashes vLLM's real request block hasher (`get_request_block_hasher`
over a real `Request`, NONE_HASH from `init_none_hash`) gives the prompt, and what
`maybe_convert_block_hash` makes of each for the KV events (their int form).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main() -> None:
    # vLLM reads this when it converts a hash for an event; ints are its default.
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"

    from vllm.lora.request import LoRARequest  # type: ignore[import-not-found]
    from vllm.multimodal.inputs import (  # type: ignore[import-not-found]
        MultiModalFeatureSpec,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams  # type: ignore[import-not-found]
    from vllm.utils.hashing import get_hash_fn_by_name  # type: ignore[import-not-found]
    from vllm.v1.core import kv_cache_utils  # type: ignore[import-not-found]
    from vllm.v1.request import Request  # type: ignore[import-not-found]

    cases: list[dict[str, Any]] = json.load(sys.stdin)
    results: list[dict[str, Any]] = []
    for n, case in enumerate(cases):
        if case["seed"] is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = case["seed"]
        hash_fn = get_hash_fn_by_name(case["algo"])
        kv_cache_utils.init_none_hash(hash_fn)
        lora = case["lora"]
        request = Request(
            request_id=f"case-{n}",
            prompt_token_ids=list(case["tokens"]),
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            mm_features=[
                MultiModalFeatureSpec(
                    data=None,
                    modality="image",
                    identifier=identifier,
                    mm_position=PlaceholderRange(offset=offset, length=length),
                )
                for identifier, offset, length in case["mm"]
            ],
            lora_request=(
                LoRARequest(lora_name=lora[0], lora_int_id=1, lora_path=lora[1]) if lora else None
            ),
            cache_salt=case["cache_salt"],
            block_hasher=kv_cache_utils.get_request_block_hasher(case["block_size"], hash_fn),
        )
        hashes = list(request.block_hashes)
        results.append(
            {
                "digests": [bytes(h).hex() for h in hashes],
                "ints": [kv_cache_utils.maybe_convert_block_hash(h) for h in hashes],
            }
        )
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
