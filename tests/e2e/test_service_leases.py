"""Prefix loads through the real service, with real engine processes (tests/lease_engine.py).

The holder is chosen from the inventory its engine published over its session;
it answers pins from its own process (possibly fewer blocks than advertised),
and its pins are released only at quiescence, after an acknowledged abort, by
an operator's resolution, or once the requester is proven gone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import CoordinatorProcess, metric_value, start_coordinator
from lease_engine import LeaseEngine
from test_service_handoff import lease_state, ready, status
from waiting import wait_until_sync

from clients.hashing import hash_block_chain
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

GRACE_MS = 1000
PROFILES = '[[profile]]\nname = "test"\nmodel = "test-model"\n'


@pytest.fixture(scope="module")
def kvrc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    profiles = Path(tmp_path_factory.mktemp("profiles")) / "profiles.toml"
    profiles.write_text(PROFILES)
    with start_coordinator(
        "--reuse",
        "on",
        "--profiles",
        str(profiles),
        "--session-grace-ms",
        str(GRACE_MS),
        "--abort-timeout-ms",
        "3000",
    ) as coordinator:
        yield coordinator


def start(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine], engine_id: str, **options: Any
) -> LeaseEngine:
    options.setdefault("reuse_opt_in", True)  # reuse_opt_in=False: no flag (option_flags)
    engine = LeaseEngine(kvrc.grpc_target, engine_id=engine_id, **options)
    engines.append(engine)
    return engine


def chain(name: str, n: int) -> list[str]:
    """`n` chained block hashes of a prompt named `name` (the one reference hasher)."""
    tokens = [ord(c) for c in name] * 16 * n
    return [h.hex() for h in hash_block_chain(tokens[: 16 * n], 16, seed=len(name))]


def store(kvrc: CoordinatorProcess, holder: LeaseEngine, hashes: list[str], requester: str) -> None:
    """Publishes the holder's inventory and waits until a lookup of `requester` sees it."""
    assert holder.command("events", hashes=hashes)["ok"]
    query = pb.LookupQuery(block_hashes=[bytes.fromhex(h) for h in hashes])
    with grpc.insecure_channel(kvrc.grpc_target) as channel:
        stub = pb_grpc.EngineServiceStub(channel)

        def visible() -> bool:
            answer = stub.Lookup(
                pb.LookupRequest(requester_child_engine_id=requester, queries=[query]), timeout=5
            )
            candidates = answer.results[0].candidates
            return any(c.child_engine_id == holder.child_engine_id for c in candidates)

        wait_until_sync(visible, 10, interval_s=0.05, what="the holder's blocks visible")


def stored_pair(
    kvrc: CoordinatorProcess,
    engines: list[LeaseEngine],
    name: str,
    blocks: int,
    *,
    holder_options: dict[str, Any] | None = None,
    requester_options: dict[str, Any] | None = None,
) -> tuple[LeaseEngine, LeaseEngine, list[str]]:
    """`hold-{name}` holds `blocks` blocks of prompt `name`, visible to `req-{name}`; both READY."""
    holder = start(kvrc, engines, f"hold-{name}", **(holder_options or {}))
    req = start(kvrc, engines, f"req-{name}", **(requester_options or {}))
    ready(kvrc, f"hold-{name}")
    ready(kvrc, f"req-{name}")
    hashes = chain(name, blocks)
    store(kvrc, holder, hashes, f"req-{name}")
    return holder, req, hashes


def load(
    requester: LeaseEngine, request_id: str, hashes: list[str], **fields: Any
) -> dict[str, Any]:
    reply = requester.command("request_load", request_id=request_id, hashes=hashes, **fields)
    assert reply["ok"], reply
    return reply


# --- end to end ------------------------------------------------------------------------------


