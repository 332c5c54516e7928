"""A small P/D proxy for vLLM's OpenAI server, in the style of vLLM's disaggregated examples.

    python -m clients.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --port 8000

For each `POST /v1/completions` or `/v1/chat/completions`:

1. the request goes to the prefill engine with `max_tokens=1` (and
   `max_completion_tokens=1`), `stream=false` and
   `kv_transfer_params={"do_remote_decode": true}`;
2. the prefill's answer carries `kv_transfer_params` (KvrcConnector's: vLLM's
   Mooncake/NIXL field names plus kvrc's); the original request goes to the
   decode engine with those params (over any `kv_transfer_params` the client sent,
   whose other fields pass through), and the decode's answer, streamed or not, is
   passed through unchanged. A client that disconnects closes the decode request,
   which vLLM's server aborts.

If the prefill fails, the request still goes to the decode engine without
params (it computes the prompt itself). `GET /healthz` answers 200. Needs
aiohttp (in every vLLM install). Several engines per side: round robin.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web  # type: ignore[import-not-found]

log = logging.getLogger("kvrc.vllm.proxy")


class PdProxy:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._prefill = itertools.cycle([p.rstrip("/") for p in prefill])
        self._decode = itertools.cycle([d.rstrip("/") for d in decode])
        self._session: ClientSession | None = None
        self.counters = {"requests": 0, "handoffs": 0, "prefill_failures": 0}

    async def start(self, app: web.Application) -> None:
        self._session = ClientSession(timeout=ClientTimeout(total=600))

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/healthz", self.health)
        app.router.add_get("/stats", self.stats)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.counters)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body: dict[str, Any] = await request.json()
        self.counters["requests"] += 1
        client_params = body.get("kv_transfer_params")
        path = request.path
        prefill_body = dict(body)
        prefill_body.update(
            stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body.pop("stream_options", None)
        params: dict[str, Any] | None = None
        try:
            async with self._session.post(next(self._prefill) + path, json=prefill_body) as reply:
                if reply.status == 200:
                    params = (await reply.json()).get("kv_transfer_params")
                else:
                    log.warning("prefill answered %d: %s", reply.status, (await reply.text())[:300])
        except Exception as e:  # the decode computes the prompt itself
            log.warning("prefill failed: %s", e)
        if params:
            self.counters["handoffs"] += 1
            passed = client_params if isinstance(client_params, dict) else {}
            body = {**body, "kv_transfer_params": {**passed, **params}}
        else:
            self.counters["prefill_failures"] += 1
        async with self._session.post(next(self._decode) + path, json=body) as reply:
            response = web.StreamResponse(status=reply.status)
            response.content_type = reply.content_type
            await response.prepare(request)
            try:
                async for chunk in reply.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:  # the client left: closing `reply` aborts the decode
                log.info("client of %s left mid-response; closing the decode request", path)
            return response


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clients.vllm.proxy")
    parser.add_argument("--prefill", action="append", required=True, help="prefill base URL")
    parser.add_argument("--decode", action="append", required=True, help="decode base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--port-file", help="write the bound port here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    async def serve() -> None:
        # A client that disconnects cancels its handler, which closes the decode request.
        runner = web.AppRunner(PdProxy(args.prefill, args.decode).app(), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        if args.port_file:
            with open(args.port_file, "w") as f:  # noqa: ASYNC230 - a few bytes, once
                json.dump({"port": port}, f)
        log.info("P/D proxy on http://%s:%d", args.host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
