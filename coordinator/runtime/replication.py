"""The inventory one replica shares with the others: recorded ops, applied in log order.

Each replica keeps the whole index in process, so a lookup never leaves it. What
changes the index of a child engine whose session this replica holds (a *local*
engine) is recorded as an op; the store (coordinator/runtime/redis_store.py)
appends the ops, in order, to one log that every replica reads in order and
applies to the engines of other replicas (*remote* engines). No Redis here: this
module is the codec and the two sides of the index, tested on plain data.

Decisions:

- The ops are the inventory core's own mutations, taken after the core accepted
  them (a refused call raises before anything is recorded): `InventoryFlow`
  orders each stream (I7-ordered-streams, `EventStreams.accept`) and its
  decisions reach the log in that order. One engine has one owning replica at a
  time, so one origin writes its ops, and log order is their order.
- A local engine wins: ops of another origin for a child engine registered here
  are ignored (the session is here, so this replica's view of it is first hand).
  An engine that moves (its replica died, it reconnected here) replaces the
  remote copy when it registers.
- Expiry instants are monotonic, and monotonic clocks differ between hosts: the
  log carries the time left, and the reader adds it to its own clock.
- Remote engines of an origin that falls silent (no heartbeat op for
  `origin_timeout_ms` on the reader's monotonic clock) are dropped: the
  inventory is advisory (I4-advisory), a forgotten block is a miss, never a
  wrong grant (a grant needs the holder's session, which the registry checks).
- An origin that starts again, or that lost ops while the store was down, sends
  a reset first, then re-announces its engines. Lease messages, hellos and call
  cancels queued meanwhile (peers.survives_reset) survive the reset: they follow
  the re-announcement.
- A replica that called an origin silent and then hears it again (it was only
  stalled or cut off) asks it, with a hello naming it, to announce its engines
  and parts again and to have its engines dump (`announce_local_again`, no
  reset: another replica that kept them ignores the repeat). Asked by the one
  that dropped them: an origin cannot know who called it silent, and asking
  for dumps after every stall of its own would cost a dump of every engine
  after each Redis blip that nobody took for silence.
"""

from __future__ import annotations

import itertools
import logging
import sys
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from coordinator.core.errors import KvrcError
from coordinator.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    InventoryEvent,
    RankKey,
    Tier,
)
from coordinator.core.inventory import ApplyResult, EngineImage, Inventory, key_probe
from coordinator.runtime.config import DEFAULT_OUTBOX_MAX_BYTES
from coordinator.runtime.peers import HELLO_AFTER_FENCE, PEER_TAGS, PeerLink, survives_reset
from coordinator.runtime.peers import OP_HELLO as PEER_HELLO  # not OP_: one tag, one module
from kvrc.vocabulary import PublishMode

log = logging.getLogger("kvrc.replication")

# Op tags (one byte each on the log): engine added, visibility, events applied,
# dump begins, dump ends, stream cleared, stream stale, engine removed, origin
# reset, origin heartbeat.
OP_ENGINE = "E"
OP_VISIBLE = "V"
OP_APPLY = "A"
OP_DUMP_BEGIN = "B"
OP_DUMP_END = "D"
OP_CLEAR = "C"
OP_STALE = "S"
OP_REMOVE = "X"
OP_RESET = "R"
OP_HEARTBEAT = "H"

Op = list[Any]
INVENTORY_TAGS = frozenset(
    (
        OP_ENGINE,
        OP_VISIBLE,
        OP_APPLY,
        OP_DUMP_BEGIN,
        OP_DUMP_END,
        OP_CLEAR,
        OP_STALE,
        OP_REMOVE,
        OP_RESET,
        OP_HEARTBEAT,
    )
)

# A store that cannot append keeps this many ops, and at most this many bytes of them
# (msgpack, as appended: a 256-block store op is 9-15 KB, so the op count alone let
# the outbox grow past the pod's memory limit); past either the remote view is rebuilt
# from a reset, a re-announcement and full dumps when the store returns.
# The byte bound is `kvrc serve --store-outbox-max-bytes` (its default in config.py).
DEFAULT_OUTBOX_LIMIT = 1_000_000
# Asked to announce again by several replicas at once (each called it silent): one
# announcement (and one round of dumps) serves every request inside this window.
REANNOUNCE_WINDOW_MS = 1_000
MAX_DEFERRED_ASKERS = 64  # names kept for the log line of a deferred announcement
# (Inside the window, a hello sent after a zombie's fence is served at its end: peers.py
# HELLO_AFTER_FENCE.)
# Origins called silent that are remembered, to be asked to announce again if heard.
EXPIRED_ORIGINS_KEPT = 1_024


