"""Scheduler side of KvrcConnector (runs in vLLM's EngineCore process).

It makes the kvrc calls that happen once per request: BeginHandoff (decode),
Lookup and RequestPrefixLoad (prefix reuse); it turns finished prefill requests
into handoffs (`request_finished` -> `delay_free=True` + kv_transfer_params in
vLLM's Mooncake/NIXL field names); and it pins the holder side's blocks in vLLM's
own block pool when kvrc asks (see `pool.py`). The workers do the per-rank work
(publish, pull, report), driven by the step's metadata.

The scheduler never waits on kvrc for longer than `lookup_timeout_ms`; past it,
it does no load, and new requests skip kvrc for a while (`KvrcBreaker`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from clients.errors import (
    DeadlineExceededError,
    KvrcClientError,
    UnavailableError,
    first_refusal,
    outcome_unknown,
    refuses_the_engine,
)
from clients.inventory import LookupClient, LookupOutcome
from clients.leases import (
    HandoffGrant,
    HandoffKeepAlive,
    LeaseClient,
    Miss,
    PrefixLoadGrant,
    handoff_still_open,
    publish_rounds,
)
from clients.vllm.config import KvrcConnectorConfig, vllm_instance_id
from clients.vllm.loop import BackgroundLoop, WarnLimit, control_socket_path, trace
from clients.vllm.metadata import (
    HANDOFF_REFUSED_FOR_THE_ENGINE,
    KvrcConnectorMetadata,
    KvrcWorkerMetadata,
    LoadSpec,
    PublishSpec,
)
from clients.vllm.pool import PoolPins
from kvrc.credentials import connect
from kvrc.kv_params import encode_kv_transfer_params
from kvrc.vocabulary import MAX_CHAIN_BLOCKS, vllm_int_hash_key

if TYPE_CHECKING:
    from clients.kv_cache import KvEndpointDescription

log = logging.getLogger("kvrc.vllm.scheduler")

RPC_TIMEOUT_S = 10.0
# The longest an idle step (nothing scheduled, kvrc work pending) yields the CPU.
IDLE_STEP_WAIT_S = 0.002
# ... when it waits for a grant (it ends as soon as one arrives).
GRANT_WAIT_S = 0.01
# ... and when it only holds handoffs for their release (frees come a little later).
RELEASE_WAIT_S = 0.02
# kv_transfer_params keys kvrc adds (vLLM's own keys keep their meaning)
KVRC_MARK = "kvrc_handoff"
# A prefix grant with less than this left before its deadline is not pulled (recompute):
# kvrc is about to abort the lease, and the read would run past it.
MIN_PULL_S = 0.05
# The lookup breaker's backoff: after a lookup times out or kvrc is unavailable, new
# requests skip kvrc (recompute) this long, doubling while the next try fails.
BREAKER_BASE_S = 1.0
BREAKER_MAX_S = 30.0
# The handoff breaker's pauses (KvrcScheduler.handoff_breaker).
HANDOFF_BREAKER_BASE_S = 0.5
HANDOFF_BREAKER_MAX_S = 2.0
# Counts no scheduler step follows reach the stats file within this (a step writes it).
STATS_FLUSH_S = 0.1


def block_hash_key(block_hash: Any) -> bytes:
    """vLLM's request block hash -> the key form kvrc's inventory holds.

    vLLM's KV events carry `maybe_convert_block_hash(hash)`: the low 64 bits as
    an int by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), or the full
    bytes; kvrc stores an int as 8 bytes big-endian. Same conversion, same key,
    with the flag read once (`int_block_hashes`): vLLM's function reads it per call,
    and this runs per block cached and per block of a prompt.
    """
    if int_block_hashes():
        return vllm_int_hash_key(block_hash)
    return bytes(block_hash)


@functools.cache
def int_block_hashes() -> bool:
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES as vLLM reads it (`vllm.envs`), read once.

    vLLM fixes its env values once the engine has started (`enable_envs_cache`, at the
    end of EngineCore's start); KvrcScheduler reads it at construction, within that
    start, so every key uses the value vLLM's events use."""
    from vllm import envs  # type: ignore[import-not-found]

    return bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)


async def _socket_answers(path: str) -> bool:
    """Whether a unix socket at `path` has a listener (a file left by a crash has none)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout=2)
    except TimeoutError:  # a listener too busy to accept is still one (OSError's subclass)
        return True
    except OSError:
        return False  # refused, no file, not a socket
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _trace_done(event: str, request_id: str, _future: concurrent.futures.Future[Any]) -> None:
    trace(event, request_id)


@dataclass
class _Recv:
    request_id: str
    flow: str
    local_block_ids: list[int]
    skip: int
    num_tokens: int
    grant: concurrent.futures.Future[Any] | None = None
    lease_id: str = ""
    test_fault: str = ""
    keepalive: HandoffKeepAlive | None = None
    started: float = field(default_factory=time.monotonic)
    # A worker's failed outcome, kept until every worker has reported the load: with
    # tp > 1 the workers may finish in different steps, and vLLM lists the request in
    # finished_recving only in the last one's.
    failure: str = ""


@dataclass(frozen=True)
class _Prefix:
    """A prefix load decided in get_num_new_matched_tokens, waiting for its blocks."""

    grant: PrefixLoadGrant
    local_blocks: int  # blocks of the local prefix-cache hit
    load_blocks: int  # blocks to load after them


@dataclass
class _Lookup:
    """A Lookup + grant out for a waiting request (get_num_new_matched_tokens)."""

    answer: concurrent.futures.Future[Any]
    usable_blocks: int  # of the prompt's blocks, what the lookup asked for
    asked_at: float  # monotonic s
    give_up_at: float  # lookup_timeout_ms after it was asked
    deferred: bool = False  # left to a later step at least once


# A refusal whose code usually stands for the engine (`refuses_the_engine`) opens a
# breaker only when this many come in a row with no answer between: the same codes
# also refuse one request alone (a request id that loaded before, one handoff's
# descriptor, one request's payload).
REFUSALS_IN_A_ROW = 3


class RefusalRun:
    """Refusals for the engine in a row; any answer ends the run."""

    def __init__(self) -> None:
        self.count = 0

    def refused(self, n: int = 1) -> bool:
        """`n` more; True once the run is long enough to take for the engine's."""
        self.count += n
        return self.count >= REFUSALS_IN_A_ROW

    def answered(self) -> None:
        self.count = 0


