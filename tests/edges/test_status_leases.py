"""GetStatus lists a bounded number of leases, and lease ids whole only to admins.

`StatusRequest.max_leases` (0 = 1,000, at most 10,000) bounds the list: quarantined
leases first, then by deadline (none last); `leases_total` counts every open lease.
Past ~6,800 leases an answer listing all of them outgrew grpc's default 4 MiB receive
limit and `kvrc status` failed. With `--auth-tokens`, a caller without the admin role
sees each lease id shortened ("ho-1a2b3c4d..."): an id lets an engine act on a lease.

Pure checks first (the ordering, the shortening), then real `kvrc serve` subprocesses
with leases opened by handoff publishes from in-process engine sessions.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from harness import (
    PYTHON,
    REPO,
    CoordinatorProcess,
    get_status,
    metric_value,
    start_coordinator,
    wait_until,
    without_heartbeat_times,
)

from clients.refengine.demo import child_process_env
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from coordinator.core.leases import Flow, LeaseState, LeaseView
from coordinator.core.profiles import DeploymentProfile, ReuseReason, ReuseStatus
from coordinator.core.registry import RankPartRegistration as PartRegistration
from coordinator.core.registry import Registry
from coordinator.edges.cli import STATUS_MAX_RECEIVE_BYTES, _status_text
from coordinator.edges.grpc_wire import (
    STATUS_CHILD_ENGINE_BYTES,
    STATUS_LEASE_BYTES,
    shortened_lease_id,
    status_to_proto,
)
from coordinator.runtime.clock import ManualClock
from coordinator.runtime.coordinator import (
    MAX_STATUS_LEASES,
    ChildEngineStatus,
    StatusSnapshot,
    status_leases,
)
from kvrc.credentials import ChannelOptions, connect
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import TransferEndpoint

MIB = 1 << 20
HEX = "0123456789abcdef" * 2

# --- pure: which leases, and what a reader sees ------------------------------------------


def _view(lease_id: str, state: LeaseState, deadline_ms: int | None) -> LeaseView:
    return LeaseView(
        lease_id=lease_id,
        flow=Flow.HANDOFF,
        state=state,
        request_id=lease_id,
        source_child_engine_id="p",
        target_child_engine_id=None,
        created_ms=0,
        deadline_ms=deadline_ms,
        reason="",
        parts_reported=0,
        parts_expected=1,
    )


def test_quarantined_first_then_by_deadline_none_last() -> None:
    ready, quarantined = LeaseState.READY, LeaseState.QUARANTINED
    leases = [
        _view("late", ready, 900),
        _view("none", ready, None),
        _view("q-none", quarantined, None),
        _view("soon", ready, 100),
        _view("q-late", quarantined, 500),
        _view("tie-a", ready, 300),
        _view("tie-b", ready, 300),
        _view("none-2", LeaseState.WAITING_READY, None),
    ]
    order = ["q-late", "q-none", "soon", "tie-a", "tie-b", "late", "none", "none-2"]
    for k in range(len(leases) + 2):
        assert [v.lease_id for v in status_leases(leases, k)] == order[:k]
    assert status_leases((), 10) == ()


@pytest.mark.parametrize(
    ("lease_id", "shown"),
    [
        ("pl-" + HEX, "pl-01234567..."),
        ("ho-" + HEX, "ho-01234567..."),
        ("pl-89abcdef0123@replica-7", "pl-89abcdef..."),
        ("custom-lease-id", "custom-l..."),  # no kvrc prefix: its first 8 characters
        ("pl-", "pl-..."),  # not a kvrc id (nothing after the prefix): the same rule
    ],
)
def test_shortened_lease_ids(lease_id: str, shown: str) -> None:
    assert shortened_lease_id(lease_id) == shown


def test_the_lease_list_stays_inside_its_byte_budget_with_the_longest_ids() -> None:
    # 10,000 leases with 256-character ids and long reasons are ~18 MiB: past the
    # server's 16 MiB send limit. The most urgent ones that fit are listed.
    longest = "e" * 256
    views = tuple(
        LeaseView(
            lease_id=f"ho-{i:032x}@{'r' * 200}",
            flow=Flow.HANDOFF,
            state=LeaseState.READY,
            request_id=longest,
            source_child_engine_id=longest,
            target_child_engine_id=longest,
            created_ms=0,
            deadline_ms=i,
            reason="r" * 1_000,
            parts_reported=0,
            parts_expected=1,
        )
        for i in range(MAX_STATUS_LEASES)
    )
    snapshot = StatusSnapshot("v", True, False, (), leases=views, leases_total=len(views))
    answer = status_to_proto(snapshot, ManualClock(), full_lease_ids=True)
    assert sum(len(v.lease_id) + 1_800 for v in views) > 16 * MIB  # the case is real
    assert 0 < len(answer.leases) < MAX_STATUS_LEASES
    assert answer.ByteSize() <= STATUS_LEASE_BYTES + 1024
    assert [x.lease_id for x in answer.leases] == [v.lease_id for v in views][: len(answer.leases)]
    assert answer.leases_total == MAX_STATUS_LEASES


def test_the_child_engine_list_stays_inside_its_byte_budget() -> None:
    # A rank part's endpoint metadata may be 1 MiB: 24 engines' worth passes the
    # server's 16 MiB send limit on its own. They are listed in order while they fit.
    registry = Registry()
    for i in range(24):
        reg = PartRegistration(
            f"e{i:02d}",
            0,
            f"e{i:02d}",
            (0, 0, 0),
            DeploymentProfile(model="m", block_size=16),
            endpoint=TransferEndpoint(agent_metadata=bytes(1 << 20)),
        )
        registry.register(reg, f"s-{i}", 1, 0)
    reuse = ReuseStatus(False, ReuseReason.DISABLED_BY_COORDINATOR, "off")
    children = tuple(ChildEngineStatus(view, reuse) for view in registry.views())
    snapshot = StatusSnapshot("v", False, False, children)
    answer = status_to_proto(snapshot, ManualClock(), full_lease_ids=True)
    listed = [c.state.child_engine_id for c in answer.child_engines]
    assert 0 < len(listed) < 24 and listed == [f"e{i:02d}" for i in range(len(listed))]
    assert answer.child_engines_total == 24
    assert answer.ByteSize() <= STATUS_CHILD_ENGINE_BYTES + 1024
    text = _status_text("t", answer)
    assert "24 child engine(s)" in text and f"{len(listed)} of 24 child engines shown" in text


def test_the_cli_receives_the_largest_bounded_answer() -> None:
    # 10,000 leases of ~0.6 KB each (the size that broke the 4 MiB default at ~6,800).
    assert STATUS_MAX_RECEIVE_BYTES >= MAX_STATUS_LEASES * 614


# --- helpers over a real coordinator -------------------------------------------------------


def _descriptor() -> pb.RankPartDescriptor:
    return pb.RankPartDescriptor(
        rank=pb.RankCoordinates(),
        endpoint=pb.TransferEndpoint(backend="mooncake", session_name="127.0.0.1:1"),
        block_ids=[1],
    )


def _publish(prefill: str, request_id: str, decode: str = "") -> pb.PublishHandoffRequest:
    return pb.PublishHandoffRequest(
        request_id=request_id,
        prefill_child_engine_id=prefill,
        decode_child_engine_id=decode,
        descriptor=_descriptor(),
        kv_transfer_params=b"\x80",
        num_blocks=1,
    )


async def _publish_many(
    stub: pb_grpc.EngineServiceAsyncStub, requests: list[pb.PublishHandoffRequest]
) -> list[str]:
    """Their lease ids; a few hundred at a time, so the sessions' heartbeats keep going."""

    async def publish(request: pb.PublishHandoffRequest) -> pb.PublishHandoffResponse:
        reply: pb.PublishHandoffResponse = await stub.PublishHandoff(request, timeout=30)
        return reply

    ids: list[str] = []
    for start in range(0, len(requests), 200):
        replies = await asyncio.gather(*map(publish, requests[start : start + 200]))
        assert all(r.state == pb.LEASE_STATE_READY for r in replies)
        ids += [r.lease_id for r in replies]
    return ids