def _rank(value: Any) -> RankKey | None:
    if value is None:
        return None
    tp, pp, pcp = value
    return (int(tp), int(pp), int(pcp))


def encode_events(events: Sequence[InventoryEvent], now_ms: int) -> list[list[Any]]:
    """Events as msgpack-ready lists; an expiry becomes the time left (>= 1 ms)."""
    out: list[list[Any]] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            left = max(ev.expiry_ms - now_ms, 1) if ev.expiry_ms else 0
            out.append(
                [
                    "s",
                    list(ev.block_hashes),
                    ev.parent_block_hash,
                    ev.num_tokens,
                    int(ev.tier),
                    ev.group_idx,
                    left,
                ]
            )
        elif isinstance(ev, BlockRemoved):
            out.append(["r", list(ev.block_hashes), int(ev.tier), ev.group_idx])
        else:
            out.append(["c"])
    return out


def decode_events(raw: Sequence[Any], now_ms: int) -> tuple[InventoryEvent, ...]:
    """The reader's side of `encode_events`: the time left is added to its own clock."""
    out: list[InventoryEvent] = []
    for item in raw:
        tag = item[0]
        if tag == "s":
            _, hashes, parent, num_tokens, tier, group, left = item
            out.append(
                BlockStored(
                    tuple(bytes(h) for h in hashes),
                    None if parent is None else bytes(parent),
                    int(num_tokens),
                    Tier(tier),
                    int(group),
                    now_ms + int(left) if left else 0,
                )
            )
        elif tag == "r":
            _, hashes, tier, group = item
            out.append(BlockRemoved(tuple(bytes(h) for h in hashes), Tier(tier), int(group)))
        elif tag == "c":
            out.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown event tag {tag!r}")
    return tuple(out)


def pack_ops(ops: Sequence[Op]) -> bytes:
    return msgpack.packb(ops, use_bin_type=True)  # type: ignore[no-any-return]


def _pack_op(op: Op) -> bytes:
    """One op as it goes into a log entry; an entry is an array header and its ops'
    bytes (`ReplicatedInventory.entry`): each op is packed once, when recorded."""
    return msgpack.packb(op, use_bin_type=True)  # type: ignore[no-any-return]


def _array_header(count: int) -> bytes:
    """msgpack's array header for `count` items (fixarray, array 16, array 32)."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def unpack_ops(data: bytes) -> list[Op]:
    ops = msgpack.unpackb(data, raw=False, use_list=True)
    if not isinstance(ops, list):
        raise ValueError("a log entry must hold a list of ops")
    return ops


# --- snapshots: the whole replicated view at one log position -------------------------

SNAPSHOT_VERSION = 1
# A snapshot bigger than this is not written (Redis refuses values over its
# proto-max-bulk-len, 512 MB by default): about 8 bytes per membership, so ~30 M.
DEFAULT_SNAPSHOT_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every engine a replica sees (its own and the others'), as of log entry `stream_id`.

    Loading it and then reading the log after `stream_id` gives the view of a
    replica that read the whole log (`ReplicatedInventory.load_snapshot`).
    """

    stream_id: str
    writer: str  # the origin that wrote it
    wall_ms: int  # the writer's wall clock when it was taken: its age, for a metric only
    engines: tuple[tuple[str, EngineImage], ...]  # (origin, image)

    @property
    def memberships(self) -> int:
        return sum(image.memberships for _, image in self.engines)


def _u64(values: Sequence[int]) -> bytes:
    a = array("Q", values)
    if sys.byteorder == "big":  # the format is little-endian everywhere
        a.byteswap()
    return a.tobytes()


