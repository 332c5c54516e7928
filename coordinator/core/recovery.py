"""Restart recovery: the warm-up after a coordinator restart, and the state file.

Pure and synchronous (time is `now_ms`); the service reads and writes the file
and feeds this module.

A restarted kvrc knows no engines: its inventory and leases lived in memory.
Engines reconnect, re-register, resend a full inventory dump and re-announce
the leases they still hold pins for (`Register.held_leases`). Until its view
is back, kvrc is *warming*: lookups answer `REUSE_REASON_WARMING` and prefix
loads are refused (FAILED_PRECONDITION), so no engine recomputes a plan from a
half-rebuilt inventory. Decode handoffs are not gated (they need no inventory).

How kvrc knows which engines to wait for: the optional state file
(`--state-file`) lists the child engines registered at the time of the last
write (written on every change of that set, never on the hot path). On start,
the engines listed there are *expected*; warming ends when every expected
child engine is READY again, or when the warm-up deadline (`--warmup-ms`)
passes, whichever comes first. Without a state file kvrc cannot tell a restart
from a first start: it warms only when `--warmup-ms` is given, for exactly that
long. Warming never comes back once it ended.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator.core.lease_ids import KEY_BYTES

__all__ = [
    "MAX_STATE_FILE_BYTES",
    "STATE_FILE_VERSION",
    "KnownEngine",
    "StateFile",
    "StateFileError",
    "Warmup",
    "WarmupStatus",
    "decode_state",
    "decode_state_file",
    "encode_state",
    "is_state_file",
]

STATE_FILE_VERSION = 1
# A state file lists child engines only; more than this is not one of ours.
MAX_STATE_FILE_BYTES = 16 << 20
MAX_KNOWN_ENGINES = 65_536
# What the state file's other fields take, at most (version, time, lease-id key).
_STATE_FILE_HEADROOM = 4_096


class StateFileError(ValueError):
    """The state file is not one kvrc wrote; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class KnownEngine:
    """A child engine registered when the state file was last written."""

    child_engine_id: str
    engine_id: str
    parts_expected: int


@dataclass(frozen=True, slots=True)
class StateFile:
    engines: tuple[KnownEngine, ...]
    # The key lease ids are tagged with (coordinator/core/lease_ids.py); None: not kept.
    lease_id_key: bytes | None = None


def encode_state(
    engines: Iterable[KnownEngine], written_ms: int, lease_id_key: bytes | None = None
) -> bytes:
    """The state file's bytes (JSON, sorted: the same set always gives the same bytes).

    At most what `decode_state_file` reads back (MAX_KNOWN_ENGINES, MAX_STATE_FILE_BYTES):
    past either, the engines last in id order are left out, and a restart warms up for
    fewer of them (else the whole file, the lease-id key with it, was refused)."""
    entries = [
        {
            "child_engine_id": e.child_engine_id,
            "engine_id": e.engine_id,
            "parts_expected": e.parts_expected,
        }
        for e in sorted(engines, key=lambda e: e.child_engine_id)
    ][:MAX_KNOWN_ENGINES]
    doc: dict[str, object] = {"version": STATE_FILE_VERSION, "written_unix_ms": written_ms}
    if lease_id_key is not None:
        doc["lease_id_key"] = lease_id_key.hex()
    data = (json.dumps({**doc, "child_engines": entries}, indent=1) + "\n").encode()
    if len(data) <= MAX_STATE_FILE_BYTES:
        return data
    budget = MAX_STATE_FILE_BYTES - _STATE_FILE_HEADROOM
    kept = 0
    empty = len(json.dumps({"child_engines": []}, indent=1))
    for entry in entries:
        # What it adds to the file, nested and indented as there, and its separator.
        budget -= len(json.dumps({"child_engines": [entry]}, indent=1)) - empty + 2
        if budget < 0:
            break
        kept += 1
    return (json.dumps({**doc, "child_engines": entries[:kept]}, indent=1) + "\n").encode()


def is_state_file(data: bytes) -> bool:
    """Whether these bytes may be a state file kvrc wrote (any version, even one cut or
    zeroed on disk: a start warms up for its whole deadline then), or nothing: a file a
    start may replace. Anything else (TOML, YAML, another JSON document) is someone
    else's file behind a mistyped path."""
    blank = b" \t\r\n\x00"
    if not data.strip(blank):
        return True
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        # A JSON object cut short, or one whose first blocks were zeroed.
        return data.lstrip(blank).startswith(b"{") or b'"child_engines"' in data
    return isinstance(doc, Mapping) and "version" in doc and "child_engines" in doc


def decode_state(data: bytes) -> tuple[KnownEngine, ...]:
    """The known engines of a state file; StateFileError names what is wrong."""
    return decode_state_file(data).engines