async def _status(target: str, max_leases: int) -> pb.StatusResponse:
    """GetStatus over a channel that takes the largest bounded answer."""
    options = ChannelOptions(
        target, grpc_options=(("grpc.max_receive_message_length", STATUS_MAX_RECEIVE_BYTES),)
    )
    channel = connect(options)
    try:
        stub = pb_grpc.AdminServiceStub(channel)
        reply: pb.StatusResponse = await stub.GetStatus(
            pb.StatusRequest(max_leases=max_leases), timeout=30
        )
        return reply
    finally:
        await channel.close(None)


def _kvrc(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "coordinator", *args],
        cwd=REPO,
        env=child_process_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _session(target: str | ChannelOptions, engine_id: str) -> EngineSession:
    registration = RankPartRegistration(
        engine_id=engine_id, profile=EngineProfile(model="m", block_size=16)
    )
    return EngineSession(target, registration, reconnect=False)


# --- a real coordinator: 30 ready handoffs and one quarantined -----------------------------


PUBLISHED = 30


@pytest.fixture
async def thirty() -> AsyncIterator[tuple[CoordinatorProcess, list[str], str]]:
    """kvrc with 30 READY handoffs (p) and one QUARANTINED (begun by d, whose session
    acknowledges no abort): (kvrc, the ready ids in publish order, the quarantined id)."""
    flags = (
        "--handoff-ready-max-wait-ms",
        "3600000",  # the ready ones stay open
        "--handoff-heartbeat-timeout-ms",
        "200",  # the begun one is aborted soon ...
        "--abort-timeout-ms",
        "200",  # ... and quarantined when no abort ack comes
    )
    with start_coordinator(*flags) as kvrc:
        sessions = [_session(kvrc.grpc_target, "p"), _session(kvrc.grpc_target, "d")]
        for session in sessions:
            await session.start()
        channel = connect(kvrc.grpc_target)
        try:
            engine = pb_grpc.EngineServiceStub(channel)
            ready = []
            for i in range(PUBLISHED):  # one at a time: deadlines in publish order
                ready += await _publish_many(engine, [_publish("p", f"r{i}")])
            [doomed] = await _publish_many(engine, [_publish("p", "doomed")])
            await engine.BeginHandoff(
                pb.BeginHandoffRequest(
                    request_id="doomed", prefill_child_engine_id="p", decode_child_engine_id="d"
                ),
                timeout=5,
            )

            async def quarantined() -> bool:
                status = await _status(kvrc.grpc_target, MAX_STATUS_LEASES)
                return any(
                    x.lease_id == doomed and x.state == pb.LEASE_STATE_QUARANTINED
                    for x in status.leases
                )

            await wait_until(quarantined, 20, what="the begun handoff quarantined")
            yield kvrc, ready, doomed
        finally:
            await channel.close(None)
            for session in sessions:
                await session.close()


