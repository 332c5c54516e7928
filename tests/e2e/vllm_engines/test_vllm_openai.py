"""vLLM's OpenAI server with KvrcConnector, behind the P/D proxy (item 7).

Two `python -m vllm.entrypoints.openai.api_server` processes (prefill on core 0,
decode on core 1), kvrc, and `clients.vllm.proxy --decode URL=CHILD_ENGINE_ID`. A
completion through the proxy, plain and streamed, equals the prefill server's own
single-engine completion; the decode server's connector counters
(`handoff_tokens_loaded`) show the prompt's KV was loaded, and the proxy's `/stats`
counts the handoffs, each reserved for the decode engine. A second proxy whose
decode URL is a stand-in that keeps the request shows kvrc holding that
reservation: the handoff's target is the decode engine before it begins, another
registered engine's begin is refused (PERMISSION_DENIED), the decode's is not.
"""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from harness import free_port
from lease_engine import LeaseEngine
from vllm_harness import (
    REPO,
    Kvrc,
    OpenAiServer,
    metric_sum,
    open_leases,
    post_json,
    post_stream,
    python_of_tests,
    random_prompt,
    workdir,
)

from clients.vllm.demo import engine_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def client_disconnects_mid_load(
    kvrc: Kvrc, prefill: OpenAiServer, decode: OpenAiServer, proxy_url: str, body: dict[str, Any]
) -> None:
    """A streaming client that hangs up while D's worker waits to pull: vLLM's server aborts
    the request (the proxy closes its decode request), the connector counts
    `loads_finished_early` and frees the blocks after the read, kvrc's lease ends, P frees
    its blocks (`handoffs_freed`), and D holds no request (vLLM's own gauges)."""
    before_d, before_p = decode.stats(), prefill.stats()
    prompt = random_prompt(52, 300)
    request = {
        **body,
        "prompt": prompt,
        "stream": True,
        # Long enough for the hang-up to reach D's engine while the load waits, also on
        # a loaded host (4 s was not, with the rest of the suite running beside it).
        "kv_transfer_params": {"kvrc_test_fault": "delay-before-pull=15"},
    }
    host, port = proxy_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request(
        "POST", "/v1/completions", json.dumps(request), {"Content-Type": "application/json"}
    )
    give_up = time.monotonic() + 30
    while metric_sum(kvrc, "kvrc_leases", flow="handoff", state="active") == 0:
        assert time.monotonic() < give_up, "D never took the handoff"
        time.sleep(0.05)
    connection.sock.shutdown(socket.SHUT_RDWR)  # the client hangs up mid-load
    connection.close()

    after_d = wait_counter(decode, "loads_finished_early", before_d, within_s=60)
    assert after_d.get("handoff_tokens_loaded", 0) >= before_d.get("handoff_tokens_loaded", 0)
    freed = wait_counter(prefill, "handoffs_freed", before_p, within_s=60)
    assert freed.get("handoff_hold_expired", 0) == before_p.get("handoff_hold_expired", 0)
    give_up = time.monotonic() + 60
    while open_leases(kvrc) > 0:
        assert time.monotonic() < give_up, "kvrc's handoff lease never ended"
        time.sleep(0.2)
    give_up = time.monotonic() + 30
    while (
        held := vllm_gauge(decode, "vllm:num_requests_running")
        + vllm_gauge(decode, "vllm:num_requests_waiting")
    ) > 0:
        assert time.monotonic() < give_up, f"D still holds {held} request(s) after the abort"
        time.sleep(0.2)


def wait_counter(
    server: OpenAiServer, key: str, before: dict[str, Any], within_s: float
) -> dict[str, Any]:
    """Wait until the connector counter `key` has grown by one since `before`."""
    give_up = time.monotonic() + within_s
    while (stats := server.stats()).get(key, 0) < before.get(key, 0) + 1:
        assert time.monotonic() < give_up, f"{server.name}: {key} stayed {stats.get(key, 0)}"
        time.sleep(0.1)
    return stats


