"""Transfer execution: plan a rank part's batch of reads, run it safely, taint on doubt.

A pull reads blocks of a peer rank part's KV cache into local blocks with one
Mooncake batch read. Mooncake's failure behaviour shapes everything here
(docs/mooncake.md):

* the call blocks and releases the GIL, so it runs in an executor thread;
* a frozen peer blocks it for 30-60 s whatever Mooncake's own timeout says, so
  `pull` enforces its own deadline and then answers UNKNOWN: the thread is still
  inside Mooncake and bytes may still land when the peer wakes up;
* a batch that returns a negative code keeps landing its other entries for up
  to about a second, so a failed batch is quiet only `settle_s` after the call
  returned.

Destination blocks of anything but a success are *tainted*: they must not be
read, reused or freed until the native call is quiet. `TransferResult` names
them and can wait for quiet; `InFlightReads` tracks every call a rank part
started, so a cancelled caller cannot lose track of one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from clients.kv_cache import (
    IncompatibleLayoutError,
    KvCacheLayout,
    KvEndpointDescription,
    KvRegionDescription,
    check_compatible,
)
from kvrc.v1 import kvrc_pb2
from kvrc.vocabulary import KvRegion, TransferEndpoint

# Mooncake lands entries of a failed batch for up to ~1 s after the call returned.
DEFAULT_SETTLE_S = 1.0
# A read started with less than this left of its deadline would end UNKNOWN (tainting
# its blocks) rather than succeed: it is not started.
MIN_READ_S = 0.005
LAYOUT_EXTRA_KEY = "kvrc.kv_layout"


class TransferOutcome(enum.Enum):
    SUCCEEDED = "SUCCEEDED"  # every byte landed, nothing running
    FAILED = "FAILED"  # failed; quiet once the result says so
    UNKNOWN = "UNKNOWN"  # deadline passed with the native call still running


class BatchReader(Protocol):
    def read_batch(
        self,
        session_name: str,
        local_addresses: Sequence[int],
        remote_addresses: Sequence[int],
        lengths: Sequence[int],
    ) -> int: ...


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """One rank part's batch: parallel (local, remote, length) entries."""

    session_name: str
    local_addresses: tuple[int, ...]
    remote_addresses: tuple[int, ...]
    lengths: tuple[int, ...]
    local_block_ids: tuple[int, ...]  # the destination blocks this plan writes
    total_bytes: int

    @property
    def num_entries(self) -> int:
        return len(self.lengths)

    @classmethod
    def build(
        cls,
        local: KvEndpointDescription,
        remote: KvEndpointDescription,
        block_pairs: Sequence[tuple[int, int]],
        *,
        coalesce: bool = True,
    ) -> TransferPlan:
        """Plan reading remote blocks into local blocks, every layer.

        `block_pairs` holds (local block id, remote block id). Heterogeneous
        layouts and out-of-range or duplicate destination ids are refused here,
        before any byte moves. With `coalesce`, runs of blocks contiguous on both
        sides become one entry per layer.
        """
        ids = np.asarray(block_pairs, dtype=np.int64).reshape(-1, 2)
        return cls.from_block_ids(local, remote, ids[:, 0], ids[:, 1], coalesce=coalesce)

    @classmethod
    def from_block_ids(
        cls,
        local: KvEndpointDescription,
        remote: KvEndpointDescription,
        local_block_ids: npt.ArrayLike,
        remote_block_ids: npt.ArrayLike,
        *,
        coalesce: bool = True,
    ) -> TransferPlan:
        """`build` from two parallel id arrays: `local_block_ids[i]` gets `remote_block_ids[i]`.

        Vectorised, no per-block Python work whatever the batch size (#22); a
        protobuf repeated field converts without a copy loop.
        """
        check_compatible(local.layout, remote.layout)
        for side in (local, remote):
            if side.backend != "mooncake":
                raise ValueError(f"backend {side.backend!r} is not mooncake")
        local_ids = np.asarray(local_block_ids, dtype=np.int64)
        remote_ids = np.asarray(remote_block_ids, dtype=np.int64)
        if local_ids.shape != remote_ids.shape or local_ids.ndim != 1:
            raise ValueError(
                f"{local_ids.size} local and {remote_ids.size} remote block ids do not pair up"
            )
        _check_block_ids(local_ids, local.layout.num_blocks, "local")
        _check_block_ids(remote_ids, remote.layout.num_blocks, "remote")
        order = np.lexsort((remote_ids, local_ids))
        local_ids, remote_ids = local_ids[order], remote_ids[order]
        repeated = local_ids[1:] == local_ids[:-1]
        if repeated.any():
            raise ValueError(f"local block id {int(local_ids[repeated.argmax()])} is written twice")

        if coalesce:  # a run breaks where either side is not the next block
            breaks = ((local_ids[1:] - local_ids[:-1]) != 1) | (
                (remote_ids[1:] - remote_ids[:-1]) != 1
            )
            starts = np.concatenate(([0], breaks.nonzero()[0] + 1)) if local_ids.size else local_ids
            counts = np.diff(starts, append=local_ids.size)
        else:
            starts, counts = np.arange(local_ids.size), np.ones(local_ids.size, dtype=np.int64)
        run_lengths = tuple((counts * local.layout.block_bytes).tolist())
        local_addresses = _addresses(local.regions, local_ids[starts])
        remote_addresses = _addresses(remote.regions, remote_ids[starts])
        return cls(
            session_name=remote.session_name,
            local_addresses=tuple(local_addresses.tolist()),
            remote_addresses=tuple(remote_addresses.tolist()),
            lengths=run_lengths * len(local.regions),  # the same runs in every region
            local_block_ids=tuple(local_ids.tolist()),
            total_bytes=sum(run_lengths) * len(local.regions),
        )