async def test_at_most_max_leases_quarantined_first_then_by_deadline(
    thirty: tuple[CoordinatorProcess, list[str], str],
) -> None:
    kvrc, ready, doomed = thirty
    everything = await _status(kvrc.grpc_target, MAX_STATUS_LEASES)
    assert everything.leases_total == PUBLISHED + 1 == len(everything.leases)
    # Without --auth-tokens every caller sees whole ids.
    assert {x.lease_id for x in everything.leases} == {*ready, doomed}
    status = await _status(kvrc.grpc_target, 5)
    assert status.leases_total == PUBLISHED + 1 and len(status.leases) == 5
    first, *rest = status.leases
    assert (first.lease_id, first.state) == (doomed, pb.LEASE_STATE_QUARANTINED)
    # Then the soonest deadlines (those published first; a tie may go either way).
    deadlines = [x.deadline_unix_ms for x in rest]
    assert deadlines == sorted(deadlines) and all(deadlines)
    shown = {x.lease_id for x in status.leases}
    unlisted = [x.deadline_unix_ms for x in everything.leases if x.lease_id not in shown]
    assert len(unlisted) == PUBLISHED - 4 and max(deadlines) <= min(unlisted)
    assert shown <= {*ready[:6], doomed}
    # 0 asks for the default (1,000): all 31 here.
    assert len((await _status(kvrc.grpc_target, 0)).leases) == PUBLISHED + 1


