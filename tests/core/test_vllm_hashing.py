"""Score's vLLM block hashing (coordinator/core/vllm_hashing.py) on plain data.

vLLM's own functions are the reference in tests/e2e/test_vllm_real.py (one
subprocess of the vLLM venv); here: the frames a real vLLM publisher sent, the
chain's properties, the key form, and every refusal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cbor2
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.vllm_hashing import (
    _TOKEN_CBOR,
    _TOKEN_CBOR_MAX,
    ALGOS,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    HashConfig,
    MmFeature,
    Seed,
    _cbor_head,
    _token_encodings,
    block_keys,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_frames"
SETTINGS = settings(max_examples=60, deadline=None)


def stored_events(kind: str) -> list[dict[str, Any]]:
    """The BlockStored events of a capture of vLLM's real publisher, in order."""
    frames = msgpack.unpackb((DATA / f"vllm-0.33.0-{kind}-hashes.msgpack").read_bytes())
    events: list[dict[str, Any]] = []
    for _topic, _seq, payload in frames:
        batch = msgpack.unpackb(payload, raw=False)
        events.extend(ev for ev in batch[1] if ev["type"] == "BlockStored")
    return events


def event_key(raw: int | bytes) -> bytes:
    # The inventory's form of a published hash (coordinator/core/vllm_events.py).
    return raw.to_bytes(8, "big") if isinstance(raw, int) else raw


def matched_events(kind: str, seed: str | Seed) -> tuple[int, int]:
    """(events whose keys kvrc recomputes exactly, events), following parent links."""
    config = HashConfig("sha256", 4, seed, int_hashes=kind == "int")
    prefix_of: dict[bytes, list[int]] = {}  # a published key -> the tokens up to its end
    matched = total = 0
    for ev in stored_events(kind):
        parent = ev["parent_block_hash"]
        tokens = (prefix_of[event_key(parent)] if parent is not None else []) + ev["token_ids"]
        published = [event_key(h) for h in ev["block_hashes"]]
        total += 1
        matched += block_keys(tokens, config)[-len(published) :] == published
        for i, key in enumerate(published):
            prefix_of[key] = tokens[: len(tokens) - 4 * (len(published) - 1 - i)]
    return matched, total


@pytest.mark.parametrize("kind", ["int", "bytes"])
def test_keys_equal_what_a_real_vllm_publisher_sent(kind: str) -> None:
    """The captures ran vLLM's real request block hasher: sha256, block size 4, no
    PYTHONHASHSEED. Chained events (a parent and only their own tokens) count too."""
    matched, total = matched_events(kind, Seed.UNSET)
    assert total >= 3 and any(ev["parent_block_hash"] is not None for ev in stored_events(kind))
    assert matched == total
    # Negative control: another seed is another NONE_HASH, so nothing matches.
    assert matched_events(kind, "0")[0] == 0


# --- the chain's properties --------------------------------------------------------

token_lists = st.lists(st.integers(0, MAX_TOKEN_ID), max_size=40)


@st.composite
def configs(draw: st.DrawFn) -> HashConfig:
    algo = draw(st.sampled_from(ALGOS))
    seed: str | Seed = draw(st.text(max_size=8))
    if algo.startswith("sha256") and draw(st.booleans()):
        seed = Seed.UNSET
    return HashConfig(algo, draw(st.integers(1, 8)), seed, int_hashes=draw(st.booleans()))


@st.composite
def scopes(draw: st.DrawFn) -> dict[str, Any]:
    scope: dict[str, Any] = {}
    if draw(st.booleans()):
        scope["lora_name"], scope["lora_path"] = "adapter", "/adapters/a"
    if draw(st.booleans()):
        scope["cache_salt"] = draw(st.text(min_size=1, max_size=6))
    if draw(st.booleans()):
        scope["mm_features"] = [MmFeature("img-1", draw(st.integers(0, 10)), 7)]
    return scope


