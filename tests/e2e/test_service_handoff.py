"""Decode handoff through the real service, with real engine processes (tests/lease_engine.py).

No KV bytes move here: descriptors and kv_transfer_params must come out of the
coordinator byte for byte as the prefill parts put them in, and pins (the
prefill's blocks) must be released only at quiescence or after proven death.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from harness import REPO, CoordinatorProcess, metric_value, start_coordinator
from lease_engine import LeaseEngine
from waiting import wait_until_sync

from kvrc.kv_params import encode_kv_transfer_params
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

GRACE_MS = 1000
HEARTBEAT_TIMEOUT_MS = 1500
ABORT_TIMEOUT_MS = 3000

NIXL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": ([1, 2, 3], [7, 8]),  # one list per KV group, a tuple
    "remote_engine_id": "prefill-nixl_dp1",
    "remote_request_id": "cmpl-42",
    "remote_host": "10.0.0.5",
    "remote_port": 5600,
    "tp_size": 2,
    "pp_size": 1,
    "dcp_size": 1,
    "remote_num_tokens": 40,
    "remote_blocks_expiry_time": 1_700_000_000.25,
    "transfer_mode": "READ",
    "x_unknown_vendor_field": {"nested": [(1, b"\x00\xff"), None, 2**70]},
}
MOONCAKE_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "transfer_id": "xfer-0001",
    "remote_bootstrap_addr": "http://10.0.0.6:8998",
    "remote_engine_id": "prefill-mc",
    "x_extra": [[1, 2], (3, (4, 5))],
}


@pytest.fixture(scope="module")
def kvrc() -> Iterator[CoordinatorProcess]:
    with start_coordinator(
        "--session-grace-ms",
        str(GRACE_MS),
        "--handoff-heartbeat-timeout-ms",
        str(HEARTBEAT_TIMEOUT_MS),
        "--abort-timeout-ms",
        str(ABORT_TIMEOUT_MS),
    ) as coordinator:
        yield coordinator


def start(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine], engine_id: str, **options: Any
) -> LeaseEngine:
    engine = LeaseEngine(kvrc.grpc_target, engine_id=engine_id, **options)
    engines.append(engine)
    return engine


def ready(kvrc: CoordinatorProcess, child: str, timeout_s: float = 10.0) -> None:
    def is_ready() -> bool:
        return any(
            c.state.child_engine_id == child and c.state.ready for c in status(kvrc).child_engines
        )

    wait_until_sync(is_ready, timeout_s, interval_s=0.05, what=f"{child} READY")


def status(kvrc: CoordinatorProcess) -> pb.StatusResponse:
    with grpc.insecure_channel(kvrc.grpc_target) as channel:
        response: pb.StatusResponse = pb_grpc.AdminServiceStub(channel).GetStatus(
            pb.StatusRequest(), timeout=5
        )
        return response


def lease_state(kvrc: CoordinatorProcess, lease_id: str) -> str | None:
    for lease in status(kvrc).leases:
        if lease.lease_id == lease_id:
            return pb.LeaseState.Name(lease.state).removeprefix("LEASE_STATE_")
    return None


def engine_stub(kvrc: CoordinatorProcess) -> tuple[grpc.Channel, pb_grpc.EngineServiceStub]:
    channel = grpc.insecure_channel(kvrc.grpc_target)
    return channel, pb_grpc.EngineServiceStub(channel)


def publish(prefill: LeaseEngine, request_id: str, params: object, **fields: Any) -> dict[str, Any]:
    reply = prefill.command(
        "publish",
        request_id=request_id,
        params=repr(params),
        num_blocks=fields.pop("num_blocks", 3),
        block_ids=fields.pop("block_ids", [5, 6, 7]),
        opaque=fields.pop("opaque", "00ff10"),
        **fields,
    )
    assert reply["ok"], reply
    return reply


def begun_pair(
    kvrc: CoordinatorProcess,
    engines: list[LeaseEngine],
    name: str,
    request_id: str,
    params: object,
    *,
    keepalive: bool = True,
    decode_options: dict[str, Any] | None = None,
) -> tuple[LeaseEngine, LeaseEngine, dict[str, Any]]:
    """READY `pre-{name}` published `request_id`; READY `dec-{name}` began it (its grant)."""
    pre = start(kvrc, engines, f"pre-{name}")
    dec = start(kvrc, engines, f"dec-{name}", **(decode_options or {}))
    ready(kvrc, f"pre-{name}")
    ready(kvrc, f"dec-{name}")
    publish(pre, request_id, params)
    grant = dec.command("begin", request_id=request_id, prefill=f"pre-{name}", keepalive=keepalive)
    return pre, dec, grant


# --- both flows end to end -------------------------------------------------------------


def test_handoff_is_ready_only_after_every_prefill_part_and_passes_everything_through(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    p0 = start(kvrc, engines, "pre-a", tp_rank=0, tp_size=2)
    p1 = start(kvrc, engines, "pre-a", tp_rank=1, tp_size=2)
    dec = start(kvrc, engines, "dec-a")
    ready(kvrc, "pre-a")
    waits_before = metric_value(kvrc, "kvrc_handoff_wait_seconds_count")
    # The decode engine asks first and waits for READY.
    begin = dec.start_command("begin", request_id="r1", prefill="pre-a", wait_ms=10_000)
    first = publish(p0, "r1", NIXL_PARAMS, block_ids=[5, 6, 7])
    assert (first["state"], first["parts_reported"], first["parts_expected"]) == (
        "WAITING_READY",
        1,
        2,
    )
    with pytest.raises(TimeoutError):  # no grant before every part reported (0.3 s to show)
        dec.result(begin, timeout_s=0.3)
    second = publish(p1, "r1", NIXL_PARAMS, block_ids=[9, 10, 11], opaque="")
    assert second["state"] == "READY"
    grant = dec.result(begin)
    assert grant["ok"], grant
    assert grant["prefill"] == "pre-a" and grant["num_blocks"] == 3
    # Byte for byte: the params as encoded by the prefill, the descriptors in rank order.
    assert (
        grant["params_hex"] == first["params_hex"] == encode_kv_transfer_params(NIXL_PARAMS).hex()
    )
    assert grant["params_repr"] == repr(NIXL_PARAMS)
    assert grant["source_parts"] == [first["descriptor"], second["descriptor"]]
    assert lease_state(kvrc, grant["lease_id"]) == "ACTIVE"

    done = dec.command(
        "complete_handoff", lease_id=grant["lease_id"], outcome="SUCCEEDED", bytes=4096
    )
    assert (done["state"], done["quiescent"]) == ("COMPLETED", True)
    for part in (p0, p1):
        assert part.event("release", grant["lease_id"])["reason"].startswith("quiescent")
    assert lease_state(kvrc, grant["lease_id"]) is None  # no longer in flight
    assert metric_value(kvrc, "kvrc_handoff_wait_seconds_count") == waits_before + 1
    assert metric_value(kvrc, "kvrc_transfer_bytes_total", flow="handoff") >= 4096

    # A completed lease cannot be re-opened; a repeated report is idempotent.
    again = dec.command("complete_handoff", lease_id=grant["lease_id"], outcome="SUCCEEDED")
    assert again["ok"] and again["state"] == "COMPLETED"
    changed = dec.command("complete_handoff", lease_id=grant["lease_id"], outcome="FAILED")
    assert changed["code"] == "FAILED_PRECONDITION"
    reopen = dec.command("begin", request_id="r1", prefill="pre-a")
    assert reopen["code"] == "FAILED_PRECONDITION"
    extend = dec.command("begin", request_id="r1", prefill="pre-a", wait_ms=200)
    assert extend["code"] == "FAILED_PRECONDITION"  # ended: no point waiting


@pytest.mark.parametrize("params", [NIXL_PARAMS, MOONCAKE_PARAMS], ids=["nixl", "mooncake"])
def test_connector_params_with_unknown_fields_pass_through(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine], params: dict[str, Any]
) -> None:
    name = "nixl" if params is NIXL_PARAMS else "mc"
    pre = start(kvrc, engines, f"pre-{name}", dp_rank=1, dp_size=2)
    dec = start(kvrc, engines, f"dec-{name}")
    assert pre.child_engine_id == f"pre-{name}_dp1"  # never rewritten
    ready(kvrc, pre.child_engine_id)
    ready(kvrc, dec.child_engine_id)
    published = publish(pre, "r-pass", params, decode=dec.child_engine_id)
    assert published["state"] == "READY"
    grant = dec.command("begin", request_id="r-pass", prefill=pre.child_engine_id)
    assert grant["ok"], grant
    assert grant["params_hex"] == published["params_hex"]
    assert grant["params_repr"] == repr(params)
    assert grant["source_parts"] == [published["descriptor"]]
    assert grant["prefill"] == pre.child_engine_id
    dec.command("complete_handoff", lease_id=grant["lease_id"], outcome="SUCCEEDED")
    pre.event("release", grant["lease_id"])


# --- heartbeats, aborts, deaths, quarantine ------------------------------------------------


def test_keepalive_holds_the_lease_and_silence_aborts_it_before_any_release(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    pre = start(kvrc, engines, "pre-hb")
    alive = start(kvrc, engines, "dec-hb-alive")
    silent = start(kvrc, engines, "dec-hb-silent", abort="delay:1200")
    for e in (pre, alive, silent):
        ready(kvrc, e.child_engine_id)
    publish(pre, "kept", MOONCAKE_PARAMS)
    publish(pre, "dropped", MOONCAKE_PARAMS)
    kept = alive.command("begin", request_id="kept", prefill="pre-hb", keepalive=True)
    kept_at = time.monotonic()
    dropped = silent.command("begin", request_id="dropped", prefill="pre-hb")
    assert kept["heartbeat_interval_ms"] == HEARTBEAT_TIMEOUT_MS // 3
    # The silent decode is told to abort once its deadline passes; the prefill keeps its
    # blocks until the abort is acknowledged (1.2 s later).
    silent.event("abort", dropped["lease_id"], timeout_s=HEARTBEAT_TIMEOUT_MS / 1000 + 3)
    assert lease_state(kvrc, dropped["lease_id"]) == "ABORTING"
    acked = silent.event("abort_acked", dropped["lease_id"], timeout_s=3)
    release = pre.event("release", dropped["lease_id"], timeout_s=3)
    assert "abort" in release["reason"] and release["t"] >= acked["t"], (acked, release)
    # Two heartbeat timeouts after its grant the kept lease is still ACTIVE. Kept sleep: the
    # scenario is time passing with only keep-alives (no event to wait for); the abort above
    # already used most of it.
    time.sleep(max(0.0, kept_at + 2 * HEARTBEAT_TIMEOUT_MS / 1000 - time.monotonic()))
    assert lease_state(kvrc, kept["lease_id"]) == "ACTIVE"
    assert alive.command("stop_keepalive")["extensions"] >= 2
    assert not alive.has_event("abort", kept["lease_id"])
    done = alive.command("complete_handoff", lease_id=kept["lease_id"], outcome="SUCCEEDED")
    assert done["state"] == "COMPLETED"
    assert metric_value(kvrc, "kvrc_lease_aborts_total", flow="handoff") >= 1


def test_decode_that_dies_mid_transfer_is_released_only_after_proof(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    pre, dec, grant = begun_pair(kvrc, engines, "die", "r-die", NIXL_PARAMS)
    dec.kill()
    killed = time.monotonic()
    # Within the grace period the decode may come back: nothing is released.
    assert not pre.has_event("release", grant["lease_id"], within_s=GRACE_MS / 1000 * 0.6)
    release = pre.event("release", grant["lease_id"], timeout_s=5)
    assert time.monotonic() - killed >= GRACE_MS / 1000 * 0.9
    assert "gone" in release["reason"]
    assert lease_state(kvrc, grant["lease_id"]) is None


def test_unacknowledged_abort_quarantines_until_resolved_by_the_cli(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    pre, dec, grant = begun_pair(
        kvrc,
        engines,
        "q",
        "r-q",
        MOONCAKE_PARAMS,
        decode_options={"abort": "never"},
        keepalive=False,
    )
    lease_id = grant["lease_id"]
    quarantines = metric_value(kvrc, "kvrc_lease_quarantines_total", flow="handoff")
    dec.event("abort", lease_id, timeout_s=5)
    notice = pre.event("quarantine", lease_id, timeout_s=ABORT_TIMEOUT_MS / 1000 + 3)
    assert "abort not acknowledged" in notice["reason"]
    assert lease_state(kvrc, lease_id) == "QUARANTINED"
    assert metric_value(kvrc, "kvrc_lease_quarantines_total", flow="handoff") == quarantines + 1
    assert metric_value(kvrc, "kvrc_leases", flow="handoff", state="quarantined") >= 1
    # Visible in `kvrc status`, kept out of use: no release.
    shown = _kvrc("status", "--target", kvrc.grpc_target)
    assert lease_id in shown.stdout and "QUARANTINED" in shown.stdout
    doc = json.loads(_kvrc("status", "--target", kvrc.grpc_target, "--json").stdout)
    listed = {x["lease_id"]: x for x in doc["leases"]}
    assert listed[lease_id]["state"] == "QUARANTINED"
    assert (listed[lease_id]["flow"], listed[lease_id]["source_child_engine_id"]) == (
        "handoff",
        "pre-q",
    )
    assert not pre.has_event("release", lease_id, within_s=0.3)

    resolved = _kvrc("quarantine", "resolve", lease_id, "--target", kvrc.grpc_target, "--json")
    assert resolved.returncode == 0, resolved.stderr
    assert '"state": "RESOLVED"' in resolved.stdout
    assert "operator" in pre.event("release", lease_id)["reason"]
    assert lease_state(kvrc, lease_id) is None
    twice = _kvrc("quarantine", "resolve", lease_id, "--target", kvrc.grpc_target)
    assert twice.returncode == 1 and "FAILED_PRECONDITION" in twice.stderr
    unknown = _kvrc("quarantine", "resolve", "no-such-lease", "--target", kvrc.grpc_target)
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def _kvrc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- drain -------------------------------------------------------------------------------


def test_drain_refuses_new_handoffs_and_aborts_at_the_deadline(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    pre, dec, grant = begun_pair(
        kvrc, engines, "drain", "r-run", MOONCAKE_PARAMS, decode_options={"abort": "delay:300"}
    )
    drain = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "drain", "pre-drain", "--target",
         kvrc.grpc_target, "--timeout-ms", "1000", "--wait", "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pre.event("drain", timeout_s=5)
        # No new grants from a draining engine; the running lease goes on until the deadline.
        refused = pre.command(
            "publish", request_id="r-new", params="{}", num_blocks=1, block_ids=[1]
        )
        assert refused["code"] == "FAILED_PRECONDITION" and "draining" in refused["message"]
        child = next(
            c for c in status(kvrc).child_engines if c.state.child_engine_id == "pre-drain"
        )
        assert child.state.draining
        dec.event("abort", grant["lease_id"], timeout_s=5)
        assert pre.event("release", grant["lease_id"], timeout_s=5)
        out, err = drain.communicate(timeout=30)
    finally:
        drain.kill()
    assert drain.returncode == 0, err
    assert '"safe_to_stop": true' in out and '"leases_remaining": 0' in out
    # Unknown engines are NOT_FOUND.
    missing = _kvrc("drain", "no-such-engine", "--target", kvrc.grpc_target)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_drain_rpc_returns_safe_once_running_leases_complete(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    pre, dec, grant = begun_pair(kvrc, engines, "drain2", "r", MOONCAKE_PARAMS)
    with grpc.insecure_channel(kvrc.grpc_target) as channel:
        admin = pb_grpc.AdminServiceStub(channel)
        first = admin.Drain(pb.DrainRequest(child_engine_id="dec-drain2", timeout_ms=20_000))
        assert (first.leases_remaining, first.safe_to_stop) == (1, False)
        assert list(first.child_engine_ids) == ["dec-drain2"]
        # A draining decode engine takes no new handoff.
        publish(pre, "r2", MOONCAKE_PARAMS)
        refused = dec.command("begin", request_id="r2", prefill="pre-drain2")
        assert refused["code"] == "FAILED_PRECONDITION"
        waiting = admin.Drain.future(
            pb.DrainRequest(child_engine_id="dec-drain2", timeout_ms=20_000, wait=True)
        )
        with pytest.raises(grpc.FutureTimeoutError):  # it waits (0.3 s to show it does)
            waiting.result(timeout=0.3)
        dec.command("complete_handoff", lease_id=grant["lease_id"], outcome="SUCCEEDED")
        answer = waiting.result(timeout=10)
        assert (answer.leases_remaining, answer.safe_to_stop) == (0, True)
    assert not dec.has_event("abort", grant["lease_id"])


# --- bad input and authority ---------------------------------------------------------------


def test_bad_handoff_requests_get_statuses_and_change_nothing(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    pre = start(kvrc, engines, "pre-bad")
    dec = start(kvrc, engines, "dec-bad")
    other = start(kvrc, engines, "dec-other")
    half = start(kvrc, engines, "pre-half", tp_rank=0, tp_size=2)  # never READY
    for e in (pre, dec, other):
        ready(kvrc, e.child_engine_id)
    publish(pre, "r-bad", MOONCAKE_PARAMS)
    grant = dec.command("begin", request_id="r-bad", prefill="pre-bad", keepalive=True)
    lease_id = grant["lease_id"]
    before = mine(kvrc)

    # Not READY / unknown engines.
    not_ready = publish_raw(kvrc, prefill="pre-half", request_id="x")
    assert not_ready.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not READY" in (not_ready.details() or "")
    assert publish_raw(kvrc, prefill="ghost", request_id="x").code() == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    assert half.command("begin", request_id="r-bad", prefill="pre-bad")["code"] == (
        "FAILED_PRECONDITION"
    )
    # Nothing published yet; waiting runs out.
    assert dec.command("begin", request_id="nope", prefill="pre-bad")["code"] == "NOT_FOUND"
    late = dec.command("begin", request_id="nope", prefill="pre-bad", wait_ms=300)
    assert late["code"] == "DEADLINE_EXCEEDED"
    # Authority: another decode engine may not take, extend or report on this lease.
    assert other.command("begin", request_id="r-bad", prefill="pre-bad")["code"] == (
        "PERMISSION_DENIED"
    )
    denied = metric_value(kvrc, "kvrc_auth_denied_total", reason="foreign_lease")
    foreign = other.command("complete_handoff", lease_id=lease_id, outcome="SUCCEEDED")
    assert foreign["code"] == "PERMISSION_DENIED"
    assert metric_value(kvrc, "kvrc_auth_denied_total", reason="foreign_lease") == denied + 1
    unknown = dec.command("complete_handoff", lease_id="no-such-lease", outcome="SUCCEEDED")
    assert unknown["code"] == "NOT_FOUND"
    wrong_flow = dec.command("complete_load", lease_id=lease_id, outcome="SUCCEEDED")
    assert wrong_flow["code"] == "NOT_FOUND"

    channel, stub = engine_stub(kvrc)
    with channel:
        cases: list[tuple[Any, Any]] = [
            (stub.PublishHandoff, pb.PublishHandoffRequest(prefill_child_engine_id="pre-bad")),
            (
                stub.PublishHandoff,
                _publish_request("pre-bad", "big", params=b"\x00" * ((1 << 20) + 1)),
            ),
            (stub.PublishHandoff, _publish_request("pre-bad", "rank", descriptor_tp=1)),
            (
                stub.CompleteHandoff,
                pb.TransferReport(
                    lease_id=lease_id,
                    reporter_child_engine_id="dec-bad",
                    outcome=pb.TransferOutcome.ValueType(9),
                ),
            ),
            (
                stub.CompleteHandoff,
                pb.TransferReport(
                    reporter_child_engine_id="dec-bad", outcome=pb.TRANSFER_OUTCOME_SUCCEEDED
                ),
            ),
            (
                stub.ExtendHandoff,
                pb.ExtendHandoffRequest(lease_id="x" * 300, decode_child_engine_id="d"),
            ),
            (
                stub.BeginHandoff,
                pb.BeginHandoffRequest(
                    request_id="r", prefill_child_engine_id="pre-bad",
                    decode_child_engine_id="dec-bad", wait_timeout_ms=10_000_000,
                ),
            ),
        ]  # fmt: skip
        for method, request in cases:
            with pytest.raises(grpc.RpcError) as info:
                method(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
    assert mine(kvrc) == before
    assert lease_state(kvrc, lease_id) == "ACTIVE"
    done = dec.command("complete_handoff", lease_id=lease_id, outcome="SUCCEEDED")
    assert done["state"] == "COMPLETED"


def mine(kvrc: CoordinatorProcess) -> list[tuple[str, int]]:
    """Leases of this test's engines (other tests' leases on the shared coordinator move on)."""
    engines = {"pre-bad", "dec-bad", "dec-other", "pre-half", "ghost"}
    return [
        (x.lease_id, x.state)
        for x in status(kvrc).leases
        if x.source_child_engine_id in engines or x.target_child_engine_id in engines
    ]


def _publish_request(
    prefill: str, request_id: str, *, params: bytes = b"\x80", descriptor_tp: int = 0
) -> pb.PublishHandoffRequest:
    return pb.PublishHandoffRequest(
        request_id=request_id,
        prefill_child_engine_id=prefill,
        rank=pb.RankCoordinates(),
        descriptor=pb.RankPartDescriptor(rank=pb.RankCoordinates(tp_rank=descriptor_tp)),
        kv_transfer_params=params,
        num_blocks=1,
    )


def publish_raw(kvrc: CoordinatorProcess, *, prefill: str, request_id: str) -> grpc.RpcError:
    channel, stub = engine_stub(kvrc)
    with channel, pytest.raises(grpc.RpcError) as info:
        stub.PublishHandoff(_publish_request(prefill, request_id), timeout=5)
    return info.value


def test_drain_by_engine_id_covers_every_child_engine(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    start(kvrc, engines, "dpe", dp_rank=0, dp_size=2)
    start(kvrc, engines, "dpe", dp_rank=1, dp_size=2)
    ready(kvrc, "dpe_dp0")
    ready(kvrc, "dpe_dp1")
    out = _kvrc("drain", "dpe", "--target", kvrc.grpc_target, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc == {
        "child_engine_ids": ["dpe_dp0", "dpe_dp1"],
        "leases_remaining": 0,
        "safe_to_stop": True,
    }
    for engine in engines:
        engine.event("drain")
    draining = {c.state.child_engine_id: c.state.draining for c in status(kvrc).child_engines}
    assert draining["dpe_dp0"] and draining["dpe_dp1"]
