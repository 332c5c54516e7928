"""The lease ledger: every replica's prefix-load leases and their pin counts, in Redis.

With a shared store (coordinator/runtime/redis_store.py) the replica that owns a
prefix load (the requester's, `pl-<random>@<owner>`) records the lease in Redis
before its pin requests leave, and every later change of it, each change one Lua
script (atomic; scripts run one at a time on the server):

- `{kvrc}:lease:<lease id>`, a hash: `o` owner replica, `s` source (holder) child
  engine, `t` target (requester), `st` state (`pinning`, `granted`, `quarantined`),
  `b` the block hashes the lease names (msgpack): every requested block while
  pinning, the granted prefix once granted;
- `{kvrc}:pins:<source child engine>`, a hash: block hash -> the number of live
  leases naming it (a field leaves at 0). Several leases on one block are legal;
- `{kvrc}:owned:<owner>`, a set: the owner's live lease ids; `{kvrc}:owners`, the
  owners that have records (a silent one leaves it with its last record).

What holds across replicas, checked by the scripts themselves:

- **Lease ids are unique.** `open` refuses an id that another owner recorded (a
  retry of the owner's own open is answered "already yours").
- **One owner per lease.** Only the owner changes or ends its record (a fence):
  another replica's write is refused and changes nothing.
- **A block's pin count equals the number of live leases naming it**: `open` counts
  the blocks, a grant trims the count to the granted prefix, `end` takes them all
  away, and a re-sync replaces exactly the owner's own contributions.
- **One store.** Every script first checks the store's epoch (`{kvrc}:epoch`): a
  Redis that came back empty (a store loss) refuses them all until the replica has
  seen the new epoch; then the replica writes its live leases again (`resync`).
- **No grant names a block its holder reported gone**: the holder's own PinResult is
  the proof (it pins only what it still has); the grant names at most what every
  holder part pinned, and the ledger records exactly that prefix.

The gate (I6-quiescence, fail closed): a lease's pin requests leave only once its
`open` is recorded; refused (the id taken, the store unreachable or lost) the lease
misses `store_refused` and no holder part was ever asked to pin. Later changes are
queued in order behind it and retried while Redis is unreachable; nothing here
ends or releases a lease, and no key carries a TTL (I6: no pin ends on a clock).
Handoff leases are not recorded: they pin their own request's blocks, not blocks of
the shared inventory, and stay in the decode replica's table.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.leases import (
    Flow,
    LeaseEnded,
    LeaseGranted,
    LeaseQuarantined,
    LeaseView,
    SendPin,
)
from coordinator.runtime.metrics import Metrics
from coordinator.runtime.store_keys import (
    BACKOFF_MS,
    EPOCH_KEY,
    LEASE_PREFIX,
    OWNED_PREFIX,
    OWNERS_KEY,
    PINS_PREFIX,
    RESYNC_MARKS_KEY,
    RESYNCS_PREFIX,
)
from kvrc.vocabulary import COORDINATOR_SHUTTING_DOWN

log = logging.getLogger("kvrc.store")

BATCH = 256  # ledger writes per pipeline (one round trip)
OWNER_READ_TIMEOUT_S = 2.0  # reading which replica owns a lease (a report waits on it)
# Such reads at once: they share the writer's connections (heartbeats, ledger writes).
OWNER_READS_AT_ONCE = 2

PINNING = "pinning"
GRANTED = "granted"
QUARANTINED = "quarantined"

# Script answers.
OK = 1
ALREADY_OURS = 2  # `open` retried after a write whose answer was lost
UNKNOWN = 0  # `open`: the id is another owner's; others: no such lease
EPOCH_CHANGED = -1
NOT_OWNER = -2

DECR_LUA = """
local function decr(key, field)
  if redis.call('HINCRBY', key, field, -1) <= 0 then redis.call('HDEL', key, field) end
