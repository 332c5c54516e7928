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
import socket
import urllib.request
from typing import Any

import grpc
import pytest
from harness import start_coordinator
from waiting import wait_until

from clients.session import EngineProfile, EngineSession, RankPartRegistration


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
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ],
)
async def test_bytes_that_are_not_protobuf_sent_to_health_or_reflection_log_one_short_line(
    path: str,
) -> None:
    """grpc parses these two services' requests itself (kvrc's own parse with a parser
    that never raises): each junk request, from anyone, credentials or not, printed grpc's
    'Unexpected [DecodeError]' with a traceback. One line per 10 s now, no traceback."""
    with start_coordinator() as kvrc:
        channel = grpc.insecure_channel(kvrc.grpc_target)
        try:
            for _ in range(30):
                if path.endswith("Check"):
                    call: Any = channel.unary_unary(path, None, None)
                    with contextlib.suppress(grpc.RpcError):
                        call(b"\x07\x80", timeout=5)
                else:
                    stream: Any = channel.stream_stream(path, None, None)
                    with contextlib.suppress(grpc.RpcError):
                        list(stream(iter([b"\x07\x80"]), timeout=5))
        finally:
            channel.close()
        await wait_until(lambda: "DecodeError" in kvrc.stderr_text(), 10)
        await asyncio.sleep(0.5)  # the other 29 would be logged by now
        text = kvrc.stderr_text()
    assert "Traceback" not in text, text[-3000:]
    assert len([x for x in text.splitlines() if "DecodeError" in x]) == 1, text[-3000:]


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