def vllm_gauge(server: OpenAiServer, name: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def start_proxy(
    vllm_python: str, work: Path, name: str, prefill: str, decode: str
) -> tuple[subprocess.Popen[bytes], str]:
    """`clients.vllm.proxy` in the vLLM venv, and its URL once it listens."""
    port_file = work / f"{name}-port.json"
    proxy = subprocess.Popen(
        [
            vllm_python,
            "-m",
            "clients.vllm.proxy",
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ],
        cwd=REPO,
        env=engine_env("0", work),
        stdout=subprocess.DEVNULL,
        stderr=open(work / f"{name}.log", "wb"),  # noqa: SIM115 - the child keeps it
        start_new_session=True,
    )
    give_up = time.monotonic() + 30
    while not port_file.is_file() or not port_file.read_text().endswith("}"):
        assert time.monotonic() < give_up and proxy.poll() is None, f"{name} did not start"
        time.sleep(0.1)
    return proxy, f"http://127.0.0.1:{json.loads(port_file.read_text())['port']}"


class KeptDecode(http.server.ThreadingHTTPServer):
    """Stands in for the decode's URL: keeps each request body it is sent, answers 503.
    The prefill's handoff then stays READY, not begun, for the test to look at."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        kept = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                kept.bodies.append(json.loads(self.rfile.read(length)))
                self.send_error(503, "kept by the test")

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def kvrc_holds_the_reservation(
    vllm_python: str,
    work: Path,
    kvrc: Kvrc,
    prefill: OpenAiServer,
    decode: OpenAiServer,
    body: dict[str, Any],
    reference: str,
) -> None:
    """The proxy's reservation, as kvrc enforces it, on a handoff nobody has begun yet."""
    kept = KeptDecode()
    proxy, proxy_url = start_proxy(
        vllm_python, work, "kept-proxy", prefill.url, f"{kept.url}={decode.name}"
    )
    intruder = None
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            post_json(proxy_url + "/v1/completions", body)
        assert refused.value.code == 503  # the stand-in's answer, passed through
        [to_decode] = kept.bodies
        params = to_decode["kv_transfer_params"]
        assert params["kvrc_decode_engine_id"] == decode.name  # the proxy asked for it
        handoff, source = params["transfer_id"], params["remote_engine_id"]
        assert source == prefill.name

        # kvrc's lease names the reserved decode engine before any begin.
        [lease] = [
            x
            for x in kvrc.status(python_of_tests())["leases"]
            if x["flow"] == "handoff" and x["source_child_engine_id"] == prefill.name
        ]
        assert (lease["state"], lease["target_child_engine_id"]) == ("READY", decode.name)

        # Another registered, READY engine that knows the ids is refused.
        intruder = LeaseEngine(kvrc.target, engine_id="intruder")
        give_up = time.monotonic() + 30
        while not any(
            c["child_engine_id"] == "intruder" and c["ready"]
            for c in kvrc.status(python_of_tests())["child_engines"]
        ):
            assert time.monotonic() < give_up, "the intruder never became READY"
            time.sleep(0.2)
        begun = intruder.command("begin", request_id=handoff, prefill=source)
        assert begun["ok"] is False and begun["code"] == "PERMISSION_DENIED", begun
        assert f"reserved for decode child engine {decode.name!r}" in begun["message"]

        # The decode engine it is reserved for takes it: same answer, KV loaded.
        before = decode.stats()
        assert post_json(decode.url + "/v1/completions", to_decode)["choices"][0]["text"] == (
            reference
        )
        after = wait_counter(decode, "handoff_loads", before, within_s=30)
        assert after.get("handoff_load_failures", 0) == 0
    finally:
        if intruder is not None:
            intruder.kill()
        proxy.terminate()
        proxy.wait(10)
        kept.shutdown()
        kept.server_close()


def test_openai_servers_behind_the_pd_proxy(vllm_python: str, tiny_model: Path) -> None:
    work = workdir("openai")
    kvrc = Kvrc(python_of_tests(), work, "--reuse", "off")
    extra = {"kvrc_target": kvrc.target, "test_faults": True}
    prefill = OpenAiServer(
        vllm_python,
        work,
        "api-prefill",
        model=tiny_model,
        cores="0",
        kv_role="kv_producer",
        extra=extra,
        port=free_port(),
    )
    decode = OpenAiServer(
        vllm_python,
        work,
        "api-decode",
        model=tiny_model,
        cores="1",
        kv_role="kv_consumer",
        extra=extra,
        port=free_port(),
    )
    proxy = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        # Each handoff reserved for the decode's child engine id (its engine_id here).
        proxy, proxy_url = start_proxy(
            vllm_python, work, "proxy", prefill.url, f"{decode.url}={decode.name}"
        )

        prompt = random_prompt(51, 300)
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        reference = post_json(prefill.url + "/v1/completions", body)["choices"][0]["text"]

        via_proxy = post_json(proxy_url + "/v1/completions", body)
        assert via_proxy["choices"][0]["text"] == reference
        events = post_stream(proxy_url + "/v1/completions", {**body, "stream": True})
        assert len(events) > 1  # streamed through, chunk by chunk
        assert "".join(e["choices"][0]["text"] for e in events) == reference

        give_up = time.monotonic() + 30
        while decode.stats().get("handoff_loads", 0) < 2 and time.monotonic() < give_up:
            time.sleep(0.1)
        stats = decode.stats()
        assert stats["handoff_loads"] == 2
        # the second time D holds the prompt's 9 full blocks itself: it loads the tail only
        full_blocks = len(prompt) // 32
        assert stats["handoff_tokens_loaded"] == len(prompt) + (len(prompt) - full_blocks * 32)
        assert stats.get("handoff_load_failures", 0) == 0
        with urllib.request.urlopen(proxy_url + "/stats") as r:
            counters = json.loads(r.read())
        assert (counters["handoffs"], counters["handoffs_reserved"]) == (2, 2)

        client_disconnects_mid_load(kvrc, prefill, decode, proxy_url, body)
        # D still serves, from intact blocks
        assert post_json(proxy_url + "/v1/completions", body)["choices"][0]["text"] == reference
        kvrc_holds_the_reservation(vllm_python, work, kvrc, prefill, decode, body, reference)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        prefill.close()
        decode.close()
        kvrc.close()