end
"""

# KEYS: lease, pins of its source, owned set of the owner, epoch, the set of owners.
# ARGV: epoch, owner, lease id, source, target, state, mode, keep, blocks...
# mode `new`: record a lease (0: the id is another owner's; 2: already ours).
# mode `set`: record it whatever was there (a re-sync).
# mode `state`: set its state; keep >= 0 trims its counted blocks to the first
# `keep` (0: not recorded, e.g. pruned while this owner was silent).
# mode `adopt`: `state`, and a record of another owner (one that fell silent) becomes
# this owner's, blocks and all; a lease not recorded is recorded with the given
# blocks. Reaches the old owner's set by a derived key (same hash tag).
PUT_SCRIPT = (
    DECR_LUA
    + """
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return -1 end
local old = redis.call('HMGET', KEYS[1], 'o', 'b')
local mode = ARGV[7]
if old[1] then
  if old[1] ~= ARGV[2] then
    if mode == 'new' then return 0 end
    if mode ~= 'adopt' then return -2 end
    -- A lease re-announced to this replica after its owner fell silent.
    redis.call('SREM', '"""
    + OWNED_PREFIX
    + """' .. old[1], ARGV[3])
    redis.call('HSET', KEYS[1], 'o', ARGV[2])
    redis.call('SADD', KEYS[3], ARGV[3])
    redis.call('SADD', KEYS[5], ARGV[2])
  end
  if mode == 'new' then return 2 end
  if mode == 'state' or mode == 'adopt' then
    local keep = tonumber(ARGV[8])
    if keep >= 0 then
      local blocks = cmsgpack.unpack(old[2])
      if keep < #blocks then
        local kept = {}
        for i = 1, #blocks do
          if i <= keep then kept[i] = blocks[i] else decr(KEYS[2], blocks[i]) end
        end
        redis.call('HSET', KEYS[1], 'b', cmsgpack.pack(kept))
      end
    end
    redis.call('HSET', KEYS[1], 'st', ARGV[6])
    return 1
  end
  for _, block in ipairs(cmsgpack.unpack(old[2])) do decr(KEYS[2], block) end
elseif mode == 'state' then
  return 0
end
local blocks = {}
for i = 9, #ARGV do
  blocks[#blocks + 1] = ARGV[i]
  redis.call('HINCRBY', KEYS[2], ARGV[i], 1)
end
redis.call('HSET', KEYS[1], 'o', ARGV[2], 's', ARGV[4], 't', ARGV[5], 'st', ARGV[6],
  'b', cmsgpack.pack(blocks))
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('SADD', KEYS[5], ARGV[2])
return 1
"""
)

# KEYS: lease, pins of its source, owned set, epoch. ARGV: epoch, owner, lease id.
END_SCRIPT = (
    DECR_LUA
    + """
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return -1 end
local old = redis.call('HMGET', KEYS[1], 'o', 'b')
if not old[1] then return 0 end
if old[1] ~= ARGV[2] then return -2 end
for _, block in ipairs(cmsgpack.unpack(old[2])) do decr(KEYS[2], block) end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[3], ARGV[3])
return 1
"""
)

