"""Worker side of KvrcConnector: one vLLM Worker (TP rank) = one kvrc rank part.

In `register_kv_caches` the worker

* starts its own Mooncake transfer engine and registers vLLM's KV tensors with it
  (as they are: vLLM's memory, no copy);
* registers with kvrc as a rank part of its child engine, with its region and
  layout (block size, dtype, KV heads, head size, layers, per-layer shape);
* serves kvrc's session requests: pins (asked of the scheduler side, which owns
  the block pool), aborts (acknowledged only once its reads are quiet) and
  releases (a prefill handoff's blocks are freed: `finished_sending`).

Each step it starts the loads the scheduler side put in the metadata (one
Mooncake batch read of its slice), reports every outcome to kvrc, and hands
back, through `get_finished` and `get_block_ids_with_load_errors`, requests
whose loads ended. Blocks of a failed or timed-out read are handed back only
once the read is proven quiet (a failed Mooncake batch keeps landing entries).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import Counter
from typing import Any

import torch

from clients.errors import (
    DeadlineExceededError,
    KvrcClientError,
    UnavailableError,
    outcome_unknown,
    refuses_the_engine,
)
from clients.holds import HoldDeadlines
from clients.kv_cache import IncompatibleLayoutError, KvCacheLayout, PagedKvCache
from clients.leases import (
    LeaseClient,
    LeaseSessionHandler,
    PinAnswer,
    PinRequestInfo,
    PublishResult,
    handoff_still_open,
    publish_attempts,
)
from clients.mooncake_engine import MooncakeConfig, MooncakeTransferEngine
from clients.session import (
    ChildEngineState,
    EngineProfile,
    EngineSession,
    NullHandler,
    RankPartRegistration,
    RegisterAck,
)
from clients.transfer import (
    InFlightReads,
    NativeRead,
    TransferOutcome,
    TransferResult,
    endpoint_to_session,
    plan_rank_part_pull,
    pull,
    pull_threads,
    rank_part_descriptor,
)
from clients.vllm.config import KvrcConnectorConfig, hash_declaration, vllm_instance_id
from clients.vllm.loop import BackgroundLoop, WarnLimit, control_socket_path, trace
from clients.vllm.metadata import (
    HANDOFF_REFUSED_FOR_THE_ENGINE,
    KvrcConnectorMetadata,
    LoadSpec,
    PublishSpec,
)
from kvrc.credentials import connect
from kvrc.v1 import kvrc_pb2 as pb

log = logging.getLogger("kvrc.vllm.worker")

RPC_TIMEOUT_S = 10.0

# vLLM dtype -> kvrc's protocol dtype name
_DTYPE_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.uint8: "uint8",
}


def describe_kv_caches(
    kv_caches: dict[str, torch.Tensor], block_size: int
) -> tuple[KvCacheLayout, list[torch.Tensor], str]:
    """kvrc's view of vLLM's per-layer KV tensors: (layout, block-major tensors, vLLM shape).

    A block of one layer must be one contiguous run of bytes (block-major
    layouts: vLLM's CPU backend `[num_blocks, kv_heads, block_size, 2*head]`,
    or `[num_blocks, 2, block_size, kv_heads, head]`). The tensors returned are
    views of vLLM's own memory shaped the way `PagedKvCache` describes blocks;
    the bytes of a block are moved as they are, never reinterpreted.
    """
    if not kv_caches:
        raise ValueError("register_kv_caches got no KV tensors")
    tensors = list(kv_caches.values())
    first = tensors[0]
    shape = tuple(first.shape)
    for name, tensor in kv_caches.items():
        if tuple(tensor.shape) != shape or tensor.dtype != first.dtype:
            raise ValueError(f"layer {name} has shape {tuple(tensor.shape)}, the first {shape}")
        if not tensor.is_contiguous():
            raise ValueError(f"layer {name} is not contiguous; kvrc moves whole blocks")
    if first.dtype not in _DTYPE_NAMES:
        raise ValueError(f"KV dtype {first.dtype} is not supported")
    if len(shape) == 4 and shape[2] == block_size and shape[3] % 2 == 0:
        num_blocks, heads, _, double_head = shape
        head = double_head // 2
    elif len(shape) == 5 and shape[1] == 2 and shape[2] == block_size:
        num_blocks, _, _, heads, head = shape
    else:
        raise ValueError(
            f"unsupported KV cache layout {shape} (block size {block_size}): KvrcConnector "
            "needs block-major tensors (one block of a layer is one contiguous run)"
        )
    layout = KvCacheLayout(
        num_layers=len(tensors),
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head,
        dtype=_DTYPE_NAMES[first.dtype],
        kv_layout="HND",
    )
    views = [tensor.view(layout.layer_shape) for tensor in tensors]
    return layout, views, "x".join(map(str, shape))


# The longest an idle step's get_finished waits for a running pull to end.
IDLE_LOAD_WAIT_S = 0.01
# Leases kvrc aborted, remembered so that a load dispatched later never reads them.
MAX_ABORTED_LEASES = 65536
# A quarantine the scheduler could not take is handed over again after these waits.
QUARANTINE_RETRY_DELAYS_S = (1.0, 2.0, 5.0, 10.0, 30.0)


class _Finished:
    """Thread-safe sets handed to vLLM at the next `get_finished`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recved = threading.Condition(self._lock)
        self.loads_running = 0
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.counters: Counter[str] = Counter()
        self.outcomes: dict[str, str] = {}

    def add_sending(self, request_id: str) -> None:
        with self._lock:
            self.sending.add(request_id)

    def load_started(self) -> None:
        with self._lock:
            self.loads_running += 1

    def add_recving(self, request_id: str, errors: list[int], outcome: str) -> None:
        with self._lock:
            self.load_errors.update(errors)
            self.recving.add(request_id)
            self.outcomes[request_id] = outcome
            self.loads_running -= 1
            self._recved.notify_all()

    def wait_recving(self, timeout_s: float) -> None:
        """Until a running load finishes (or `timeout_s`): an idle step reports it at once."""
        with self._lock:
            if self.loads_running > 0 and not self.recving:
                self._recved.wait(timeout_s)

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def take(self) -> tuple[set[str], set[str]]:
        with self._lock:
            sending, recving = self.sending, self.recving
            self.sending, self.recving = set(), set()
            return sending, recving

    def take_errors(self) -> set[int]:
        with self._lock:
            errors, self.load_errors = self.load_errors, set()
            return errors

    def take_meta(self) -> tuple[dict[str, int], dict[str, str]]:
        with self._lock:
            counters, outcomes = dict(self.counters), self.outcomes
            self.counters, self.outcomes = Counter(), {}
            return counters, outcomes