def _check_block_ids(block_ids: npt.NDArray[np.int64], num_blocks: int, side: str) -> None:
    # As unsigned, a negative id is huge: one comparison checks both bounds.
    outside = block_ids.view(np.uint64) >= num_blocks
    if outside.any():
        block_id = int(block_ids[outside.argmax()])
        raise ValueError(f"{side} block id {block_id} is not in 0..{num_blocks - 1}")


def _addresses(
    regions: Sequence[KvRegionDescription], block_ids: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Region by region (layer-major, as the entries go): base + block id x block length."""
    bases = np.array([region.base_addr for region in regions], dtype=np.int64)
    strides = np.array([region.block_len for region in regions], dtype=np.int64)
    return (bases[:, None] + block_ids * strides[:, None]).reshape(-1)


@dataclass(frozen=True, slots=True)
class _NativeReturn:
    return_code: int
    returned_at: float  # time.monotonic()
    error: str


class NativeRead:
    """One batch read submitted to an executor; knows when it is quiet.

    Quiet means the native call returned and, when it failed, `settle_s` has
    passed since, so no entry of the batch can still be landing.
    """

    def __init__(
        self,
        future: concurrent.futures.Future[_NativeReturn],
        local_block_ids: tuple[int, ...],
        settle_s: float,
    ) -> None:
        self._future = future
        self.local_block_ids = local_block_ids
        self.settle_s = settle_s

    @property
    def returned(self) -> bool:
        return self._future.done()

    def quiet_at(self) -> float | None:
        """Monotonic time from which the call is quiet; None while it runs."""
        if self._future.cancelled():
            return 0.0  # never started (its deadline passed in the executor's queue)
        if not self._future.done():
            return None
        native = self._future.result()
        if native.return_code == 0:
            return native.returned_at
        return native.returned_at + self.settle_s

    def is_quiet(self) -> bool:
        quiet_at = self.quiet_at()
        return quiet_at is not None and time.monotonic() >= quiet_at

    async def wait_quiet(self, timeout_s: float | None = None) -> bool:
        """Wait until quiet; False if `timeout_s` passed first."""
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._future.done():
            task = asyncio.current_task()
            cancelling = task.cancelling() if task is not None else 0
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._future)), timeout_s)
            except TimeoutError:
                return False
            except asyncio.CancelledError:
                # The read was cancelled before it started (`pull`'s deadline): quiet. A
                # cancellation of this task itself (one more request than before the
                # wait: an earlier one may have been swallowed) goes on.
                if not self._future.cancelled() or (
                    task is not None and task.cancelling() > cancelling
                ):
                    raise
        quiet_at = self.quiet_at()
        assert quiet_at is not None
        wait = quiet_at - time.monotonic()
        if give_up is not None and quiet_at > give_up:
            await asyncio.sleep(max(0.0, give_up - time.monotonic()))
            return False
        if wait > 0:
            await asyncio.sleep(wait)
        return True


class InFlightReads:
    """Every native read of one rank part that is not yet quiet.

    Destination blocks a read not quiet yet still writes must stay out of use (not
    read, reallocated or freed); `wait_all_quiet` is what a shutdown awaits. A count
    per tainted block, kept as reads come and go, answers for a plan's blocks
    (`tainted_among`) in the plan's size, whatever the number of reads in flight;
    `tainted_block_ids()` lists them all.
    """

    def __init__(self) -> None:
        self._reads: list[NativeRead] = []
        self._tainted: dict[int, int] = {}  # block id -> reads not quiet that write it

    def add(self, read: NativeRead) -> None:
        self._prune()
        self._reads.append(read)
        tainted = self._tainted
        for block in read.local_block_ids:
            tainted[block] = tainted.get(block, 0) + 1

    def tainted_among(self, block_ids: Iterable[int]) -> set[int]:
        """Those of `block_ids` a read not quiet yet still writes."""
        self._prune()
        return {block for block in block_ids if block in self._tainted}

    def tainted_block_ids(self) -> frozenset[int]:
        self._prune()
        return frozenset(self._tainted)

    def __len__(self) -> int:
        self._prune()
        return len(self._reads)

    async def wait_all_quiet(self, timeout_s: float | None = None) -> bool:
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        for read in list(self._reads):
            left = None if give_up is None else max(0.0, give_up - time.monotonic())
            if not await read.wait_quiet(left):
                return False
        self._prune()
        return True

    def _prune(self) -> None:
        still: list[NativeRead] = []
        quiet: list[NativeRead] = []
        for read in self._reads:  # asked once each: a read may turn quiet meanwhile
            (quiet if read.is_quiet() else still).append(read)
        if not quiet:
            return
        self._reads = still
        tainted = self._tainted
        for read in quiet:
            for block in read.local_block_ids:
                left = tainted[block] - 1
                if left:
                    tainted[block] = left
                else:
                    del tainted[block]


@dataclass(frozen=True, slots=True)
class TransferResult:
    outcome: TransferOutcome
    bytes_moved: int
    duration_s: float
    error: str
    # Destination blocks that must stay out of use until `wait_quiet()` returns True.
    tainted_block_ids: tuple[int, ...]
    native_read: NativeRead | None = field(default=None, repr=False)

    @classmethod
    def not_started(cls, error: str, native_read: NativeRead | None = None) -> TransferResult:
        """A read that never ran: FAILED, nothing tainted, quiet, and no duration (its
        wait says nothing of the link: a deadline-long one would teach the cost gate
        that a healthy link is slow)."""
        return cls(TransferOutcome.FAILED, 0, 0.0, error, (), native_read)

    def is_quiet(self) -> bool:
        return self.native_read is None or self.native_read.is_quiet()

    async def wait_quiet(self, timeout_s: float | None = None) -> bool:
        if self.native_read is None:
            return True
        return await self.native_read.wait_quiet(timeout_s)

    def to_report(
        self,
        *,
        lease_id: str,
        reporter_child_engine_id: str,
        tp_rank: int,
        pp_rank: int = 0,
        pcp_rank: int = 0,
        prefill: tuple[int, float] | None = None,
    ) -> kvrc_pb2.TransferReport:
        """This rank part's terminal report (CompletePrefixLoad / CompleteHandoff).

        FAILED promises "proven quiet" on the wire, so it is refused before quiet.
        `prefill` is a prefill rate sample of this engine where it measures one: (tokens,
        seconds) of a recent prefill it computed. The coordinator's cost model
        (docs/cost_model.md) learns the engine's prefill rate from it; leave it None
        when the engine does not know, and the declared (or default) rate is used.
        """
        if self.outcome is TransferOutcome.FAILED and not self.is_quiet():
            raise RuntimeError("report FAILED only after `await result.wait_quiet()`")
        sample = None
        if prefill is not None:
            tokens, seconds = prefill
            duration_us = int(seconds * 1e6)
            if tokens < 1 or duration_us < 1:
                raise ValueError(f"a prefill sample needs tokens >= 1 and time > 0, got {prefill}")
            sample = kvrc_pb2.PrefillSample(tokens=tokens, duration_us=duration_us)
        return kvrc_pb2.TransferReport(
            lease_id=lease_id,
            reporter_child_engine_id=reporter_child_engine_id,
            rank=kvrc_pb2.RankCoordinates(tp_rank=tp_rank, pp_rank=pp_rank, pcp_rank=pcp_rank),
            outcome=_OUTCOME_TO_PROTO[self.outcome],
            bytes_moved=self.bytes_moved,
            duration_us=min(int(self.duration_s * 1e6), 2**32 - 1),
            error_message=self.error[:1024],
            prefill=sample,
        )


_OUTCOME_TO_PROTO = {
    TransferOutcome.SUCCEEDED: kvrc_pb2.TRANSFER_OUTCOME_SUCCEEDED,
    TransferOutcome.FAILED: kvrc_pb2.TRANSFER_OUTCOME_FAILED,
    TransferOutcome.UNKNOWN: kvrc_pb2.TRANSFER_OUTCOME_UNKNOWN,
}


def combine_outcomes(outcomes: Sequence[TransferOutcome]) -> TransferOutcome:
    """The outcome of a whole load from its rank parts' outcomes.

    One failed slice fails the request (no partially loaded request); one
    unknown slice makes it unknown (its blocks may still change).
    """
    if not outcomes:
        raise ValueError("a load has at least one rank part")
    if TransferOutcome.UNKNOWN in outcomes:
        return TransferOutcome.UNKNOWN
    if TransferOutcome.FAILED in outcomes:
        return TransferOutcome.FAILED
    return TransferOutcome.SUCCEEDED


def _read(engine: BatchReader, plan: TransferPlan) -> _NativeReturn:
    try:
        return_code = engine.read_batch(
            plan.session_name, plan.local_addresses, plan.remote_addresses, plan.lengths
        )
        error = "" if return_code == 0 else f"mooncake batch read returned {return_code}"
    except Exception as exc:  # a binding error is a failure like any other, never a crash
        return_code, error = -1, f"mooncake batch read raised {exc!r}"
    return _NativeReturn(return_code, time.monotonic(), error)


class _SlotsClosed(Exception):
    """`PeerSlots.close()` ended a wait for a slot."""


def _handed(granted: asyncio.Future[None]) -> bool:
    """A waiter's future that `release` handed a slot to (not cancelled, not closed)."""
    return granted.done() and not granted.cancelled() and granted.exception() is None


class PeerSlots:
    """Which native reads may hold a pull thread: at most `per_peer` from one peer
    (Mooncake session), and at most `threads` running at once.

    A frozen peer holds each read's thread for up to a minute. Uncapped, its reads can
    take every pull thread, and loads from healthy peers queued behind them fail at
    their deadline; capped, its further reads wait here (their deadline running) and
    the other peers' reads keep threads. A read past its deadline (`overdue`: `pull`
    answered UNKNOWN, the native call is still inside the peer) keeps its peer's slot
    but gives its running place back, up to `spare` such reads: so several frozen peers
    (a partitioned rack) do not take every thread either, and the executor needs
    `threads + spare` workers. A slot is held until the native call returns, not until
    `pull` gives up on it. Used on one event loop; the executor's threads hand their
    slot back through it (`call_soon_threadsafe`).
    """

    def __init__(self, per_peer: int, threads: int | None = None, spare: int = 0) -> None:
        if per_peer < 1:
            raise ValueError(f"per_peer must be >= 1, got {per_peer}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if spare < 0:
            raise ValueError(f"spare must not be negative, got {spare}")
        self.per_peer = per_peer
        self.threads = threads  # None: no bound over all peers (the executor's own)
        self.spare = spare
        self._held: dict[str, int] = {}
        self._running = 0  # reads holding a running place (not overdue)
        self._overdue: set[concurrent.futures.Future[_NativeReturn]] = set()
        # FIFO; a waiter is granted once its peer and the running places allow it.
        self._waiting: deque[tuple[str, asyncio.Future[None]]] = deque()
        self._closed = False

    def close(self) -> None:
        """No read starts any more (a shutdown): every waiter, and every later
        `acquire`, gets False; slots held are still handed back as their reads return."""
        self._closed = True
        for _, waiter in self._waiting:
            if not waiter.done():
                waiter.set_exception(_SlotsClosed())

    def held(self, peer: str) -> int:
        return self._held.get(peer, 0)

    @property
    def running(self) -> int:
        return self._running

    @property
    def overdue(self) -> int:
        return len(self._overdue)

    def _may_start(self, peer: str) -> bool:
        return self.held(peer) < self.per_peer and (
            self.threads is None or self._running < self.threads
        )

    def _take(self, peer: str) -> None:
        self._held[peer] = self.held(peer) + 1
        self._running += 1

    async def acquire(self, peer: str, timeout_s: float) -> bool:
        """A slot for one read from `peer`; False when none came within `timeout_s`, or
        the slots are closed."""
        if self._closed:
            return False
        if self._may_start(peer) and not any(p == peer and not w.done() for p, w in self._waiting):
            self._take(peer)
            return True
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (peer, granted)
        self._waiting.append(entry)
        try:
            await asyncio.wait_for(granted, timeout_s)
            if self._closed:  # handed a slot just before the shutdown closed them
                self.release(peer)
                return False
            return True
        except TimeoutError:
            # Handed a slot as the deadline passed (Python 3.12's wait_for cannot cancel
            # a future already done): pass it on, or it is held for good.
            if _handed(granted):
                self.release(peer)
            return False
        except _SlotsClosed:
            return False
        except BaseException:
            if _handed(granted):
                self.release(peer)  # handed over just as this waiter was cancelled
            raise
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)
                self._grant()  # a waiter behind this one may start now

    def release(self, peer: str, overdue: bool = False) -> None:
        """One read from `peer` returned (or never ran): its slot, and its running place
        unless it was overdue, go to the waiters that may start now."""
        left = self.held(peer) - 1
        if left > 0:
            self._held[peer] = left
        else:
            self._held.pop(peer, None)
        if not overdue:
            self._running -= 1
        self._grant()

    def _grant(self) -> None:
        for entry in list(self._waiting):
            peer, waiter = entry
            if waiter.done():
                continue
            if self._may_start(peer):
                self._take(peer)
                waiter.set_result(None)
                self._waiting.remove(entry)

    def mark_overdue(self, future: concurrent.futures.Future[_NativeReturn]) -> None:
        """`pull` gave up on this running read: it keeps its peer's slot until it returns,
        and gives its running place to others while fewer than `spare` reads are overdue."""
        if future.done() or future in self._overdue or len(self._overdue) >= self.spare:
            return
        self._overdue.add(future)
        self._running -= 1
        self._grant()

    def release_when_done(
        self, peer: str, future: concurrent.futures.Future[_NativeReturn]
    ) -> None:
        """Hands the slot back once the native call returns (or is cancelled)."""
        loop = asyncio.get_running_loop()

        def on_loop() -> None:
            was_overdue = future in self._overdue
            self._overdue.discard(future)
            self.release(peer, overdue=was_overdue)

        def returned(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(on_loop)

        future.add_done_callback(returned)


# A rank part's native reads running at once, and the spare threads that reads past
# their deadline (inside frozen peers, idle until Mooncake gives up on them) move to:
# 24 is six frozen peers' worth of overdue reads (PeerSlots).
PULL_THREADS = 8
SPARE_PULL_THREADS = 24


def pull_threads(name: str) -> tuple[concurrent.futures.ThreadPoolExecutor, PeerSlots]:
    """A rank part's pull threads and the slots that share them out: one peer's reads
    hold at most half the running places, and overdue reads move to the spare threads.
    Close the slots at shutdown, before waiting for the reads in flight."""
    executor = concurrent.futures.ThreadPoolExecutor(
        PULL_THREADS + SPARE_PULL_THREADS, thread_name_prefix=name
    )
    return executor, PeerSlots(PULL_THREADS // 2, threads=PULL_THREADS, spare=SPARE_PULL_THREADS)


async def pull(
    engine: BatchReader,
    plan: TransferPlan,
    *,
    deadline_s: float,
    executor: concurrent.futures.Executor,
    settle_s: float = DEFAULT_SETTLE_S,
    wait_settle: bool = True,
    in_flight: InFlightReads | None = None,
    on_submit: Callable[[NativeRead], None] | None = None,
    peer_slots: PeerSlots | None = None,
) -> TransferResult:
    """Run `plan` as one batch read in `executor`, bounded by `deadline_s`.

    * return code 0 -> SUCCEEDED, nothing tainted;
    * negative code -> FAILED. With `wait_settle` (the default) `pull` waits
      `settle_s` so that the result is already quiet and FAILED may be reported
      at once; without it, `pull` returns as soon as the call does (to start a
      recompute into other blocks sooner) and the destination blocks stay
      tainted until `result.wait_quiet()`: report FAILED only after that;
    * deadline passed -> UNKNOWN: the thread is still inside Mooncake, the
      destination blocks stay tainted until it returns (plus `settle_s`);
    * deadline passed before a thread took the read (every one busy, e.g. inside
      reads from a frozen peer) -> the read is cancelled: FAILED, nothing tainted,
      quiet at once, instead of running a minute later behind the frozen reads.

    Never raises for a transfer failure; raises ValueError, before anything
    runs, for a plan writing into blocks `in_flight` still lists as tainted.
    Pass the rank part's `InFlightReads` so that a cancelled caller cannot lose
    track of a native read, and `on_submit` to file the read under its lease as soon
    as it runs: an abort's ack then waits for it even if this call is cancelled before
    it returns (I6-quiescence). A frozen peer holds a thread for up to a minute: an
    executor with fewer threads than concurrent pulls fails the pulls queued behind
    such reads at their deadline; `peer_slots` caps the threads one peer's reads hold
    (a read that gets no slot by its deadline is FAILED, never started).
    """
    if deadline_s <= 0:
        raise ValueError(f"deadline_s must be positive, got {deadline_s}")
    if settle_s < 0:
        raise ValueError(f"settle_s must not be negative, got {settle_s}")
    if in_flight is not None:
        still_tainted = in_flight.tainted_among(plan.local_block_ids)
        if still_tainted:
            raise ValueError(
                f"blocks {sorted(still_tainted)} are tainted by a read that is not quiet yet"
            )
    started = time.monotonic()
    if plan.num_entries == 0:
        return TransferResult(TransferOutcome.SUCCEEDED, 0, 0.0, "", ())

    if peer_slots is not None:
        acquired = await peer_slots.acquire(plan.session_name, deadline_s)
        left_s = deadline_s - (time.monotonic() - started)
        if not acquired or left_s < MIN_READ_S:
            if acquired:  # a slot as the deadline passed: a read now would end UNKNOWN
                peer_slots.release(plan.session_name)
            return TransferResult.not_started(
                f"{peer_slots.held(plan.session_name)} read(s) from {plan.session_name} and "
                f"{peer_slots.running} in all already running (frozen peers?); this one "
                f"did not start within {deadline_s:.3f} s"
            )
        deadline_s = left_s
        try:
            future = executor.submit(_read, engine, plan)
        except BaseException:
            peer_slots.release(plan.session_name)
            raise
        peer_slots.release_when_done(plan.session_name, future)
    else:
        future = executor.submit(_read, engine, plan)
    native_read = NativeRead(future, plan.local_block_ids, settle_s)
    if in_flight is not None:
        in_flight.add(native_read)
    if on_submit is not None:
        on_submit(native_read)
    try:
        # shield: a timeout or a cancelled caller must not lose the native call's result.
        native = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), deadline_s)
    except TimeoutError:
        if future.cancel():
            return TransferResult.not_started(
                f"the read from {plan.session_name} did not start within {deadline_s:.3f} s "
                "(every pull thread busy, e.g. with reads from a frozen peer); cancelled",
                native_read,
            )
        if peer_slots is not None:
            peer_slots.mark_overdue(future)
        return TransferResult(
            TransferOutcome.UNKNOWN,
            0,
            time.monotonic() - started,
            f"no answer from {plan.session_name} within {deadline_s:.3f} s; "
            "the native read may still land",
            plan.local_block_ids,
            native_read,
        )
    duration_s = native.returned_at - started
    if native.return_code == 0:
        return TransferResult(
            TransferOutcome.SUCCEEDED, plan.total_bytes, duration_s, "", (), native_read
        )
    if wait_settle:
        await native_read.wait_quiet()
    return TransferResult(
        TransferOutcome.FAILED,
        0,
        duration_s,
        f"{native.error} reading {plan.num_entries} entries from {plan.session_name}",
        () if wait_settle else plan.local_block_ids,
        native_read,
    )


def rank_part_descriptor(
    endpoint: KvEndpointDescription,
    block_ids: Sequence[int],
    *,
    tp_rank: int,
    pp_rank: int = 0,
    pcp_rank: int = 0,
) -> kvrc_pb2.RankPartDescriptor:
    """What a source rank part answers (PinResult, PublishHandoff): its blocks, in chain order."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    _check_block_ids(ids, endpoint.layout.num_blocks, "source")
    return kvrc_pb2.RankPartDescriptor(
        rank=kvrc_pb2.RankCoordinates(tp_rank=tp_rank, pp_rank=pp_rank, pcp_rank=pcp_rank),
        endpoint=_endpoint_proto(endpoint),
        block_ids=list(block_ids),
    )


# A rank part answers every pin and publish with the same endpoint (built once, at its
# start): its protocol form is built once too (~0.2 ms at 80 layers, per answer before).
# Keyed by identity; the entry keeps its endpoint alive, so an id is never reused while
# cached. Bounded: a process holds a few endpoints.
_ENDPOINT_PROTOS: dict[int, tuple[KvEndpointDescription, kvrc_pb2.TransferEndpoint]] = {}
_ENDPOINT_PROTOS_KEPT = 64


def _endpoint_proto(endpoint: KvEndpointDescription) -> kvrc_pb2.TransferEndpoint:
    """`endpoint_to_proto`, once per endpoint object (read only: a descriptor copies it)."""
    cached = _ENDPOINT_PROTOS.get(id(endpoint))
    if cached is not None and cached[0] is endpoint:
        return cached[1]
    proto = endpoint_to_proto(endpoint)
    if len(_ENDPOINT_PROTOS) >= _ENDPOINT_PROTOS_KEPT:
        _ENDPOINT_PROTOS.clear()
    _ENDPOINT_PROTOS[id(endpoint)] = (endpoint, proto)
    return proto


def plan_rank_part_pull(
    local: KvEndpointDescription,
    local_block_ids: Sequence[int],
    source_parts: Sequence[kvrc_pb2.RankPartDescriptor],
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    pcp_rank: int = 0,
    pcp_size: int = 1,
) -> TransferPlan:
    """This rank part's slice of a grant or handoff: read from the matching source part.

    The source's rank grid must equal ours (a tp/pp/pcp mismatch is refused
    before any byte moves, as are heterogeneous layouts). `local_block_ids[i]`
    receives the source part's `block_ids[i]`; the source may list more blocks
    than we load (its pin is the longest match), never fewer.
    """
    expected_parts = tp_size * pp_size * pcp_size
    if len(source_parts) != expected_parts:
        raise IncompatibleLayoutError(
            f"source has {len(source_parts)} rank parts, this engine {expected_parts} "
            f"(tp {tp_size} x pp {pp_size} x pcp {pcp_size}): parallel layouts differ"
        )
    by_rank: dict[tuple[int, int, int], kvrc_pb2.RankPartDescriptor] = {}
    for part in source_parts:
        coordinates = (part.rank.tp_rank, part.rank.pp_rank, part.rank.pcp_rank)
        if (
            coordinates in by_rank
            or part.rank.tp_rank >= tp_size
            or part.rank.pp_rank >= pp_size
            or part.rank.pcp_rank >= pcp_size
        ):
            raise IncompatibleLayoutError(
                f"source rank parts do not form a tp {tp_size} x pp {pp_size} x pcp {pcp_size} "
                f"grid (duplicate or out-of-range rank {coordinates})"
            )
        by_rank[coordinates] = part
    mine = by_rank[(tp_rank, pp_rank, pcp_rank)]
    remote = endpoint_from_proto(mine.endpoint)
    wanted = len(local_block_ids)
    if len(mine.block_ids) < wanted:
        raise ValueError(f"source part lists {len(mine.block_ids)} blocks, {wanted} requested")
    remote_block_ids = np.asarray(mine.block_ids, dtype=np.int64)[:wanted]
    return TransferPlan.from_block_ids(local, remote, local_block_ids, remote_block_ids)


def endpoint_to_proto(endpoint: KvEndpointDescription) -> kvrc_pb2.TransferEndpoint:
    """The protocol form: regions field for field, the layout as JSON in `extra`."""
    return endpoint_to_session(endpoint).to_proto()


def endpoint_to_session(endpoint: KvEndpointDescription) -> TransferEndpoint:
    """The registration form (`RankPartRegistration.endpoint`), layout included."""
    return TransferEndpoint(
        backend=endpoint.backend,
        session_name=endpoint.session_name,
        regions=tuple(
            KvRegion(
                base_addr=region.base_addr,
                block_len=region.block_len,
                num_blocks=region.num_blocks,
                layer=region.layer,
                kv_index=region.kv_index,
            )
            for region in endpoint.regions
        ),
        extra=((LAYOUT_EXTRA_KEY, _layout_json(endpoint.layout)),),
    )


def _layout_json(layout: KvCacheLayout) -> bytes:
    return json.dumps(layout.to_dict(), sort_keys=True).encode()


def endpoint_from_proto(message: kvrc_pb2.TransferEndpoint) -> KvEndpointDescription:
    """Inverse of `endpoint_to_proto`; ValueError for a description it cannot trust."""
    if LAYOUT_EXTRA_KEY not in message.extra:
        raise ValueError(f"transfer endpoint carries no {LAYOUT_EXTRA_KEY!r}")
    try:
        layout = KvCacheLayout.from_dict(json.loads(message.extra[LAYOUT_EXTRA_KEY]))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"malformed {LAYOUT_EXTRA_KEY}: {exc}") from exc
    return KvEndpointDescription.from_parts(
        backend=message.backend,
        session_name=message.session_name,
        layout=layout,
        regions=[
            KvRegionDescription(
                layer=region.layer,
                base_addr=region.base_addr,
                block_len=region.block_len,
                num_blocks=region.num_blocks,
                kv_index=region.kv_index,
            )
            for region in message.regions
        ],
    )