class KvrcBreaker:
    """Skips kvrc calls of one kind (lookups; handoffs) for a while after one timed out
    or found kvrc unavailable.

    A frozen or unreachable kvrc would otherwise make every new request wait for it
    before it recomputes. Open: the calls are skipped (recompute) until the backoff
    ends; the next one then tries kvrc again (one per backoff), which closes the
    breaker or opens it for twice as long (up to `max_s`). Calls made before the last
    failure that fail after it are the same outage: they change nothing.
    """

    def __init__(self, base_s: float = BREAKER_BASE_S, max_s: float = BREAKER_MAX_S) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.is_open = False
        self.backoff_s = 0.0
        self._until = 0.0
        self._failed_at = 0.0

    def allows(self, now: float) -> bool:
        if now < self._until:
            return False
        if self.is_open:
            # One lookup tries kvrc; the next waits another backoff unless it answers
            # first (lookups are asynchronous: many would try within its timeout).
            self._until = now + self.backoff_s
        return True

    def failed(self, now: float, asked_at: float) -> bool:
        """A lookup asked at `asked_at` failed; True when this opened the breaker."""
        if self.is_open and asked_at < self._failed_at:
            return False  # out when the breaker opened (or last failed): the same outage
        opened = not self.is_open
        self.backoff_s = self.base_s if opened else min(self.backoff_s * 2, self.max_s)
        self._until = now + self.backoff_s
        self._failed_at = now
        self.is_open = True
        return opened

    def succeeded(self) -> bool:
        """kvrc answered; True when this closed the breaker."""
        closed = self.is_open
        self.is_open = False
        self.backoff_s = 0.0
        self._until = 0.0
        return closed


