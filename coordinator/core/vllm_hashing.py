"""vLLM 0.32.0's prefix-caching block hashes, computed from token ids (for Score only).

The inventory never uses this: it keys blocks by the hashes engines publish.
Score is the one place kvrc hashes, because a router holds a prompt's token ids,
not its block hashes. The keys are in the inventory's form for vLLM blocks, the
form `coordinator.core.vllm_events` gives the KV events' hashes:

- `int_hashes=True` (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`):
  vLLM publishes the digest's low 64 bits as an int, which kvrc keeps as 8 bytes
  big-endian, i.e. the digest's last 8 bytes;
- `int_hashes=False`: the whole digest (32 bytes for sha256, 16 for xxhash).

What it follows, from vLLM 0.32.0 (`vllm/v1/core/kv_cache_utils.py`,
`vllm/utils/hashing.py`):

- block i's hash is `H((parent, tuple(block i's tokens), extra_keys_i))`, the
  parent of block 0 being `NONE_HASH = H(seed)`; only full blocks are hashed;
- `H` is one of `sha256` (pickle protocol 5, then SHA-256), `sha256_cbor`
  (canonical CBOR, then SHA-256), `xxhash` and `xxhash_cbor` (the same
  serializations, then XXH3-128);
- the seed is the engines' `PYTHONHASHSEED` string, verbatim. Without it vLLM
  uses the fixed "vllm-none-hash" for the sha256 algorithms, but 32 random bytes
  per process for the xxhash ones: those hashes cannot be known, so such a
  config is refused rather than answered with silent misses;
- extra keys, in vLLM's order: `("lora", name, path)` on every block,
  `("mm", identifier, offset - block_start)` for each multimodal item a block
  overlaps, `("cache_salt", salt)` on block 0 only; None when there are none.
  Prompt embeddings (vLLM's fourth kind) cannot come with token ids, so there
  are none here. Pickle writes an object repeated within one block as a
  back-reference, in vLLM as here: the strings are used as the caller gave them.

Pure: no I/O, no clock. `xxhash` is imported only when an xxhash algorithm is
configured (it is optional in vLLM for the same reason: not every deployment
may install a non-cryptographic hash).
"""

from __future__ import annotations

import enum
import hashlib
import pickle
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final

import cbor2

from coordinator.core.errors import invalid
from kvrc.vocabulary import BlockHash, vllm_int_hash_key

ALGOS: Final = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM keeps a random per-process seed for these when PYTHONHASHSEED is unset.
_NON_CRYPTO: Final = frozenset({"xxhash", "xxhash_cbor"})
# vLLM's seed for the cryptographic algorithms when PYTHONHASHSEED is unset.
DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"
# One Score prompt at most: a 256k-token context. Hashing that many at block size
# 16 is ~16k digests; the bound keeps one request's CPU time on the loop small.
MAX_TOKENS: Final = 1 << 18
# Token ids are vocabulary indices; anything outside uint32 is not a token.
MAX_TOKEN_ID: Final = (1 << 32) - 1
MAX_MM_FEATURES: Final = 4096
_PICKLE_PROTOCOL: Final = 5  # vLLM's pickle.HIGHEST_PROTOCOL (5 since Python 3.8)


class Seed(enum.Enum):
    """A seed that is not a PYTHONHASHSEED value."""

    UNSET = "unset"  # the engines run without PYTHONHASHSEED
    UNKNOWN = "unknown"  # nobody has said: kvrc refuses to guess