def _from_u64(data: Any) -> tuple[int, ...]:
    if not isinstance(data, bytes) or len(data) % 8:
        raise ValueError("a packed key array must be bytes, 8 per value")
    a = array("Q")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return tuple(a)


def _left(expiries: Sequence[int], now_ms: int) -> bytes:
    # Time left, as in the log: the loader adds it to its own monotonic clock.
    return _u64([max(e - now_ms, 1) if e else 0 for e in expiries])


def _at(data: Any, now_ms: int) -> tuple[int, ...]:
    return tuple(now_ms + v if v else 0 for v in _from_u64(data))


def _rank_out(rank: Any) -> list[int] | None:
    return None if rank is None else list(rank)


def encode_snapshot(snapshot: Snapshot, now_ms: int) -> bytes:
    """msgpack; block keys as packed little-endian u64 arrays (8 bytes a membership)."""
    engines = []
    for origin, im in snapshot.engines:
        engines.append(
            [
                origin,
                im.child_engine_id,
                im.compatibility_hash,
                int(im.publish_mode),
                [list(k) for k in im.rank_keys],
                im.ready,
                im.serving,
                [_rank_out(k) for k in im.stale],
                [_rank_out(k) for k in im.dumping],
                [[g, t, _u64(keys)] for g, t, keys in im.index],
                [[g, _u64(keys), _left(exp, now_ms)] for g, keys, exp in im.expiry],
                [
                    [list(r), g, _u64(keys), bytes(tiers), _left(exp, now_ms)]
                    for r, g, keys, tiers, exp in im.parts
                ],
            ]
        )
    doc = [
        SNAPSHOT_VERSION,
        key_probe(),
        snapshot.stream_id,
        snapshot.writer,
        snapshot.wall_ms,
        engines,
    ]
    return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]


class SnapshotIncompatible(ValueError):
    """Written by a process whose block keys differ (another PYTHONHASHSEED or Python)."""


def decode_snapshot(data: bytes, now_ms: int) -> Snapshot:
    """The loader's side of `encode_snapshot`; ValueError for anything malformed."""
    try:
        doc = msgpack.unpackb(data, raw=False, use_list=True)
        version, probe, stream_id, writer, wall_ms, engines = doc
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"not a kvrc snapshot: {e}") from e
    if version != SNAPSHOT_VERSION:
        raise ValueError(f"snapshot version {version!r}, this kvrc reads {SNAPSHOT_VERSION}")
    if probe != key_probe():
        raise SnapshotIncompatible(
            "the snapshot's block keys come from another PYTHONHASHSEED (or Python build)"
        )
    out: list[tuple[str, EngineImage]] = []
    try:
        for item in engines:
            (origin, cid, compat, mode, ranks, ready, serving, stale, dumping, index,
             expiry, parts) = item  # fmt: skip
            rank_keys = tuple(k for k in (_rank(r) for r in ranks) if k is not None)
            image = EngineImage(
                str(cid),
                str(compat),
                PublishMode(mode),
                rank_keys,
                bool(ready),
                bool(serving),
                tuple(_rank(r) for r in stale),
                tuple(_rank(r) for r in dumping),
                tuple((int(g), int(t), _from_u64(keys)) for g, t, keys in index),
                tuple(_expiry(g, keys, exp, now_ms) for g, keys, exp in expiry),
                tuple(_part(r, g, keys, tiers, exp, now_ms) for r, g, keys, tiers, exp in parts),
            )
            out.append((str(origin), image))
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"malformed snapshot engine: {e}") from e
    return Snapshot(str(stream_id), str(writer), int(wall_ms), tuple(out))


