"""The Redis store: one replicated, ordered inventory log that replicas share.

Every replica appends its local inventory ops (coordinator/runtime/replication.py)
to one Redis Stream, as msgpack batches, and reads the same stream in order from
its last entry id, applying other replicas' ops to its own in-process index. A
lookup never touches Redis.

Keys share the hash tag `{kvrc}` so that a Redis Cluster slot could hold them all:

- `{kvrc}:inventory`: the stream; entries `o` (origin replica) and `d` (packed ops),
  trimmed with MINID at the snapshot before the newest (so a new replica finds
  everything after the newest snapshot, and one a snapshot interval behind still
  follows), and with MAXLEN ~ on every append as the hard cap on Redis memory;
- `{kvrc}:snapshot`: a hash, `id` (the last log entry the snapshot covers), `w` (its
  writer's wall ms) and `d` (`encode_snapshot`), written together by one Lua
  compare-and-set: a snapshot never replaces one with a newer id, nor one of
  another epoch. A replica that starts loads it and reads the log after its id; so
  does one whose read position was trimmed away (the entry it last read is older
  than the stream's first);
- `{kvrc}:epoch`: a random value set once (SET NX). A different or missing value
  means Redis restarted empty (no AOF) or was replaced: a store loss. Every replica
  then forgets the other replicas' engines, reads the new log from its start and
  re-announces its own engines. A store that came back *older* keeps its epoch (a
  restart from an older RDB save or AOF, a failover to a lagging Redis replica):
  every append first checks, in the same script, that the entry its replica
  appended last is still there, and the first to find it gone makes the rollback a
  store loss for all (`_APPEND`: a new epoch, the log and snapshot deleted).

Fail closed: while Redis cannot be reached (an append, a read or the epoch check
failed), or a store loss has not been re-announced yet, `unavailable_reason` says
why; the lease flow then refuses new prefix loads with UNAVAILABLE. Leases
already granted and their pins are not touched (I6-quiescence): nothing here ends
a lease. Liveness of the other replicas runs on this replica's monotonic clock
(heartbeat ops in the log), never on a Redis key TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import ssl
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from coordinator.runtime.clock import Clock
from coordinator.runtime.config import STORE_HEARTBEAT_MS, StoreConfig
from coordinator.runtime.lease_ledger import LeaseLedger, resyncs_key
from coordinator.runtime.metrics import Metrics
from coordinator.runtime.replication import (
    DEFAULT_SNAPSHOT_MAX_BYTES,
    OP_HEARTBEAT,
    ReplicatedInventory,
    Snapshot,
    decode_snapshot,
    encode_snapshot,
    pack_ops,
    unpack_ops,
)
from coordinator.runtime.store_keys import (
    BACKOFF_MS,
    EPOCH_KEY,
    FENCE_KEY,
    OWNERS_KEY,
    SNAPSHOT_KEY,
    STREAM_KEY,
)

log = logging.getLogger("kvrc.store")

OPS_PER_ENTRY = 512  # one XADD carries up to this many ops
READ_COUNT = 256  # entries per XREAD
READ_BLOCK_MS = 500
STREAM_MAXLEN = 1_000_000  # entries kept (approximately): bounded Redis memory
# Connections per pool, at most: a burst (every engine of a killed replica registering
# here at once, each claiming a fencing token) waits for one instead of opening one per
# caller and keeping them all, idle, for the life of the process.
WRITER_CONNECTIONS = 8
READER_CONNECTIONS = 4  # one blocks in XREAD; the snapshot reads use another

# KEYS: snapshot, epoch, stream. ARGV: id ms, id seq, id, wall ms, data, epoch.
# Returns 1 written, 0 not newer than the one there, -1 another epoch (a store loss).
# The stream is trimmed to the snapshot this one replaces: a replica up to one
# snapshot interval behind still reads on, an older one reloads.
_SNAPSHOT_CAS = """
if redis.call('GET', KEYS[2]) ~= ARGV[6] then return -1 end
local cur = redis.call('HGET', KEYS[1], 'id')
if cur then
  local ms, seq = string.match(cur, '^(%d+)-(%d+)$')
  ms, seq = tonumber(ms), tonumber(seq)
  local new_ms, new_seq = tonumber(ARGV[1]), tonumber(ARGV[2])
  if ms > new_ms or (ms == new_ms and seq >= new_seq) then return 0 end
  redis.call('XTRIM', KEYS[3], 'MINID', cur)
end
redis.call('HSET', KEYS[1], 'id', ARGV[3], 'w', ARGV[4], 'd', ARGV[5])
return 1
"""


# KEYS: fence counter, epoch. ARGV: epoch, the highest token this replica has seen. A
# fencing token for one registration (coordinator/runtime/peers.py), or -1 when the
# store is not the one this replica knows (a store loss: the replica claims again once
# it has re-announced). Above every token seen: a store that came back older (an AOF
# tail lost, a failover to a lagging replica) keeps its epoch but not its counter, and a
# repeated token ties two sessions of one part, which neither replica fences.
_CLAIM = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local floor = tonumber(ARGV[2]) or 0
local now = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if now < floor then redis.call('SET', KEYS[1], floor) end
return redis.call('INCR', KEYS[1])
"""