class _StateHandler(NullHandler):
    def __init__(self, worker: KvrcWorker) -> None:
        self.worker = worker

    async def on_registered(self, ack: RegisterAck) -> None:
        self.worker.registered.set()
        log.info(
            "%s tp%d registered with kvrc (session %s, reuse %s, ready %s)",
            self.worker.child_engine_id,
            self.worker.tp_rank,
            ack.session_id,
            ack.reuse.reason,
            ack.state.ready,
        )

    async def on_state(self, state: ChildEngineState) -> None:
        if state.ready:
            self.worker.ready.set()


class KvrcWorker:
    def __init__(self, vllm_config: Any, config: KvrcConnectorConfig, identity: Any) -> None:
        from vllm.distributed.parallel_state import (  # type: ignore[import-not-found]
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.vllm_config = vllm_config
        # Sent with every request to the scheduler side, which refuses another
        # instance's workers (same engine_id on one host).
        self.instance_id = vllm_instance_id(vllm_config)
        self.config = config
        self.identity = identity
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.child_engine_id: str = identity.child_engine_id
        self.block_size = int(vllm_config.cache_config.block_size)
        self.finished = _Finished()
        self._idle_step = False
        self.loop = BackgroundLoop(f"kvrc-worker-tp{self.tp_rank}")
        if config.stall_dump_s:
            self.loop.watch_for_stalls(config.stall_dump_s)
        self.registered = threading.Event()
        self.registration_refused = threading.Event()
        self.refused = ""
        self.ready = threading.Event()
        self.in_flight = InFlightReads()
        # A frozen peer holds a thread per read for up to a minute (PeerSlots).
        self.executor, self.peer_slots = pull_threads("kvrc-pull")
        self._started_loads: dict[str, None] = {}
        self._reads_by_lease: dict[str, list[NativeRead]] = {}
        self._pulls_running: dict[str, list[asyncio.Future[None]]] = {}
        self._aborted: dict[str, None] = {}  # lease ids, oldest first (MAX_ABORTED_LEASES)
        self._held: dict[str, str] = {}  # handoff lease id -> prefill request id
        self._quarantined = HoldDeadlines()  # only what kvrc quarantined (no nets here)
        self._released_early: dict[str, None] = {}
        self._handoff_of_request: dict[str, str] = {}
        self._scheduler_channel: Any = None
        self._pin_unreachable_said = False  # one warning, not one per pin
        self._warn_limit = WarnLimit()  # on the loop's thread
        self._reports: set[asyncio.Task[None]] = set()
        self.session: EngineSession | None = None
        self.leases: LeaseClient | None = None
        self.engine: MooncakeTransferEngine | None = None
        self.cache: PagedKvCache | None = None

    # --- registration --------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout, views, vllm_shape = describe_kv_caches(kv_caches, self.block_size)
        # Built from the loop thread, so Mooncake's transport threads inherit its
        # binding to every core the engine was given, not this rank's compute core.
        self.engine = self.loop.run(self._new_transfer_engine(), timeout_s=60)
        self.cache = PagedKvCache.wrap(layout, views)
        self.endpoint = self.cache.register(self.engine)
        model = self.vllm_config.model_config
        kv_events = getattr(self.vllm_config, "kv_events_config", None)
        events_on = bool(
            kv_events is not None
            and kv_events.enable_kv_cache_events
            and kv_events.publisher == "zmq"
        )
        device = str(views[0].device)
        registration = RankPartRegistration(
            engine_id=self.identity.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            dp_rank=self.identity.dp_rank,
            dp_size=self.identity.dp_size,
            profile=EngineProfile(
                model=self.config.model_name or str(model.model),
                block_size=self.block_size,
                kv_dtype=layout.dtype,
                num_layers=layout.num_layers,
                num_kv_heads=int(model.get_total_num_kv_heads()),
                head_size=layout.head_size,
                attention_backend="vllm",
                kv_layout=f"vllm:{vllm_shape.split('x', 1)[1]}",
                gpu_kind="cpu" if views[0].device.type == "cpu" else device.split(":")[0],
                reuse_opt_in=self.config.reuse,
                transfer_backends=("mooncake",),
                extra=(
                    ("vllm_kv_shape", vllm_shape),
                    *hash_declaration(self.vllm_config.cache_config, os.environ),
                ),
            ),
            endpoint=endpoint_to_session(self.endpoint),
            kv_events_endpoint=str(kv_events.endpoint) if events_on else "",  # type: ignore[union-attr]
            kv_events_replay_endpoint=(
                str(kv_events.replay_endpoint or "") if events_on else ""  # type: ignore[union-attr]
            ),
        )
        self.loop.run(self._start_session(registration), timeout_s=10)
        give_up = time.monotonic() + self.config.register_timeout_s
        while time.monotonic() < give_up and not self.registered.is_set():
            if self.registration_refused.wait(0.05):
                raise RuntimeError(
                    f"KvrcConnector: kvrc refused rank part tp{self.tp_rank} of "
                    f"{self.child_engine_id}: {self.refused}"
                )
        if not self.registered.is_set():
            log.warning(
                "%s tp%d: not registered with kvrc at %s within %.0f s; serving without kvrc "
                "(no reuse, no handoffs) and retrying in the background",
                self.child_engine_id,
                self.tp_rank,
                self.config.kvrc_target,
                self.config.register_timeout_s,
            )
            self.finished.count("kvrc_unavailable")

    async def _new_transfer_engine(self) -> MooncakeTransferEngine:
        config = MooncakeConfig(
            local_hostname=self.config.hostname,
            protocol=self.config.mooncake_protocol,
            device_name=self.config.mooncake_device,
            read_sleep_share=self.config.mooncake_read_sleep_share,
        )
        # On a pull thread: started from the loop thread, it has its binding, and the
        # loop (heartbeats) keeps running while Mooncake starts.
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, MooncakeTransferEngine, config
        )

    async def _start_session(self, registration: RankPartRegistration) -> None:
        self.handler = LeaseSessionHandler(
            pin=self._pin,
            abort=self._abort,
            on_release=self._on_release,
            on_quarantine=self._on_quarantine,
            inner=_StateHandler(self),
        )
        options = self.config.channel_options()
        self.session = EngineSession(options, registration, handler=self.handler)
        self.handler.attach(self.session)
        self._channel = connect(options)
        self.leases = LeaseClient(self._channel, self.child_engine_id, timeout_s=RPC_TIMEOUT_S)
        self.handler.replay_reports_of(self.leases)  # a restarted kvrc may wait for them
        self._session_task = asyncio.create_task(self._keep_registering())
        self._hello_task = asyncio.create_task(self._say_hello())

    async def _say_hello(self) -> None:
        """Give the scheduler side this rank part's endpoint (it publishes handoffs with it).

        The scheduler side starts after the workers: retried until its socket is up."""
        for _ in range(600):
            try:
                await self._scheduler_call(
                    "hello", tp_rank=self.tp_rank, endpoint=self.endpoint.to_json()
                )
                return
            except Exception:  # not up yet
                self._scheduler_channel = None
                await asyncio.sleep(0.2)
        log.warning("the scheduler side never answered; handoffs are published from workers")

    async def _keep_registering(self) -> None:
        """The first registration, retried with backoff (the session reconnects after)."""
        assert self.session is not None
        delay = 0.2
        while True:
            try:
                await self.session.start()
                return
            except (UnavailableError, DeadlineExceededError) as e:
                log.warning("kvrc registration failed (%s); retrying in %.1f s", e, delay)
                self.finished.count("kvrc_unavailable")
            except KvrcClientError as e:
                # Refused (a layout mismatch, a duplicate rank part, ...): say so, loudly.
                # Within register_timeout_s the engine's start fails (register_kv_caches);
                # later, the worker serves without kvrc (docs/vllm.md, "kvrc down").
                self.refused = str(e)
                log.error(
                    "kvrc refused %s tp%d: %s; not retrying",
                    self.child_engine_id,
                    self.tp_rank,
                    e,
                )
                self.finished.count("kvrc_refused")
                self.registration_refused.set()
                return
            except Exception:
                log.exception("kvrc registration failed; retrying in %.1f s", delay)
            # a refused start leaves the session unusable: make a new one (every target)
            self.session = EngineSession(
                self.session.targets,
                self.session.registration,
                handler=self.handler,
            )
            self.handler.attach(self.session)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    # --- each step -----------------------------------------------------------------

    def start_step(self, meta: KvrcConnectorMetadata) -> None:
        for spec in meta.loads:
            if spec.request_id in self._started_loads:
                continue
            self._started_loads[spec.request_id] = None
            trace("worker_load_start", spec.request_id)
            while len(self._started_loads) > 65536:
                del self._started_loads[next(iter(self._started_loads))]
            self.finished.load_started()
            self.loop.submit(self._load(spec))
        self._idle_step = meta.idle_step
        for publish in meta.publishes:
            trace("worker_publish_start", publish.request_id)
            self.loop.submit(self._publish(publish))
        for request_id in meta.free_now:
            self.finished.add_sending(request_id)
        for lease_id, decode_child_engine_id in meta.held:
            self.handler.track_held(lease_id, decode_child_engine_id)
        for lease_id in meta.unheld:
            self.handler.untrack_held(lease_id)

    def get_finished(self) -> tuple[set[str], set[str]]:
        if self._idle_step:
            # Nothing to compute this step: rather than spin through empty steps, wait here
            # for a running pull, so its end reaches the scheduler in this very step.
            self.finished.wait_recving(IDLE_LOAD_WAIT_S)
        sending, recving = self.finished.take()
        for request_id in recving:
            # Its load is over: a later one of the same request (vLLM asks again after a
            # preemption, or after a failed load) must run, not be taken for a repeat of
            # this one, which left the request in WAITING_FOR_REMOTE_KVS for good.
            self._started_loads.pop(request_id, None)
        return sending, recving

    # --- loads (decode handoff, prefix load) ---------------------------------------

    async def _load(self, spec: LoadSpec) -> None:
        try:
            ok, outcome = await self._pull_and_report(spec)
        except Exception as e:  # a bug here must not leave the request waiting forever
            log.exception("load of %s failed", spec.request_id)
            ok, outcome = False, f"FAILED: {e}"
        self.finished.count(f"{spec.flow}_loads")
        if ok:
            self.finished.count(f"{spec.flow}_blocks_loaded", len(spec.local_block_ids))
        else:
            self.finished.count(f"{spec.flow}_load_failures")
        self.finished.add_recving(
            spec.request_id, [] if ok else list(spec.local_block_ids), outcome
        )
        trace("worker_load_done", spec.request_id)

    async def _pull_and_report(self, spec: LoadSpec) -> tuple[bool, str]:
        if spec.error:
            return False, f"FAILED: {spec.error}"
        if spec.lease_id in self._aborted:
            return self._refuse_aborted(spec)
        # Registered before any await (both run on this loop's thread): an abort from
        # now on waits for this pull; one that came before was recorded, refused above.
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pulls_running.setdefault(spec.lease_id, []).append(done)
        try:
            return await self._pull(spec)
        finally:
            done.set_result(None)
            running = self._pulls_running.pop(spec.lease_id, [])
            running.remove(done)
            if running:
                self._pulls_running[spec.lease_id] = running
            self._forget_quiet_reads(spec.lease_id)

    async def _pull(self, spec: LoadSpec) -> tuple[bool, str]:
        assert self.engine is not None and self.cache is not None
        parts = []
        for raw in spec.source_parts:
            descriptor = pb.RankPartDescriptor.FromString(raw)
            del descriptor.block_ids[: spec.skip]
            parts.append(descriptor)
        try:
            plan = plan_rank_part_pull(
                self.endpoint,
                spec.local_block_ids,
                parts,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
            )
        except (IncompatibleLayoutError, ValueError) as exc:
            log.warning("%s: load of %s refused: %s", spec.flow, spec.request_id, exc)
            self.finished.count(f"{spec.flow}_refused")
            await self._report(spec, TransferResult.not_started(f"refused: {exc}"))
            return False, f"FAILED: refused: {exc}"
        fault, _, value = spec.test_fault.partition("=")
        if fault == "delay-before-pull":
            await asyncio.sleep(min(float(value), 60.0))

        def submitted(read: NativeRead) -> None:
            # Filed as it starts, so an abort waits for it even if this task is cancelled.
            self._reads_by_lease.setdefault(spec.lease_id, []).append(read)

        result = await pull(
            self.engine,
            plan,
            deadline_s=max(0.05, spec.deadline_s),
            executor=self.executor,
            in_flight=self.in_flight,
            on_submit=submitted,
            peer_slots=self.peer_slots,
        )
        if result.outcome is TransferOutcome.SUCCEEDED:
            if fault == "corrupt":
                self._corrupt(spec.local_block_ids)
                self.finished.count("test_corrupted_loads")
            self.finished.count(f"{spec.flow}_bytes", result.bytes_moved)
        if result.outcome is TransferOutcome.SUCCEEDED:
            # Off the request's critical path: the blocks are good, vLLM may use them now.
            task = asyncio.create_task(self._report(spec, result))
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)
        else:
            await self._report(spec, result)
        if result.tainted_block_ids:
            # Hold the destination blocks until no entry of the read can still land.
            log.warning(
                "%s of %s: %s %s; holding %d block(s) until the read is quiet",
                spec.flow,
                spec.request_id,
                result.outcome.value,
                result.error,
                len(result.tainted_block_ids),
            )
            await result.wait_quiet()
            self.finished.count(f"{spec.flow}_held_until_quiet")
        elif result.outcome is not TransferOutcome.SUCCEEDED:
            # Quiet already (it never ran, or failed and settled): nothing to hold.
            log.warning(
                "%s of %s: %s %s; recomputing",
                spec.flow,
                spec.request_id,
                result.outcome.value,
                result.error,
            )
        ok = result.outcome is TransferOutcome.SUCCEEDED
        return ok, result.outcome.value if ok else f"{result.outcome.value}: {result.error}"

    def _refuse_aborted(self, spec: LoadSpec) -> tuple[bool, str]:
        """kvrc aborted the lease before this load read anything: the holder may have
        unpinned the blocks, so nothing is read and vLLM recomputes (I6-quiescence).
        No report: kvrc ended the lease when this worker acknowledged the abort."""
        log.warning(
            "%s of %s: lease %s was aborted by kvrc before the read; recomputing",
            spec.flow,
            spec.request_id,
            spec.lease_id,
        )
        self.finished.count(f"{spec.flow}_aborted_before_read")
        return False, "FAILED: the lease was aborted by kvrc before the read"

    def _corrupt(self, block_ids: list[int]) -> None:
        assert self.cache is not None
        generator = torch.Generator().manual_seed(7)
        for layer in self.cache.layers:
            for block_id in block_ids:
                block = layer[block_id]
                block.copy_(torch.randn(block.shape, generator=generator).to(block.dtype))

    async def _report(self, spec: LoadSpec, result: TransferResult) -> None:
        if self.leases is None:
            return
        report = result.to_report(
            lease_id=spec.lease_id,
            reporter_child_engine_id=self.child_engine_id,
            tp_rank=self.tp_rank,
        )
        try:
            if spec.flow == "prefix_load":
                await self.leases.complete_prefix_load(report)
            else:
                await self.leases.complete_handoff(report)
        except KvrcClientError as e:
            log.warning("reporting %s %s failed: %s", spec.flow, spec.lease_id, e)

    def _forget_quiet_reads(self, lease_id: str) -> None:
        """At a pull's end, its lease's reads: quiet by then (a failed one was waited for),
        unless the pull raised, when the rest are forgotten once quiet. (Every lease's
        reads were swept at each pull's end: O(loads in flight) per load.)"""
        reads = self._reads_by_lease.pop(lease_id, [])
        left = [read for read in reads if not read.is_quiet()]
        if left:
            self._reads_by_lease[lease_id] = left
            self.loop.spawn_later(0.0, lambda: self._forget_once_quiet(lease_id, left))

    async def _forget_once_quiet(self, lease_id: str, reads: list[NativeRead]) -> None:
        for read in reads:
            await read.wait_quiet()
        self._forget_quiet_reads(lease_id)

    # --- handoff publish (prefill) -------------------------------------------------

    async def _publish(self, spec: PublishSpec) -> None:
        if self.leases is None or not self.registered.is_set():
            log.warning("handoff %s not published: not registered with kvrc", spec.handoff_id)
            self.finished.count("handoff_publish_failures")
            self.finished.add_sending(spec.request_id)
            return
        loop = asyncio.get_running_loop()
        hold_ends = loop.time() + self.config.handoff_hold_s
        published = None
        async for attempt in publish_attempts(hold_ends):
            try:
                published = await self._publish_part(spec)
                break
            except KvrcClientError as e:
                if attempt == 0:
                    self.finished.count("handoff_publish_failures")
                if not outcome_unknown(e) and attempt == 0:
                    log.warning(
                        "handoff %s not published: %s; freeing its blocks", spec.handoff_id, e
                    )
                    if refuses_the_engine(e):  # the scheduler side stops offering handoffs
                        self.finished.count(HANDOFF_REFUSED_FOR_THE_ENGINE)
                    self.finished.add_sending(spec.request_id)
                    return
                # A repeat's refusal proves nothing: the first may have been recorded and
                # read, and a repeat is refused while the engine is not ready (a part
                # reconnecting). The hold stays, and the publish goes again.
                if attempt == 0:
                    # kvrc may have recorded the part (only the answer was lost): a
                    # decode may be granted these blocks, so they are held as a
                    # published handoff's are, and the publish goes again until an
                    # answer names its lease (I6-quiescence).
                    log.warning(
                        "handoff %s: publish outcome unknown (%s); holding its blocks",
                        spec.handoff_id,
                        e,
                    )
                    self.finished.count("handoff_publish_unknown")
        if published is None:  # never answered: the hold's time is all it gets
            loop.call_at(hold_ends, self.finished.add_sending, spec.request_id)
            return
        self.finished.count("handoffs_published")
        trace("worker_published", spec.request_id)
        if published.ended or not published.lease_id:
            self.finished.add_sending(spec.request_id)
            return
        lease_id = published.lease_id
        self.handler.track_held(lease_id, spec.decode_child_engine_id)
        if lease_id in self._released_early:
            del self._released_early[lease_id]
            self._free_handoff(lease_id, spec.request_id, "released before the publish returned")
            return
        self._held[lease_id] = spec.request_id
        self._arm_hold(lease_id, spec)

    def _arm_hold(self, lease_id: str, spec: PublishSpec) -> None:
        self.loop.spawn_later(
            self.config.handoff_hold_s, lambda: self._hold_expired(lease_id, spec)
        )

    async def _publish_part(self, spec: PublishSpec) -> PublishResult:
        assert self.leases is not None
        return await self.leases.publish_handoff(
            spec.handoff_id,
            descriptor=rank_part_descriptor(self.endpoint, spec.block_ids, tp_rank=self.tp_rank),
            kv_transfer_params=spec.kv_transfer_params,
            num_blocks=len(spec.block_ids),
            decode_child_engine_id=spec.decode_child_engine_id,
        )

    async def _hold_expired(self, lease_id: str, spec: PublishSpec) -> None:
        if self._quarantined.is_quarantined(lease_id) or lease_id not in self._held:
            return  # kept until kvrc's release (I6-quiescence), or released already
        if await handoff_still_open(lease_id, lambda: self._publish_part(spec)):
            # A decode may be reading these blocks now: kvrc's release or quarantine
            # decides them, not the clock (I6-quiescence).
            log.info("handoff lease %s still open at kvrc: its hold goes on", lease_id)
            self.finished.count("handoff_hold_extended")
            if lease_id in self._held:
                self._arm_hold(lease_id, spec)
            return
        request_id = self._held.pop(lease_id, None)
        if request_id is not None:
            log.warning("handoff lease %s never released; freeing %s", lease_id, request_id)
            self.finished.count("handoff_hold_expired")
            self._free_handoff(lease_id, request_id, "hold expired")

    def _free_handoff(self, lease_id: str, request_id: str, why: str) -> None:
        log.info("handoff %s (%s) freed: %s", request_id, lease_id, why)
        self.handler.untrack_held(lease_id)
        self.finished.add_sending(request_id)

    # --- kvrc session requests -------------------------------------------------------

    async def _scheduler_call(self, op: str, **args: Any) -> Any:
        """A request to this engine's scheduler side (it owns vLLM's block pool)."""
        from clients.refengine.channel import Channel, ChannelError

        for attempt in range(2):
            channel = self._scheduler_channel
            if channel is None or channel.closed.is_set():
                reader, writer = await asyncio.open_unix_connection(
                    control_socket_path(self.child_engine_id)
                )
                channel = Channel(reader, writer, None, name="kvrc-scheduler")
                channel.start()
                self._scheduler_channel = channel
            try:
                return await channel.call(
                    op, timeout_s=RPC_TIMEOUT_S, instance=self.instance_id, **args
                )
            except ChannelError:
                self._scheduler_channel = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _pin(self, info: PinRequestInfo) -> PinAnswer:
        if not self.config.reuse:
            return PinAnswer(0, error_message="reuse is off on this engine")
        try:
            block_ids: list[int] = await self._scheduler_call(
                "pin",
                lease_id=info.lease_id,
                hashes=list(info.block_hashes),
                deadline_ms=info.deadline_unix_ms,
            )
        except TimeoutError:  # an OSError too: first
            # kvrc hears a miss, but the scheduler side may still take the pin (its loop
            # was stuck): undo it then, or its blocks stay pinned until the safety net
            # (the lease's deadline + 60 s). The unpin queues behind the pin.
            self.finished.count("pins_timed_out")
            self.loop.spawn_later(0.0, lambda: self._unpin_late(info.lease_id))
            return PinAnswer(
                0,
                error_message=f"the engine's scheduler side did not answer the pin within "
                f"{RPC_TIMEOUT_S:g} s",
            )
        except OSError as e:
            # No scheduler side on this host (a rank of multi-node TP: the control socket
            # is local), or it is gone: a miss, said once, not a traceback per pin.
            if not self._pin_unreachable_said:
                self._pin_unreachable_said = True
                log.warning(
                    "rank %d cannot reach its engine's scheduler side (%s): it answers every "
                    "pin with a miss (prefix reuse holds blocks only where the EngineCore "
                    "runs: single-node TP)",
                    self.tp_rank,
                    e,
                )
            self.finished.count("pins_unreachable")
            return PinAnswer(0, error_message=f"the engine's scheduler side is unreachable: {e}")
        if not block_ids:
            return PinAnswer(0)
        descriptor = rank_part_descriptor(self.endpoint, block_ids, tp_rank=self.tp_rank)
        self.finished.count("pins")
        return PinAnswer(len(block_ids), descriptor)

    async def _unpin_late(self, lease_id: str) -> None:
        # A stuck scheduler side times out every pin: one line a second at most.
        try:
            if await self._scheduler_call("unpin", lease_id=lease_id) and self._warn_limit.may(
                "unpinned"
            ):
                log.info("lease %s: a pin taken after its answer timed out was undone", lease_id)
        except Exception as e:
            if self._warn_limit.may("unpin_failed"):
                log.warning(
                    "lease %s: a pin the scheduler side may take late was not undone (%s); "
                    "its safety net frees it",
                    lease_id,
                    e,
                )

    async def _abort(self, lease_id: str, reason: str) -> None:
        """Resolves only once no read of the lease can still land (then kvrc gets the ack).

        The lease is recorded first, before any await: a load of it not yet running
        (its grant still waiting for vLLM's blocks, or submitted to this loop but not
        started) then never reads (`_pull_and_report`)."""
        self._aborted[lease_id] = None
        while len(self._aborted) > MAX_ABORTED_LEASES:
            del self._aborted[next(iter(self._aborted))]
        for running in list(self._pulls_running.get(lease_id, [])):
            await asyncio.shield(running)
        for read in list(self._reads_by_lease.get(lease_id, [])):
            await read.wait_quiet()

    async def _on_release(self, lease_id: str, reason: str) -> None:
        request_id = self._held.pop(lease_id, None)
        if request_id is not None:
            self._free_handoff(lease_id, request_id, f"released by kvrc ({reason})")
            return
        try:
            if await self._scheduler_call("release", lease_id=lease_id):
                return  # LeaseSessionHandler then stops announcing it as held
        except Exception as e:
            self._release_early(lease_id)
            # Raised, so neither acknowledged nor forgotten: kvrc keeps the release and
            # sends it again when this part's session starts over, and the lease is still
            # re-announced; until then the scheduler's safety net bounds the pins (I6).
            raise RuntimeError(
                f"release of lease {lease_id} not passed to the scheduler: {e!r}; kvrc "
                "sends it again when this session starts over"
            ) from e
        self._release_early(lease_id)  # the scheduler did not know it (yet)

    def _release_early(self, lease_id: str) -> None:
        """A release that came before this worker knew the lease (its publish answer may
        still come)."""
        self._released_early[lease_id] = None
        while len(self._released_early) > 4096:
            del self._released_early[next(iter(self._released_early))]

    async def _on_quarantine(self, lease_id: str, reason: str) -> None:
        log.warning("lease %s quarantined: %s (its blocks stay out of use)", lease_id, reason)
        self.finished.count("quarantined")
        self._quarantined.quarantine(lease_id)
        try:  # the scheduler holds the pin: its safety net must not free it
            await self._scheduler_call("quarantine", lease_id=lease_id)
        except Exception as e:
            # kvrc does not say it again on this session: tried again in the background,
            # not holding up this session's other messages (I6-quiescence).
            log.warning("quarantine of %s not passed to the scheduler yet: %s", lease_id, e)
            self.loop.spawn_later(0.0, lambda: self._pass_quarantine_again(lease_id))

    async def _pass_quarantine_again(self, lease_id: str) -> None:
        error: Exception | None = None
        for delay_s in QUARANTINE_RETRY_DELAYS_S:
            await asyncio.sleep(delay_s)
            try:
                await self._scheduler_call("quarantine", lease_id=lease_id)
                log.info("quarantine of %s passed to the scheduler", lease_id)
                return
            except Exception as e:
                error = e
        log.error(
            "quarantine of %s not passed to the scheduler after %d more tries: %s; its "
            "safety net may free the blocks",
            lease_id,
            len(QUARANTINE_RETRY_DELAYS_S),
            error,
        )

    # --- shutdown ------------------------------------------------------------------

    def shutdown(self) -> None:
        async def close() -> None:
            quiet = False
            # No read starts from here on: one waiting for its peer's slot would land
            # after the wait below, into tensors vLLM is about to free.
            self.peer_slots.close()
            with contextlib.suppress(Exception):
                quiet = await self.in_flight.wait_all_quiet(timeout_s=5.0)
            if not quiet:
                # Torn down anyway (vLLM is stopping): say so, a read may still write.
                log.warning(
                    "rank %d shuts down with %d native read(s) still in flight: they may "
                    "still write into vLLM's KV cache tensors",
                    self.tp_rank,
                    len(self.in_flight),
                )
            hello = getattr(self, "_hello_task", None)
            if hello is not None:
                hello.cancel()
            scheduler_channel = self._scheduler_channel
            if scheduler_channel is not None:
                with contextlib.suppress(Exception):
                    await scheduler_channel.close()
            if self.session is not None:
                with contextlib.suppress(Exception):
                    await self.handler.flush_release_acks()  # while the stream is up
                with contextlib.suppress(Exception):
                    await self.session.close(timeout_s=2.0)
            task = getattr(self, "_session_task", None)
            if task is not None:
                task.cancel()
            channel = getattr(self, "_channel", None)
            if channel is not None:
                with contextlib.suppress(Exception):
                    await channel.close(None)
            if quiet and self.cache is not None:
                # Last, with kvrc told: a peer's read after it is refused (the reader
                # discards it) instead of reading tensors vLLM is about to free. Not
                # while this rank's own reads may still land in them.
                try:
                    self.cache.unregister()
                except Exception as error:
                    log.warning("rank %d: KV memory not unregistered: %s", self.tp_rank, error)

        with contextlib.suppress(Exception):
            self.loop.run(close(), timeout_s=10)
        self.loop.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)


def now_ms() -> int:
    return time.time_ns() // 1_000_000