def _expiry(
    group: Any, keys: Any, exp: Any, now_ms: int
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    k, e = _from_u64(keys), _at(exp, now_ms)
    if len(k) != len(e):
        raise ValueError("an expiry table's keys and expiries differ in length")
    return (int(group), k, e)


def _part(
    rank: Any, group: Any, keys: Any, tiers: Any, exp: Any, now_ms: int
) -> tuple[RankKey, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    key = _rank(rank)
    if key is None or not isinstance(tiers, bytes):
        raise ValueError("a part fact needs a rank key and tier bytes")
    k, e = _from_u64(keys), _at(exp, now_ms)
    if not len(k) == len(tiers) == len(e):
        raise ValueError("a part's keys, tiers and expiries differ in length")
    return (key, int(group), k, tuple(tiers), e)


class ReplicatedInventory(Inventory):
    """The core's `Inventory`, whose local changes are recorded for the log.

    `InventoryFlow` and `Grants` use it exactly as the plain one (a subclass, so
    the core stays the only place that decides); the store drains `outbox` and
    feeds other replicas' ops to `apply_remote`.
    """

    def __init__(
        self,
        origin: str,
        *,
        max_entries_total: int,
        max_entries_per_engine: int,
        outbox_limit: int = DEFAULT_OUTBOX_LIMIT,
        outbox_max_bytes: int = DEFAULT_OUTBOX_MAX_BYTES,
    ) -> None:
        super().__init__(
            max_entries_total=max_entries_total, max_entries_per_engine=max_entries_per_engine
        )
        self.origin = origin
        self.outbox: deque[Op] = deque()
        self.outbox_limit = outbox_limit
        self.outbox_max_bytes = outbox_max_bytes
        self.outbox_bytes = 0  # packed size of the ops in `outbox`
        self._packed: deque[bytes] = deque()  # each op packed, in outbox order
        self.outbox_overflowed = False  # ops were lost: reset and re-announce next
        # Lease messages kept across an overflow, re-queued after the re-announcement.
        self._kept: list[Op] = []
        self._kept_bytes = 0
        self.generation = 0  # bumped whenever the outbox is replaced (the writer checks it)
        self.on_record: Callable[[], None] = lambda: None  # wakes the store's writer
        self._remote: dict[str, str] = {}  # child engine -> origin replica
        self._origin_seen: dict[str, int] = {}  # origin -> reader's monotonic ms
        self._expired: dict[str, None] = {}  # origins called silent, oldest first
        # Asked to announce again (another replica had called this one silent): the store
        # asks this replica's engines for full dumps, naming who asked.
        self.on_asked_to_announce: Callable[[str], None] = lambda asker: None
        self._announced_on_request_ms: int | None = None
        # Who asked inside the window after an announcement: served by one more at its
        # end (`heartbeat`). At most MAX_DEFERRED_ASKERS names; past them, still served.
        self._deferred_askers: set[str] = set()
        # What was announced of each local engine: (compat, mode, ranks), (visible, serving).
        self._local: dict[str, tuple[Op, tuple[bool, bool]]] = {}
        # Rank parts and lease messages across replicas share this log (peers.py).
        self.peers: PeerLink | None = None

    def record(self, op: Op) -> None:
        """Appends an op of another module (coordinator/runtime/peers.py) to the outbox."""
        self._record(op)

    # --- local changes (recorded after the core accepted them) -----------------------

    def _record(self, op: Op) -> None:
        packed = _pack_op(op)
        size = len(packed)
        if not self.outbox:  # drained (or cleared by a test): the count starts again
            self.outbox_bytes = 0
            self._packed.clear()
        if not self.outbox_overflowed and (
            len(self.outbox) >= self.outbox_limit
            or self.outbox_bytes + size > self.outbox_max_bytes
        ):
            self._overflow()
        if not self.outbox_overflowed:
            self.outbox.append(op)
            self._packed.append(packed)
            self.outbox_bytes += size
        elif survives_reset(op):
            self._keep(op, size)
        self.on_record()

    def _overflow(self) -> None:
        """The outbox is full: its inventory ops go (a reset replaces them), its lease
        messages stay (a release lost here would leave a live holder pinned), and the
        rest that `survives_reset`."""
        for queued in self.outbox:
            if survives_reset(queued):
                self._keep(queued, len(_pack_op(queued)))
        self.outbox.clear()
        self._packed.clear()
        self.outbox_bytes = 0
        self.outbox_overflowed = True
        self.generation += 1

    def _keep(self, op: Op, size: int) -> None:
        if self._kept_bytes + size > self.outbox_max_bytes:
            # Bounded too: that lease times out instead (aborted or quarantined, I6-quiescence).
            log.warning("lease message %r dropped: the outbox is full", op[:2])
            return
        self._kept.append(op)
        self._kept_bytes += size

    def entry(self, count: int) -> bytes:
        """The first `count` ops of the outbox as one log entry: the bytes `pack_ops`
        gives for them, from each op's bytes packed when it was recorded."""
        return _array_header(count) + b"".join(itertools.islice(self._packed, count))

    def take_sent(self, count: int) -> None:
        """The first `count` ops of the outbox are in the log: they leave it."""
        for _ in range(count):
            self.outbox.popleft()
            self.outbox_bytes -= len(self._packed.popleft()) if self._packed else 0

    def add_engine(
        self,
        child_engine_id: str,
        compatibility_hash: str,
        *,
        publish_mode: PublishMode = PublishMode.PER_CHILD_ENGINE,
        rank_keys: Sequence[RankKey] = (),
    ) -> None:
        if child_engine_id in self._remote:  # it moved here: the session is first hand
            self._drop_remote(child_engine_id)
        super().add_engine(
            child_engine_id, compatibility_hash, publish_mode=publish_mode, rank_keys=rank_keys
        )
        op: Op = [
            OP_ENGINE,
            child_engine_id,
            compatibility_hash,
            int(publish_mode),
            [list(k) for k in rank_keys],
        ]
        self._local[child_engine_id] = (op, (False, False))
        self._record(op)

    def remove_engine(self, child_engine_id: str) -> int:
        dropped = super().remove_engine(child_engine_id)
        if self._local.pop(child_engine_id, None) is not None:
            self._record([OP_REMOVE, child_engine_id])
        return dropped

    def set_ready(self, child_engine_id: str, ready: bool) -> None:
        super().set_ready(child_engine_id, ready)
        self._record_flags(child_engine_id, ready=ready)

    def set_serving(self, child_engine_id: str, serving: bool) -> None:
        super().set_serving(child_engine_id, serving)
        self._record_flags(child_engine_id, serving=serving)

    def _record_flags(
        self, child_engine_id: str, *, ready: bool | None = None, serving: bool | None = None
    ) -> None:
        known = self._local.get(child_engine_id)
        if known is None:
            return
        old = known[1]
        flags = (old[0] if ready is None else ready, old[1] if serving is None else serving)
        if flags != old:  # InventoryFlow refreshes often
            self._local[child_engine_id] = (known[0], flags)
            # The serving flag rides as a 4th element: a replica that predates it reads
            # op[2] only (its Score then sees only engines that may lend, docs/score.md).
            self._record([OP_VISIBLE, child_engine_id, flags[0], flags[1]])

    def apply(
        self,
        child_engine_id: str,
        events: Sequence[InventoryEvent],
        *,
        rank_key: RankKey | None = None,
        now_ms: int = 0,
    ) -> ApplyResult:
        result = super().apply(child_engine_id, events, rank_key=rank_key, now_ms=now_ms)
        if child_engine_id in self._local:
            self._record(
                [
                    OP_APPLY,
                    child_engine_id,
                    None if rank_key is None else list(rank_key),
                    encode_events(events, now_ms),
                ]
            )
        return result

    def _stream_op(self, tag: str, child_engine_id: str, rank_key: RankKey | None) -> None:
        if child_engine_id in self._local:
            self._record([tag, child_engine_id, None if rank_key is None else list(rank_key)])

    def mark_stale(self, child_engine_id: str, rank_key: RankKey | None = None) -> None:
        super().mark_stale(child_engine_id, rank_key)
        self._stream_op(OP_STALE, child_engine_id, rank_key)

    def begin_dump(self, child_engine_id: str, rank_key: RankKey | None = None) -> None:
        super().begin_dump(child_engine_id, rank_key)
        self._stream_op(OP_DUMP_BEGIN, child_engine_id, rank_key)

    def end_dump(self, child_engine_id: str, rank_key: RankKey | None = None) -> None:
        super().end_dump(child_engine_id, rank_key)
        self._stream_op(OP_DUMP_END, child_engine_id, rank_key)

    def clear_stream(self, child_engine_id: str, rank_key: RankKey | None = None) -> int:
        dropped = super().clear_stream(child_engine_id, rank_key)
        self._stream_op(OP_CLEAR, child_engine_id, rank_key)
        return dropped

    # --- what the store sends on its own behalf ------------------------------------

    def heartbeat(self, now_ms: int | None = None) -> None:
        """Tells the others this replica lives; with `now_ms` (the store's health loop,
        every 500 ms), also makes the announcement deferred inside REANNOUNCE_WINDOW_MS
        at the first beat past it."""
        self._record([OP_HEARTBEAT])
        last = self._announced_on_request_ms
        if not self._deferred_askers or now_ms is None or last is None:
            return
        if 0 <= now_ms - last < REANNOUNCE_WINDOW_MS:
            return
        askers = ", ".join(sorted(self._deferred_askers))
        try:
            self._announce_on_request(askers, now_ms)
        except Exception:  # the health loop must go on (it keeps the store up)
            log.exception("the announcement deferred for %s failed", askers)

    def reannounce(self, *, reclaim: bool = False) -> None:
        """After lost ops (or a new, empty store): reset this origin, announce its engines.

        The engines' entries come back with their next events and the full dumps the
        store asks for; a block whose store event was lost is a miss on the other
        replicas meanwhile (I4-advisory). Lease messages that were queued (or kept
        over an overflow) are queued again after the re-announcement: a release must
        reach its holder (I6-quiescence). `reclaim`: the store is new, its fencing
        counter started again, so every part takes a new token (peers.py).
        """
        kept = [op for op in self.outbox if survives_reset(op)] + self._kept
        self.outbox.clear()
        self._packed.clear()
        self.outbox_bytes = 0
        self._kept = []
        self._kept_bytes = 0
        self.outbox_overflowed = False
        self.generation += 1
        self._deferred_askers.clear()  # what follows serves any deferred asker too
        self._record([OP_RESET])
        self._announce_engines()
        if self.peers is not None:
            self.peers.announce_local(reclaim=reclaim)
            # Its lost ops may have fenced (or ended) another replica's session of a part
            # it had taken from its own view (a part that moved here, then left): the
            # others announce their parts again, so it hears of any that live on.
            self.peers.hello()
        for op in kept:
            self._record(op)

    def _asked_to_announce(self, asker: str, now_ms: int, *, after_fence: bool = False) -> None:
        last = self._announced_on_request_ms
        if last is not None and 0 <= now_ms - last < REANNOUNCE_WINDOW_MS:
            # Several askers at once (replicas that heard this one again) get one
            # announcement per window. One that fenced a zombie had ignored the last
            # (the engine was its own then) and asked after it: one more at the window's
            # end (`heartbeat`) serves it, and every other such asker meanwhile.
            if after_fence and len(self._deferred_askers) < MAX_DEFERRED_ASKERS:
                self._deferred_askers.add(asker)
            return
        self._announce_on_request(asker, now_ms)

    def _announce_on_request(self, asker: str, now_ms: int) -> None:
        self._announced_on_request_ms = now_ms
        self._deferred_askers.clear()  # served by this one
        log.warning("replica %s had called this one silent: announcing its engines again", asker)
        self.announce_local_again()
        self.on_asked_to_announce(asker)

    def announce_local_again(self) -> None:
        """Another replica called this one silent (nothing it queued was lost): its
        engines and parts again, no reset. The replica that asked takes them back
        (their blocks with the full dumps the store asks for); one that did not
        drop them already holds them and ignores the repeat."""
        self._announce_engines()
        if self.peers is not None:
            self.peers.announce_local()

    def _announce_engines(self) -> None:
        for child_engine_id, (op, (visible, serving)) in self._local.items():
            self._record(list(op))
            if visible or serving:
                self._record([OP_VISIBLE, child_engine_id, visible, serving])

    # --- the other replicas' ops --------------------------------------------------------

    def caught_up(self) -> None:
        """The store read the log up to its end for the first time (peers.py)."""
        if self.peers is not None:
            for owner in self.peers.caught_up():
                self._origin_seen.setdefault(owner, 0)  # silence counts from following

    def called_silent(self, origin: str) -> bool:
        """Another replica called silent here and not heard from since (the last
        EXPIRED_ORIGINS_KEPT)."""
        return origin in self._expired

    def origin_alive(self, origin: str) -> bool:
        """Another replica heard from within the silence timeout (or this replica itself)."""
        return origin == self.origin or origin in self._origin_seen

    def remote_engines(self) -> dict[str, str]:
        return dict(self._remote)

    def apply_remote(self, origin: str, ops: Sequence[Op], now_ms: int) -> int:
        """Applies one log entry of another origin; returns the ops applied.

        A malformed op or one the core refuses is logged and skipped: the log is
        written only by replicas, so this is a bug or a version skew, and one bad op
        must not stop a replica from following the others.
        """
        if origin == self.origin:
            return 0
        if origin not in self._origin_seen and origin in self._expired:
            del self._expired[origin]
            # Called silent here, yet alive: its engines and parts left this view and
            # nothing re-announces them by itself (its later ops name engines unknown here).
            log.info(
                "replica %s, called silent here, is heard again: asking it to announce", origin
            )
            self._record([PEER_HELLO, origin])
        self._origin_seen[origin] = now_ms
        applied = 0
        for op in ops:
            try:
                if self._apply_one(origin, op, now_ms):
                    applied += 1
            except Exception as e:  # any: one bad op must not stop the reader (docstring)
                log.warning("replicated op %.80r of %s skipped: %r", op, origin, e)
        return applied

    def _apply_one(self, origin: str, op: Op, now_ms: int) -> bool:
        tag = op[0]
        if tag == OP_HEARTBEAT:
            return True
        if tag == OP_RESET:
            for cid in [c for c, o in self._remote.items() if o == origin]:
                self._drop_remote(cid)
            if self.peers is not None:
                self.peers.origin_reset(origin, f"replica {origin} reset its state")
            return True
        if tag == PEER_HELLO and len(op) > 1 and op[1] == self.origin:
            after_fence = len(op) > 2 and op[2] == HELLO_AFTER_FENCE
            self._asked_to_announce(origin, now_ms, after_fence=after_fence)
            return True
        if tag in PEER_TAGS:
            return self.peers.apply(origin, op) if self.peers is not None else False
        cid = str(op[1])
        if cid in self._local:
            return False  # a local engine wins (module doc)
        if tag == OP_ENGINE:
            _, _, compat, mode, ranks = op
            if self._remote.get(cid) == origin:
                return False  # a re-announcement of what is already here
            if cid in self._remote:
                self._drop_remote(cid)  # it moved to another replica
            Inventory.add_engine(
                self,
                cid,
                str(compat),
                publish_mode=PublishMode(mode),
                rank_keys=[k for k in (_rank(r) for r in ranks) if k is not None],
            )
            self._remote[cid] = origin
            return True
        if self._remote.get(cid) != origin:
            return False  # an engine this replica does not know from that origin
        if tag == OP_VISIBLE:
            Inventory.set_ready(self, cid, bool(op[2]))
            # Older replicas send no serving flag: a visible engine serves.
            Inventory.set_serving(self, cid, bool(op[3]) if len(op) > 3 else bool(op[2]))
        elif tag == OP_APPLY:
            Inventory.apply(
                self, cid, decode_events(op[3], now_ms), rank_key=_rank(op[2]), now_ms=now_ms
            )
        elif tag == OP_DUMP_BEGIN:
            Inventory.begin_dump(self, cid, _rank(op[2]))
        elif tag == OP_DUMP_END:
            Inventory.end_dump(self, cid, _rank(op[2]))
        elif tag == OP_CLEAR:
            Inventory.clear_stream(self, cid, _rank(op[2]))
        elif tag == OP_STALE:
            Inventory.mark_stale(self, cid, _rank(op[2]))
        elif tag == OP_REMOVE:
            self._drop_remote(cid)
        else:
            raise ValueError(f"unknown op tag {tag!r}")
        return True

    # --- snapshots ------------------------------------------------------------------

    def snapshot(self, stream_id: str, wall_ms: int, now_ms: int) -> Snapshot:
        """Every engine of this view, labelled with the last log entry read (`stream_id`).

        This replica's own engines may be ahead of `stream_id` (ops in its outbox or
        appended but not read back yet): those ops are in the log after `stream_id`,
        and a loader that applies them again ends in the same state, since every op
        sets the state of what it names (store/remove a block, clear, dump, flags).
        """
        engines = [self.snapshot_engine(cid, now_ms) for cid in self.engine_ids()]
        return Snapshot(stream_id, self.origin, wall_ms, tuple(engines))

    def snapshot_engine(self, child_engine_id: str, now_ms: int) -> tuple[str, EngineImage]:
        """(origin, image) of one engine. A snapshot taken engine by engine while the log
        moves on is still exact once the tail is applied, by the argument above: each
        image is at or after the snapshot's `stream_id`."""
        origin = self._remote.get(child_engine_id, self.origin)
        return origin, self.export_engine(child_engine_id, now_ms)

    def load_snapshot(self, snapshot: Snapshot, now_ms: int) -> int:
        """Replaces the other replicas' engines with the snapshot's; returns engines loaded.

        This replica's own engines stay (first hand), and so do its own origin's
        entries in the snapshot's place (a replica never applies its own ops).
        """
        self.drop_all_remote("a snapshot was loaded")
        loaded = 0
        for origin, image in snapshot.engines:
            if origin == self.origin or image.child_engine_id in self._local:
                continue
            if self.has_engine(image.child_engine_id):
                continue  # a malformed snapshot naming one engine twice
            try:
                self.restore_engine(image)
            except KvrcError as e:  # written by a replica: a bug or a version skew
                log.warning("snapshot engine %r skipped: %s", image.child_engine_id, e)
                continue
            self._remote[image.child_engine_id] = origin
            # Liveness starts now, on this clock, as if the origin had just been heard.
            self._origin_seen[origin] = now_ms
            loaded += 1
        # Parts are not in the snapshot: drop_all_remote's hello has their replicas
        # announce them.
        return loaded

    def expire_silent_origins(
        self, now_ms: int, timeout_ms: int, following_since_ms: int = 0
    ) -> int:
        """Drops the engines of origins not heard from within `timeout_ms`. Returns them.

        `following_since_ms`: since when this replica has read the log without a gap
        (a failure, a pause, a stall of its own). Silence before it proves nothing
        (this replica could not have heard anybody), so an origin's silence counts
        from the later of its last op and that instant.
        """
        silent = {
            o
            for o, seen in self._origin_seen.items()
            if now_ms - max(seen, following_since_ms) > timeout_ms
        }
        dropped = 0
        for cid in [c for c, o in self._remote.items() if o in silent]:
            self._drop_remote(cid)
            dropped += 1
        for origin in silent:
            del self._origin_seen[origin]
            self._expired[origin] = None
            while len(self._expired) > EXPIRED_ORIGINS_KEPT:
                del self._expired[next(iter(self._expired))]
            if self.peers is not None:
                self.peers.origin_gone(origin, f"replica {origin} fell silent")
                self.peers.origin_silent(origin)
        return dropped

    def drop_all_remote(self, reason: str, store_lost: bool = False) -> int:
        """This replica lost track of the log (a store loss, a snapshot reload): forget
        every other replica's engines; their parts are unaccounted for until their
        replicas announce again (peers.py `PeerLink.forget_all`, which asks them)."""
        count = len(self._remote)
        for cid in list(self._remote):
            self._drop_remote(cid)
        # Each origin heard before stays watched, as if last heard before this replica
        # follows the log again: one never heard again is called silent, and its
        # unaccounted parts are gone with it (`PeerLink.origin_silent`).
        heard = list(self._origin_seen)
        self._origin_seen = dict.fromkeys(heard, 0)
        self._expired.clear()  # every replica re-announces after a store loss anyway
        if self.peers is not None:
            self.peers.forget_all(reason, store_lost)
        return count

    def _drop_remote(self, child_engine_id: str) -> None:
        del self._remote[child_engine_id]
        if self.has_engine(child_engine_id):
            Inventory.remove_engine(self, child_engine_id)


__all__ = [
    "DEFAULT_OUTBOX_LIMIT",
    "DEFAULT_SNAPSHOT_MAX_BYTES",
    "OP_HEARTBEAT",
    "ReplicatedInventory",
    "Snapshot",
    "SnapshotIncompatible",
    "decode_events",
    "decode_snapshot",
    "encode_events",
    "encode_snapshot",
    "pack_ops",
    "unpack_ops",
]
