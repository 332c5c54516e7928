"""The reference chained block hasher: stable keys, chaining, prefix property."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.hashing import (
    block_hash_to_int,
    hash_block_chain,
    int_to_block_hash,
    root_hash,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=64)
block_sizes = st.integers(min_value=1, max_value=8)


def test_golden_values_are_stable() -> None:
    # Changing these breaks every stored inventory and every peer on an older
    # version: bump HASH_FORMAT_VERSION (and the key) instead.
    assert root_hash(0).hex() == "6cacbdc45e3f70cced9f7e0fa243f9ad"
    assert [h.hex() for h in hash_block_chain(list(range(10)), 4, seed=0)] == [
        "8a7d4e0b5ee7a2063d5d5acff0bbc414",
        "4fcb92b600b0723936d65246e8165cba",
    ]
    assert [
        h.hex()
        for h in hash_block_chain(list(range(8)), 4, seed=42, extra=b"lora-a", digest_size=8)
    ] == ["702cfe244842820c", "61b3e561ea32e884"]


def test_same_keys_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from clients.hashing import hash_block_chain;"
        "print(','.join(h.hex() for h in hash_block_chain(list(range(40)), 16, seed=7)))"
    )
    outputs = set()
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        outputs.add(done.stdout.strip())
    here = ",".join(h.hex() for h in hash_block_chain(list(range(40)), 16, seed=7))
    assert outputs == {here}


def test_only_full_blocks_are_hashed() -> None:
    assert hash_block_chain([1, 2, 3], 4, seed=0) == []
    assert len(hash_block_chain(list(range(11)), 4, seed=0)) == 2
    assert len(hash_block_chain(list(range(12)), 4, seed=0)) == 3


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, block_size=block_sizes, data=st.data())
def test_changing_one_token_changes_its_block_and_every_later_block(
    tokens: list[int], block_size: int, data: st.DataObject
) -> None:
    full = len(tokens) // block_size * block_size
    if full == 0:
        return
    position = data.draw(st.integers(min_value=0, max_value=full - 1))
    changed = list(tokens)
    changed[position] = (changed[position] + 1) % 2**32
    before = hash_block_chain(tokens, block_size, seed=1)
    after = hash_block_chain(changed, block_size, seed=1)
    first_changed_block = position // block_size
    assert before[:first_changed_block] == after[:first_changed_block]
    for index in range(first_changed_block, len(before)):
        assert before[index] != after[index]


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, block_size=block_sizes, cut=st.integers(min_value=0, max_value=64))
def test_prefix_property_and_resuming_from_a_parent(
    tokens: list[int], block_size: int, cut: int
) -> None:
    whole = hash_block_chain(tokens, block_size, seed=3)
    cut_tokens = min(cut, len(tokens)) // block_size * block_size
    head = hash_block_chain(tokens[:cut_tokens], block_size, seed=3)
    assert whole[: len(head)] == head
    # Hashing the rest from the last head key gives the same chain as hashing at once.
    parent = head[-1] if head else None
    tail = hash_block_chain(tokens[cut_tokens:], block_size, seed=3, parent=parent)
    assert head + tail == whole


def test_seed_extra_and_block_size_scope_the_chain() -> None:
    tokens = list(range(32))
    base = hash_block_chain(tokens, 8, seed=0)
    assert hash_block_chain(tokens, 8, seed=1)[0] != base[0]
    assert hash_block_chain(tokens, 8, seed=0, extra=b"lora")[0] != base[0]
    # The same 16 tokens in two blocks of 8 vs one of 16 must not collide.
    assert hash_block_chain(tokens[:16], 16, seed=0)[0] != base[1]


def test_digest_sizes_and_int_round_trip() -> None:
    for size in (8, 16, 32):
        keys = hash_block_chain(list(range(8)), 4, seed=0, digest_size=size)
        assert all(len(key) == size for key in keys)
    key = hash_block_chain(list(range(4)), 4, seed=0, digest_size=8)[0]
    assert int_to_block_hash(block_hash_to_int(key)) == key
    assert int_to_block_hash(1) == b"\x00" * 7 + b"\x01"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: hash_block_chain([1, -1], 2, seed=0), "token id -1"),
        (lambda: hash_block_chain([1, 2**32], 2, seed=0), "token id 4294967296"),
        (lambda: hash_block_chain([1, 2], 0, seed=0), "block_size"),
        (lambda: hash_block_chain([1, 2], 2, seed=-1), "seed"),
        (lambda: hash_block_chain([1, 2], 2, seed=0, digest_size=12), "digest_size"),
        (lambda: hash_block_chain([1, 2], 2, seed=0, parent=b"short"), "parent hash"),
        (lambda: int_to_block_hash(2**64), "does not fit"),
        (lambda: block_hash_to_int(b""), "1..64 bytes"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(
    call: Callable[[], object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        call()