@dataclass(frozen=True, slots=True)
class HashConfig:
    """How a vLLM deployment hashes its blocks; all three must match the engines.

    `seed` is the engines' PYTHONHASHSEED exactly as set (a string, "" included),
    `Seed.UNSET` when they run without it, or `Seed.UNKNOWN` (always refused).
    `int_hashes` is VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
    Construction raises `KvrcError` (INVALID_ARGUMENT) for a config whose hashes
    kvrc cannot reproduce.
    """

    algo: str
    block_size: int
    seed: str | Seed
    int_hashes: bool = True

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise invalid(
                f"unknown vLLM prefix-caching hash algorithm {self.algo!r}: "
                f"expected one of {', '.join(ALGOS)} (vLLM's --prefix-caching-hash-algo)"
            )
        if type(self.block_size) is not int or not 1 <= self.block_size <= MAX_TOKENS:
            raise invalid(
                f"block_size must be an int in 1..{MAX_TOKENS} (vLLM's --block-size), "
                f"got {self.block_size!r}"
            )
        if type(self.seed) is not str and not isinstance(self.seed, Seed):
            raise invalid(
                "seed must be the engines' PYTHONHASHSEED string, Seed.UNSET or "
                f"Seed.UNKNOWN, got {type(self.seed).__name__}"
            )
        if self.seed is Seed.UNKNOWN:
            raise invalid(
                "the vLLM engines' PYTHONHASHSEED is unknown, so kvrc cannot compute their "
                "block hashes: give kvrc the value the engines run with (or say they run "
                "without one)"
            )
        if self.seed is Seed.UNSET and self.algo in _NON_CRYPTO:
            raise invalid(
                f"vLLM engines using {self.algo} without PYTHONHASHSEED seed their block "
                "hashes with random bytes per process, so kvrc cannot compute them: set "
                "PYTHONHASHSEED to the same value on every engine and give kvrc that value"
            )
        if self.algo in _NON_CRYPTO:
            _xxh3_128()  # fail here, not on the first Score, if xxhash is missing

    @property
    def none_hash(self) -> bytes:
        """vLLM's NONE_HASH for this config: the parent of every chain's first block."""
        seed = self.seed if type(self.seed) is str else DEFAULT_NONE_HASH_SEED
        return _none_hash(self.algo, seed)


