"""Reading a prompt from the command line, for `kvrc score` and `kvrc route`.

Both sides' CLIs take a prompt as token ids (`1,2,3`, or a JSON list in a file) or
as block hashes in hex; the parsing is defined once here. ValueError carries a
one-line message naming the flag. `wire_text` and `timeout_seconds` are the
argparse types of both sides' client flags: refused at parsing, in one line, not
by protobuf or gRPC with a traceback or a misleading DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvrc.vocabulary import DEFAULT_COORDINATOR

MAX_TOKEN_ID = (1 << 32) - 1
MAX_TIMEOUT_S = 86_400.0  # a day: far past any call, within gRPC's deadline range


def wire_text(value: str) -> str:
    """Text sent in a protobuf string field, which must be valid UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{value!r} is not valid UTF-8 text") from None
    return value


def target_address(value: str) -> str:
    """A coordinator's HOST:PORT ([v6]:PORT) or grpc URI (unix:, dns:, ...), checked as
    an engine's targets are, before any connection is tried."""
    from kvrc.credentials import check_target

    value = wire_text(value)
    try:
        check_target(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_target_argument(parser: argparse.ArgumentParser) -> None:
    """`--target`: the one coordinator a command calls."""
    parser.add_argument(
        "--target",
        type=target_address,
        default=DEFAULT_COORDINATOR,
        metavar="HOST:PORT",
        help=f"the coordinator to call (default {DEFAULT_COORDINATOR})",
    )


def timeout_seconds(value: str) -> float:
    """A call's deadline in seconds: finite and in (0, MAX_TIMEOUT_S]."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(
            f"must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, got {value}"
        )
    return seconds


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


def parse_engine_ids(text: str) -> list[str]:
    """`--candidates`: child engine ids separated by commas, spaces around them and
    repeats dropped (the first keeps its place), so that `a, b` or `a,a` names what
    was meant instead of being refused by kvrc."""
    return list(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))


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
    if (
        not identifier
        or start < 0
        or not 1 <= length <= MAX_TOKEN_ID
        or start + length - 1 > MAX_TOKEN_ID
    ):
        raise ValueError(
            f"{where}: expected IDENTIFIER:OFFSET:LENGTH with a non-empty identifier, "
            f"OFFSET >= 0 and LENGTH >= 1, got {text!r}"
        )
    return identifier, start, length
