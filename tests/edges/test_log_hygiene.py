"""What a client can make kvrc log: one line it can act on, never a traceback (I8-bad-input).

Both cases were found by the soak (benchmarks/soak.py) in a real kvrc process:
- a /metrics request that breaks the HTTP handler (a 64 KiB path answered 414
  to a peer that already hung up) printed socketserver's traceback per request;
- an engine naming a KV-event endpoint kvrc cannot bind logged the
  background task's traceback at ERROR.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request

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
