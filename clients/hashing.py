"""The reference chained block hasher shared by engines, simulators and tests.

kvrc never computes block hashes (docs/invariants.md, Terms: they are opaque engine keys); this
module exists so that every engine process of a deployment, and every test, derives
the same key for the same prefix. It is pure Python (hashlib, no Python `hash()`),
so the values are stable across processes, runs, machines and PYTHONHASHSEED.

Byte format (version 1), all integers unsigned:

    root   = BLAKE2b(key=b"kvrc-block-hash/v1", digest_size=D,
                     data = seed as 8 bytes big-endian)
    h[i]   = BLAKE2b(key=b"kvrc-block-hash/v1", digest_size=D,
                     data = h[i-1]                               (D bytes; root for i=0)
                          || block_size as 4 bytes little-endian
                          || len(extra) as 4 bytes little-endian || extra
                          || token_ids[i*B:(i+1)*B], each 4 bytes little-endian)

D (`digest_size`) is 16 by default; 8 gives vLLM-sized keys (an unsigned 64-bit
int, sent big-endian as the protocol says). `extra` scopes the chain (e.g. a LoRA
name or multimodal hash) and enters every block, like vLLM's extra keys. Only full
blocks are hashed: a trailing partial block has no key.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_FORMAT_VERSION = 1
DEFAULT_DIGEST_SIZE = 16
_KEY = b"kvrc-block-hash/v1"
_ALLOWED_DIGEST_SIZES = (8, 16, 32)
_MAX_TOKEN_ID = 2**32 - 1
_MAX_SEED = 2**64 - 1
_MAX_BLOCK_SIZE = 2**32 - 1


def root_hash(seed: int, *, digest_size: int = DEFAULT_DIGEST_SIZE) -> bytes:
    """The parent of the first block of every chain under `seed`."""
    _check_digest_size(digest_size)
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed must be an unsigned 64-bit int, got {seed}")
    return hashlib.blake2b(seed.to_bytes(8, "big"), key=_KEY, digest_size=digest_size).digest()


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: int,
    extra: bytes | None = None,
    parent: bytes | None = None,
    digest_size: int = DEFAULT_DIGEST_SIZE,
) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`, first block first.

    `parent` continues an existing chain (the hash of the block just before
    `token_ids[0]`); by default the chain starts at `root_hash(seed)`. Hashing a
    prompt in pieces gives the same keys as hashing it at once.
    """
    _check_digest_size(digest_size)
    if not 1 <= block_size <= _MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in 1..{_MAX_BLOCK_SIZE}, got {block_size}")
    if parent is None:
        parent = root_hash(seed, digest_size=digest_size)
    elif len(parent) != digest_size:
        raise ValueError(f"parent hash has {len(parent)} bytes, expected {digest_size}")
    extra_bytes = b"" if extra is None else bytes(extra)
    header = struct.pack("<II", block_size, len(extra_bytes)) + extra_bytes
    token_format = struct.Struct(f"<{block_size}I")
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        try:
            packed_tokens = token_format.pack(*block)
        except struct.error as exc:
            bad = next((t for t in block if not 0 <= t <= _MAX_TOKEN_ID), None)
            raise ValueError(
                f"token id {bad!r} at block {start // block_size} is not in 0..{_MAX_TOKEN_ID}"
            ) from exc
        parent = hashlib.blake2b(
            parent + header + packed_tokens, key=_KEY, digest_size=digest_size
        ).digest()
        hashes.append(parent)
    return hashes


def block_hash_to_int(block_hash: bytes) -> int:
    """The unsigned int form of a key (big-endian), as vLLM's int block hashes."""
    if not 1 <= len(block_hash) <= 64:
        raise ValueError(f"a block hash has 1..64 bytes, got {len(block_hash)}")
    return int.from_bytes(block_hash, "big")


def int_to_block_hash(value: int, *, digest_size: int = 8) -> bytes:
    """Inverse of `block_hash_to_int`: vLLM's u64 hashes travel as 8 bytes big-endian."""
    if not 1 <= digest_size <= 64:
        raise ValueError(f"digest_size must be in 1..64, got {digest_size}")
    if not 0 <= value < 1 << (8 * digest_size):
        raise ValueError(f"{value} does not fit in {digest_size} unsigned bytes")
    return value.to_bytes(digest_size, "big")


def _check_digest_size(digest_size: int) -> None:
    if digest_size not in _ALLOWED_DIGEST_SIZES:
        raise ValueError(f"digest_size must be one of {_ALLOWED_DIGEST_SIZES}, got {digest_size}")