def test_prefix_load_grants_the_shortest_pin_and_releases_at_quiescence(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    h0 = start(kvrc, engines, "hold-a", tp_rank=0, tp_size=2)
    h1 = start(kvrc, engines, "hold-a", tp_rank=1, tp_size=2, pin="3")  # fewer than advertised
    r0 = start(kvrc, engines, "req-a", tp_rank=0, tp_size=2)
    r1 = start(kvrc, engines, "req-a", tp_rank=1, tp_size=2)
    ready(kvrc, "hold-a")
    ready(kvrc, "req-a")
    hashes = chain("a", 6)
    store(kvrc, h0, hashes, "req-a")
    grants_before = metric_value(
        kvrc, "kvrc_lease_grant_duration_seconds_count", flow="prefix_load"
    )

    grant = load(r0, "q1", hashes, min_blocks=2, pin_timeout_ms=3000)
    assert grant["granted"] and grant["source"] == "hold-a"
    assert grant["matched_blocks"] == 3  # the short part caps the match
    pinned = [h0.event("pinned", grant["lease_id"]), h1.event("pinned", grant["lease_id"])]
    assert [p["pinned"] for p in pinned] == [6, 3]
    assert grant["source_parts"] == [p["descriptor"] for p in pinned]  # byte for byte
    assert lease_state(kvrc, grant["lease_id"]) == "ACTIVE"
    assert (
        metric_value(kvrc, "kvrc_lease_grant_duration_seconds_count", flow="prefix_load")
        == grants_before + 1
    )
    # The same request id gives the same lease (any rank part of the requester may ask).
    assert load(r1, "q1", hashes, min_blocks=2)["lease_id"] == grant["lease_id"]

    first = r0.command("complete_load", lease_id=grant["lease_id"], outcome="SUCCEEDED", bytes=10)
    assert (first["state"], first["quiescent"]) == ("ACTIVE", False)
    assert not h0.has_event("release", grant["lease_id"], within_s=0.3)
    again = r0.command("complete_load", lease_id=grant["lease_id"], outcome="SUCCEEDED", bytes=10)
    assert again["state"] == "ACTIVE"  # a double report is idempotent
    last = r1.command("complete_load", lease_id=grant["lease_id"], outcome="SUCCEEDED", bytes=10)
    assert (last["state"], last["quiescent"]) == ("COMPLETED", True)
    for holder in (h0, h1):
        assert holder.event("release", grant["lease_id"])["reason"].startswith("quiescent")
    # The ended grant is neither re-opened nor handed out again: its pins are gone (I6).
    repeat = r0.command("request_load", request_id="q1", hashes=hashes, min_blocks=2)
    assert (repeat["ok"], repeat["code"]) == (False, "FAILED_PRECONDITION"), repeat
    assert grant["lease_id"] in repeat["message"], repeat
    assert lease_state(kvrc, grant["lease_id"]) is None


def test_short_and_empty_pins_are_misses_not_errors(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    empty = start(kvrc, engines, "hold-empty", pin="0")
    short = start(kvrc, engines, "hold-short", pin="2")
    req = start(kvrc, engines, "req-miss")
    for e in (empty, short, req):
        ready(kvrc, e.child_engine_id)
    first, second = chain("empty", 5), chain("short", 5)
    store(kvrc, empty, first, "req-miss")
    store(kvrc, short, second, "req-miss")
    misses = metric_value(kvrc, "kvrc_prefix_load_misses_total", reason="short_pin")

    miss = load(req, "m1", first)
    assert (miss["granted"], miss["reason"]) == (False, "short_pin")
    assert metric_value(kvrc, "kvrc_prefix_load_misses_total", reason="short_pin") == misses + 1
    assert not empty.has_event("release", miss["lease_id"], within_s=0.3)  # it pinned nothing

    below = load(req, "m2", second, min_blocks=4)
    assert (below["granted"], below["reason"]) == (False, "below_min_blocks")
    assert short.event("release", below["lease_id"])  # it pinned 2: they are given back

    nothing = load(req, "m3", chain("nobody", 3))
    assert (nothing["granted"], nothing["reason"], nothing["lease_id"]) == (
        False,
        "no_candidate",
        "",
    )


def test_holder_that_dies_before_answering_is_a_miss_within_the_deadline(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    holder, req, hashes = stored_pair(kvrc, engines, "die", 4, holder_options={"pin": "never"})
    started = time.monotonic()
    tag = req.start_command("request_load", request_id="d1", hashes=hashes, pin_timeout_ms=1500)
    holder.event("pin_request")
    holder.kill()
    miss = req.result(tag)
    assert miss["ok"] and not miss["granted"]
    assert miss["reason"] in ("pin_timeout", "holder_gone")
    # Bounded by the pin timeout (1.5 s), not by a transfer deadline or a hang;
    # the slack absorbs a loaded CI machine.
    assert time.monotonic() - started < 1.5 + 5.0


def test_requester_that_dies_mid_transfer_is_released_at_the_leases_deadline(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    """Proven gone one grace period (1 s) after the kill, but a requester alive without
    its session could still read until the lease's deadline (4 s): released then."""
    holder, req, hashes = stored_pair(kvrc, engines, "rq", 4)
    granted = time.monotonic()
    grant = load(req, "g1", hashes, transfer_timeout_ms=4_000)
    req.kill()
    assert not holder.has_event("release", grant["lease_id"], within_s=2.5)
    release = holder.event("release", grant["lease_id"], timeout_s=10)
    assert time.monotonic() - granted >= 4.0 * 0.9
    assert "requester engine gone" in release["reason"]


def test_lease_timeout_with_a_live_requester_aborts_then_releases_after_the_ack(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    holder, req, hashes = stored_pair(
        kvrc, engines, "to", 4, requester_options={"abort": "delay:1500"}
    )
    aborts = metric_value(kvrc, "kvrc_lease_aborts_total", flow="prefix_load")
    grant = load(req, "t1", hashes, transfer_timeout_ms=600)
    req.event("abort", grant["lease_id"], timeout_s=5)
    assert lease_state(kvrc, grant["lease_id"]) == "ABORTING"
    acked = req.event("abort_acked", grant["lease_id"], timeout_s=5)  # just before the ack
    release = holder.event("release", grant["lease_id"], timeout_s=5)
    assert release["t"] >= acked["t"], (acked, release)  # released only after the ack
    assert metric_value(kvrc, "kvrc_lease_aborts_total", flow="prefix_load") == aborts + 1
    assert metric_value(kvrc, "kvrc_leases_ended_total", flow="prefix_load", state="failed") >= 1


def test_unknown_outcome_quarantines_until_resolved_by_rpc(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    # The requester never proves its reads quiet (it never acknowledges an abort).
    options = {"abort": "never"}
    holder, req, hashes = stored_pair(kvrc, engines, "uq", 3, requester_options=options)
    grant = load(req, "u1", hashes)
    done = req.command("complete_load", lease_id=grant["lease_id"], outcome="UNKNOWN")
    assert (done["state"], done["quiescent"]) == ("QUARANTINED", False)
    holder.event("quarantine", grant["lease_id"])
    req.event("abort", grant["lease_id"])  # asked for the proof, which never comes
    assert not holder.has_event("release", grant["lease_id"], within_s=0.5)
    assert lease_state(kvrc, grant["lease_id"]) == "QUARANTINED"
    with grpc.insecure_channel(kvrc.grpc_target) as channel:
        admin = pb_grpc.AdminServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            admin.ResolveQuarantine(pb.ResolveQuarantineRequest(lease_id=grant["lease_id"]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # no resolution named
        assert lease_state(kvrc, grant["lease_id"]) == "QUARANTINED"
        resolved = admin.ResolveQuarantine(
            pb.ResolveQuarantineRequest(
                lease_id=grant["lease_id"],
                resolution=pb.QUARANTINE_RESOLUTION_RELEASE,
                operator_note="checked the buffers",
            )
        )
    assert resolved.state == pb.LEASE_STATE_RESOLVED
    assert "operator" in holder.event("release", grant["lease_id"])["reason"]


def test_an_unknown_outcome_ends_when_the_requester_acks_the_abort_once_quiet(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    # I6-quiescence: the UNKNOWN part's abort ack (sent once its reads are quiet) is the
    # proof that ends the quarantine; the holder is released only after it.
    options = {"abort": "delay:800"}
    holder, req, hashes = stored_pair(kvrc, engines, "uk", 3, requester_options=options)
    grant = load(req, "k1", hashes)
    done = req.command("complete_load", lease_id=grant["lease_id"], outcome="UNKNOWN")
    assert done["state"] == "QUARANTINED"
    holder.event("quarantine", grant["lease_id"])
    req.event("abort", grant["lease_id"])
    acked = req.event("abort_acked", grant["lease_id"])  # printed just before the ack goes out
    release = holder.event("release", grant["lease_id"])
    assert release["t"] >= acked["t"], (acked, release)  # not before the ack was sent
    assert "proved its reads quiet" in release["reason"], release
    assert lease_state(kvrc, grant["lease_id"]) is None  # ended (FAILED), not open


# --- gate, authority, bad input ------------------------------------------------------------


def test_reuse_gate_and_bad_input_get_statuses_and_change_nothing(
    kvrc: CoordinatorProcess, engines: list[LeaseEngine]
) -> None:
    holder = start(kvrc, engines, "hold-bad")
    req = start(kvrc, engines, "req-bad")
    other = start(kvrc, engines, "req-other")
    closed = start(kvrc, engines, "req-closed", reuse_opt_in=False)
    for e in (holder, req, other, closed):
        ready(kvrc, e.child_engine_id)
    hashes = chain("bad", 4)
    store(kvrc, holder, hashes, "req-bad")
    grant = load(req, "b1", hashes)
    lease_id = grant["lease_id"]
    before = [
        (x.lease_id, x.state)
        for x in status(kvrc).leases
        if "bad" in x.lease_id + x.source_child_engine_id
    ]

    gated = closed.command("request_load", request_id="c1", hashes=hashes)
    assert gated["code"] == "FAILED_PRECONDITION" and "reuse" in gated["message"]
    assert other.command("complete_load", lease_id=lease_id, outcome="SUCCEEDED")["code"] == (
        "PERMISSION_DENIED"
    )
    assert req.command("complete_load", lease_id="nope", outcome="SUCCEEDED")["code"] == "NOT_FOUND"
    assert req.command("complete_handoff", lease_id=lease_id, outcome="SUCCEEDED")["code"] == (
        "NOT_FOUND"
    )
    # The same request id with another chain is refused, not silently re-used.
    assert req.command("request_load", request_id="b1", hashes=chain("x", 4))["code"] == (
        "ALREADY_EXISTS"
    )

    bad: list[pb.PrefixLoadRequest] = [
        pb.PrefixLoadRequest(request_id="o", requester_child_engine_id="req-bad",
                             block_hashes=[b"\x01" * 8] * 4097),
        pb.PrefixLoadRequest(request_id="h", requester_child_engine_id="req-bad",
                             block_hashes=[b"\x01" * 65]),
        pb.PrefixLoadRequest(request_id="", requester_child_engine_id="req-bad",
                             block_hashes=[b"\x01"]),
        pb.PrefixLoadRequest(request_id="e", requester_child_engine_id="req-bad"),
        pb.PrefixLoadRequest(request_id="m", requester_child_engine_id="req-bad",
                             block_hashes=[b"\x01"], min_blocks=2),
        pb.PrefixLoadRequest(request_id="t", requester_child_engine_id="req-bad",
                             block_hashes=[b"\x01"], pin_timeout_ms=10_000_000),
        pb.PrefixLoadRequest(request_id="l", requester_child_engine_id="req-bad",
                             block_hashes=[b"\x01", b"\x02"], local_blocks=2),
    ]  # fmt: skip
    with grpc.insecure_channel(kvrc.grpc_target) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        for request in bad:
            with pytest.raises(grpc.RpcError) as info:
                stub.RequestPrefixLoad(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request.request_id
        with pytest.raises(grpc.RpcError) as info:
            stub.RequestPrefixLoad(
                pb.PrefixLoadRequest(
                    request_id="u", requester_child_engine_id="ghost", block_hashes=[b"\x01"]
                ),
                timeout=5,
            )
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    after = [
        (x.lease_id, x.state)
        for x in status(kvrc).leases
        if "bad" in x.lease_id + x.source_child_engine_id
    ]
    assert after == before
    assert lease_state(kvrc, lease_id) == "ACTIVE"
    assert req.command("complete_load", lease_id=lease_id, outcome="FAILED")["state"] == "FAILED"
    assert holder.event("release", lease_id)


def test_reuse_off_refuses_prefix_loads_but_not_handoffs() -> None:
    with start_coordinator() as kvrc:
        engines: list[LeaseEngine] = []
        try:
            req = LeaseEngine(kvrc.grpc_target, engine_id="req-off", reuse_opt_in=True)
            pre = LeaseEngine(kvrc.grpc_target, engine_id="pre-off")
            dec = LeaseEngine(kvrc.grpc_target, engine_id="dec-off")
            engines += [req, pre, dec]
            for e in engines:
                ready(kvrc, e.child_engine_id)
            refused = req.command("request_load", request_id="x", hashes=chain("off", 2))
            assert refused["code"] == "FAILED_PRECONDITION"
            assert "--reuse on" in refused["message"]
            published = pre.command(
                "publish", request_id="h", params="{'k': 1}", num_blocks=1, block_ids=[1]
            )
            assert published["state"] == "READY"
            grant = dec.command("begin", request_id="h", prefill="pre-off")
            assert grant["ok"] and grant["params_repr"] == "{'k': 1}"
        finally:
            for e in engines:
                e.kill()
