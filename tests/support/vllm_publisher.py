"""Run vLLM's real scheduler-side KV-event path in a process of its own.

Runs with the cached vLLM venv's python (`tests/support/vllm_env.py`), never with kvrc's.
It builds vLLM's real `BlockPool` (prefix caching and KV events on) and real
`ZmqEventPublisher`, then obeys JSON-line commands on stdin; every command that
changes the pool publishes the pool's events (`take_events()`) as one
`KVEventBatch`, exactly as vLLM's scheduler does once per step:

    {"op": "cache", "tokens": [...]}  a request's prompt: reuse cached prefix
                                      blocks, allocate the rest, cache the full
                                      blocks, free the request (blocks stay
                                      cached as eviction candidates)
    {"op": "evict", "n": k}           allocate and free k blocks: evicts LRU blocks
    {"op": "reset"}                   reset_prefix_cache(): AllBlocksCleared
    {"op": "truth"}                   no change, only the answer
    {"op": "exit"}                    shut the publisher down and exit

Each answer is one JSON line: {"seq": last published sequence (-1: none),
"cached": the pool's cached blocks as sorted "group:hash-hex" strings, hashes in
kvrc's convention (ints as 8 bytes big-endian), "pin_keys": the keys the vLLM
connector's holder pins (`clients/vllm/pool.py`, bound to this pool as the
connector binds it) would find, in the same form}. The first line, once the
publisher is up, is {"ready": true}.

`--capture FILE` subscribes to the publisher's own PUB endpoint (when it binds)
and writes every frame received, unchanged, as msgpack `[[topic, seq, payload],
...]` at exit: the decoder's test data comes from here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True, help="vLLM kv_events endpoint")
    parser.add_argument("--replay-endpoint", default=None)
    parser.add_argument("--hash-kind", choices=("int", "bytes"), default="int")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=16)
    parser.add_argument("--topic", default="")
    parser.add_argument("--dp-rank", type=int, default=0)
    parser.add_argument("--buffer-steps", type=int, default=10_000)
    parser.add_argument("--capture", default=None)
    args = parser.parse_args()

    # Read by vLLM's envs at use time; set before anything converts a hash.
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if args.hash_kind == "int" else "0"

    import msgpack  # type: ignore[import-not-found,unused-ignore]
    import zmq  # type: ignore[import-not-found,unused-ignore]
    from vllm.distributed.kv_events import (  # type: ignore[import-not-found]
        KVEventBatch,
        ZmqEventPublisher,
    )
    from vllm.sampling_params import SamplingParams  # type: ignore[import-not-found]
    from vllm.utils.hashing import sha256  # type: ignore[import-not-found]
    from vllm.v1.core.block_pool import BlockPool  # type: ignore[import-not-found]
    from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found]
        get_block_hash,
        get_group_id,
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )
    from vllm.v1.request import Request  # type: ignore[import-not-found]

    init_none_hash(sha256)
    block_size: int = args.block_size
    hasher = get_request_block_hasher(block_size, sha256)
    pool = BlockPool(
        num_gpu_blocks=args.num_blocks,
        enable_caching=True,
        hash_block_size=block_size,
        enable_kv_cache_events=True,
    )
    from clients.vllm.pool import PoolPins
    from clients.vllm.scheduler import block_hash_key

    pins = PoolPins(block_hash_key)
    pins.bind(pool)
    publisher = ZmqEventPublisher(
        data_parallel_rank=args.dp_rank,
        endpoint=args.endpoint,
        replay_endpoint=args.replay_endpoint,
        buffer_steps=args.buffer_steps,
        topic=args.topic,
    )

    capture_sock: Any = None
    captured: list[list[bytes]] = []
    if args.capture:
        capture_sock = zmq.Context.instance().socket(zmq.SUB)
        capture_sock.setsockopt(zmq.SUBSCRIBE, b"")
        capture_sock.connect(args.endpoint.replace("*", "127.0.0.1"))
        time.sleep(0.5)  # let the subscription reach the publisher

    published = -1
    request_count = 0

    def publish() -> None:
        nonlocal published
        events = pool.take_events()
        if not events:
            return
        publisher.publish(KVEventBatch(ts=time.time(), events=events))
        published += 1

    def kvrc_hash(external: int | bytes) -> str:
        if isinstance(external, int):
            return external.to_bytes(8, "big").hex()
        return bytes(external).hex()

    def cached() -> list[str]:
        return sorted(
            f"{get_group_id(key)}:{kvrc_hash(maybe_convert_block_hash(get_block_hash(key)))}"
            for key in pool.cached_block_hash_to_block._cache
        )

    def state() -> dict[str, Any]:
        pin_keys = sorted(f"0:{key.hex()}" for key in pins._by_key)
        return {"seq": published, "cached": cached(), "pin_keys": pin_keys}

    def cache_request(tokens: list[int]) -> None:
        nonlocal request_count
        request_count += 1
        request = Request(
            request_id=f"req-{request_count}",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=hasher,
        )
        hits: list[Any] = []
        for block_hash in request.block_hashes:
            found = pool.get_cached_block(block_hash, [0])
            if found is None:
                break
            hits.append(found[0])
        pool.touch(hits)
        num_full = len(tokens) // block_size
        num_needed = -(-len(tokens) // block_size)
        blocks = hits + pool.get_new_blocks(num_needed - len(hits))
        pool.cache_full_blocks(request, blocks, len(hits), num_full, block_size, 0)
        # The step that cached them ran (vLLM's scheduler seals it at build_connector_meta
        # and hears it ran at update_connector_output): its blocks become pinnable.
        pins.seal_step()
        pins.step_done()
        # Freed tail first: vLLM frees a finished request's blocks in reverse order.
        pool.free_blocks(reversed(blocks))

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "cache":
            cache_request([int(t) for t in command["tokens"]])
            publish()
        elif op == "evict":
            blocks = pool.get_new_blocks(int(command["n"]))
            pool.free_blocks(blocks)
            publish()
        elif op == "reset":
            if not pool.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache refused: blocks still in use")
            publish()
        elif op == "exit":
            break
        elif op != "truth":
            raise ValueError(f"unknown op {op!r}")
        print(json.dumps(state()), flush=True)

    if capture_sock is not None:
        deadline = time.monotonic() + 2.0
        while len(captured) < published + 1 and time.monotonic() < deadline:
            if capture_sock.poll(100):
                captured.append(capture_sock.recv_multipart())
        with open(args.capture, "wb") as out:
            out.write(msgpack.packb(captured, use_bin_type=True))
        capture_sock.close(linger=0)
    publisher.shutdown()
    print(json.dumps({**state(), "exit": True}), flush=True)


if __name__ == "__main__":
    main()
