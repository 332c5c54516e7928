"""Holder-side pins in vLLM's own block pool (`bind_kv_cache_manager` / `bind_gpu_block_pool`).

A pin is what a request's prefix-cache hit does: `BlockPool.touch(blocks)` takes
a reference (ref_cnt + 1, out of the free queue), so vLLM can neither evict nor
reuse the blocks; the release is `BlockPool.free_blocks(blocks)`, which puts them
back as cached, evictable blocks. Blocks are found by vLLM's own block hashes
(`cached_block_hash_to_block`), the kvrc key of each being vLLM's
`maybe_convert_block_hash` form (see `scheduler.block_hash_key`).

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


class PoolPins:
    def __init__(self, key_of: Callable[[Any], bytes]) -> None:
        self.lock = threading.RLock()
        self._key_of = key_of
        self._pool: Any = None
        self._pins: dict[str, list[Any]] = {}  # lease id -> its pinned blocks
        self._nets = HoldDeadlines()
        self._by_key: dict[bytes, bytes] = {}  # kvrc key -> vLLM BlockHash

    def bind(self, pool: Any, manager: Any = None) -> None:
        self._pool = pool
        _lock_public_methods(pool, self.lock)
        if manager is not None:
            _lock_public_methods(manager, self.lock)

    @property
    def bound(self) -> bool:
        return self._pool is not None

    def _keys_of(self, cached: list[Any]) -> dict[bytes, bytes]:
        """kvrc key -> vLLM BlockHash for a snapshot of the pool's cached block hashes."""
        from vllm.v1.core.kv_cache_utils import get_block_hash  # type: ignore[import-not-found]

        by_key: dict[bytes, bytes] = {}
        for key_with_group in cached:
            block_hash = get_block_hash(key_with_group)
            by_key[self._key_of(block_hash)] = block_hash
        return by_key

    def _find(self, keys: Sequence[bytes]) -> list[Any]:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # type: ignore[import-not-found]

        blocks: list[Any] = []
        for key in keys:
            block_hash = self._by_key.get(key)
            if block_hash is None:
                break
            block = self._pool.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, 0)
            )
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
            cached: list[Any] | None = None
            if (
                len(self._by_key) == 0
                or keys[0] not in self._by_key
                or keys[-1] not in self._by_key
            ):
                # One C-level copy of the keys under the lock; converting them (Python,
                # per block: a second or more for a million cached blocks) runs outside
                # it, so vLLM's scheduler is not held meanwhile.
                cached = list(self._pool.cached_block_hash_to_block._cache)
        if cached is not None:
            by_key = self._keys_of(cached)
        with self.lock:
            if cached is not None:
                # Advisory: a block evicted since the copy is not found by `_find`,
                # which looks each one up in the pool again under the lock.
                self._by_key = by_key
            existing = self._pins.get(lease_id)
            if existing is not None:
                return [block.block_id for block in existing]
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