# KEYS: owned set, epoch, the owner's re-sync mark, the set of owners (a silent owner
# left with no record leaves it), the counter marks are drawn from. ARGV: epoch, owner,
# who, lease ids to keep... Ends every record of the owner not kept. who `own`: the
# owner's own re-sync (marked anew, and listed as an owner, so that a sweep drops the
# mark's key of one that never opened a lease, once it is silent). Otherwise another
# replica drops a silent owner's records, and `who` is the owner's mark as the sweep
# read it: a re-sync since then (the owner came back) refuses the prune (-3). The one
# script that reaches keys it derives (each lease's record and its source's pins): all
# under the same hash tag, so one Redis Cluster slot would still hold them. A dropped
# owner's mark expires after RESYNCS_KEPT_S (origins are new per process: else one key
# per replica ever run that re-synced). Marks come from one counter, so none repeats: an
# expiry between a sweep's read and its prune reads as '0' (no mark), and a re-sync
# after it makes a new mark; either refuses that prune.
RESYNCS_KEPT_S = 86_400
PRUNE_SCRIPT = (
    DECR_LUA
    + """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
if ARGV[3] == 'own' then
  redis.call('SET', KEYS[3], redis.call('INCR', KEYS[5]))
  redis.call('SADD', KEYS[4], ARGV[2])
elseif (redis.call('GET', KEYS[3]) or '0') ~= ARGV[3] then
  return -3
end
local keep = {}
for i = 4, #ARGV do keep[ARGV[i]] = true end
local pruned = 0
for _, lease_id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if not keep[lease_id] then
    local key = '"""
    + LEASE_PREFIX
    + """' .. lease_id
    local old = redis.call('HMGET', key, 'o', 'b', 's')
    if old[1] == ARGV[2] then
      for _, block in ipairs(cmsgpack.unpack(old[2])) do
        decr('"""
    + PINS_PREFIX
    + """' .. old[3], block)
      end
      redis.call('DEL', key)
    end
    redis.call('SREM', KEYS[1], lease_id)
    pruned = pruned + 1
  end
end
if ARGV[3] ~= 'own' and redis.call('SCARD', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[4], ARGV[2])
  redis.call('EXPIRE', KEYS[3], """
    + str(RESYNCS_KEPT_S)
    + """)
end
return pruned
"""
)


# Scripts run by their SHA1 (EVALSHA): the text travels once per Redis start.
_SHA = {
    script: hashlib.sha1(script.encode()).hexdigest()
    for script in (PUT_SCRIPT, END_SCRIPT, PRUNE_SCRIPT)
}


def lease_key(lease_id: str) -> str:
    return LEASE_PREFIX + lease_id


def pins_key(source_child_engine_id: str) -> str:
    return PINS_PREFIX + source_child_engine_id


def owned_key(owner: str) -> str:
    return OWNED_PREFIX + owner


def resyncs_key(owner: str) -> str:
    return RESYNCS_PREFIX + owner


@dataclass(slots=True)
class _Record:
    """What this owner last wrote of one live lease (for a re-sync)."""

    source_child_engine_id: str
    target_child_engine_id: str
    blocks: tuple[bytes, ...] | None  # None: adopted; the blocks Redis holds are kept
    state: str


@dataclass(frozen=True, slots=True)
class _Write:
    op: str  # open | state | adopt | end | prune
    lease_id: str  # prune: the silent owner whose records go
    source_child_engine_id: str
    target_child_engine_id: str = ""
    state: str = ""
    keep: int = -1
    blocks: tuple[bytes, ...] = ()
    # `open` only: told whether the lease was recorded, and why not.
    done: Callable[[bool, str], None] | None = None


OpenDone = Callable[[bool, str], None]