@dataclass(frozen=True, slots=True)
class MmFeature:
    """One multimodal item of a prompt: vLLM's `MultiModalFeatureSpec.identifier`
    and its placeholder range (`mm_position.offset`, `.length`) in the token ids."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if type(self.identifier) is not str or not self.identifier:
            raise invalid("a multimodal feature's identifier must be a non-empty string")
        if type(self.offset) is not int or not 0 <= self.offset <= MAX_TOKENS:
            raise invalid(f"multimodal offset must be in 0..{MAX_TOKENS}, got {self.offset!r}")
        if type(self.length) is not int or not 1 <= self.length <= MAX_TOKENS:
            raise invalid(f"multimodal length must be in 1..{MAX_TOKENS}, got {self.length!r}")


def block_keys(
    token_ids: Sequence[int],
    config: HashConfig,
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_features: Sequence[MmFeature] = (),
) -> list[BlockHash]:
    """The inventory keys of a prompt's full blocks, first block first.

    A trailing partial block has no key (vLLM hashes only full blocks).
    `lora_name` and `lora_path` are the adapter's `LoRARequest.lora_name` and
    `.lora_path` on the engines (vLLM hashes both); give both or neither.
    `mm_features` must be sorted by offset and not overlap, as vLLM holds them.
    Raises `KvrcError` (INVALID_ARGUMENT) naming the bad input.
    """
    ids = _checked_token_ids(token_ids)
    bs = config.block_size
    num_blocks = len(ids) // bs
    extras = _extra_keys(num_blocks, bs, lora_name, lora_path, cache_salt, mm_features)
    if config.algo.endswith("_cbor"):
        digests = _chain_cbor(ids, bs, num_blocks, config.none_hash, extras, _digest(config.algo))
    else:
        digests = _chain_pickle(ids, bs, num_blocks, config.none_hash, extras, _digest(config.algo))
    if config.int_hashes:
        return [vllm_int_hash_key(d) for d in digests]
    return digests


# --- internals -------------------------------------------------------------------


def _checked_token_ids(token_ids: Sequence[int]) -> list[int]:
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        # array() would read bytes as raw machine ints.
        raise invalid(f"token ids must be a sequence of ints, got {type(token_ids).__name__}")
    if len(token_ids) > MAX_TOKENS:
        raise invalid(
            f"a prompt of {len(token_ids)} tokens is over the maximum of {MAX_TOKENS}: "
            "score a prefix of it"
        )
    try:
        # One C-level pass: array("I") (uint32) refuses negatives, ids past 2**32 - 1,
        # floats and strings; tolist() gives plain ints (a bool or a numpy int would
        # serialize differently from vLLM's ints).
        return array("I", token_ids).tolist()
    except (TypeError, OverflowError):
        for index, t in enumerate(token_ids):
            if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                raise invalid(
                    f"token id {t!r} at index {index} is not an integer in 0..{MAX_TOKEN_ID}"
                ) from None
        raise invalid(f"token ids must be integers in 0..{MAX_TOKEN_ID}") from None


def _extra_keys(
    num_blocks: int,
    block_size: int,
    lora_name: str | None,
    lora_path: str | None,
    cache_salt: str | None,
    mm_features: Sequence[MmFeature],
) -> list[tuple[Any, ...] | None] | None:
    """Each block's extra-keys tuple as vLLM builds it, or None if every block has none."""
    if (lora_name is None) != (lora_path is None):
        raise invalid(
            "give both lora_name and lora_path (vLLM hashes the adapter's name and path) or neither"
        )
    lora: list[tuple[Any, ...]] = []
    if lora_name is not None:
        if type(lora_name) is not str or not lora_name:
            raise invalid("lora_name must be a non-empty string")
        if type(lora_path) is not str or not lora_path:
            raise invalid("lora_path must be a non-empty string (vLLM requires one)")
        lora = [("lora", lora_name, lora_path)]
    if cache_salt is not None and type(cache_salt) is not str:
        raise invalid(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if len(mm_features) > MAX_MM_FEATURES:
        raise invalid(
            f"{len(mm_features)} multimodal features is over the maximum of {MAX_MM_FEATURES}"
        )
    if not (lora or cache_salt or mm_features):
        return None
    features = list(mm_features)
    end = 0
    for f in features:
        if type(f) is not MmFeature:
            raise invalid(f"mm_features must hold MmFeature values, got {type(f).__name__}")
        # vLLM assumes this order (its incremental hasher bisects on it).
        if f.offset < end:
            raise invalid(
                f"multimodal feature at offset {f.offset} overlaps or precedes the one "
                f"ending at {end}: give features sorted by offset, not overlapping"
            )
        end = f.offset + f.length
    extras: list[tuple[Any, ...] | None] = []
    mm_idx = 0
    for i in range(num_blocks):
        start = i * block_size
        mm_keys, mm_idx = _mm_keys(features, start, start + block_size, mm_idx)
        # vLLM: the salt only on the block that starts at token 0; "" adds nothing.
        salt = [("cache_salt", cache_salt)] if i == 0 and cache_salt else []
        keys = lora + mm_keys + salt
        extras.append(tuple(keys) if keys else None)
    return extras


def _mm_keys(
    features: list[MmFeature], start: int, end: int, mm_idx: int
) -> tuple[list[tuple[Any, ...]], int]:
    """vLLM's `_gen_mm_extra_hash_keys`, step for step."""
    keys: list[tuple[Any, ...]] = []
    if not features:
        return keys, mm_idx
    last = features[-1]
    if last.offset + last.length <= start:
        return keys, mm_idx
    while mm_idx < len(features):
        f = features[mm_idx]
        if end > f.offset:
            if start >= f.offset + f.length:
                mm_idx += 1  # the block is past this item
                continue
            keys.append(("mm", f.identifier, f.offset - start))
            if end >= f.offset + f.length:
                mm_idx += 1  # the item ends here; the next may start in this block too
            else:
                break
        else:
            break
    return keys, mm_idx


def _chain_pickle(
    ids: list[int],
    bs: int,
    num_blocks: int,
    parent: bytes,
    extras: list[tuple[Any, ...] | None] | None,
    digest: Callable[[bytes], bytes],
) -> list[bytes]:
    """vLLM's `hash_block_tokens` loop for the pickle algorithms (sha256, xxhash)."""
    dumps = pickle.dumps
    out: list[bytes] = []
    append = out.append
    for i in range(num_blocks):
        start = i * bs
        extra = None if extras is None else extras[i]
        parent = digest(dumps((parent, tuple(ids[start : start + bs]), extra), _PICKLE_PROTOCOL))
        append(parent)
    return out


def _chain_cbor(
    ids: list[int],
    bs: int,
    num_blocks: int,
    parent: bytes,
    extras: list[tuple[Any, ...] | None] | None,
    digest: Callable[[bytes], bytes],
) -> list[bytes]:
    """The same for the CBOR algorithms, with the CBOR of each block built in parts.

    `cbor2.dumps((parent, tokens, extra), canonical=True)` is the 3-array header,
    then each item's own encoding: the parent's byte-string header is the same for
    every digest of one algorithm, and the tokens are an array header followed by
    each id's own encoding (`_token_encodings`), joined per block.
    """
    dumps = cbor2.dumps
    head = b"\x83" + dumps(parent)[: -len(parent)]
    array_head = _cbor_head(4, bs)
    none_tail = dumps(None)
    encoded = _token_encodings(ids[: num_blocks * bs])
    join = b"".join
    out: list[bytes] = []
    append = out.append
    for i in range(num_blocks):
        start = i * bs
        tail = none_tail if extras is None else dumps(extras[i], canonical=True)
        parent = digest(head + parent + array_head + join(encoded[start : start + bs]) + tail)
        append(parent)
    return out


# Token id -> its CBOR encoding, filled as ids are met: a vocabulary's ids are few
# and small (~32k-256k), so after warm-up a prompt's encodings are one C-level map.
# Only ids below the bound are kept (at most that many entries, ~10 MB): larger ids
# (random ones from a client) are encoded each time and cannot crowd out the vocabulary.
_TOKEN_CBOR: dict[int, bytes] = {}
_TOKEN_CBOR_MAX: Final = 1 << 18


def _token_encodings(ids: list[int]) -> list[bytes]:
    """Each id's canonical CBOR encoding (what cbor2 writes for it inside a list)."""
    cache = _TOKEN_CBOR
    out: list[bytes | None] = list(map(cache.get, ids))
    if None in out:
        for j, token in enumerate(ids):
            if out[j] is None:
                encoding = _cbor_head(0, token)
                out[j] = encoding
                if token < _TOKEN_CBOR_MAX:
                    cache[token] = encoding
    return out  # type: ignore[return-value]  # no None is left


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item head in canonical (shortest) form: an unsigned int is major type 0
    with the value itself, an array major type 4 with its length (RFC 8949, 3.1)."""
    kind = major << 5
    if value < 24:
        return bytes((kind | value,))
    if value < 0x100:
        return bytes((kind | 24, value))
    if value < 0x10000:
        return bytes((kind | 25,)) + value.to_bytes(2, "big")
    if value < 0x100000000:
        return bytes((kind | 26,)) + value.to_bytes(4, "big")
    return bytes((kind | 27,)) + value.to_bytes(8, "big")


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _digest(algo: str) -> Callable[[bytes], bytes]:
    """The digest of an algorithm's serialized block: SHA-256 or XXH3-128."""
    return _xxh3_128() if algo in _NON_CRYPTO else _sha256_digest


@lru_cache(maxsize=1)
def _xxh3_128() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError:
        raise invalid(
            "the xxhash algorithms need the `xxhash` package in kvrc's environment "
            "(pip install xxhash)"
        ) from None
    digest: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
    return digest


@lru_cache(maxsize=64)
def _none_hash(algo: str, seed: str) -> bytes:
    """vLLM's `init_none_hash`: the algorithm's hash of the seed string itself."""
    if algo.endswith("_cbor"):
        return _digest(algo)(cbor2.dumps(seed, canonical=True))
    return _digest(algo)(pickle.dumps(seed, protocol=_PICKLE_PROTOCOL))
