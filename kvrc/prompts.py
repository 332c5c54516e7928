"""Reading a prompt from the command line, for `kvrc score` and `kvrc route`.

Both sides' CLIs take a prompt as token ids (`1,2,3`, or a JSON list in a file) or
as block hashes in hex; the parsing is defined once here. ValueError carries a
one-line message naming the flag.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_TOKEN_ID = (1 << 32) - 1


def parse_token_ids(text: str, where: str) -> list[int]:
    """`1,2,3`, `1 2 3` or a JSON list of ints; at least one, each in 0..2**32-1."""
    text = text.strip()
    try:
        if text.startswith("["):
            values = json.loads(text)
            if not isinstance(values, list):
                raise ValueError
        else:
            values = [v for v in text.replace(",", " ").split() if v]
        ids = [int(v) for v in values]
    except (ValueError, TypeError):
        raise ValueError(f"{where}: token ids must be integers (1,2,3 or a JSON list)") from None
    if not ids or any(not 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise ValueError(f"{where}: give at least one token id, each in 0..{MAX_TOKEN_ID}")
    return ids


def read_token_ids(path: Path, where: str) -> list[int]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where} {path}: cannot read: {e}") from None
    return parse_token_ids(text, f"{where} {path}")


def parse_block_hashes(text: str, where: str) -> list[bytes]:
    """Hex strings separated by commas, first block first; at least one."""
    try:
        hashes = [bytes.fromhex(h.strip()) for h in text.split(",") if h.strip()]
    except ValueError:
        raise ValueError(f"{where}: expected hex strings separated by commas") from None
    if not hashes:
        raise ValueError(f"{where}: give at least one block hash")
    return hashes


def parse_mm_feature(text: str, where: str) -> tuple[str, int, int]:
    """`IDENTIFIER:OFFSET:LENGTH`, one multimodal item of the prompt (vLLM's identifier,
    the item's first placeholder token, its placeholder tokens). The identifier may hold
    colons itself: the last two fields are the numbers."""
    identifier, _, numbers = text.strip().rpartition(":")
    identifier, _, offset = identifier.rpartition(":")
    try:
        start, length = int(offset), int(numbers)
    except ValueError:
        raise ValueError(f"{where}: expected IDENTIFIER:OFFSET:LENGTH, got {text!r}") from None
    if not identifier or start < 0 or length < 1 or start + length - 1 > MAX_TOKEN_ID:
        raise ValueError(
            f"{where}: expected IDENTIFIER:OFFSET:LENGTH with a non-empty identifier, "
            f"OFFSET >= 0 and LENGTH >= 1, got {text!r}"
        )
    return identifier, start, length
