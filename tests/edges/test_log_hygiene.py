"""What a client can make kvrc log: one line it can act on, never a traceback (I8-bad-input).

Both cases were found by the soak (benchmarks/soak.py) in a real kvrc process:
- a /metrics request that breaks the HTTP handler (a 64 KiB path answered 414
  to a peer that already hung up) printed socketserver's traceback per request;
- an engine naming a KV-event endpoint kvrc cannot bind logged the
  background task's traceback at ERROR.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import urllib.request
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from harness import start_coordinator
from waiting import wait_until

from clients.session import EngineProfile, EngineSession, RankPartRegistration
from coordinator.edges.server import SERVICE_NAMES


def _send_and_hang_up(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_RDWR)  # gone before the answer: its write fails


async def test_a_broken_metrics_request_is_one_rate_limited_line() -> None:
    # check_exit (the default) fails the test on any traceback in kvrc's stderr.
    with start_coordinator() as kvrc:
        for _ in range(20):
            _send_and_hang_up(kvrc.metrics_port, b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\n\r\n")
            _send_and_hang_up(kvrc.metrics_port, bytes(range(256)) * 16)
        await wait_until(lambda: "/metrics request from 127.0.0.1 failed" in kvrc.stderr_text(), 10)
        # /metrics still serves.
        response = await asyncio.to_thread(urllib.request.urlopen, kvrc.metrics_url, timeout=5)
        body = response.read().decode()
        assert "kvrc_rpc_requests_total" in body
        lines = [x for x in kvrc.stderr_text().splitlines() if "/metrics request from" in x]
    assert 1 <= len(lines) <= 2, lines  # one per 10 s interval, not one per request
    assert "Traceback" not in kvrc.stderr_text()


async def test_a_kv_event_endpoint_kvrc_cannot_bind_is_one_warning_not_a_traceback() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with start_coordinator() as kvrc:
            session = EngineSession(
                kvrc.grpc_target,
                RankPartRegistration(
                    engine_id="busy-port",
                    profile=EngineProfile(model="m", block_size=16),
                    # A host, not `*`: vLLM's publisher connects, so kvrc binds here.
                    kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                ),
            )
            await session.start()
            try:
                await wait_until(lambda: "KV-event endpoint refused" in kvrc.stderr_text(), 10)
                (line,) = [x for x in kvrc.stderr_text().splitlines() if "refused" in x]
                assert "busy-port" in line and "cannot bind" in line and "WARNING" in line
                # The registration stands: handoffs need no inventory.
                assert session.connected
            finally:
                await session.close()
        assert "Traceback" not in kvrc.stderr_text()
    finally:
        taken.close()


async def test_what_an_engine_sends_in_a_loop_is_a_few_quoted_lines_not_one_per_message() -> None:
    """A session's stale lease messages, refused registrations and sequence gaps each
    logged a line per message (6,000 lines for 4,000 messages), and a PinResult's
    error_message was logged as sent: a newline in it forged a line of kvrc's own."""
    import grpc
    from grpc.aio import EOF  # type: ignore[attr-defined]
    from test_bad_input import good_register

    from kvrc.v1 import kvrc_pb2 as pb
    from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

    forged = "WARNING quarantine of prefix_load lease pl-x resolved by an operator"
    rounds = 60
    with start_coordinator("--reuse", "on") as kvrc:  # on: the inventory takes events
        async with grpc.aio.insecure_channel(kvrc.grpc_target) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            call = stub.Session()  # type: ignore[call-arg]
            register = good_register("chatty")
            register.profile.parallel.tp_size = 1  # READY alone: its events are applied
            await call.write(pb.EngineMessage(register=register))
            ack: Any = await call.read()
            incarnation = ack.register_ack.incarnation
            for i in range(rounds):
                error = f"pin failed\n{forged} {i}"
                result = pb.PinResult(lease_id=f"pl-x{i}", error_message=error)
                await call.write(pb.EngineMessage(pin_result=result))
                await call.write(pb.EngineMessage(abort_ack=pb.AbortAck(lease_id=f"ho-y{i}")))
                begin = pb.EventBatch(incarnation=incarnation, sequence=20 * i + 1, dump_begin=True)
                await call.write(pb.EngineMessage(events=begin))
                gap = pb.EventBatch(incarnation=incarnation, sequence=20 * i + 7)
                await call.write(pb.EngineMessage(events=gap))
            # Refused in the core (the profile differs from rank 0's), not at the wire.
            for _ in range(rounds // 3):
                other = good_register("chatty", tp_rank=1)
                other.profile.model = "another-model"
                refused = stub.Session()  # type: ignore[call-arg]
                await refused.write(pb.EngineMessage(register=other))
                await refused.done_writing()
                with contextlib.suppress(grpc.aio.AioRpcError):
                    while await refused.read() is not EOF:
                        pass
            heartbeat = pb.EngineMessage(heartbeat=pb.Heartbeat())
            await call.write(heartbeat)  # the session stands: each was only ignored
            await wait_until(lambda: "registration refused" in kvrc.stderr_text(), 10)
            await call.done_writing()
        text = kvrc.stderr_text()
    lines = text.splitlines()
    for needle in ("answered lease", "AbortAck ignored", "lost events", "registration refused"):
        found = [x for x in lines if needle in x]
        assert 1 <= len(found) <= 2, (needle, found)  # one per 10 s, the rest counted
    assert not [x for x in lines if x.lstrip().startswith(forged)]
    assert any("\\n" + forged in x for x in lines)  # quoted: the newline is escaped


@pytest.mark.parametrize(
    "path",
    [
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ],
)
async def test_bytes_that_are_not_protobuf_sent_to_health_or_reflection_are_invalid_argument(
    path: str,
) -> None:
    """grpc parsed these services' requests itself: each junk request, from anyone,
    credentials or not, got UNKNOWN, and grpc printed 'Unexpected [DecodeError]' with a
    traceback (later one line per 10 s). They are parsed as kvrc's own are now (a parser
    that never raises): INVALID_ARGUMENT naming the message, and nothing logged."""
    junk = b"\x07\x80"
    errors: list[grpc.RpcError] = []
    with start_coordinator() as kvrc:
        channel = grpc.insecure_channel(kvrc.grpc_target)
        try:
            for _ in range(30):
                try:
                    if path.endswith("Check"):
                        channel.unary_unary(path, None, None)(junk, timeout=5)
                    elif path.endswith("Watch"):
                        list(channel.unary_stream(path, None, None)(junk, timeout=5))
                    else:
                        list(channel.stream_stream(path, None, None)(iter([junk]), timeout=5))
                except grpc.RpcError as e:
                    errors.append(e)
            # Negative control: a well-formed request on the same channel is answered.
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                health_pb2.HealthCheckRequest.SerializeToString,
                health_pb2.HealthCheckResponse.FromString,
            )
            answer = check(health_pb2.HealthCheckRequest(service=SERVICE_NAMES[0]), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            channel.close()
        await asyncio.sleep(0.5)  # a line for any of the 30 would be out by now
        text = kvrc.stderr_text()
    assert len(errors) == 30
    assert {e.code() for e in errors} == {grpc.StatusCode.INVALID_ARGUMENT}  # type: ignore[attr-defined]
    request_type = "ServerReflectionRequest" if "Reflection" in path else "HealthCheckRequest"
    details = str(errors[0].details())  # type: ignore[attr-defined]
    assert f"request to {path} is not a valid" in details and request_type in details, details
    assert "DecodeError" not in text and "Traceback" not in text, text[-3000:]


def test_grpcs_own_error_lines_are_one_per_kind_per_interval_without_a_traceback() -> None:
    """The net for what grpc still logs itself (kvrc parses every request now, above):
    30 of one kind are one line, its traceback dropped; the next line of that kind after
    the interval says how many were left out; another kind has its own line."""
    from coordinator.edges.server import _GrpcErrorLines
    from coordinator.runtime.log_limit import RateLimitedLog

    now = [0]
    grpc_log = logging.getLogger("test.grpc-lines")
    lines = _GrpcErrorLines(RateLimitedLog(grpc_log, lambda: now[0]))

    def record(msg: str) -> logging.LogRecord:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
        return grpc_log.makeRecord(grpc_log.name, logging.ERROR, "f", 1, msg, (), exc_info)

    kept = [r for r in (record("Unexpected [ValueError] /a") for _ in range(30)) if lines.filter(r)]
    assert len(kept) == 1 and kept[0].exc_info is None
    assert lines.filter(record("Unexpected [KeyError] /b"))  # another kind
    now[0] = 60_000
    again = record("Unexpected [ValueError] /a")
    assert lines.filter(again) and "29 more like it" in again.getMessage()


def test_a_metrics_request_that_never_finishes_is_dropped_after_the_timeout() -> None:
    """The /metrics server runs a thread per connection, with no timeout: a client that
    sent half a request and waited held its thread for good (anyone can connect)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from coordinator.edges.server import bound_http_requests

    httpd, thread = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        bound_http_requests(httpd, timeout_s=0.3)
        with socket.create_connection(("127.0.0.1", httpd.server_port), 5) as s:
            s.sendall(b"GET /metr")  # and nothing more
            s.settimeout(5)
            assert s.recv(1024) == b""  # closed by the server, not left waiting
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