def decode_state_file(data: bytes) -> StateFile:
    """Parses and checks a state file; StateFileError names what is wrong."""
    if len(data) > MAX_STATE_FILE_BYTES:
        raise StateFileError(f"{len(data)} bytes, more than the limit {MAX_STATE_FILE_BYTES}")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateFileError(f"not JSON: {e}") from None
    if not isinstance(doc, Mapping):
        raise StateFileError("expected a JSON object")
    if doc.get("version") != STATE_FILE_VERSION:
        raise StateFileError(f"version {doc.get('version')!r}, expected {STATE_FILE_VERSION}")
    entries = doc.get("child_engines")
    if not isinstance(entries, list):
        raise StateFileError("'child_engines' must be a list")
    if len(entries) > MAX_KNOWN_ENGINES:
        raise StateFileError(f"{len(entries)} child engines, more than {MAX_KNOWN_ENGINES}")
    engines: dict[str, KnownEngine] = {}
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise StateFileError(f"child_engines[{index}] must be an object")
        child = entry.get("child_engine_id")
        engine = entry.get("engine_id")
        parts = entry.get("parts_expected")
        for name, value in (("child_engine_id", child), ("engine_id", engine)):
            if not isinstance(value, str) or not 1 <= len(value) <= 256:
                raise StateFileError(f"child_engines[{index}].{name} must be 1..256 characters")
        if type(parts) is not int or parts < 1:
            raise StateFileError(f"child_engines[{index}].parts_expected must be an int >= 1")
        assert isinstance(child, str) and isinstance(engine, str)
        if child in engines:
            raise StateFileError(f"child engine {child!r} is listed twice")
        engines[child] = KnownEngine(child, engine, parts)
    key = doc.get("lease_id_key")
    if key is not None and (
        not isinstance(key, str)
        or len(key) != 2 * KEY_BYTES
        or any(c not in "0123456789abcdef" for c in key)
    ):
        raise StateFileError(f"'lease_id_key' must be {2 * KEY_BYTES} lowercase hex digits")
    return StateFile(
        tuple(engines[c] for c in sorted(engines)), None if key is None else bytes.fromhex(key)
    )


@dataclass(frozen=True, slots=True)
class WarmupStatus:
    warming: bool
    expected: tuple[str, ...]  # child engines kvrc waits for (from the state file)
    missing: tuple[str, ...]  # expected and not READY yet (empty once warm)
    deadline_ms: int | None  # None: no warm-up at all
    detail: str  # a sentence for people (the reuse status detail while warming)


class Warmup:
    """Warming after a restart: until every expected engine is READY, or the deadline.

    `expected` empty and `timed` False: not warming at all (a first start).
    `expected` empty and `timed` True: warming exactly until the deadline.
    """

    __slots__ = ("_deadline_ms", "_expected", "_missing", "_warming", "_warmup_ms")

    def __init__(
        self, *, expected: Iterable[str], started_ms: int, warmup_ms: int, timed: bool = False
    ) -> None:
        if type(warmup_ms) is not int or warmup_ms < 0:
            raise ValueError(f"warmup_ms must be an int >= 0, got {warmup_ms!r}")
        self._expected = tuple(sorted(set(expected)))
        self._missing = set(self._expected)
        waits = bool(self._expected) or timed
        self._warming = waits and warmup_ms > 0
        self._deadline_ms: int | None = started_ms + warmup_ms if waits else None
        self._warmup_ms = warmup_ms

    @property
    def warming(self) -> bool:
        return self._warming

    def engine_ready(self, child_engine_id: str) -> bool:
        """An engine is READY; True when this ended the warm-up (every expected one is back).

        A timed warm-up without a state file waits for its deadline only.
        """
        self._missing.discard(child_engine_id)
        if self._warming and self._expected and not self._missing:
            self._warming = False
            return True
        return False

    def tick(self, now_ms: int) -> bool:
        """True when the deadline ended the warm-up at this call."""
        if self._warming and self._deadline_ms is not None and now_ms >= self._deadline_ms:
            self._warming = False
            return True
        return False

    def status(self) -> WarmupStatus:
        missing = tuple(sorted(self._missing)) if self._warming else ()
        if not self._warming:
            detail = "warm"
        elif self._expected:
            shown = ", ".join(repr(m) for m in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            detail = (
                f"the coordinator restarted and is waiting for {len(missing)} of "
                f"{len(self._expected)} known child engine(s) to re-register ({shown}{more}) "
                f"for at most {self._warmup_ms} ms after the restart; recompute meanwhile"
            )
        else:
            detail = (
                f"the coordinator restarted and rebuilds its inventory for "
                f"{self._warmup_ms} ms; recompute meanwhile"
            )
        return WarmupStatus(self._warming, self._expected, missing, self._deadline_ms, detail)