async def test_max_leases_above_the_limit_is_invalid_and_changes_nothing(
    thirty: tuple[CoordinatorProcess, list[str], str],
) -> None:
    kvrc, _, _ = thirty
    invalid = metric_value(
        kvrc, "kvrc_rpc_requests_total", method="GetStatus", code="INVALID_ARGUMENT"
    )
    before = without_heartbeat_times(await _status(kvrc.grpc_target, MAX_STATUS_LEASES))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _status(kvrc.grpc_target, MAX_STATUS_LEASES + 1)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details() or ""
    assert "max_leases is 10001" in details and "10,000" in details
    after = without_heartbeat_times(await _status(kvrc.grpc_target, MAX_STATUS_LEASES))
    assert after == before
    assert metric_value(
        kvrc, "kvrc_rpc_requests_total", method="GetStatus", code="INVALID_ARGUMENT"
    ) == (invalid + 1)


async def test_cli_max_leases_prints_how_many_are_shown(
    thirty: tuple[CoordinatorProcess, list[str], str],
) -> None:
    kvrc, ready, doomed = thirty
    target = ("--target", kvrc.grpc_target)
    text = await asyncio.to_thread(_kvrc, "status", *target, "--max-leases", "3")
    assert text.returncode == 0, text.stderr
    assert "3 of 31 leases shown" in text.stdout
    first_three = [x.lease_id for x in (await _status(kvrc.grpc_target, 3)).leases]
    assert first_three[0] == doomed
    assert {x for x in ready if x in text.stdout} == set(first_three[1:])
    doc = json.loads(
        (await asyncio.to_thread(_kvrc, "status", *target, "--max-leases", "3", "--json")).stdout
    )
    assert doc["leases_total"] == 31 and len(doc["leases"]) == 3
    assert doc["leases"][0]["state"] == "QUARANTINED"
    whole = await asyncio.to_thread(_kvrc, "status", *target)
    assert whole.returncode == 0 and "leases shown" not in whole.stdout
    assert "31 lease(s) in flight or quarantined (1 quarantined)" in whole.stdout
    too_many = await asyncio.to_thread(_kvrc, "status", *target, "--max-leases", "100001")
    assert too_many.returncode == 1 and "INVALID_ARGUMENT" in too_many.stderr
    assert "the limit is 10,000" in too_many.stderr


# --- with --auth-tokens: readers see shortened ids, admins whole ones -----------------------

TOKENS = {
    "prefill": "tok-prefill-0123456789abcdef",
    "reader": "tok-reader-0123456789abcdef",
    "admin": "tok-admin-0123456789abcdef",
}
CREDENTIALS = f"""
[[token]]
name = "prefill-cred"
token = "{TOKENS["prefill"]}"
engine_ids = ["p"]
roles = ["read"]

[[token]]
name = "reader-cred"
token = "{TOKENS["reader"]}"
roles = ["read"]

[[token]]
name = "admin-cred"
sha256 = "{hashlib.sha256(TOKENS["admin"].encode()).hexdigest()}"
roles = ["admin"]
"""