@SETTINGS
@given(configs(), token_lists, st.integers(0, 40), scopes())
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(
    config: HashConfig, tokens: list[int], cut: int, scope: dict[str, Any]
) -> None:
    keys = block_keys(tokens, config, **scope)
    assert len(keys) == len(tokens) // config.block_size
    assert (
        block_keys(tokens[:cut], config, **scope)
        == keys[: min(cut, len(tokens)) // config.block_size]
    )


@SETTINGS
@given(configs(), token_lists, token_lists, scopes())
def test_a_partial_trailing_block_has_no_key(
    config: HashConfig, tokens: list[int], tail: list[int], scope: dict[str, Any]
) -> None:
    full = tokens[: len(tokens) // config.block_size * config.block_size]
    partial = tail[: config.block_size - 1]
    assert block_keys(full + partial, config, **scope) == block_keys(full, config, **scope)


@SETTINGS
@given(configs(), token_lists, scopes())
def test_keys_are_deterministic_whatever_sequence_holds_the_ids(
    config: HashConfig, tokens: list[int], scope: dict[str, Any]
) -> None:
    keys = block_keys(tokens, config, **scope)
    assert block_keys(tuple(tokens), config, **scope) == keys
    assert block_keys(list(tokens), HashConfig(*_fields(config)), **scope) == keys
    assert all(
        len(k) == (8 if config.int_hashes else 16 if "xx" in config.algo else 32) for k in keys
    )


@SETTINGS
@given(configs(), st.lists(st.integers(0, MAX_TOKEN_ID), min_size=8, max_size=40), st.data())
def test_a_changed_token_changes_its_block_key_and_every_later_one(
    config: HashConfig, tokens: list[int], data: st.DataObject
) -> None:
    keys = block_keys(tokens, config)
    index = data.draw(st.integers(0, len(keys) * config.block_size - 1), label="index")
    changed = [*tokens]
    changed[index] = (changed[index] + 1) % (MAX_TOKEN_ID + 1)
    block = index // config.block_size
    other = block_keys(changed, config)
    assert other[:block] == keys[:block]
    assert all(a != b for a, b in zip(other[block:], keys[block:], strict=True))


def _fields(config: HashConfig) -> tuple[str, int, str | Seed, bool]:
    return (config.algo, config.block_size, config.seed, config.int_hashes)


def test_int_keys_are_the_last_8_bytes_of_the_digests() -> None:
    """vLLM's int is the digest's low 64 bits; kvrc holds it as 8 bytes big-endian."""
    tokens = list(range(100, 164))
    for algo in ALGOS:
        digests = block_keys(tokens, HashConfig(algo, 16, "7", int_hashes=False))
        ints = block_keys(tokens, HashConfig(algo, 16, "7"))
        assert ints == [d[-8:] for d in digests]
        assert ints == [
            (int.from_bytes(d, "big") & (2**64 - 1)).to_bytes(8, "big") for d in digests
        ]


def test_every_scope_input_changes_the_keys() -> None:
    """The salt changes block 0's key (so every key, chained); LoRA and mm change the
    blocks they touch. Agreement with vLLM on each is tests/e2e/test_vllm_real.py."""
    config = HashConfig("sha256_cbor", 4, "0")
    tokens = list(range(16))
    base = block_keys(tokens, config)
    variants = [
        block_keys(tokens, config, cache_salt="tenant-a"),
        block_keys(tokens, config, cache_salt="tenant-b"),
        block_keys(tokens, config, lora_name="a", lora_path="/a"),
        block_keys(tokens, config, lora_name="a", lora_path="/b"),
        block_keys(tokens, config, mm_features=[MmFeature("img", 5, 2)]),
        block_keys(tokens, config, mm_features=[MmFeature("img", 6, 2)]),
    ]
    assert len({tuple(k) for k in [base, *variants]}) == 1 + len(variants)
    # An item inside block 1 leaves block 0 alone; an empty salt is no salt (as in vLLM).
    assert variants[4][0] == base[0] and variants[4][1] != base[1]
    assert block_keys(tokens, config, cache_salt="") == base


# --- refusals ------------------------------------------------------------------------


def refused(call: Any, *words: str) -> str:
    with pytest.raises(KvrcError) as info:
        call()
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value.message


def test_configs_whose_hashes_cannot_be_known_are_refused() -> None:
    refused(lambda: HashConfig("md5", 16, "0"), "md5", "sha256_cbor", "--prefix-caching-hash-algo")
    refused(lambda: HashConfig("sha256", 16, Seed.UNKNOWN), "PYTHONHASHSEED is unknown")
    for algo in ("xxhash", "xxhash_cbor"):
        refused(lambda a=algo: HashConfig(a, 16, Seed.UNSET), algo, "random", "set PYTHONHASHSEED")
    refused(lambda: HashConfig("sha256", 16, None), "Seed.UNSET")  # type: ignore[arg-type]
    refused(lambda: HashConfig("sha256", 0, "0"), "block_size")
    # The sha256 algorithms without PYTHONHASHSEED use vLLM's fixed seed: accepted.
    assert (
        HashConfig("sha256_cbor", 16, Seed.UNSET).none_hash
        == HashConfig("sha256_cbor", 16, "vllm-none-hash").none_hash
    )


def test_bad_prompts_are_refused_with_the_reason() -> None:
    config = HashConfig("sha256", 16, "0")
    refused(lambda: block_keys([0] * (MAX_TOKENS + 1), config), f"maximum of {MAX_TOKENS}")
    assert len(block_keys([0] * MAX_TOKENS, HashConfig("sha256", 4096, "0"))) == 64
    refused(lambda: block_keys([1, 2, -3], config), "token id -3 at index 2", "0..4294967295")
    refused(lambda: block_keys([1, MAX_TOKEN_ID + 1], config), "index 1")
    refused(lambda: block_keys([1, 2.0], config), "2.0", "index 1")  # type: ignore[list-item]
    refused(lambda: block_keys(b"\x01\x02", config), "bytes")  # type: ignore[arg-type]
    refused(lambda: block_keys([1], config, lora_name="a"), "lora_path")
    refused(lambda: block_keys([1], config, lora_name="", lora_path="/a"), "lora_name")
    refused(lambda: MmFeature("img", -1, 4), "offset")
    refused(lambda: MmFeature("img", 0, 0), "length")
    overlapping = [MmFeature("a", 0, 8), MmFeature("b", 4, 8)]
    refused(lambda: block_keys([1] * 32, config, mm_features=overlapping), "sorted by offset")
    assert block_keys([], config) == [] and block_keys([1] * 15, config) == []


@SETTINGS
@given(
    st.lists(
        st.one_of(
            st.integers(0, MAX_TOKEN_ID),
            st.sampled_from([0, 23, 24, 255, 256, 65535, 65536, MAX_TOKEN_ID]),
        ),
        max_size=300,
    )
)
def test_token_encodings_are_what_cbor2_writes(ids: list[int]) -> None:
    """The hand-built CBOR of a block's tokens (the fast path) equals cbor2's, byte for
    byte, at every width boundary; and twice in a row (the second from the cache)."""
    for _ in range(2):
        built = _cbor_head(4, len(ids)) + b"".join(_token_encodings(ids))
        assert built == cbor2.dumps(ids, canonical=True)


def test_the_token_encoding_cache_keeps_only_vocabulary_sized_ids() -> None:
    """Ids past the bound (random ones from a client) are encoded, never kept: they
    cannot grow the cache or crowd out the vocabulary's ids."""
    large = list(range(_TOKEN_CBOR_MAX, _TOKEN_CBOR_MAX + 5000))
    small = [_TOKEN_CBOR_MAX - 1, 7, 300]
    built = _cbor_head(4, len(large + small)) + b"".join(_token_encodings(large + small))
    assert built == cbor2.dumps(large + small, canonical=True)
    assert not any(t in _TOKEN_CBOR for t in large)
    assert all(t in _TOKEN_CBOR for t in small)  # control: small ids are kept
    assert len(_TOKEN_CBOR) <= _TOKEN_CBOR_MAX
