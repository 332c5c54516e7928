"""One request, one core call: the runtime asks the grants core once per RPC or message.

The lease runtime (`LeaseFlow`) holds the core (`Grants`) as `core` and the lease
table as `table`; both are swapped for recording proxies, so every call the runtime
makes into either is counted. A prefix-load RPC, a pin result, a handoff publish,
begin and report each make exactly one call into the core and no call that changes
the table; the answer of a waiting RPC comes from the actions of the call that
settled it, never from asking again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from manual_rig import CHAIN, drain_outbound, manual_coordinator, settle

from coordinator.core.grants import (
    BeginHandoffRequest,
    PrefixLoadRequest,
    PublishHandoffRequest,
    TransferReport,
)
from coordinator.core.leases import Outcome, SendPin
from coordinator.runtime.lease_flow import LeaseFlow

T = TypeVar("T")

# Table reads the runtime may make after executing a step (the lease gauges, status).
TABLE_READS = frozenset(
    {"counts", "take_changed_counts", "config", "list_leases", "open_counts_by_engine"}
)


class Recorder:
    """Forwards every attribute; records the name of each method called."""

    def __init__(self, target: object, calls: list[str]) -> None:
        self._target = target
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self._calls.append(name)
            return value(*args, **kwargs)

        return recorded


def record(flow: LeaseFlow) -> tuple[list[str], list[str]]:
    core_calls: list[str] = []
    table_calls: list[str] = []
    flow.core = Recorder(flow.core, core_calls)  # type: ignore[assignment]
    flow.table = Recorder(flow.table, table_calls)  # type: ignore[assignment]
    return core_calls, table_calls


def one_call(calls: list[str], table_calls: list[str], name: str, run: Callable[[], Any]) -> Any:
    calls.clear()
    table_calls.clear()
    result = run()
    assert calls == [name], calls
    assert set(table_calls) <= TABLE_READS, table_calls
    return result


async def one_call_async(
    calls: list[str], table_calls: list[str], name: str, run: Callable[[], Awaitable[T]]
) -> asyncio.Future[T]:
    """Starts the RPC and lets it run up to its wait: one call into the core so far."""
    calls.clear()
    table_calls.clear()
    task = asyncio.ensure_future(run())
    await settle()
    assert calls == [name], calls
    assert set(table_calls) <= TABLE_READS, table_calls
    assert not task.done()
    calls.clear()
    return task


async def test_each_lease_request_enters_the_core_once() -> None:
    async with manual_coordinator() as rig:
        c = rig.coordinator
        holder, requester = rig.register("holder"), rig.register("req")
        rig.store(holder)
        drain_outbound(holder)
        calls, table = record(c.leases)

        # A prefix-load RPC: one call; it then waits for the pin without asking again.
        request = PrefixLoadRequest("r1", "req", CHAIN, "", 1, 0, 2_000, 10_000)
        ask = await one_call_async(
            calls, table, "request_prefix_load", lambda: c.leases.request_prefix_load(request)
        )
        (pin,) = [m for m in drain_outbound(holder) if isinstance(m, SendPin)]
        # The pin result is one call, and its actions answer the waiting RPC.
        one_call(
            calls,
            table,
            "on_pin_result",
            lambda: c.leases.on_pin_result("holder", (0, 0, 0), pin.lease_id, 8, b"d", ""),
        )
        calls.clear()
        answer = await ask
        assert answer.view is not None and answer.view.prefix_load_grant is not None
        assert calls == []  # answered from the settling call's actions
        report = TransferReport(pin.lease_id, "req", (0, 0, 0), Outcome.SUCCEEDED, 1, 1, "")
        one_call(calls, table, "complete", lambda: c.leases.complete_prefix_load(report))

        # A handoff: a begin that waits, the publish that makes it READY grants it.
        drain_outbound(requester)
        begin_req = BeginHandoffRequest("h1", "holder", "req", 5_000)
        begin = await one_call_async(
            calls, table, "begin_handoff", lambda: c.leases.begin_handoff(begin_req)
        )
        publish = PublishHandoffRequest("h1", "holder", (0, 0, 0), b"desc", b"params", None, 4)
        one_call(calls, table, "publish_handoff", lambda: c.leases.publish_handoff(publish))
        calls.clear()
        grant = await begin
        assert grant.kv_transfer_params == b"params" and calls == []


async def test_a_miss_is_answered_by_its_one_call() -> None:
    async with manual_coordinator() as rig:
        c = rig.coordinator
        rig.register("req")
        calls, table = record(c.leases)
        request = PrefixLoadRequest("r1", "req", CHAIN, "", 1, 0, 2_000, 10_000)
        calls.clear()
        answer = await c.leases.request_prefix_load(request)
        assert calls == ["request_prefix_load"]
        assert set(table) <= TABLE_READS
        assert answer.miss_reason == "no_candidate" and answer.view is None
