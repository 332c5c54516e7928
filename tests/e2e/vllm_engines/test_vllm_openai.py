"""vLLM's OpenAI server with KvrcConnector, behind the P/D proxy (item 7).

Two `python -m vllm.entrypoints.openai.api_server` processes (prefill on core 0,
decode on core 1), kvrc, and `clients.vllm.proxy`. A completion through the
proxy, plain and streamed, equals the prefill server's own single-engine
completion; the decode server's connector counters (`handoff_tokens_loaded`)
show the prompt's KV was loaded, and the proxy's `/stats` counts the handoffs.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from harness import free_port
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
        port_file = work / "proxy-port.json"
        proxy = subprocess.Popen(
            [
                vllm_python,
                "-m",
                "clients.vllm.proxy",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--port",
                "0",
                "--port-file",
                str(port_file),
            ],
            cwd=REPO,
            env=engine_env("0", work),
            stdout=subprocess.DEVNULL,
            stderr=open(work / "proxy.log", "wb"),  # noqa: SIM115 - the child keeps it
            start_new_session=True,
        )
        give_up = time.monotonic() + 30
        while not port_file.is_file() or not port_file.read_text().endswith("}"):
            assert time.monotonic() < give_up and proxy.poll() is None, "the proxy did not start"
            time.sleep(0.1)
        proxy_url = f"http://127.0.0.1:{json.loads(port_file.read_text())['port']}"

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
            assert json.loads(r.read())["handoffs"] == 2

        client_disconnects_mid_load(kvrc, prefill, decode, proxy_url, body)
        # D still serves, from intact blocks
        assert post_json(proxy_url + "/v1/completions", body)["choices"][0]["text"] == reference
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        prefill.close()
        decode.close()
        kvrc.close()