class LeaseLedger:
    """One replica's writes to the lease ledger, in order, pipelined."""

    def __init__(
        self,
        conn: aioredis.Redis,
        owner: str,
        epoch: Callable[[], object],
        metrics: Metrics,
        *,
        on_failure: Callable[[str], None] = lambda why: None,
        on_success: Callable[[], None] = lambda: None,
    ) -> None:
        self._conn = conn
        self.owner = owner
        self._epoch = epoch
        self._metrics = metrics
        self._on_failure = on_failure
        self._on_success = on_success
        self._queue: deque[_Write] = deque()
        self._live: dict[str, _Record] = {}
        self._pending_prunes: set[str] = set()  # owners with a prune queued
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._resync_needed = False
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._scripts: dict[str, Any] = {}
        self._owner_reads = asyncio.Semaphore(OWNER_READS_AT_ONCE)

    # --- what the lease flow records -------------------------------------------------

    def observe(
        self,
        actions: Sequence[object],
        view_of: Callable[[str], LeaseView],
        recorded: Callable[[str, Sequence[SendPin], bool, str], None],
    ) -> None:
        """Records what one core step did to prefix loads (handoffs are not recorded).

        A new lease's pin requests are held: `recorded(lease_id, pins, ok, why)` gets them
        once Redis answered its open, and sends them, or makes the lease miss."""
        opening: dict[str, list[SendPin]] = {}
        for action in actions:
            if isinstance(action, SendPin):
                held = opening.get(action.lease_id)
                if held is None:
                    held = opening[action.lease_id] = []
                    self.open(
                        action.lease_id,
                        action.child_engine_id,
                        action.requester_child_engine_id,
                        action.block_hashes,
                        functools.partial(recorded, action.lease_id, held),
                    )
                held.append(action)
            elif (
                not isinstance(action, LeaseGranted | LeaseQuarantined | LeaseEnded)
                or action.flow is not Flow.PREFIX_LOAD
            ):
                continue
            elif isinstance(action, LeaseGranted):
                grant = view_of(action.lease_id).prefix_load_grant
                assert grant is not None
                self.granted(action.lease_id, grant.matched_blocks)
            elif isinstance(action, LeaseQuarantined):
                view = view_of(action.lease_id)
                self.quarantined(
                    action.lease_id, view.source_child_engine_id, view.target_child_engine_id or ""
                )
            else:
                self.ended(action.lease_id)

    def open(
        self,
        lease_id: str,
        source_child_engine_id: str,
        target_child_engine_id: str,
        blocks: Sequence[bytes],
        done: OpenDone,
    ) -> None:
        """Records a new lease; `done(recorded, why_not)` runs once Redis answered."""
        self._push(
            _Write(
                "open",
                lease_id,
                source_child_engine_id,
                target_child_engine_id,
                PINNING,
                -1,
                tuple(blocks),
                done,
            )
        )

    def granted(self, lease_id: str, matched_blocks: int) -> None:
        """The grant names the first `matched_blocks` blocks: the rest stop counting."""
        record = self._live.get(lease_id)
        if record is None:
            return  # never recorded (refused): nothing to change
        self._push(
            _Write(
                "state", lease_id, record.source_child_engine_id, state=GRANTED, keep=matched_blocks
            )
        )

    def quarantined(
        self, lease_id: str, source_child_engine_id: str, target_child_engine_id: str
    ) -> None:
        """Quarantined. One this replica did not open (re-announced by its holder after its
        owner fell silent or restarted) is adopted: its record, if any, becomes this
        replica's, else it is recorded here with no blocks (their hashes are unknown)."""
        self._push(
            _Write(
                "state" if lease_id in self._live else "adopt",
                lease_id,
                source_child_engine_id,
                target_child_engine_id,
                QUARANTINED,
            )
        )

    def ended(self, lease_id: str) -> None:
        record = self._live.get(lease_id)
        if record is None:
            return
        self._push(_Write("end", lease_id, record.source_child_engine_id))

    def forget_owner(self, owner: str, resyncs: str) -> None:
        """A replica fell silent (coordinator/runtime/redis_store.py `_sweep_ledger`): its
        records leave the ledger, unless it re-synced since the sweep read its counter
        (`resyncs`). Its holders keep their pins until their own pin deadlines; a lease
        one re-announces to a replica is adopted there. (A replica that was only stalled
        re-syncs when it notices: `RedisStore._health`.) One prune per owner waits."""
        if owner != self.owner and owner not in self._pending_prunes:
            self._pending_prunes.add(owner)
            self._push(_Write("prune", owner, "", state=resyncs))

    def store_lost(self) -> None:
        """Redis came back empty, or this replica was silent long enough for others to
        drop its records: every live lease is written again (once the epoch is known)."""
        self._resync_needed = True
        self._idle.clear()
        self._wake.set()

    async def flushed(self) -> None:
        """Returns once every write queued so far has been answered (tests, shutdown)."""
        while self._queue or self._resync_needed or not self._idle.is_set():
            self._wake.set()
            await self._idle.wait()
            await asyncio.sleep(0)

    # --- reads -----------------------------------------------------------------------

    async def owner_of(self, lease_id: str) -> str | None:
        """The replica the ledger records as the lease's owner (None: no record). A lease
        rebuilt after its owner fell silent names its adopter here, not in its id."""
        try:
            # Bounded: the report waits on it (the client's own retries cover more).
            async with asyncio.timeout(OWNER_READ_TIMEOUT_S), self._owner_reads:
                owner = await self._conn.hget(lease_key(lease_id), "o")
        except (RedisError, OSError, TimeoutError) as e:
            why = (
                f"no answer within {OWNER_READ_TIMEOUT_S:g} s"
                if isinstance(e, TimeoutError)
                else (str(e) or type(e).__name__)
            )
            raise KvrcError(
                ErrorCode.UNAVAILABLE,
                f"lease {lease_id!r} is not on this replica, and the shared store that "
                f"records which replica has it did not answer ({why}): try again",
            ) from None
        if owner is None:
            return None
        return owner.decode() if isinstance(owner, bytes) else str(owner)

    # --- lifecycle -------------------------------------------------------------------

    def start(self, on_ended: Callable[[asyncio.Task[None]], None] | None = None) -> None:
        """Starts the writer; `on_ended` sees it end (the store fails closed on a crash:
        else every later open waits unanswered and the queue grows without bound)."""
        self._task = asyncio.get_running_loop().create_task(self._writer())
        self._task.add_done_callback(on_ended or _log_failure)

    async def close(self, flush_timeout_s: float = 1.0) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(flush_timeout_s):
                await self.flushed()
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        pending, self._queue = self._queue, deque()
        for write in pending:
            if write.done is not None:
                self._live.pop(write.lease_id, None)
                self._tell(write, False, COORDINATOR_SHUTTING_DOWN)

    # --- the writer -------------------------------------------------------------------

    def _push(self, write: _Write) -> None:
        # The record follows the queue (what this owner means the ledger to say), so a
        # re-sync writes the latest even while earlier writes wait for Redis.
        if write.op == "open":
            self._live[write.lease_id] = _Record(
                write.source_child_engine_id,
                write.target_child_engine_id,
                write.blocks,
                PINNING,
            )
        elif write.op in ("state", "adopt"):
            record = self._live.get(write.lease_id)
            if record is None:
                # Adopted: the blocks its record names are in Redis, not here.
                record = self._live[write.lease_id] = _Record(
                    write.source_child_engine_id, write.target_child_engine_id, None, write.state
                )
            record.state = write.state
            if write.keep >= 0 and record.blocks is not None:
                record.blocks = record.blocks[: write.keep]
        elif write.op == "end":
            self._live.pop(write.lease_id, None)
        self._queue.append(write)
        self._idle.clear()
        self._wake.set()

    async def _writer(self) -> None:
        attempt = 0
        while not self._closing:
            if not self._queue and not self._resync_needed:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                epoch = self._epoch()
                if not isinstance(epoch, (bytes, str)):
                    raise RedisError("the shared store has not been reached yet")
                if self._resync_needed:
                    # Cleared first: a store loss found while this one runs asks again.
                    self._resync_needed = False
                    try:
                        await self._resync(epoch)
                    except BaseException:
                        self._resync_needed = True
                        raise
                batch = [self._queue[i] for i in range(min(len(self._queue), BATCH))]
                answers = await self._run(batch, epoch) if batch else []
            except (RedisError, OSError) as e:
                why = f"{type(e).__name__}: {e}"
                self._on_failure(why)
                self._fail_opens(f"the shared store is unreachable ({why})")
                await asyncio.sleep(BACKOFF_MS[min(attempt, len(BACKOFF_MS) - 1)] / 1000)
                attempt += 1
                continue
            attempt = 0
            self._on_success()
            for write, answer in zip(batch, answers, strict=True):
                self._queue.popleft()
                self._answered(write, answer)

    async def _run(self, batch: Sequence[_Write], epoch: bytes | str) -> list[Any]:
        """One pipeline of scripts (EVALSHA). Every write is idempotent (a repeated open is
        "already ours", a repeated trim, end or prune changes nothing), so a batch that
        met an empty script cache (Redis restarted) is run again whole after loading
        them. A write Redis failed alone (a script error, out of memory, read-only) is
        answered with its exception; a lost connection raises."""
        for _ in range(2):
            pipe: Any = self._conn.pipeline(transaction=False)
            for write in batch:
                if write.op == "prune":
                    # write.state: the owner's re-sync count as the sweep read it.
                    args = _prune_args(epoch, write.lease_id, write.state, ())
                    pipe.evalsha(_SHA[PRUNE_SCRIPT], *args)
                elif write.op == "end":
                    keys = (
                        lease_key(write.lease_id),
                        pins_key(write.source_child_engine_id),
                        owned_key(self.owner),
                        EPOCH_KEY,
                    )
                    pipe.evalsha(_SHA[END_SCRIPT], 4, *keys, epoch, self.owner, write.lease_id)
                else:
                    mode = "new" if write.op == "open" else write.op
                    args = self._put_args(
                        epoch,
                        write.lease_id,
                        write.source_child_engine_id,
                        write.target_child_engine_id,
                        write.state,
                        mode,
                        write.keep,
                        write.blocks,
                    )
                    pipe.evalsha(_SHA[PUT_SCRIPT], *args)
            answers: list[Any] = await pipe.execute(raise_on_error=False)
            if not any(isinstance(a, NoScriptError) for a in answers):
                return answers
            await self._load_scripts()
        return answers

    def _put_args(
        self,
        epoch: bytes | str,
        lease_id: str,
        source_child_engine_id: str,
        target_child_engine_id: str,
        state: str,
        mode: str,
        keep: int,
        blocks: Sequence[bytes],
    ) -> tuple[object, ...]:
        """PUT_SCRIPT's key count, keys and arguments (see the script)."""
        return (
            5,
            lease_key(lease_id),
            pins_key(source_child_engine_id),
            owned_key(self.owner),
            EPOCH_KEY,
            OWNERS_KEY,
            epoch,
            self.owner,
            lease_id,
            source_child_engine_id,
            target_child_engine_id,
            state,
            mode,
            keep,
            *blocks,
        )

    async def _load_scripts(self) -> None:
        for script in _SHA:
            await self._conn.script_load(script)

    def _answered(self, write: _Write, answer: object) -> None:
        if isinstance(answer, Exception):
            # This write alone failed in Redis: an open misses; anything else is written
            # again by a re-sync (which backs off while Redis keeps failing).
            log.warning(
                "lease ledger: %s of %s failed in Redis: %s", write.op, write.lease_id, answer
            )
            self._metrics.store_lease_writes.labels(op=write.op, result="error").inc()
            if write.op == "prune":
                self._pending_prunes.discard(write.lease_id)  # the next sweep asks again
            elif write.done is not None:
                self._live.pop(write.lease_id, None)
                self._tell(write, False, f"the shared store failed to record the lease: {answer}")
            else:
                self._resync_needed = True
            return
        code = int(answer)  # type: ignore[call-overload]
        if write.op == "prune":
            self._pending_prunes.discard(write.lease_id)
            if code > 0:
                log.info(
                    "lease ledger: %d lease(s) of silent replica %s dropped", code, write.lease_id
                )
            self._metrics.store_lease_writes.labels(
                op="prune", result="refused" if code < 0 else "ok"
            ).inc()
            return
        recorded = code in (OK, ALREADY_OURS) or (write.op == "end" and code == UNKNOWN)
        self._metrics.store_lease_writes.labels(
            op=write.op, result="ok" if recorded else "refused"
        ).inc()
        if code == EPOCH_CHANGED or (
            write.op == "state" and code == UNKNOWN and write.lease_id in self._live
        ):
            # The store came back empty, or this replica's records were dropped while it
            # was silent: its live leases are written again (from _live).
            self._resync_needed = True
        elif not recorded and write.op != "open":
            log.warning(
                "lease ledger: %s of lease %s refused (%s)",
                write.op,
                write.lease_id,
                _ANSWER_TEXT.get(code, code),
            )
        if write.done is None:
            return
        if recorded:
            self._tell(write, True, "")
            return
        self._live.pop(write.lease_id, None)
        self._tell(
            write,
            False,
            f"the shared store did not record the lease: {_ANSWER_TEXT.get(code, code)}",
        )

    @staticmethod
    def _tell(write: _Write, recorded: bool, why: str) -> None:
        """Runs an open's callback; its failure is logged, never the writer's end."""
        assert write.done is not None
        try:
            write.done(recorded, why)
        except Exception:
            log.exception("lease ledger: the answer to the open of %s failed", write.lease_id)

    def _fail_opens(self, why: str) -> None:
        """Fail closed: opens waiting for an unreachable store are refused now, not later.

        One whose write reached Redis before the error may have its record there: it is
        replaced in the queue by its end, which takes the record away (or finds none).
        The queue is swapped out first: a refusal ends its lease, which queues nothing
        more for it (it left _live here) but may queue other writes."""
        pending, self._queue = self._queue, deque()
        refused: list[_Write] = []
        for write in pending:
            if write.done is None:
                self._queue.append(write)
                continue
            self._live.pop(write.lease_id, None)
            self._queue.append(_Write("end", write.lease_id, write.source_child_engine_id))
            refused.append(write)
        for write in refused:
            self._metrics.store_lease_writes.labels(op="open", result="error").inc()
            self._tell(write, False, why)

    async def _resync(self, epoch: bytes | str) -> None:
        """Makes the ledger say what `_live` says: the owner's other records go, these are
        written whole (mode `set`; an adopted one keeps the blocks Redis holds, mode
        `adopt`). The opens, state changes, adoptions and ends queued before it are in
        `_live` already (an adoption kept after its lease ended would bring it back);
        prunes of other owners stay queued."""
        records = list(self._live.items())
        covered = len(self._queue)
        pipe: Any = self._conn.pipeline(transaction=False)
        pipe.eval(PRUNE_SCRIPT, *_prune_args(epoch, self.owner, "own", [lid for lid, _ in records]))
        for lease_id, record in records:
            args = self._put_args(
                epoch,
                lease_id,
                record.source_child_engine_id,
                record.target_child_engine_id,
                record.state,
                "set" if record.blocks is not None else "adopt",
                -1,
                record.blocks or (),
            )
            pipe.eval(PUT_SCRIPT, *args)
        answers = [int(a) for a in await pipe.execute()]
        if EPOCH_CHANGED in answers:
            raise RedisError("the store's epoch is not the one this replica knows yet")
        written = {lease_id: a for (lease_id, _), a in zip(records, answers[1:], strict=True)}
        kept: list[_Write] = []
        for _ in range(covered):
            write = self._queue.popleft()
            if write.op == "prune":
                kept.append(write)
            elif write.done is not None:
                self._answered(write, written.get(write.lease_id, UNKNOWN))
        self._queue.extendleft(reversed(kept))
        self._metrics.store_lease_writes.labels(op="resync", result="ok").inc()
        log.info("lease ledger: %d live lease(s) of this replica written again", len(records))


def _prune_args(
    epoch: bytes | str, owner: str, who: str, keep: Sequence[str]
) -> tuple[object, ...]:
    """PRUNE_SCRIPT's key count, keys and arguments (see the script)."""
    keys = (owned_key(owner), EPOCH_KEY, resyncs_key(owner), OWNERS_KEY, RESYNC_MARKS_KEY)
    return (len(keys), *keys, epoch, owner, who, *keep)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("lease ledger writer failed", exc_info=task.exception())


_ANSWER_TEXT = {
    UNKNOWN: "the lease id is another replica's",
    EPOCH_CHANGED: "the store came back empty (its epoch changed); re-syncing",
    NOT_OWNER: "another replica owns this lease",
}
