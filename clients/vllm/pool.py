"""Holder-side pins in vLLM's own block pool (`bind_kv_cache_manager` / `bind_gpu_block_pool`).

A pin is what a request's prefix-cache hit does: `BlockPool.touch(blocks)` takes
a reference (ref_cnt + 1, out of the free queue), so vLLM can neither evict nor
reuse the blocks; the release is `BlockPool.free_blocks(blocks)`, which puts them
back as cached, evictable blocks. Blocks are found by vLLM's own block hashes
(`cached_block_hash_to_block`), the kvrc key of each being vLLM's
`maybe_convert_block_hash` form (see `scheduler.block_hash_key`); the map from
kvrc keys to vLLM's hashes follows the pool's inserts and evictions, so a pin
costs a lookup per block, whatever the size of the cache.

Pins arrive from kvrc at any time, also while the engine is idle (its EngineCore
thread blocked on its input queue), so they run on the connector's own thread.
Every public method of the KV cache manager and the block pool is wrapped in one
re-entrant lock that pins and releases take too, so a pin never interleaves
with an allocation, an eviction or a free. One pin per lease, whatever the
number of rank parts asking; released once, at kvrc's ReleaseRequest (quiescence),
or by a safety net long after the lease's own deadline, never once kvrc
quarantined the lease (`clients/holds.py`).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from clients.holds import HoldDeadlines, pin_hold_s

log = logging.getLogger("kvrc.vllm.pool")


def _lock_public_methods(obj: Any, lock: threading.RLock) -> None:
    for name in dir(type(obj)):
        if name.startswith("_"):
            continue
        attr = getattr(type(obj), name, None)
        if not callable(attr) or isinstance(attr, (staticmethod, classmethod, type)):
            continue
        bound = getattr(obj, name)
        if getattr(bound, "_kvrc_locked", False):
            continue

        def locked(*args: Any, __fn: Callable[..., Any] = bound, **kwargs: Any) -> Any:
            with lock:
                return __fn(*args, **kwargs)

        functools.update_wrapper(locked, bound)
        locked._kvrc_locked = True  # type: ignore[attr-defined]
        setattr(obj, name, locked)


# Scheduler steps whose inserts wait to be promoted, at most: past it (vLLM never
# reported a step's output, which kvrc does not expect) the oldest are dropped unpinned.
MAX_PENDING_STEPS = 64


def _blocks(held: Any) -> list[Any]:
    """The blocks of one entry of vLLM's BlockHashToBlockMap (a block, or a dict of them
    by id when several hold one hash)."""
    if held is None:
        return []
    return list(held.values()) if isinstance(held, dict) else [held]


def _block_ids(held: Any) -> list[int]:
    return [block.block_id for block in _blocks(held)]


class PoolPins:
    """`steps_in_flight`: vLLM's `max_concurrent_batches` (1; 2 with async scheduling;
    the pipeline depth with PP): how many scheduled steps may not have run yet when a
    step's output is reported.

    A block is pinnable only once the step that cached it has run. vLLM caches a block
    in its prefix-cache map when the step is *scheduled*, before the forward pass
    writes its KV; a remote reader handed it then reads KV not yet (or half) written,
    silently. Each step's inserts are sealed at `seal_step` (build_connector_meta, the
    end of scheduling) and promoted at `step_done` (update_connector_output) once at
    most `steps_in_flight - 1` newer steps may still be running."""

    def __init__(self, key_of: Callable[[Any], bytes], steps_in_flight: int = 1) -> None:
        self.lock = threading.RLock()
        self._key_of = key_of
        self._held_back = max(0, steps_in_flight - 1)
        # Inserts of the step being scheduled, then of the steps sealed since: (kvrc key,
        # vLLM BlockHash, block id) of KV cache group 0, oldest step first.
        self._current: list[tuple[bytes, Any, int]] = []
        self._sealed: collections.deque[list[tuple[bytes, Any, int]]] = collections.deque()
        # The cached blocks (of group 0) whose step ran: vLLM may hold a second block of
        # the same hash (a request that skips the prefix cache recomputes it), still
        # being written; a pin takes only these.
        self._ready_ids: set[int] = set()
        self.dropped_steps = 0  # sealed steps dropped unpromoted (MAX_PENDING_STEPS)
        self._pool: Any = None
        self._pins: dict[str, list[Any]] = {}  # lease id -> its pinned blocks
        self._nets = HoldDeadlines()
        # kvrc key -> vLLM BlockHash of each block cached in KV cache group 0 (the one
        # pins look up), kept in step with the pool's map by `_follow`.
        self._by_key: dict[bytes, bytes] = {}
        self._followed: Any = None  # the pool's map `_by_key` follows
        self.converted = 0  # block hashes converted to kvrc keys (tests: once per block)

    def bind(self, pool: Any, manager: Any = None) -> None:
        self._pool = pool
        _lock_public_methods(pool, self.lock)
        if manager is not None:
            _lock_public_methods(manager, self.lock)
        reset = getattr(pool, "reset_prefix_cache", None)
        if reset is not None:  # it replaces the map: follow the new one at once

            def reset_then_follow(*args: Any, **kwargs: Any) -> Any:
                with self.lock:
                    result = reset(*args, **kwargs)
                    self._follow()
                    return result

            pool.reset_prefix_cache = reset_then_follow
        with self.lock:
            self._follow()

    @property
    def bound(self) -> bool:
        return self._pool is not None

    def _follow(self) -> None:
        """Keeps `_by_key` in step with the pool's cached blocks: each block's key is
        converted once, when vLLM caches it (`insert`), and dropped when vLLM evicts it
        (`pop`), so a pin converts nothing. (A map rebuilt on a pin's miss converted
        every cached block again, in Python, on nearly every pin of a busy holder.)
        Called under the lock; again when vLLM replaced its map (`reset_prefix_cache`)."""
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found]
            get_block_hash,
            get_group_id,
        )

        cached = self._pool.cached_block_hash_to_block
        if cached is self._followed:
            return
        by_key, key_of, lock = self._by_key, self._key_of, self.lock
        insert, pop, get_one_block = cached.insert, cached.pop, cached.get_one_block
        current, ready = self._current, self._ready_ids

        def inserted(key: bytes, block: Any) -> None:
            with lock:
                insert(key, block)
                if get_group_id(key) == 0:  # pinnable once its step ran (`step_done`)
                    block_hash = get_block_hash(key)
                    current.append((key_of(block_hash), block_hash, block.block_id))
                    self.converted += 1

        def popped(key: bytes, block_id: int) -> Any:
            with lock:
                block = pop(key, block_id)
                if block is not None and get_group_id(key) == 0:
                    ready.discard(block_id)
                    if get_one_block(key) is None:
                        block_hash = get_block_hash(key)
                        kvrc_key = key_of(block_hash)
                        if by_key.get(kvrc_key) == block_hash:
                            del by_key[kvrc_key]
                return block

        # A new map: the first (empty), or vLLM's reset, which it refuses while any
        # block is in use, so whatever it holds was computed.
        by_key.clear()
        current.clear()
        ready.clear()
        self._sealed.clear()
        for key, blocks in list(cached._cache.items()):
            if get_group_id(key) == 0:
                block_hash = get_block_hash(key)
                by_key[key_of(block_hash)] = block_hash
                ready.update(_block_ids(blocks))
                self.converted += 1
        cached.insert, cached.pop = inserted, popped
        self._followed = cached

    def seal_step(self) -> None:
        """The scheduler finished a step (build_connector_meta): what it cached waits
        for that step to run."""
        with self.lock:
            self._sealed.append(self._current[:])
            self._current.clear()
            if len(self._sealed) > MAX_PENDING_STEPS:
                self._sealed.popleft()
                self.dropped_steps += 1

    def step_done(self) -> None:
        """A step's output came back (update_connector_output): every sealed step but
        the newest `steps_in_flight - 1` has run, and so has the oldest (outputs come
        in order, and no more steps were promoted than outputs came); their blocks
        become pinnable."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # type: ignore[import-not-found]

        with self.lock:
            if self._pool is None:
                return
            cached = self._pool.cached_block_hash_to_block
            ran = min(len(self._sealed), max(1, len(self._sealed) - self._held_back))
            for _ in range(ran):
                for kvrc_key, block_hash, block_id in self._sealed.popleft():
                    # Evicted meanwhile: nothing to promote (its `pop` found no entry).
                    if cached.contain(make_block_hash_with_group_id(block_hash, 0), block_id):
                        self._by_key[kvrc_key] = block_hash
                        self._ready_ids.add(block_id)

    def _find(self, keys: Sequence[bytes]) -> list[Any]:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # type: ignore[import-not-found]

        cached = self._pool.cached_block_hash_to_block._cache
        ready = self._ready_ids
        blocks: list[Any] = []
        for key in keys:
            block_hash = self._by_key.get(key)
            if block_hash is None:
                break
            held = cached.get(make_block_hash_with_group_id(block_hash, 0))
            # Of the blocks vLLM holds for the hash, one whose step ran.
            block = next((b for b in _blocks(held) if b.block_id in ready), None)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def pin(self, lease_id: str, keys: Sequence[bytes], deadline_unix_ms: int) -> list[int]:
        """Pin the longest cached prefix of `keys` (chain order); its block ids."""
        if self._pool is None:
            return []
        with self.lock:
            existing = self._pins.get(lease_id)
            if existing is not None:  # another rank part of this engine asked too
                return [block.block_id for block in existing]
            self._follow()
            blocks = self._find(keys)
            if not blocks:
                return []
            self._pool.touch(blocks)
            self._pins[lease_id] = blocks
            self._nets.hold(lease_id, pin_hold_s(deadline_unix_ms))
            return [block.block_id for block in blocks]

    def release(self, lease_id: str) -> bool:
        with self.lock:
            blocks = self._pins.pop(lease_id, None)
            self._nets.discard(lease_id)
            if blocks is None:
                return False
            self._pool.free_blocks(blocks)
            return True

    def quarantine(self, lease_id: str) -> None:
        """kvrc quarantined the lease: its pin stays until kvrc's release."""
        with self.lock:
            self._nets.quarantine(lease_id)

    def is_quarantined(self, lease_id: str) -> bool:
        with self.lock:
            return self._nets.is_quarantined(lease_id)

    def expire(self) -> list[str]:
        """Pins whose release never came, dropped long after their deadline."""
        with self.lock:
            late = self._nets.overdue()
        for lease in late:
            log.warning("pin of lease %s never released; dropping it", lease)
            self.release(lease)
        return late

    def pinned_leases(self) -> int:
        return len(self._pins)
