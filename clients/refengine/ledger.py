"""The engine's own record of when each lease's blocks were read and released.

A holder's pin is released early when its blocks became reusable while a
requester's read of them could still land (docs/invariants.md,
I6-quiescence). kvrc's view cannot prove that it did not happen, so the
soak checks it from the engines' own records: the holder's leader stamps when
it freed a lease's blocks (`released_at`), every requester rank part stamps
when each of its reads of a lease went quiet (`quiet_at`, None while one still
runs). Both are `time.monotonic()`, which on Linux is one clock for every
process of the machine. Bounded: the oldest leases are forgotten first.
"""

from __future__ import annotations

import time

from clients.transfer import NativeRead

MAX_LEASES = 50_000


class ReleaseLedger:
    """Leader side: lease id -> monotonic time its blocks were freed."""

    def __init__(self, max_leases: int = MAX_LEASES) -> None:
        self._released_at: dict[str, float] = {}
        self._max = max_leases

    def released(self, lease_id: str) -> None:
        self._released_at.setdefault(lease_id, time.monotonic())
        while len(self._released_at) > self._max:
            del self._released_at[next(iter(self._released_at))]

    def document(self) -> dict[str, float]:
        return dict(self._released_at)


class ReadLedger:
    """Rank part side: lease id -> its reads, each known quiet or not."""

    def __init__(self, max_leases: int = MAX_LEASES) -> None:
        self._reads: dict[str, list[NativeRead]] = {}
        self._max = max_leases

    def read(self, lease_id: str, native_read: NativeRead) -> None:
        self._reads.setdefault(lease_id, []).append(native_read)
        while len(self._reads) > self._max:
            del self._reads[next(iter(self._reads))]

    def document(self) -> dict[str, float | None]:
        """Per lease, when its last read went quiet; None while one may still land."""
        quiet: dict[str, float | None] = {}
        for lease_id, reads in self._reads.items():
            times = [read.quiet_at() for read in reads]
            quiet[lease_id] = None if None in times else max(t for t in times if t is not None)
        return quiet
