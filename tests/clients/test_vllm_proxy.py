"""The P/D proxy's options and its pairing of prefill and decode (clients/vllm/proxy.py).

Real HTTP throughout: the proxy's own aiohttp app on a port, and small aiohttp
servers standing in for vLLM's OpenAI servers (they note what they were sent).
tests/e2e/vllm_engines/test_vllm_openai.py runs the proxy over real vLLM engines
and kvrc, where the reservation is kvrc's to enforce.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from harness import REPO

from clients.vllm.proxy import DecodeEngine, PdProxy, decode_engine, main


@dataclass
class StandIn:
    """A stand-in OpenAI server: a prefill answers kv_transfer_params, a decode its name."""

    name: str
    prefill: bool
    bodies: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if body.get("min_tokens", 0) > body.get("max_tokens", 16):  # as vLLM's check
            return web.json_response({"error": "min_tokens above max_tokens"}, status=400)
        if self.prefill:
            params = {**body["kv_transfer_params"], "do_remote_prefill": True}
            params.update(do_remote_decode=False, remote_engine_id=self.name)
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})
        return web.json_response({"choices": [{"text": self.name}]})


async def serve(app: web.Application, runners: list[web.AppRunner]) -> str:
    runner = web.AppRunner(app)
    await runner.setup()
    runners.append(runner)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def runners() -> AsyncIterator[list[web.AppRunner]]:
    started: list[web.AppRunner] = []
    yield started
    for runner in reversed(started):
        await runner.cleanup()


async def stand_in(name: str, prefill: bool, runners: list[web.AppRunner]) -> StandIn:
    engine = StandIn(name, prefill)
    app = web.Application()
    app.router.add_post("/v1/completions", engine.completions)
    engine.url = await serve(app, runners)
    return engine


async def test_each_handoff_is_reserved_for_the_decode_engine_that_gets_the_request(
    runners: list[web.AppRunner],
) -> None:
    prefill = await stand_in("p-0", True, runners)
    reserved = await stand_in("d-0", False, runners)
    bare = await stand_in("d-1", False, runners)
    proxy = PdProxy([prefill.url], [f"{reserved.url}=d-0", bare.url])
    proxy_url = await serve(proxy.app(), runners)
    body = {"model": "m", "prompt": "hi", "max_tokens": 8}
    async with ClientSession() as client:
        answered = []
        for _ in range(4):  # round robin: d-0, d-1, d-0, d-1
            async with client.post(proxy_url + "/v1/completions", json=body) as reply:
                answered.append((await reply.json())["choices"][0]["text"])
        async with client.get(proxy_url + "/stats") as reply:
            stats = await reply.json()
    assert answered == ["d-0", "d-1", "d-0", "d-1"]
    to_prefill = [b["kv_transfer_params"] for b in prefill.bodies]
    # The reservation travels to the prefill, for the engine that then gets the decode.
    assert (
        to_prefill
        == [
            {"do_remote_decode": True, "kvrc_decode_engine_id": "d-0"},
            {"do_remote_decode": True},
        ]
        * 2
    )
    assert [b["kv_transfer_params"]["kvrc_decode_engine_id"] for b in reserved.bodies] == [
        "d-0",
        "d-0",
    ]
    assert all("kvrc_decode_engine_id" not in b["kv_transfer_params"] for b in bare.bodies)
    assert stats == {"requests": 4, "handoffs": 4, "handoffs_reserved": 2, "prefill_failures": 0}


async def test_a_request_with_min_tokens_still_gets_its_handoff(
    runners: list[web.AppRunner],
) -> None:
    """The prefill is asked for one token; a client's min_tokens above 1 was passed on
    with it, vLLM refused the prefill (400) and every such request was recomputed."""
    prefill = await stand_in("p-0", True, runners)
    decode = await stand_in("d-0", False, runners)
    proxy = PdProxy([prefill.url], [f"{decode.url}=d-0"])
    proxy_url = await serve(proxy.app(), runners)
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "min_tokens": 4}
    async with ClientSession() as client:
        async with client.post(proxy_url + "/v1/completions", json=body) as reply:
            assert (await reply.json())["choices"][0]["text"] == "d-0"
        async with client.get(proxy_url + "/stats") as reply:
            stats = await reply.json()
    assert stats["handoffs"] == 1 and stats["prefill_failures"] == 0
    assert "min_tokens" not in prefill.bodies[0] and prefill.bodies[0]["max_tokens"] == 1
    assert decode.bodies[0]["min_tokens"] == 4  # the client's request, as it asked


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("http://127.0.0.1:8200=decode-0", DecodeEngine("http://127.0.0.1:8200", "decode-0")),
        ("https://d.svc:8200/=decode-0_dp1", DecodeEngine("https://d.svc:8200", "decode-0_dp1")),
        ("http://127.0.0.1:8200", DecodeEngine("http://127.0.0.1:8200", None)),
    ],
)
def test_a_decode_takes_its_child_engine_id_after_the_url(value: str, parsed: DecodeEngine) -> None:
    assert decode_engine(value) == parsed


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("http://127.0.0.1:8200=", "the child engine id after '=' is empty"),
        ("http://127.0.0.1:8200=  ", "the child engine id after '=' is empty"),
        ("http://127.0.0.1:8200=a b", "printable ASCII characters without spaces"),
        ("http://127.0.0.1:8200=décode", "printable ASCII characters without spaces"),
        ("http://127.0.0.1:8200=" + "x" * 257, "1..256 printable ASCII characters"),
        ("127.0.0.1:8200=decode-0", "is not an engine URL"),
        ("ftp://127.0.0.1:8200=decode-0", "is not an engine URL"),
        ("http://=decode-0", "is not an engine URL"),
        ("http://127.0.0.1:99999=decode-0", "is not a URL"),
        ("http://127.0.0.1:8200/?a=b", "no ?query or #fragment"),
    ],
)
def test_a_bad_decode_is_a_clear_usage_error(
    value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--prefill", "http://127.0.0.1:8100", "--decode", value])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("python -m clients.vllm.proxy: error: argument --decode: ")
    assert says in lines[-1]


def test_an_unreserved_decode_gets_one_startup_warning(tmp_path: Path) -> None:
    port_file = tmp_path / "port.json"
    proxy = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clients.vllm.proxy",
            "--prefill",
            "http://127.0.0.1:8100",
            "--decode",
            "http://127.0.0.1:8200=decode-0",
            "--decode",
            "http://127.0.0.1:8201",
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        give_up = time.monotonic() + 30
        while not port_file.is_file() or not port_file.read_text().endswith("}"):
            assert time.monotonic() < give_up and proxy.poll() is None, "the proxy did not start"
            time.sleep(0.05)
        assert json.loads(port_file.read_text())["port"] > 0
    finally:
        proxy.terminate()
        _, err = proxy.communicate(timeout=10)
    warnings = [line for line in err.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, err
    assert "http://127.0.0.1:8201" in warnings[0] and "unreserved" in warnings[0]
    assert "8200" not in warnings[0]