# KEYS: stream, epoch, snapshot. ARGV: the epoch as this replica knows it, the id of the
# entry it appended last ("": none since its last store loss), a new epoch, MAXLEN, the
# entry's origin and data. Appends the entry and returns its id. Under this replica's
# epoch, though, a store that no longer has the entry it appended last (and has not
# trimmed past it) came back older: a restart from an older save, a failover to a
# lagging replica. Checked at every append, so that no later append (whose id the old
# log may well have) can hide it. That is made a store loss for every replica (a new
# epoch, the log and its snapshot deleted: what others wrote since the rollback point
# is gone for them too) and nil is returned, nothing appended. The epoch itself is not
# checked otherwise: a store that came back empty is found by the epoch check.
_APPEND = """
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) == ARGV[1] then
  local ms, seq = string.match(ARGV[2], '^(%d+)-(%d+)$')
  ms, seq = tonumber(ms), tonumber(seq)
  local kept = false
  local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
  if #first > 0 then
    local fms, fseq = string.match(first[1][1], '^(%d+)-(%d+)$')
    fms, fseq = tonumber(fms), tonumber(fseq)
    kept = fms > ms or (fms == ms and fseq > seq)
      or #redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2]) > 0
  end
  if not kept then
    redis.call('SET', KEYS[2], ARGV[3])
    redis.call('DEL', KEYS[1], KEYS[3])
    return false
  end
end
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', 'o', ARGV[5], 'd', ARGV[6])
"""
_APPEND_SHA = hashlib.sha1(_APPEND.encode()).hexdigest()  # sent by its digest once loaded

_HEARTBEAT_ENTRY = pack_ops([[OP_HEARTBEAT]])  # an entry of one heartbeat op


def stream_id(value: str) -> tuple[int, int]:
    """A stream entry id as a comparable pair."""
    ms, _, seq = value.partition("-")
    return (int(ms), int(seq or 0))


def redis_client(config: StoreConfig, *, name: str, max_connections: int) -> aioredis.Redis:
    """One bounded connection pool to the store; timeouts so that a partition is noticed.

    A caller finding every connection busy waits for one, up to the socket timeout,
    and then fails as an unreachable store does (RedisError: retried with backoff).
    """
    socket_timeout_s = READ_BLOCK_MS / 1000 + 2.0
    kwargs: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "db": config.db,
        "username": config.username,
        "password": config.password,
        "socket_connect_timeout": 1.0,
        # Above the XREAD block, so a blocked read is not mistaken for a dead server.
        "socket_timeout": socket_timeout_s,
        "client_name": name,
        "protocol": 2,
    }
    if config.tls:
        kwargs["connection_class"] = aioredis.SSLConnection
        kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        if config.tls_ca is not None:
            kwargs["ssl_ca_certs"] = str(config.tls_ca)
    pool = aioredis.BlockingConnectionPool(
        max_connections=max_connections, timeout=socket_timeout_s, **kwargs
    )
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool


class RedisStore:
    """Appends this replica's inventory ops and applies everybody else's, in log order."""

    def __init__(
        self,
        config: StoreConfig,
        inventory: ReplicatedInventory,
        clock: Clock,
        metrics: Metrics,
        *,
        on_applied: Callable[[], None] = lambda: None,
        request_full_dumps: Callable[[str], object] = lambda why: None,
        on_epoch: Callable[[bytes], None] = lambda epoch: None,
        stream_maxlen: int = STREAM_MAXLEN,
        load_snapshots: bool = True,
        snapshot_max_bytes: int = DEFAULT_SNAPSHOT_MAX_BYTES,
    ) -> None:
        self._config = config
        self._inventory = inventory
        self._clock = clock
        self._metrics = metrics
        self._on_applied = on_applied
        # Asks this replica's engines to send their whole inventory again (the reason
        # goes to them): after a store loss, an outbox overflow or a long silence of
        # this replica, the others' view of them may lack what they published.
        self._request_full_dumps = request_full_dumps
        # Told each epoch this replica reads (the first, and a store loss's): a secret
        # every replica shares (the lease id key derives from it).
        self._on_epoch = on_epoch
        # The highest fencing token this replica has seen (peers.py `highest_token`): a
        # claim is answered above it (_CLAIM).
        self.token_floor: Callable[[], int] = lambda: 0
        self._maxlen = stream_maxlen
        self._origin_timeout_ms = config.origin_timeout_ms
        self._writer_conn = redis_client(
            config, name=f"kvrc-{inventory.origin}-w", max_connections=WRITER_CONNECTIONS
        )
        self._reader_conn = redis_client(
            config, name=f"kvrc-{inventory.origin}-r", max_connections=READER_CONNECTIONS
        )
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._epoch: object = None  # the epoch key's value as this replica last saw it
        self._epoch_tag = b""  # `epoch_tag()` of it, made once per epoch
        self._reset_reader = False  # a store loss: read the new log from its start
        # The last entry this replica appended to the log of its epoch (None: none since
        # the last store loss), and the store losses seen: an append answered across a
        # loss must not name an entry of the old log (_APPEND would find it gone).
        self._appended_id: str | None = None
        self._losses_seen = 0
        self._rolled_back_id: str | None = None  # the entry an append found gone
        self._epoch_checks_after_failure = 0  # reset by every failure (see _fail)
        self._failures: dict[str, str] = {"start": "the shared store has not been reached yet"}
        self._claims_failing = 0  # claim tasks whose last try failed ("claim" failure)
        self._load_snapshots = load_snapshots  # False: read the retained log only (tests)
        self._caught_up = False  # read the log up to its end once since starting
        # Read up to the log's end since the last (re)load of the view (a short read, or
        # past the newest entry when the catch-up began): while it replays a backlog it
        # hears each replica as late as its entries are read, so it calls nobody silent
        # and drops nobody's ledger records until then.
        self._at_log_end = False
        # The log's newest entry when this catch-up began: read past it, the reader is at
        # the log's end even if every read is full (writes as fast as it reads).
        self._log_end_target: str | None = None
        self._snapshot_max_bytes = snapshot_max_bytes
        self._read_id: str | None = None  # the last log entry applied; None: not started
        self._entries_since_snapshot = 0
        self._snapshot_id_seen: str | None = None  # the newest snapshot's id, as last seen
        self._snapshot_seen_ms = clock.monotonic_ms()
        self._snapshot_due = asyncio.Event()
        self._reading = asyncio.Event()
        self._reading.set()
        self._reader_stopped = asyncio.Event()  # paused, and its read in flight answered
        self._m_out = metrics.store_ops.labels(direction="out")
        self._m_in = metrics.store_ops.labels(direction="in")
        inventory.on_record = self._wake.set
        inventory.on_asked_to_announce = lambda asker: self._dumps(
            f"replica {asker} had called this replica silent"
        )
        # Prefix-load leases and their pin counts, shared (coordinator/runtime/lease_ledger.py).
        self.ledger = LeaseLedger(
            self._writer_conn,
            inventory.origin,
            lambda: self._epoch,
            metrics,
            on_failure=lambda why: self._fail("lease ledger", why),
            on_success=lambda: self._ok("lease ledger"),
        )
        # Since when the reader has read the log without a failure or a pause (None: it
        # has not): only a replica that follows the log may call another one silent.
        self._read_ok_since_ms: int | None = None
        # The last health tick that found the store healthy (None: none yet).
        self._healthy_ms: int | None = None
        self._set_up_gauge()

    # --- health ---------------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        """None while Redis answers and this replica follows the log; else why not."""
        if not self._failures:
            return None
        detail = "; ".join(sorted(set(self._failures.values())))
        return f"the shared store {self._config.url} is unavailable ({detail})"

    def _ok(self, part: str) -> None:
        if self._failures.pop(part, None) is not None:
            if part != "start":
                log.info("shared store %s: %s works again", self._config.url, part)
            self._set_up_gauge()

    def _fail(self, part: str, why: str) -> None:
        if part not in self._failures:
            log.warning("shared store %s: %s failed: %s", self._config.url, part, why)
        self._failures[part] = why
        # Up again only after an epoch check that started after this failure: an empty
        # restarted Redis must be seen as a store loss before any grant (a check that
        # was in flight through the outage may have read the old epoch).
        self._failures.setdefault("epoch check", "not checked since the store failed")
        self._epoch_checks_after_failure = 0
        self._set_up_gauge()

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """One of the store's own loops (writer, reader, health, snapshots, ledger sweep)
        ended. One that failed is not restarted: the store stays down (fail closed: no
        grants on a view nobody follows any more). A dead reader also no longer counts as
        following the log, so this replica stops calling others silent."""
        if task.cancelled() or self._closing or task.exception() is None:
            return
        error = task.exception()
        log.error("shared store task failed; restart this replica", exc_info=error)
        self._read_ok_since_ms = None
        self._fail("task", f"a background task failed: {error!r}"[:200])

    def _set_up_gauge(self) -> None:
        self._metrics.store_up.set(0 if self._failures else 1)

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Starts following the log; an unreachable Redis is retried, failing closed."""
        await self._check_epoch()
        loop = asyncio.get_running_loop()
        for coro in (
            self._writer(),
            self._reader(),
            self._health(),
            self._snapshotter(),
            self._sweep_ledger(),
        ):
            task = loop.create_task(coro)
            task.add_done_callback(self._task_ended)
            self._tasks.append(task)
        self.ledger.start(on_ended=self._task_ended)
        self._inventory.heartbeat()  # other replicas hear of this one at once

    async def close(self, flush_timeout_s: float = 1.0) -> None:
        """Flushes what is queued (departures, mostly), then stops."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(flush_timeout_s):
                while self._inventory.outbox and "append" not in self._failures:
                    self._wake.set()
                    await asyncio.sleep(0.01)
        await self.ledger.close(flush_timeout_s)
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in (self._writer_conn, self._reader_conn):
            with contextlib.suppress(RedisError, OSError):
                await conn.aclose()

    # --- fencing tokens (coordinator/runtime/peers.py) -------------------------------------

    def claim(
        self, part_key: str, session_id: str, on_token: Callable[[int], None]
    ) -> Callable[[], None]:
        """Asks for a fencing token in the background; returns how to cancel the ask."""
        task = asyncio.get_running_loop().create_task(self._claim(on_token))
        # A claim that crashed leaves its part without a token for good: fail closed.
        task.add_done_callback(self._task_ended)

        def cancel() -> None:
            task.cancel()

        return cancel

    async def _claim(self, on_token: Callable[[int], None]) -> None:
        attempt = 0
        failing = False  # this claim's last try failed (counted in _claims_failing)
        try:
            while not self._closing:
                epoch = self._epoch if isinstance(self._epoch, (bytes, str)) else ""
                try:
                    token = int(
                        await self._writer_conn.eval(  # type: ignore[misc]
                            _CLAIM, 2, FENCE_KEY, EPOCH_KEY, epoch, self.token_floor()
                        )
                    )
                except (RedisError, OSError) as e:
                    if not failing:
                        failing = True
                        self._claims_failing += 1
                    self._fail("claim", _why(e))
                    await asyncio.sleep(BACKOFF_MS[min(attempt, len(BACKOFF_MS) - 1)] / 1000)
                    attempt += 1
                    continue
                failing = self._claim_settled(failing)
                if token > 0:
                    on_token(token)
                    return
                # Not the store this replica knew (or not checked yet): a loss found here
                # re-announces every part with new claims, which cancels this one.
                await self._check_epoch()
                await asyncio.sleep(BACKOFF_MS[min(attempt, len(BACKOFF_MS) - 1)] / 1000)
                attempt += 1
        finally:
            # Cancelled while failing (its part left before Redis answered): no claim
            # stands behind the failure any more, so it must not keep the store down.
            self._claim_settled(failing)

    def _claim_settled(self, failing: bool) -> bool:
        """A claim no longer failing: the store's "claim" failure clears with the last."""
        if failing:
            self._claims_failing -= 1
        if self._claims_failing == 0:
            self._ok("claim")
        return False

    # --- the epoch: an empty, restarted Redis is a store loss ------------------------------

    def epoch_tag(self) -> bytes:
        """The store this replica knows, as 8 bytes of its epoch's digest (b"": not read
        yet). Fencing tokens carry it (peers.py): the epoch itself is a shared secret,
        and the log is no place for it."""
        return self._epoch_tag

    async def _check_epoch(self) -> None:
        generation = self._epoch_checks_after_failure = self._epoch_checks_after_failure + 1
        try:
            epoch = await self._writer_conn.get(EPOCH_KEY)
            if epoch is None:
                await self._writer_conn.set(EPOCH_KEY, secrets.token_hex(16), nx=True)
                epoch = await self._writer_conn.get(EPOCH_KEY)
        except (RedisError, OSError) as e:
            self._fail("epoch check", _why(e))
            return
        if self._epoch is not None and epoch != self._epoch:
            self._store_lost()
        if epoch != self._epoch and epoch is not None:
            raw = epoch if isinstance(epoch, bytes) else str(epoch).encode()
            self._on_epoch(raw)
            self._epoch_tag = hashlib.sha256(raw).digest()[:8]
        self._epoch = epoch
        if generation == self._epoch_checks_after_failure:  # no failure while it ran
            self._ok("epoch check")
            self._ok("start")

    def _store_lost(self) -> None:
        rolled_back, self._rolled_back_id = self._rolled_back_id, None
        if rolled_back is not None:
            log.warning(
                "shared store %s came back older than this replica wrote it (its log entry "
                "%s is gone: a restart from an older save, or a failover to a lagging "
                "replica): treated as a store loss, the shared view is rebuilt from the "
                "replicas' re-announcements",
                self._config.url,
                rolled_back,
            )
        else:
            log.warning(
                "shared store %s came back empty or rolled back (its epoch changed): "
                "rebuilding the shared view from the replicas' re-announcements",
                self._config.url,
            )
        self._appended_id = None
        self._losses_seen += 1
        self._metrics.store_losses.inc()
        self._reset_reader = True
        self._read_ok_since_ms = None  # who is alive is read anew: no sweep before that
        self._healthy_ms = None  # everything is re-announced here: no re-sync on top
        self.ledger.store_lost()
        # New tokens (reclaim): the new store's fencing counter started again, and a part
        # announced with its old, higher token would outrank a later failover elsewhere.
        self._inventory.reannounce(reclaim=True)
        what = "came back empty or rolled back" if rolled_back is None else "rolled back"
        self._dumps(f"the shared store {self._config.url} {what}")
        self._failures["rebuild"] = f"it {what}; the view is being rebuilt"
        self._set_up_gauge()
        self._wake.set()

    def _dumps(self, why: str) -> None:
        try:
            count = self._request_full_dumps(f"{why}: resend your inventory")
        except Exception:  # the rebuild must go on without them
            log.exception("full dumps not requested (%s)", why)
            return
        log.info("asked %s publishing part(s) for a full dump: %s", count, why)

    # --- tasks ---------------------------------------------------------------------------

    async def _health(self) -> None:
        while not self._closing:
            await asyncio.sleep(STORE_HEARTBEAT_MS / 1000)
            await self._check_epoch()
            self._inventory.heartbeat(self._clock.monotonic_ms())
            self._resync_after_silence(self._clock.monotonic_ms())
            self._expire_silent(self._clock.monotonic_ms())

    def _expire_silent(self, now_ms: int) -> None:
        """Drops the engines and parts of replicas not heard from for the origin timeout,
        judged only while this replica follows the log itself: a replica that cannot
        read (Redis down, reading paused, a failure) hears nobody, and calling every
        other replica silent then would drop their engines and parts, and a lease's
        holder there would look proven gone (I6-quiescence) while it lives."""
        since = self._read_ok_since_ms
        if since is None or self._failures or not self._at_log_end:
            return
        dropped = self._inventory.expire_silent_origins(now_ms, self._origin_timeout_ms, since)
        if dropped:
            log.info("%d child engine(s) of silent replicas left the view", dropped)
            self._on_applied()

    def _resync_after_silence(self, now_ms: int) -> None:
        """This replica was unhealthy or stalled (a pause, a partition, Redis down) long
        enough that the others may have called it silent and dropped its ledger
        records: it writes its live leases again.

        How a replica the others called silent comes back, and why no more is needed:
        1. nobody calls another silent while it cannot read itself (`_expire_silent`),
           so an outage of Redis, which every replica sees, drops nothing anywhere;
        2. a stall of this replica's own (its event loop paused: no failure to see)
           restarts its count of the others' silence from now: it heard nobody
           while stalled, and their ops since are still to be read;
        3. a replica that did call this one silent (it was cut off alone, or stalled)
           asks it to announce its engines and parts, and have them dump, when it
           hears it again (replication.py, a hello naming it): only the replica
           that dropped something asks, so a blip nobody took for silence costs no
           dumps. The threshold here is half the others' timeout, as before."""
        if self._failures or not self._reading.is_set():
            return
        gap = None if self._healthy_ms is None else now_ms - self._healthy_ms
        self._healthy_ms = now_ms
        if gap is None or gap <= self._origin_timeout_ms // 2:
            return
        log.warning(
            "this replica was unhealthy or stalled for %d ms: writing its live leases to the "
            "lease ledger again",
            gap,
        )
        if self._read_ok_since_ms is not None:
            self._read_ok_since_ms = now_ms  # 2. above
        self.ledger.store_lost()

    async def _sweep_ledger(self) -> None:
        """Every origin timeout: the ledger's records of replicas not heard from within it
        are dropped (died, or stalled: one that comes back writes its own again). Only
        while this replica has followed the log for a whole timeout without a failure
        or a pause, so that its own outage never makes the others look silent."""
        while not self._closing:
            await asyncio.sleep(self._origin_timeout_ms / 1000)
            since = self._read_ok_since_ms
            if since is None or self._clock.monotonic_ms() - since < self._origin_timeout_ms:
                continue
            if not self._at_log_end:
                continue  # replaying: an owner not read yet is not a silent one
            if "lease ledger" in self._failures:
                continue  # its writes fail: queue no prunes behind them
            try:
                owners = [_text(o) for o in await self._writer_conn.smembers(OWNERS_KEY)]
                silent = [o for o in owners if not self._inventory.origin_alive(o)]
                # Each one's re-sync count now: a prune is refused if it re-syncs first.
                counts = (
                    await self._writer_conn.mget([resyncs_key(o) for o in silent]) if silent else []
                )
            except (RedisError, OSError) as e:
                # Housekeeping: tried again next time, no reason to refuse grants meanwhile.
                log.warning("lease ledger sweep failed: %s", _why(e))
                continue
            for owner, count in zip(silent, counts, strict=True):
                self.ledger.forget_owner(owner, _text(count or b"0"))

    async def _writer(self) -> None:
        attempt = 0
        inventory = self._inventory
        while not self._closing:
            if not inventory.outbox and not inventory.outbox_overflowed:
                self._wake.clear()
                await self._wake.wait()
                continue
            if inventory.outbox_overflowed:
                try:
                    # Rebuild once the store answers: dumps asked for while it is down
                    # would only overflow the outbox again.
                    await self._writer_conn.ping()
                except (RedisError, OSError) as e:
                    self._fail("append", _why(e))
                    await asyncio.sleep(BACKOFF_MS[min(attempt, len(BACKOFF_MS) - 1)] / 1000)
                    attempt += 1
                    continue
                log.warning(
                    "shared store %s: more than %d ops or %d bytes queued: resetting this "
                    "replica's part of the shared view and asking its engines for full dumps",
                    self._config.url,
                    inventory.outbox_limit,
                    inventory.outbox_max_bytes,
                )
                inventory.reannounce()
                # The reset drops this origin's engines everywhere: their blocks come back
                # with the dumps (the store-loss path does the same).
                self._dumps("this replica's queue of changes for the shared store overflowed")
            count = min(len(inventory.outbox), OPS_PER_ENTRY)
            generation = inventory.generation
            losses = self._losses_seen
            try:
                entry_id = await self._append(inventory.origin, inventory.entry(count))
            except (RedisError, OSError) as e:
                self._fail("append", _why(e))
                await asyncio.sleep(BACKOFF_MS[min(attempt, len(BACKOFF_MS) - 1)] / 1000)
                attempt += 1
                continue
            attempt = 0
            self._ok("append")
            if entry_id is None:
                # The store came back older than this replica's last entry: now a store
                # loss, which the epoch check finds (the outbox is reset and re-announced).
                self._rolled_back_id = self._appended_id
                await self._check_epoch()
                continue
            if losses == self._losses_seen:
                self._appended_id = entry_id
            if inventory.generation != generation:
                continue  # the outbox was replaced meanwhile (a reset): these ops are not in it
            inventory.take_sent(count)
            self._m_out.inc(count)
            if "rebuild" in self._failures and not inventory.outbox:
                self._ok("rebuild")  # the reset and re-announcement are in the new log

    async def _append(self, origin: str, data: bytes) -> str | None:
        """One log entry; its id, or None when the store came back older (`_APPEND`)."""
        known = self._epoch if isinstance(self._epoch, (bytes, str)) else ""
        keys_and_args = (
            3,
            STREAM_KEY,
            EPOCH_KEY,
            SNAPSHOT_KEY,
            known,
            self._appended_id or "",
            secrets.token_hex(16),
            self._maxlen,
            origin,
            data,
        )
        try:
            reply = await self._writer_conn.evalsha(_APPEND_SHA, *keys_and_args)  # type: ignore[misc]
        except NoScriptError:  # a restarted Redis: EVAL loads it for the next appends
            reply = await self._writer_conn.eval(_APPEND, *keys_and_args)  # type: ignore[misc]
        return None if reply is None else _text(reply)

    # --- reading the log ---------------------------------------------------------------

    @property
    def read_position(self) -> str | None:
        """The id of the last log entry this replica applied (None before the first read)."""
        return self._read_id

    def pause_reading(self) -> None:
        """Stops applying the log, as a replica stalled by a pause or a partition would."""
        if self._reading.is_set():
            # A reader woken by a resume it has not run since still reads once more:
            # `reading_stopped` waits for it to stop again, not for the last pause's stop.
            self._reader_stopped.clear()
        self._reading.clear()
        self._read_ok_since_ms = None
        self._at_log_end = False  # what was written meanwhile is a backlog to replay
        self._log_end_target = None

    def resume_reading(self) -> None:
        self._reading.set()

    async def reading_stopped(self) -> None:
        """Returns once a paused reader has stopped: the read it had in flight answered
        and was applied, and it reads nothing more until `resume_reading`."""
        await self._reader_stopped.wait()

    async def _reader(self) -> None:
        attempt = 0
        origin = self._inventory.origin.encode()
        accept_trim = False  # the hard cap cut past the newest snapshot: read on from there
        while not self._closing:
            if not self._reading.is_set():
                self._reader_stopped.set()
            await self._reading.wait()
            self._reader_stopped.clear()
            if self._epoch is None:
                # `start`'s check failed: nothing is read before the store's epoch is
                # known, so that every fencing token read is judged against the store
                # it came from (peers.py).
                await self._check_epoch()
                if self._epoch is None:
                    await asyncio.sleep(BACKOFF_MS[min(attempt, len(BACKOFF_MS) - 1)] / 1000)
                    attempt += 1
                    continue
            try:
                if self._reset_reader or self._read_id is None:
                    self._at_log_end = False
                    self._log_end_target = None
                    if self._reset_reader:
                        self._reset_reader = False
                        # The log is gone (a store loss): its snapshot with it.
                        self._read_id = "0-0"
                        if self._inventory.drop_all_remote(
                            "the shared store was lost", store_lost=True
                        ):
                            self._on_applied()
                    else:
                        self._read_ok_since_ms = None  # a snapshot's view: no sweep yet
                        accept_trim = await self._bootstrap()
                last_id = self._read_id
                assert last_id is not None
                if not self._at_log_end and self._log_end_target is None:
                    newest = await self._last_id() or "0-0"
                    # A pause meanwhile makes what is written until the resume a backlog.
                    self._log_end_target = newest if self._reading.is_set() else None
                reply, first = await self._read_after(last_id)
            except (RedisError, OSError) as e:
                self._fail("read", _why(e))
                self._read_ok_since_ms = None
                await asyncio.sleep(BACKOFF_MS[min(attempt, len(BACKOFF_MS) - 1)] / 1000)
                attempt += 1
                continue
            attempt = 0
            self._ok("read")
            if self._read_ok_since_ms is None and self._reading.is_set():
                self._read_ok_since_ms = self._clock.monotonic_ms()
            if self._reset_reader:
                continue  # read from a log that is gone: start again from the new one
            trimmed = first is not None and stream_id(first) > stream_id(last_id)
            if trimmed and last_id != "0-0" and not accept_trim:
                # A store that came back empty looks trimmed too (its ids are newer): its
                # epoch says which, before anything of it is applied (else applied now,
                # and again from its start once the loss is noticed).
                await self._check_epoch()
                if "epoch check" in self._failures:
                    await asyncio.sleep(BACKOFF_MS[min(attempt, len(BACKOFF_MS) - 1)] / 1000)
                    attempt += 1
                    continue
                if self._reset_reader:
                    continue  # a store loss: the new log is read from its start
                log.warning(
                    "the log entry %s this replica read last was trimmed away: "
                    "loading the newest snapshot",
                    last_id,
                )
                self._read_id = None  # bootstrap again: snapshot, then the tail
                continue
            accept_trim = False
            applied = 0
            read = 0
            now = self._clock.monotonic_ms()
            for _stream, entries in reply or ():
                read += len(entries)
                for entry_id, fields in entries:
                    last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    self._read_id = last_id
                    data = fields.get(b"d")
                    if data != _HEARTBEAT_ENTRY:  # an idle log makes no snapshot due
                        self._entries_since_snapshot += 1
                    source = fields.get(b"o", b"")
                    if source == origin:
                        continue
                    try:
                        if data is None:
                            raise KeyError("d")
                        ops = unpack_ops(data)
                        applied += self._inventory.apply_remote(_text(source), ops, now)
                    except Exception as e:
                        # Replicas write the log: a bug or a version skew. One entry must
                        # not stop this replica from following the others.
                        log.warning("log entry %s skipped: %r", last_id, e)
                        continue
            if applied:
                self._m_in.inc(applied)
                self._on_applied()
            target = self._log_end_target
            if read < READ_COUNT or (
                target is not None
                and self._read_id is not None
                and stream_id(self._read_id) >= stream_id(target)
            ):
                self._at_log_end = True
                self._log_end_target = None
                if not self._caught_up:
                    self._caught_up = True  # up to the log's end: who is alive is known
                    self._inventory.caught_up()
            if self._snapshot_every and self._entries_since_snapshot >= self._snapshot_every:
                self._snapshot_due.set()

    async def _read_after(self, last_id: str) -> tuple[Any, str | None]:
        """The next entries after `last_id` (XREAD) and the stream's first id after them.

        The first id is read after the reply, so that an entry trimmed before the read
        (missing from the reply) shows as a first id newer than `last_id`. Both
        commands go in one pipeline on one connection: Redis runs a client's commands
        in order and holds the XRANGE until the blocked XREAD has answered, so the
        check costs no round trip of its own (it used to be a second one after every
        read, in the visibility path).
        """
        pipe: Any = self._reader_conn.pipeline(transaction=False)
        pipe.xread({STREAM_KEY: last_id}, count=READ_COUNT, block=READ_BLOCK_MS)
        pipe.xrange(STREAM_KEY, "-", "+", count=1)
        reply, rows = await pipe.execute()
        return reply, _first_of(rows) if reply else None

    async def _first_id(self) -> str | None:
        rows: Any = await self._reader_conn.xrange(STREAM_KEY, "-", "+", count=1)
        return _first_of(rows)

    async def _last_id(self) -> str | None:
        rows: Any = await self._reader_conn.xrevrange(STREAM_KEY, "+", "-", count=1)
        return _first_of(rows)

    async def _bootstrap(self) -> bool:
        """Where a replica starts reading: after the newest snapshot, loaded, or at the start.

        Returns True when the hard cap (MAXLEN) has cut past that point too: what was
        cut is lost to this replica until the engines' next dumps (docs/operations.md).
        """
        start = await self._load_newest_snapshot() if self._load_snapshots else "0-0"
        # No snapshot (or not loadable): nothing but the retained log to go on.
        if start == "0-0" and self._inventory.drop_all_remote("no snapshot was loaded"):
            self._on_applied()
        self._read_id = start
        first = await self._first_id()
        if first is None or start == "0-0" or stream_id(first) <= stream_id(start):
            return start == "0-0"  # from the start, whatever was trimmed is gone anyway
        log.warning(
            "the log was cut past snapshot %s (first entry %s, MAXLEN %d): what was cut is "
            "missing until the engines' next dumps",
            start,
            first,
            self._maxlen,
        )
        self._metrics.store_snapshots.labels(action="gap").inc()
        return True

    async def _load_newest_snapshot(self) -> str:
        """Loads the newest snapshot; returns its id, or "0-0" when none could be loaded."""
        raw: Any = await self._reader_conn.hmget(SNAPSHOT_KEY, ["id", "d"])
        if raw[0] is None or raw[1] is None:
            return "0-0"
        now = self._clock.monotonic_ms()
        refused = self._metrics.store_snapshots.labels(action="refused")
        try:
            snapshot = decode_snapshot(raw[1], now)
        except ValueError as e:  # SnapshotIncompatible too: another PYTHONHASHSEED
            log.warning("snapshot %s not loaded: %s", raw[0].decode(), e)
            refused.inc()
            return "0-0"
        try:
            loaded = self._inventory.load_snapshot(snapshot, now)
        except Exception:  # following the log must go on without it
            log.exception("snapshot %s not loaded", snapshot.stream_id)
            refused.inc()
            return "0-0"
        self._note_snapshot(snapshot.stream_id)
        self._metrics.store_snapshots.labels(action="loaded").inc()
        log.info(
            "loaded snapshot %s of %s: %d child engine(s), %d membership(s)",
            snapshot.stream_id,
            snapshot.writer,
            loaded,
            snapshot.memberships,
        )
        self._on_applied()
        return snapshot.stream_id

    # --- writing snapshots ------------------------------------------------------------

    @property
    def _snapshot_every(self) -> int:
        return self._config.snapshot_every_entries

    def _note_snapshot(self, snapshot_id: str) -> None:
        if snapshot_id != self._snapshot_id_seen:
            self._snapshot_id_seen = snapshot_id
            self._snapshot_seen_ms = self._clock.monotonic_ms()
            self._entries_since_snapshot = 0

    async def _snapshotter(self) -> None:
        if not self._snapshot_every:
            return
        interval = self._config.snapshot_interval_ms
        failing = False  # one warning per run of failures, not one per tick
        while not self._closing:
            await self._clock.wait(self._snapshot_due, min(interval, 5_000))
            self._snapshot_due.clear()
            if self._failures:
                continue  # not following the log (write_snapshot would refuse anyway)
            try:
                await self.write_snapshot(force=False)
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("snapshot not written: %s", _why(e))
                failing = True
                continue
            if failing:
                log.info("snapshots are written again")
                failing = False

    async def write_snapshot(self, *, force: bool = True) -> bool:
        """Writes this replica's view as the newest snapshot if it is due (or `force`).

        Due: `snapshot_every_entries` log entries read since the newest snapshot, or
        `snapshot_interval_ms` since it changed with entries read meanwhile. Any
        replica may write; the compare-and-set keeps the newest. True when written.
        """
        raw: Any = await self._writer_conn.hmget(SNAPSHOT_KEY, ["id", "w"])
        if raw[0] is not None:
            self._note_snapshot(raw[0].decode())
            age_s = (self._clock.wall_ms() - int(raw[1] or 0)) / 1000
            self._metrics.store_snapshot_age.set(max(age_s, 0.0))
        read_id = self._read_id
        if read_id is None or read_id == "0-0" or self._failures:
            return False  # nothing read yet, or not following the log
        if self._snapshot_id_seen is not None and stream_id(self._snapshot_id_seen) >= stream_id(
            read_id
        ):
            return False
        waited = self._clock.monotonic_ms() - self._snapshot_seen_ms
        due = self._entries_since_snapshot >= self._snapshot_every or (
            waited >= self._config.snapshot_interval_ms and self._entries_since_snapshot > 0
        )
        if not (force or due):
            return False
        wall = self._clock.wall_ms()
        inventory = self._inventory
        engines = []
        for cid in inventory.engine_ids():
            # One engine at a time, the event loop running between them (0.5 s of CPU
            # a million memberships): each is then at or after read_id, which the tail
            # makes exact (ReplicatedInventory.snapshot).
            if inventory.has_engine(cid):
                engines.append(inventory.snapshot_engine(cid, self._clock.monotonic_ms()))
            await asyncio.sleep(0)
        now = self._clock.monotonic_ms()
        snapshot = Snapshot(read_id, inventory.origin, wall, tuple(engines))
        data = encode_snapshot(snapshot, now)
        if len(data) > self._snapshot_max_bytes:
            log.warning(
                "snapshot of %d bytes not written (the bound is %d)",
                len(data),
                self._snapshot_max_bytes,
            )
            self._metrics.store_snapshots.labels(action="too_large").inc()
            return False
        epoch = self._epoch if isinstance(self._epoch, (bytes, str)) else ""
        result = await put_snapshot(self._writer_conn, read_id, wall, data, epoch)
        if result == 1:
            self._note_snapshot(read_id)
            self._metrics.store_snapshots.labels(action="written").inc()
            self._metrics.store_snapshot_age.set(0)
            log.info("wrote snapshot %s (%d bytes)", read_id, len(data))
            return True
        self._metrics.store_snapshots.labels(action="stale").inc()
        return False


async def put_snapshot(
    conn: aioredis.Redis, read_id: str, wall_ms: int, data: bytes, epoch: bytes | str
) -> int:
    """The compare-and-set: 1 written, 0 an id as new or newer is there, -1 another epoch."""
    ms, seq = stream_id(read_id)
    result: Any = await conn.eval(
        _SNAPSHOT_CAS,
        3,
        SNAPSHOT_KEY,
        EPOCH_KEY,
        STREAM_KEY,
        ms,
        seq,
        read_id,
        wall_ms,
        data,
        epoch,
    )
    return int(result)


def _first_of(rows: Any) -> str | None:
    """The id of the first row of an XRANGE reply, or None for an empty stream."""
    if not rows:
        return None
    entry_id = rows[0][0]
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def _why(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text.splitlines()[0][:200]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


__all__ = [
    "RedisStore",
    "put_snapshot",
    "redis_client",
    "stream_id",
]
