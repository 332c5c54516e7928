"""The engine's block pool: prefix table, LRU eviction, pins, retention, taint.

Pure and synchronous (time comes in as `now_ms`), like vLLM's BlockPool: it
decides which cache block holds what; the engine executes. Every change of
the prefix table comes back as `StoredBlock` / removed hashes for the engine
to publish as BlockStored / BlockRemoved events. A method that raises has
changed nothing.

A block is, at any time, exactly one of:
- free (never used, or freed);
- referenced (`refs > 0`: a running request, a pin of a lease, a handoff);
- cached (hashed, unreferenced: in the LRU, evictable, or expired);
- tainted (the destination of a transfer that failed or timed out: out of use
  until the engine proves the native read quiet, then free).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class PoolExhaustedError(RuntimeError):
    """Not enough free or evictable blocks; nothing was allocated."""


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block that entered the prefix table (one BlockStored entry)."""

    block_hash: bytes
    parent_hash: bytes  # b"" for the first block of a chain
    expiry_ms: int  # 0 = no expiry


@dataclass(slots=True)
class _Block:
    block_hash: bytes | None = None
    parent_hash: bytes = b""
    expiry_ms: int = 0
    refs: int = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, oldest first
        self._tainted: set[int] = set()
        self._pins: dict[str, tuple[int, ...]] = {}

    # --- reads -------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def tainted(self) -> frozenset[int]:
        return frozenset(self._tainted)

    @property
    def pinned_leases(self) -> frozenset[str]:
        return frozenset(self._pins)

    def refs(self, block_id: int) -> int:
        return self._blocks[block_id].refs

    def match_prefix(self, hashes: Sequence[bytes], now_ms: int) -> list[int]:
        """Blocks holding the longest live prefix of `hashes` (first block first)."""
        found: list[int] = []
        for block_hash in hashes:
            block_id = self._by_hash.get(block_hash)
            if block_id is None or self._expired(self._blocks[block_id], now_ms):
                break
            found.append(block_id)
        return found

    def table(self) -> list[StoredBlock]:
        """Every block of the prefix table, parents before children (a full dump)."""
        entries = [
            StoredBlock(b.block_hash, b.parent_hash, b.expiry_ms)
            for b in self._blocks
            if b.block_hash is not None
        ]
        known = {e.block_hash for e in entries}
        ordered: list[StoredBlock] = []
        placed: set[bytes] = set()
        pending = entries
        while pending:  # parents first; a parent outside the table counts as placed
            rest = []
            for entry in pending:
                if entry.parent_hash in placed or entry.parent_hash not in known:
                    ordered.append(entry)
                    placed.add(entry.block_hash)
                else:
                    rest.append(entry)
            if len(rest) == len(pending):  # defensive: no cycle is possible with chained hashes
                ordered.extend(rest)
                break
            pending = rest
        return ordered

    # --- requests ----------------------------------------------------------------

    def acquire(self, block_ids: Sequence[int]) -> None:
        """One more reference on each block (a request uses a cached prefix)."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.refs == 0 and block_id not in self._lru:
                raise ValueError(f"block {block_id} is neither referenced nor cached")
        for block_id in block_ids:
            self._ref(block_id)

    def allocate(self, count: int, now_ms: int) -> tuple[list[int], list[bytes]]:
        """`count` blocks, referenced once, and the hashes evicted to make room.

        Free blocks first, then expired cached blocks, then least recently used.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free) + len(self._lru):
            raise PoolExhaustedError(
                f"need {count} blocks, {len(self._free)} free and {len(self._lru)} evictable "
                f"({len(self._tainted)} tainted, {len(self._pins)} leases pinned)"
            )
        removed: list[bytes] = []
        removed += self.expire(now_ms)
        taken: list[int] = []
        while len(taken) < count:
            if self._free:
                block_id = self._free.pop()
            else:
                block_id, _ = self._lru.popitem(last=False)
                block_hash = self._unhash(block_id)
                removed.append(block_hash)
            self._blocks[block_id].refs = 1
            taken.append(block_id)
        # Ascending ids: runs contiguous on both sides coalesce into one transfer
        # entry per layer (freed blocks come back in reverse order otherwise).
        taken.sort()
        return taken, removed

    def commit(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        parent_hash: bytes,
        *,
        expiry_ms: int = 0,
    ) -> list[StoredBlock]:
        """Enter computed or loaded blocks in the prefix table (chain order).

        `block_ids[i]` holds the block of `hashes[i]`, whose parent is
        `hashes[i-1]` (`parent_hash` for i = 0). A hash another block already
        holds keeps that block (this one stays unhashed and is freed when
        released). `expiry_ms` (re)sets the retention of every listed block.
        """
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} blocks for {len(hashes)} hashes")
        for block_id in block_ids:
            if self._blocks[block_id].refs == 0:
                raise ValueError(f"block {block_id} is not held by the caller")
        stored: list[StoredBlock] = []
        parent = parent_hash
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            block = self._blocks[block_id]
            holder = self._by_hash.get(block_hash)
            new = holder is None and block.block_hash is None
            if new:
                block.block_hash, block.parent_hash, block.expiry_ms = block_hash, parent, 0
                self._by_hash[block_hash] = block_id
                holder = block_id
            if holder is not None:
                held = self._blocks[holder]
                # Retention only grows: a later request extends it, never shortens it.
                expiry = held.expiry_ms
                if expiry_ms and (new or expiry == 0 or expiry_ms > expiry):
                    expiry = expiry_ms
                if new or expiry != held.expiry_ms:
                    held.expiry_ms = expiry
                    stored.append(StoredBlock(block_hash, held.parent_hash, expiry))
            parent = block_hash
        return stored

    def release(self, block_ids: Sequence[int], now_ms: int) -> list[bytes]:
        """Drop one reference per block; returns hashes removed (expired on release)."""
        for block_id in block_ids:
            if self._blocks[block_id].refs <= 0:
                raise ValueError(f"block {block_id} is not referenced")
        removed: list[bytes] = []
        for block_id in block_ids:
            block = self._blocks[block_id]
            block.refs -= 1
            if block.refs > 0 or block_id in self._tainted:
                continue
            if block.block_hash is None:
                self._free.append(block_id)
            elif self._expired(block, now_ms):
                removed.append(self._unhash(block_id))
                self._free.append(block_id)
            else:
                self._lru[block_id] = None
                self._lru.move_to_end(block_id)
        return removed

    # --- transfers ---------------------------------------------------------------

    def taint(self, block_ids: Sequence[int]) -> None:
        """Destination blocks of a failed or unknown transfer: held out of use.

        The caller's references are dropped; the blocks return to the free list
        only through `untaint`, once the native read is proven quiet.
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.refs != 1 or block.block_hash is not None:
                raise ValueError(f"block {block_id} is not a fresh, singly held block")
        for block_id in block_ids:
            self._blocks[block_id].refs = 0
            self._tainted.add(block_id)

    def untaint(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if block_id in self._tainted:
                self._tainted.discard(block_id)
                self._free.append(block_id)

    def pin(self, lease_id: str, hashes: Sequence[bytes], now_ms: int) -> tuple[int, ...]:
        """Pin the longest live prefix of `hashes` for a lease (idempotent per lease)."""
        if lease_id in self._pins:
            return self._pins[lease_id]
        block_ids = tuple(self.match_prefix(hashes, now_ms))
        for block_id in block_ids:
            self._ref(block_id)
        self._pins[lease_id] = block_ids
        return block_ids

    def unpin(self, lease_id: str, now_ms: int) -> list[bytes]:
        """Release a lease's pins (idempotent); returns hashes removed by expiry."""
        block_ids = self._pins.pop(lease_id, None)
        if block_ids is None:
            return []
        return self.release(block_ids, now_ms)

    def expire(self, now_ms: int) -> list[bytes]:
        """Drop cached blocks whose retention ended; returns their hashes."""
        removed: list[bytes] = []
        for block_id in [b for b in self._lru if self._expired(self._blocks[b], now_ms)]:
            del self._lru[block_id]
            removed.append(self._unhash(block_id))
            self._free.append(block_id)
        return removed

    # --- internals ---------------------------------------------------------------

    @staticmethod
    def _expired(block: _Block, now_ms: int) -> bool:
        return block.expiry_ms != 0 and block.expiry_ms <= now_ms

    def _ref(self, block_id: int) -> None:
        self._lru.pop(block_id, None)
        self._blocks[block_id].refs += 1

    def _unhash(self, block_id: int) -> bytes:
        block = self._blocks[block_id]
        assert block.block_hash is not None
        block_hash = block.block_hash
        del self._by_hash[block_hash]
        block.block_hash, block.parent_hash, block.expiry_ms = None, b"", 0
        return block_hash