@pytest.fixture
def authed(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    path = tmp_path / "auth.toml"
    path.write_text(CREDENTIALS)
    with start_coordinator("--auth-tokens", str(path)) as kvrc:
        yield kvrc


async def test_with_auth_readers_see_shortened_ids_and_admins_whole_ones(
    authed: CoordinatorProcess, tmp_path: Path
) -> None:
    def options(who: str) -> ChannelOptions:
        return ChannelOptions(authed.grpc_target, token=TOKENS[who])

    session = _session(options("prefill"), "p")
    await session.start()
    channels = {who: connect(options(who)) for who in TOKENS}
    try:
        published = await pb_grpc.EngineServiceStub(channels["prefill"]).PublishHandoff(
            _publish("p", "r1"), timeout=5
        )
        lease_id = published.lease_id
        assert lease_id.startswith("ho-") and len(lease_id) > len("ho-") + 8

        async def listed(who: str) -> list[str]:
            admin = pb_grpc.AdminServiceStub(channels[who])
            status = await admin.GetStatus(pb.StatusRequest(), timeout=5)
            assert status.leases_total == 1
            return [x.lease_id for x in status.leases]

        shortened = lease_id[: len("ho-") + 8] + "..."
        assert await listed("reader") == [shortened]
        # An engine's credential with the read role is no admin either.
        assert await listed("prefill") == [shortened]
        assert await listed("admin") == [lease_id]
        # `kvrc status` with a reader's token shows the short form only.
        token_file = tmp_path / "reader.token"
        token_file.write_text(TOKENS["reader"] + "\n")
        out = await asyncio.to_thread(
            _kvrc, "status", "--target", authed.grpc_target, "--token-file", str(token_file)
        )
        assert out.returncode == 0, out.stderr
        assert shortened in out.stdout and lease_id not in out.stdout
    finally:
        for channel in channels.values():
            await channel.close(None)
        await session.close()


# --- past 4 MiB: `kvrc status` still answers ------------------------------------------------

# 255-character child engine ids (the limit is 256) make each listed handoff ~0.65 KB.
LONG = "e" * 250
PREFILLS = (f"{LONG}-p0", f"{LONG}-p1")
DECODES = (f"{LONG}-d0", f"{LONG}-d1")  # reserved: never registered
PER_PREFILL = 3_800  # under the 4,096 open leases per engine


@pytest.fixture
async def crowded() -> AsyncIterator[tuple[CoordinatorProcess, int]]:
    """kvrc with 7,600 READY handoffs whose full list is above 4 MiB."""
    # Heartbeats share this loop with thousands of publishes: no false engine loss.
    flags = ("--handoff-ready-max-wait-ms", "3600000", "--heartbeat-timeout-ms", "60000")
    with start_coordinator(*flags) as kvrc:
        sessions = [_session(kvrc.grpc_target, p) for p in PREFILLS]
        for session in sessions:
            await session.start()
        channel = connect(kvrc.grpc_target)
        try:
            engine = pb_grpc.EngineServiceStub(channel)
            requests = [
                _publish(prefill, f"r{i}", decode)
                for prefill, decode in zip(PREFILLS, DECODES, strict=True)
                for i in range(PER_PREFILL)
            ]
            await _publish_many(engine, requests)
            yield kvrc, len(requests)
        finally:
            await channel.close(None)
            for session in sessions:
                await session.close()


async def test_status_past_4_mib_of_leases_still_succeeds(
    crowded: tuple[CoordinatorProcess, int],
) -> None:
    kvrc, total = crowded
    # The premise: every lease listed is above grpc's default 4 MiB receive limit, so
    # the old GetStatus (which listed them all) failed on a default channel, `kvrc
    # status`'s among them (RESOURCE_EXHAUSTED: 4,797,681 bytes vs. 4,194,304). Not
    # asked for here: the server logs a traceback for each answer a client refuses.
    everything = await _status(kvrc.grpc_target, MAX_STATUS_LEASES)
    assert len(everything.leases) == everything.leases_total == total
    assert everything.ByteSize() > 4 * MIB
    # The default answer is bounded: a default channel takes it.
    assert len((await get_status(kvrc.grpc_target, timeout_s=30)).leases) == 1_000
    # `kvrc status`: bounded by default, and its channel takes every lease on request.
    target = ("--target", kvrc.grpc_target)
    default = await asyncio.to_thread(_kvrc, "status", *target)
    assert default.returncode == 0, default.stderr
    assert f"1000 of {total} leases shown" in default.stdout
    full = await asyncio.to_thread(_kvrc, "status", *target, "--max-leases", "10000", "--json")
    assert full.returncode == 0, full.stderr
    doc = json.loads(full.stdout)
    assert doc["leases_total"] == total == len(doc["leases"])