class KvrcScheduler:
    def __init__(self, vllm_config: Any, config: KvrcConnectorConfig, identity: Any) -> None:
        self.vllm_config = vllm_config
        # vLLM's id of this engine instance, the same in its workers (they get this
        # config): a worker of another instance is refused (`_handle_worker`).
        self.instance_id = vllm_instance_id(vllm_config)
        self.config = config
        self.identity = identity
        self.child_engine_id: str = identity.child_engine_id
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        kv = vllm_config.kv_transfer_config
        self.kv_role = kv.kv_role
        self.kv_port = int(kv.kv_port)
        self.loop = BackgroundLoop("kvrc-scheduler")
        self._lock = threading.Lock()
        # Loads in flight, until vLLM hears they finished (finished_recving); of them,
        # those whose grant no step took yet, and those granted since the last step: a
        # step looks only at what changed, not at every load in flight.
        self._recv: dict[str, _Recv] = {}
        self._awaiting_grant: dict[str, _Recv] = {}
        self._granted: list[_Recv] = []
        # Set by every grant and lookup answer: ends an idle step's wait for kvrc.
        self._kvrc_answered = threading.Event()
        self._prefix: dict[str, _Prefix] = {}
        self._prefix_decided: dict[str, int] = {}  # request id -> tokens (0: no load)
        self._lookups: dict[str, _Lookup] = {}  # waiting requests' lookups still out
        # What the current scheduler step may still wait for lookups (build_connector_meta
        # starts each step's afresh): a slow kvrc costs a step this much, not per request.
        self._step_wait_left_s = self.config.lookup_step_wait_ms / 1000
        self._publishes: list[PublishSpec] = []
        self._free_now: list[str] = []
        self._sending: dict[str, float] = {}
        # Handoffs published from here (every rank part's descriptor, from the workers'
        # endpoints): lease id -> request id, until kvrc's release (or handoff_hold_s).
        self._endpoints: dict[int, KvEndpointDescription] = {}  # tp rank -> its endpoint
        self._handoff_leases: dict[str, str] = {}
        self._released_early: dict[str, None] = {}
        self._held_new: list[tuple[str, str]] = []  # (lease id, reserved decode or "")
        # Leases this side's safety nets freed (a hold's end, a pin past its deadline):
        # the workers stop announcing them as held.
        self._unheld_new: list[str] = []
        self.counters: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._stats_dirty = False  # counted since the stats file was last written
        self._stats_flush_armed = False  # the loop writes it within _stats_flush_s
        self._stats_flush_s = STATS_FLUSH_S
        self.breaker = KvrcBreaker()
        # The P/D path's own: after kvrc was unreachable for a publish or a begin, a
        # prefill offers no handoff (vLLM frees the blocks; the decode recomputes) and
        # a decode begins none (it recomputes at once), one try per backoff. Without
        # it every finished prefill held its blocks for handoff_hold_s, and every
        # decode waited handoff_wait_ms and more, while kvrc was down.
        # Short pauses: a decode that skips a handoff a prefill published after kvrc came
        # back leaves the prefill's blocks pinned until kvrc fails the handoff.
        self.handoff_breaker = KvrcBreaker(HANDOFF_BREAKER_BASE_S, HANDOFF_BREAKER_MAX_S)
        self._lookup_refusals = RefusalRun()  # on the EngineCore thread
        self._handoff_refusals = RefusalRun()  # under self._lock
        self._warn_limit = WarnLimit()  # warnings that requests repeat
        int_block_hashes()  # read now, as vLLM's events will use it
        # Steps vLLM may have scheduled and not yet run: a block is pinnable only once
        # the step that cached it ran (PoolPins).
        steps_in_flight = int(getattr(vllm_config, "max_concurrent_batches", 1) or 1)
        self.pins = PoolPins(block_hash_key, steps_in_flight=steps_in_flight)
        self.loop.run(self._connect(), timeout_s=10)
        try:
            self.loop.run(self._serve_workers(), timeout_s=10)
        except BaseException:
            self.shutdown()  # no server of ours: the socket, if any, is another engine's
            raise

    async def _connect(self) -> None:
        options = self.config.channel_options()
        self._channel = connect(options)
        self.leases = LeaseClient(self._channel, self.child_engine_id, timeout_s=RPC_TIMEOUT_S)
        self.lookups = LookupClient(options, channel=self._channel)

    def bind_pool(self, pool: Any, manager: Any = None) -> None:
        if not self.pins.bound:
            self.pins.bind(pool, manager)

    # --- the workers' requests (holder pins) ---------------------------------------

    async def _serve_workers(self) -> None:
        from clients.refengine.channel import Channel

        path = control_socket_path(self.child_engine_id)

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            channel = Channel(reader, writer, self._handle_worker, name="kvrc-worker")
            channel.start()

        # Listening under a name of its own first, then linked to the engine's path: a
        # link never replaces a file, so of two engines that start at once with one
        # engine_id, one takes the path and the other finds it answering.
        staging = f"{path}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        server = await asyncio.start_unix_server(accept, staging)
        try:
            for _ in range(3):
                try:
                    os.link(staging, path)
                    break
                except FileExistsError:
                    if await _socket_answers(path):
                        # Unlinking it would send the other engine's workers' pin
                        # requests here, for blocks of another cache.
                        raise RuntimeError(
                            f"KvrcConnector: another engine on this host already serves "
                            f"engine {self.child_engine_id!r} (its control socket {path} "
                            "answers); give each vLLM instance its own kv_transfer_config "
                            "engine_id"
                        ) from None
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)  # a previous incarnation's, no longer served
            else:
                raise RuntimeError(f"KvrcConnector: could not take the control socket {path}")
        except BaseException:
            server.close()
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
        self._server = server
        self._expirer = asyncio.create_task(self._expire_pins())

    async def _handle_worker(self, op: str, args: dict[str, Any]) -> Any:
        instance = str(args.get("instance", ""))
        if instance and self.instance_id and instance != self.instance_id:
            # A worker of another vLLM instance with this engine_id (it reached this
            # socket first): its pins would name this cache's blocks.
            raise ValueError(
                f"a worker of vLLM instance {instance!r} is not one of this engine's "
                f"({self.instance_id!r}): engine_id {self.child_engine_id!r} is taken"
            )
        if op == "pin":
            block_ids = self.pins.pin(
                str(args["lease_id"]), [bytes(h) for h in args["hashes"]], int(args["deadline_ms"])
            )
            self._count("pins" if block_ids else "pin_misses")
            return block_ids
        if op == "unpin":  # a pin its worker stopped waiting for (kvrc heard a miss)
            undone = self.pins.release(str(args["lease_id"]))
            if undone:
                self._count("late_pins_undone")
            return undone
        if op == "release":
            lease_id = str(args["lease_id"])
            released = self.pins.release(lease_id)
            if released:
                self._count("pins_released")
                return True
            return self._handoff_released(lease_id)
        if op == "hello":
            from clients.kv_cache import KvEndpointDescription

            # Parsed once: every publish of this rank describes it.
            endpoint = KvEndpointDescription.from_json(str(args["endpoint"]))
            self._endpoints[int(args["tp_rank"])] = endpoint
            return True
        if op == "quarantine":  # no safety net frees its pin or handoff (clients/holds.py)
            self.pins.quarantine(str(args["lease_id"]))
            return True
        raise ValueError(f"unknown worker request {op!r}")

    def _handoff_released(self, lease_id: str) -> bool:
        """kvrc released a handoff published from here (any rank's release proves quiescence)."""
        with self._lock:
            request_id = self._handoff_leases.pop(lease_id, None)
            if request_id is None:
                self._released_early[lease_id] = None  # the publish answer may still come
                while len(self._released_early) > 4096:
                    del self._released_early[next(iter(self._released_early))]
                return False  # the worker records it too: its own publish may name it
            if request_id in self._sending:
                self._free_now.append(request_id)
            # The workers may not have been told to hold it yet (`_held_new` goes out with
            # the next step, which kvrc's release can beat): untracked after it, in the
            # same step, so no worker keeps announcing a released lease as held.
            self._unheld_new.append(lease_id)
        return True

    async def _publish_all(self, spec: PublishSpec) -> None:
        """PublishHandoff for every rank part at once, before the prefill's answer is out."""

        def one(rank: int) -> Any:
            return self._publish_part(spec, rank)

        def held() -> bool:
            # Released by kvrc once an answer named the lease: a repeat would only open a
            # stray handoff for blocks about to be freed.
            named = {a.lease_id for a in answers if not isinstance(a, BaseException)}
            with self._lock:
                released = any(lease_id in self._released_early for lease_id in named)
                return spec.request_id in self._sending and not released

        loop = asyncio.get_running_loop()
        hold_ends = loop.time() + self.config.handoff_hold_s
        answers: list[Any] = []
        failures: list[BaseException] = []
        asked_at = time.monotonic()
        async for attempt, answers in publish_rounds(one, self.tp_size, hold_ends, held):
            failures = [a for a in answers if isinstance(a, BaseException)]
            if attempt == 0:
                # A publish never waits at kvrc: a deadline is a kvrc that did not answer.
                unreachable = [
                    e for e in failures if isinstance(e, UnavailableError | DeadlineExceededError)
                ]
                if unreachable:
                    self._handoff_kvrc_failed(f"PublishHandoff: {unreachable[0]}", asked_at)
                elif len(failures) < len(answers):
                    self._handoff_kvrc_answered()
            if not failures or attempt > 0:
                continue
            self._count("handoff_publish_failures")
            refusal = first_refusal(failures)
            if refusal is not None:
                if refuses_the_engine(refusal):
                    # Not ready, draining, unknown: the next handoffs would be refused
                    # too, and each decode would wait its whole handoff wait for them.
                    self._handoff_refused(f"PublishHandoff refused: {refusal}", asked_at)
                # kvrc refused a part's first publish: the handoff never goes READY, no
                # decode reads, whatever the other parts' outcome. A repeat's refusal
                # proves nothing (the first may have been recorded and read; a repeat is
                # refused while the engine is not ready): the hold stays (I6-quiescence).
                log.warning(
                    "handoff %s not published: %s; freeing its blocks", spec.handoff_id, refusal
                )
                with self._lock:
                    self._free_now.append(spec.request_id)
                return
            # kvrc may have recorded every part (only the answer was lost): a decode may
            # be granted these blocks, so they are held as a published handoff's are,
            # and the parts without an answer go again (I6-quiescence).
            log.warning(
                "handoff %s: publish outcome unknown (%s); holding its blocks",
                spec.handoff_id,
                next(e for e in failures if outcome_unknown(e)),
            )
            self._count("handoff_publish_unknown")
        results = [a for a in answers if not isinstance(a, BaseException)]
        if not any(r.lease_id for r in results) and failures:
            # never named: the hold's time is all it gets
            loop.call_at(hold_ends, self._free_unknown_publish, spec.request_id)
            return
        trace("published", spec.request_id)
        self._count("handoffs_published")
        lease_id = next((r.lease_id for r in results if r.lease_id), "")
        ended = any(r.ended for r in results)
        with self._lock:
            released_first = lease_id in self._released_early  # kvrc was quicker than us
            self._released_early.pop(lease_id, None)
            if ended or not lease_id or released_first:
                self._free_now.append(spec.request_id)
                return
            self._handoff_leases[lease_id] = spec.request_id
            self._held_new.append((lease_id, spec.decode_child_engine_id))
        self._arm_hold(lease_id, spec)

    async def _publish_part(self, spec: PublishSpec, rank: int) -> Any:
        from clients.transfer import rank_part_descriptor

        endpoint = self._endpoints[rank]
        return await self.leases.publish_handoff(
            spec.handoff_id,
            descriptor=rank_part_descriptor(endpoint, spec.block_ids, tp_rank=rank),
            kv_transfer_params=spec.kv_transfer_params,
            num_blocks=len(spec.block_ids),
            decode_child_engine_id=spec.decode_child_engine_id,
        )

    def _arm_hold(self, lease_id: str, spec: PublishSpec) -> None:
        self.loop.spawn_later(
            self.config.handoff_hold_s, lambda: self._hold_expired(lease_id, spec)
        )

    def _free_unknown_publish(self, request_id: str) -> None:
        with self._lock:
            self._free_now.append(request_id)
        log.info("handoff of %s (publish outcome unknown) freed after its hold", request_id)

    async def _hold_expired(self, lease_id: str, spec: PublishSpec) -> None:
        if self.pins.is_quarantined(lease_id):
            return  # kept until kvrc's release (I6-quiescence)
        with self._lock:
            if lease_id not in self._handoff_leases:
                return  # released already
        if await handoff_still_open(lease_id, lambda: self._publish_part(spec, 0)):
            # A decode may be reading these blocks now: kvrc's release or quarantine
            # decides them, not the clock (I6-quiescence).
            log.info("handoff lease %s still open at kvrc: its hold goes on", lease_id)
            self._count("handoff_hold_extended")
            with self._lock:
                still_held = lease_id in self._handoff_leases
            if still_held:
                self._arm_hold(lease_id, spec)
            return
        with self._lock:
            request_id = self._handoff_leases.pop(lease_id, None)
            if request_id is None:
                return
            self._free_now.append(request_id)
            self._unheld_new.append(lease_id)
        log.warning("handoff lease %s never released; freeing %s", lease_id, request_id)
        self._count("handoff_hold_expired")

    async def _expire_pins(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for lease_id in self.pins.expire():
                with self._lock:
                    self._unheld_new.append(lease_id)
                self._count("pins_expired")

    # --- counters ------------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        """Counts; the stats file is written once a step (`build_connector_meta`), by the
        loop within STATS_FLUSH_S for counts no step follows (a pin on an idle holder, an
        abort), and at shutdown: not once per count (it was, under the lock the loop's
        pins take too)."""
        with self._stats_lock:
            self.counters[key] += n
            if not self.config.stats_file:
                return
            self._stats_dirty = True
            arm = not self._stats_flush_armed
            self._stats_flush_armed = True
        if arm:
            self.loop.call_soon(self._arm_stats_flush)

    def _arm_stats_flush(self) -> None:
        self.loop.loop.call_later(self._stats_flush_s, self._stats_flush_due)

    def _stats_flush_due(self) -> None:
        with self._stats_lock:
            self._stats_flush_armed = False
        self._write_stats()

    def _write_stats(self) -> None:
        """Both threads count (the EngineCore's steps, the loop's pins) and write: one
        lock, so that no count is lost and two writers never share the temporary file.
        Nothing counted since the last write: nothing written."""
        with self._stats_lock:
            if not self._stats_dirty:
                return
            self._stats_dirty = False
            data = {"child_engine_id": self.child_engine_id, **self.counters}
            tmp = f"{self.config.stats_file}.{os.getpid()}.tmp"
            with contextlib.suppress(OSError):
                with open(tmp, "w") as f:
                    json.dump(data, f, sort_keys=True)
                os.replace(tmp, self.config.stats_file)

    # --- get_num_new_matched_tokens ------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            if not params.get(KVRC_MARK):
                return 0, False  # not a kvrc handoff: nothing for this connector
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0 and not self._handoff_allowed():
                self._count("handoff_begins_skipped")  # kvrc was unreachable just now
                return 0, False
            trace("matched", request.request_id)
            return (count, True) if count > 0 else (0, False)
        if self.config.reuse:
            tokens = self._prefix_tokens(request, num_computed_tokens)
            if tokens is None:
                return None, False  # kvrc has not answered yet: vLLM asks again next step
            return (tokens, True) if tokens > 0 else (0, False)
        return 0, False

    def _prefix_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """One Lookup + grant, bounded by lookup_timeout_ms; 0 = recompute, None = not
        answered yet (the request waits; vLLM schedules others and asks again).

        The EngineCore thread runs this inside vLLM's schedule(): it waits for kvrc at
        most `lookup_step_wait_ms` per step in all, so a slow kvrc delays the requests
        that wait for it, never the running ones (a wait per request stalled every
        step by the number of new requests times kvrc's latency)."""
        request_id = request.request_id
        local_blocks = num_computed_tokens // self.block_size
        if request_id in self._prefix_decided or request_id in self._prefix:
            # (A grant waiting for its blocks whose decision the cap on decisions dropped
            # is still this request's: a new lookup would leave it pinned.)
            return self._prefix_again(request_id, local_blocks, num_computed_tokens)
        lookup = self._lookups.get(request_id)
        if lookup is None:
            prompt_len = len(request.prompt_token_ids or ())
            # Never the last prompt token (vLLM must compute one), whole blocks only, and
            # no more than kvrc takes in one chain (MAX_CHAIN_BLOCKS: a long prompt reuses
            # its first blocks, where a longer chain would be INVALID_ARGUMENT).
            usable_blocks = min(
                len(request.block_hashes), (prompt_len - 1) // self.block_size, MAX_CHAIN_BLOCKS
            )
            if usable_blocks - local_blocks < self.config.min_blocks or getattr(
                request, "skip_reading_prefix_cache", False
            ):
                # (vLLM reads no cached prefix for it, e.g. prompt_logprobs: it would
                # turn any answer into 0 and never ask again.)
                self._decide(request_id, 0)
                return 0
            if not self.breaker.allows(time.monotonic()):
                self._count("prefix_lookups_skipped")  # kvrc timed out or was down just now
                self._decide(request_id, 0)
                return 0
            hashes = [block_hash_key(h) for h in request.block_hashes[:usable_blocks]]
            fault, _, value = self._test_fault(request.kv_transfer_params or {}).partition("=")
            delay_s = min(float(value), 60.0) if fault == "delay-lookup" else 0.0
            future = self.loop.submit(
                self._lookup_and_grant(request_id, hashes, local_blocks, delay_s)
            )
            asked_at = time.monotonic()
            give_up_at = asked_at + self.config.lookup_timeout_ms / 1000
            lookup = _Lookup(future, usable_blocks, asked_at, give_up_at)
            self._lookups[request_id] = lookup
            future.add_done_callback(self._kvrc_answer_came)
        if not lookup.answer.done():
            wait_s = min(self._step_wait_left_s, lookup.give_up_at - time.monotonic())
            if wait_s > 0:
                started = time.monotonic()
                concurrent.futures.wait([lookup.answer], wait_s)
                self._step_wait_left_s -= time.monotonic() - started
        if not lookup.answer.done():
            if time.monotonic() < lookup.give_up_at:
                if not lookup.deferred:
                    lookup.deferred = True
                    self._count("prefix_lookups_deferred")
                return None
            # Past the deadline: no load. A grant that still comes is given back.
            del self._lookups[request_id]
            self._count("prefix_lookup_timeouts")
            lookup.answer.add_done_callback(self._abandon_late)
            self._lookup_failed(
                f"no answer within {self.config.lookup_timeout_ms} ms", lookup.asked_at
            )
            self._decide(request_id, 0)
            return 0
        del self._lookups[request_id]
        return self._prefix_answered(request_id, lookup, local_blocks)

    def _prefix_answered(self, request_id: str, lookup: _Lookup, local_blocks: int) -> int:
        """kvrc's answer to a request's lookup: the tokens to load (0 = recompute). The
        local hit may have changed since the lookup was asked (it waited steps): the
        grant serves any hit below its end (the holder pinned the chain from block 0)."""
        try:
            answer = lookup.answer.result()
        except Exception as e:  # recompute
            self._count("prefix_lookup_errors")
            answer = None
            if isinstance(e, UnavailableError | DeadlineExceededError):  # kvrc down
                log.debug("prefix lookup for %s failed: %s", request_id, e)
                self._lookup_failed(str(e), lookup.asked_at)
            elif refuses_the_engine(e) and self._lookup_refusals.refused():
                # Refused for the engine (credentials, registration), request after
                # request: back off as from an outage, one line, not one per request.
                self._lookup_failed(str(e), lookup.asked_at)
            elif self._warn_limit.may("lookup_error"):
                log.warning(
                    "prefix lookup for %s failed: %s (%d lookup error(s) so far)",
                    request_id,
                    e,
                    self.counters["prefix_lookup_errors"],
                )
        else:
            self._lookup_refusals.answered()
            if self.breaker.succeeded():
                log.info("kvrc answers lookups again: prefix lookups resume")
        if not isinstance(answer, PrefixLoadGrant):
            if answer is not None:
                self._count(f"prefix_miss_{answer}")
            self._decide(request_id, 0)
            return 0
        matched = min(answer.matched_blocks, lookup.usable_blocks)
        load_blocks = matched - local_blocks
        if load_blocks < self.config.min_blocks:
            self._abandon(answer, "below min_blocks after the pin")
            self._decide(request_id, 0)
            return 0
        self._prefix[request_id] = _Prefix(answer, local_blocks, load_blocks)
        self._decide(request_id, load_blocks * self.block_size)
        self._count("prefix_grants")
        return load_blocks * self.block_size

    def _prefix_again(self, request_id: str, local_blocks: int, num_computed_tokens: int) -> int:
        """vLLM asks again for a request it could not allocate blocks for (no new Lookup).

        Its local prefix-cache hit may have changed meanwhile (evicted under the same
        memory pressure, or computed by another request). The pending load is rebased on
        the new hit rather than abandoned: the holder pinned the chain from block 0
        (the source descriptors list it all; the worker skips `local_blocks` of them), so
        the same lease, pin and reports serve any local hit below its end, and kvrc's
        lease accounting does not change. A hit that leaves fewer than min_blocks to
        load gives the grant back as unused, as any abandoned grant.
        """
        decided = self._prefix.get(request_id)
        if decided is None:
            return 0
        if local_blocks != decided.local_blocks:
            end = decided.local_blocks + decided.load_blocks
            if end - local_blocks < self.config.min_blocks:
                del self._prefix[request_id]
                self._abandon(decided.grant, "the local hit grew past the load")
                self._decide(request_id, 0)
                self._count("prefix_grants_abandoned_on_requery")
                return 0
            decided = replace(decided, local_blocks=local_blocks, load_blocks=end - local_blocks)
            self._prefix[request_id] = decided
            self._decide(request_id, decided.load_blocks * self.block_size)
            self._count("prefix_loads_rebased")
        return max(
            0, (decided.local_blocks + decided.load_blocks) * self.block_size - num_computed_tokens
        )

    def _lookup_failed(self, why: str, asked_at: float) -> None:
        if self.breaker.failed(time.monotonic(), asked_at):
            log.warning(
                "kvrc lookup failed (%s): new requests recompute without asking kvrc for "
                "%.0f s and longer while it keeps failing (until it answers again)",
                why,
                self.breaker.backoff_s,
            )
            self._count("lookup_breaker_opened")

    def _decide(self, request_id: str, tokens: int) -> None:
        self._prefix_decided[request_id] = tokens
        while len(self._prefix_decided) > 65536:
            del self._prefix_decided[next(iter(self._prefix_decided))]

    async def _lookup_and_grant(
        self, request_id: str, hashes: list[bytes], local_blocks: int, delay_s: float = 0.0
    ) -> PrefixLoadGrant | str:
        if delay_s:
            await asyncio.sleep(delay_s)  # test fault `delay-lookup=S`: a slow kvrc
        want = local_blocks + self.config.min_blocks
        hint = await self.lookups.lookup(
            self.child_engine_id, hashes, min_blocks=want, timeout_s=RPC_TIMEOUT_S
        )
        if hint.outcome is not LookupOutcome.HIT:
            return str(hint.outcome.value)
        answer = await self.leases.request_prefix_load(
            f"{request_id}/load",
            hashes,
            min_blocks=want,
            local_blocks=local_blocks,  # the load moves the rest; the gate prices the rest
            pin_timeout_ms=self.config.pin_timeout_ms,
            transfer_timeout_ms=self.config.transfer_timeout_ms,
        )
        if isinstance(answer, Miss):
            return answer.reason
        return answer

    def _abandon_late(self, future: concurrent.futures.Future[Any]) -> None:
        """A lookup's answer that nobody waits for any more (past lookup_timeout_ms, or
        its request finished): a grant in it is given back."""
        if future.cancelled() or future.exception() is not None:
            return
        if isinstance(future.result(), PrefixLoadGrant):
            self._abandon(future.result(), "granted after its request stopped waiting")

    def _abandon(self, grant: PrefixLoadGrant, why: str) -> None:
        """A grant we will not use: every rank part reports it (nothing was read)."""
        self.loop.submit(self._report_unused(grant.lease_id, why))

    async def _report_unused(self, lease_id: str, why: str) -> None:
        from clients.transfer import TransferResult

        for tp_rank in range(self.tp_size):
            report = TransferResult.not_started(f"not used: {why}").to_report(
                lease_id=lease_id, reporter_child_engine_id=self.child_engine_id, tp_rank=tp_rank
            )
            with contextlib.suppress(KvrcClientError):
                await self.leases.complete_prefix_load(report)

    # --- update_state_after_alloc ------------------------------------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        request_id = request.request_id
        if params and params.get("do_remote_prefill") and params.get(KVRC_MARK):
            params["do_remote_prefill"] = False  # one transfer per request
            if num_external_tokens <= 0:
                return
            block_ids = list(blocks.get_block_ids()[0])
            prompt_len = len(request.prompt_token_ids or ())
            local_tokens = prompt_len - num_external_tokens
            skip = local_tokens // self.block_size
            needed = -(-prompt_len // self.block_size)
            recv = _Recv(
                request_id,
                "handoff",
                block_ids[skip:needed],
                skip,
                num_external_tokens,
            )
            handoff_id = str(params.get("transfer_id") or params.get("remote_request_id"))
            prefill = str(params.get("remote_engine_id") or "")
            recv.grant = self.loop.submit(self._begin_handoff(handoff_id, prefill))
            trace("begin_submitted", request_id)
            recv.grant.add_done_callback(functools.partial(_trace_done, "granted", request_id))
            recv.test_fault = self._test_fault(params)
            self._await_grant(recv)
            return
        lookup = self._lookups.pop(request_id, None)
        if lookup is not None:
            # Scheduled without the lookup's answer (vLLM set it aside: a request that
            # reads no cached prefix): a grant that still comes is given back.
            lookup.answer.add_done_callback(self._abandon_late)
            self._decide(request_id, 0)
        prefix = self._prefix.pop(request_id, None)
        if prefix is None:
            return
        if num_external_tokens <= 0:
            self._abandon(prefix.grant, "vLLM allocated no blocks for it")
            return
        block_ids = list(blocks.get_block_ids()[0])
        local_block_ids = block_ids[prefix.local_blocks : prefix.local_blocks + prefix.load_blocks]
        recv = _Recv(
            request_id, "prefix_load", local_block_ids, prefix.local_blocks, num_external_tokens
        )
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_result(prefix.grant)
        recv.grant = done
        recv.lease_id = prefix.grant.lease_id
        recv.test_fault = self._test_fault(request.kv_transfer_params or {})
        self._await_grant(recv)

    def _await_grant(self, recv: _Recv) -> None:
        """In flight from now on; the step after its grant comes dispatches its load."""
        with self._lock:
            self._recv[recv.request_id] = recv
            self._awaiting_grant[recv.request_id] = recv
        assert recv.grant is not None
        recv.grant.add_done_callback(functools.partial(self._grant_came, recv))

    def _grant_came(self, recv: _Recv, _future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            if self._awaiting_grant.get(recv.request_id) is recv:
                del self._awaiting_grant[recv.request_id]
                self._granted.append(recv)
        self._kvrc_answered.set()

    def _kvrc_answer_came(self, _future: concurrent.futures.Future[Any]) -> None:
        self._kvrc_answered.set()

    def _test_fault(self, params: dict[str, Any]) -> str:
        fault = str(params.get("kvrc_test_fault") or "")
        if fault and not self.config.test_faults:
            log.warning("ignoring kvrc_test_fault %r: test_faults is off", fault)
            return ""
        return fault

    async def _begin_handoff(self, handoff_id: str, prefill: str) -> HandoffGrant:
        """BeginHandoff, waiting up to handoff_wait_ms (LeaseClient makes it again while
        this engine's own rank parts re-register or kvrc is unreachable)."""
        asked_at = time.monotonic()
        try:
            grant = await self.leases.begin_handoff(
                handoff_id, prefill, wait_timeout_ms=self.config.handoff_wait_ms
            )
        except UnavailableError as e:
            self._handoff_kvrc_failed(f"BeginHandoff: {e}", asked_at)
            raise
        except DeadlineExceededError as e:
            # kvrc answers DEADLINE_EXCEEDED itself when the wait runs out (the prefill
            # never published); no answer by then is a kvrc that does not answer.
            if time.monotonic() - asked_at > self.config.handoff_wait_ms / 1000 + 1.0:
                self._handoff_kvrc_failed(f"BeginHandoff: {e}", asked_at)
            raise
        self._handoff_kvrc_answered()
        return grant

    def _handoff_allowed(self) -> bool:
        with self._lock:
            return self.handoff_breaker.allows(time.monotonic())

    def _handoff_kvrc_failed(self, why: str, asked_at: float) -> None:
        with self._lock:
            opened = self.handoff_breaker.failed(time.monotonic(), asked_at)
            backoff_s = self.handoff_breaker.backoff_s
        if opened:
            log.warning(
                "kvrc unreachable or refusing this engine's handoffs (%s): no handoffs "
                "offered or begun for "
                "%.1f s and longer while it keeps failing (prefills free, decodes recompute)",
                why,
                backoff_s,
            )

    def _handoff_refused(self, why: str, asked_at: float, n: int = 1) -> None:
        """`n` first publishes refused for the engine: the breaker opens on a run of them."""
        with self._lock:
            run = self._handoff_refusals.refused(n)
        if run:
            self._handoff_kvrc_failed(why, asked_at)

    def _handoff_kvrc_answered(self) -> None:
        with self._lock:
            self._handoff_refusals.answered()
            closed = self.handoff_breaker.succeeded()
        if closed:
            log.info("kvrc answers handoffs again: handoffs resume")

    # --- build_connector_meta ----------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KvrcConnectorMetadata:
        self.pins.seal_step()  # what this step cached is pinnable once it ran
        meta = KvrcConnectorMetadata()
        self._step_wait_left_s = self.config.lookup_step_wait_ms / 1000  # the next step's
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        meta.idle_step = idle
        if idle:
            self._kvrc_answered.clear()  # an answer from now on ends this step's wait
        with self._lock:
            granted, self._granted = self._granted, []
            awaiting_grants = bool(self._awaiting_grant)
        if idle and (self._recv or self._sending or self._lookups):
            # An idle step that only waits for kvrc (a lookup, a grant, a pull, a release):
            # vLLM would spin here and starve the connector's threads (one core per
            # engine). Yield the CPU briefly instead; an answer that arrives meanwhile
            # ends the wait at once.
            if granted or any(lookup.answer.done() for lookup in self._lookups.values()):
                pass  # answered already: dispatched below, or taken at the next step
            elif awaiting_grants or self._lookups:
                self._kvrc_answered.wait(GRANT_WAIT_S)
                with self._lock:
                    granted += self._granted
                    self._granted = []
            elif self._recv:
                pass  # pulls are running: the workers wait for their end (get_finished)
            elif self._free_now:
                time.sleep(IDLE_STEP_WAIT_S)
            else:
                time.sleep(RELEASE_WAIT_S)  # only held handoffs: a release frees them later
        for recv in granted:
            assert recv.grant is not None
            try:
                grant = recv.grant.result()
            except Exception as e:
                log.warning("%s of %s: no grant: %s", recv.flow, recv.request_id, e)
                self._count(f"{recv.flow}_grant_failures")
                meta.loads.append(
                    LoadSpec(
                        recv.request_id, recv.flow, "", [], 0, recv.local_block_ids, 0.0, str(e)
                    )
                )
                continue
            recv.lease_id = grant.lease_id
            trace("dispatched", recv.request_id)
            left_s = (grant.deadline_unix_ms - time.time() * 1000) / 1000
            if recv.flow == "prefix_load" and left_s < MIN_PULL_S:
                # The grant waited (vLLM had no blocks for it) until its lease expired:
                # kvrc aborts it, and the holder's pin may already be gone. No read:
                # every block is a load error, vLLM recomputes (I6-quiescence).
                self._count("prefix_grants_expired_before_dispatch")
                self._abandon(grant, "its deadline passed before vLLM allocated its blocks")
                meta.loads.append(
                    LoadSpec(
                        recv.request_id,
                        recv.flow,
                        grant.lease_id,
                        [],
                        0,
                        recv.local_block_ids,
                        0.0,
                        "the grant's deadline passed before its blocks were allocated",
                    )
                )
                continue
            deadline_s = min(left_s, self.config.transfer_timeout_ms / 1000)
            if recv.flow == "handoff":
                deadline_s = self.config.transfer_timeout_ms / 1000
                recv.keepalive = self.leases.keep_alive(grant)
                self.loop.call_soon(recv.keepalive.start)
            meta.loads.append(
                LoadSpec(
                    recv.request_id,
                    recv.flow,
                    grant.lease_id,
                    [part.SerializeToString() for part in grant.source_parts],
                    recv.skip,
                    recv.local_block_ids,
                    deadline_s,
                    test_fault=recv.test_fault,
                )
            )
        with self._lock:
            meta.publishes, self._publishes = self._publishes, []
            meta.free_now, self._free_now = self._free_now, []
            meta.held, self._held_new = self._held_new, []
            meta.unheld, self._unheld_new = self._unheld_new, []
        if self._stats_dirty:  # read unlocked: _write_stats checks again under the lock
            self._write_stats()  # once a step: what it and the step before counted
        return meta

    # --- update_connector_output -------------------------------------------------------

    def update_connector_output(self, output: Any) -> None:
        self.pins.step_done()  # a step ran: the blocks it cached may be pinned now
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        outcomes: dict[str, str] = {}
        if isinstance(worker_meta, KvrcWorkerMetadata):
            outcomes = worker_meta.outcomes
            for key, value in worker_meta.counters.items():
                self._count(f"workers_{key}", value)
            if worker_meta.counters.get("handoffs_published"):
                with self._lock:
                    self._handoff_refusals.answered()
            refused = worker_meta.counters.get(HANDOFF_REFUSED_FOR_THE_ENGINE, 0)
            if refused:
                self._handoff_refused(
                    "workers' PublishHandoffs were refused (their log says why)",
                    time.monotonic(),
                    refused,
                )
        with self._lock:
            for request_id, outcome in outcomes.items():
                pending = self._recv.get(request_id)
                if pending is not None and outcome != "SUCCEEDED" and not pending.failure:
                    pending.failure = outcome
        for request_id in output.finished_recving or ():
            trace("finished_recving", request_id)
            with self._lock:
                recv = self._recv.pop(request_id, None)
            if recv is None:
                continue
            if recv.keepalive is not None:
                self.loop.submit(recv.keepalive.stop())
            outcome = recv.failure or "SUCCEEDED"
            if outcome == "SUCCEEDED":
                self._count(f"{recv.flow}_loads")
                self._count(f"{recv.flow}_tokens_loaded", recv.num_tokens)
                self._count(f"{recv.flow}_blocks_loaded", len(recv.local_block_ids))
            else:
                self._count(f"{recv.flow}_load_failures")
                self._count(f"{recv.flow}_tokens_recomputed", recv.num_tokens)
                log.warning("%s of %s failed: %s (vLLM recomputes)", recv.flow, request_id, outcome)
        for request_id in output.finished_sending or ():
            if self._sending.pop(request_id, None) is not None:
                self._count("handoffs_freed")

    # --- request_finished --------------------------------------------------------------

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._prefix_decided.pop(request_id, None)
        lookup = self._lookups.pop(request_id, None)
        if lookup is not None:  # finished (aborted) while its lookup was out
            lookup.answer.add_done_callback(self._abandon_late)
        leftover = self._prefix.pop(request_id, None)
        if leftover is not None:
            self._abandon(leftover.grant, "request finished before its blocks were allocated")
        with self._lock:
            loading = request_id in self._recv
        if loading:
            # Aborted while its KV is loading: the blocks are freed once the read is quiet
            # (the worker reports the request in finished_recving).
            self._count("loads_finished_early")
            return True, None
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or self.kv_role == "kv_consumer":
            return False, None
        from vllm.v1.request import RequestStatus  # type: ignore[import-not-found]

        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None  # aborted prefill: nothing to hand off
        if not self._handoff_allowed():
            # kvrc was unreachable just now: vLLM frees the blocks, the decode recomputes
            # (no kv_transfer_params), rather than holding them handoff_hold_s for nobody.
            self._count("handoffs_not_offered")
            return False, None
        num_tokens = int(request.num_computed_tokens)
        blocks = list(block_ids[: -(-num_tokens // self.block_size)])
        handoff_id = str(params.get("transfer_id") or f"{self.child_engine_id}/{request_id}")
        out = dict(params)  # unknown fields pass through unchanged
        out.update(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.child_engine_id,
            remote_request_id=request_id,
            remote_block_ids=blocks,
            remote_host=self.config.hostname,
            remote_port=self.kv_port,
            remote_num_tokens=num_tokens,
            tp_size=self.tp_size,
            transfer_id=handoff_id,
        )
        out[KVRC_MARK] = True
        decode = str(params.get("kvrc_decode_engine_id") or "")
        try:
            encoded = encode_kv_transfer_params(out)
        except (ValueError, TypeError, RecursionError) as e:
            # The client's own params (too deep, too big, a lone surrogate): raised here it
            # would end the EngineCore. No handoff: vLLM frees the blocks as usual.
            self._params_unencodable(request_id, e)
            return False, None
        spec = PublishSpec(request_id, handoff_id, blocks, decode, encoded)
        with self._lock:
            self._sending[request_id] = time.monotonic()
            if len(self._endpoints) == self.tp_size:
                self.loop.submit(self._publish_all(spec))
            else:  # the workers publish their own parts at the next step
                self._publishes.append(spec)
        self._count("handoffs_offered")
        trace("handoff_offered", request_id)
        return True, out

    def _params_unencodable(self, request_id: str, error: Exception) -> None:
        self._count("handoff_params_unencodable")
        if not self._warn_limit.may("params_unencodable"):
            return
        log.warning(
            "request %s: its kv_transfer_params cannot be sent to kvrc (%s); no remote "
            "decode, the decode recomputes (%d such request(s) so far)",
            request_id,
            error,
            self.counters["handoff_params_unencodable"],
        )

    def has_pending_push_work(self) -> bool:
        return bool(self._sending or self._publishes)

    def shutdown(self) -> None:
        async def close() -> None:
            # The workers' socket first (its file too: one per engine start otherwise
            # piled up in the runtime folder), then the pin expirer, then kvrc's channel.
            server = getattr(self, "_server", None)
            if server is not None:
                server.close()
                with contextlib.suppress(Exception):
                    await server.wait_closed()
            if server is not None:  # a socket it does not serve is another engine's
                with contextlib.suppress(OSError):
                    os.unlink(control_socket_path(self.child_engine_id))
            expirer = getattr(self, "_expirer", None)
            if expirer is not None:
                expirer.cancel()
            with contextlib.suppress(Exception):
                await self._channel.close(None)

        with contextlib.suppress(Exception):
            self.loop.run(close(), timeout_s=5)
        self.loop.stop()
        self._write_stats()  # what no step or flush wrote, the closing's counts included
