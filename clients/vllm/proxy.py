"""A small P/D proxy for vLLM's OpenAI server, in the style of vLLM's disaggregated examples.

    python -m clients.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200=decode-0 --port 8000

`--decode URL=CHILD_ENGINE_ID` names the kvrc child engine id that decode engine
registers with (its `kv_transfer_config.engine_id`; `<engine_id>_dp<rank>` with
several DP ranks, each behind its own URL: one URL that balances over several ranks
cannot be reserved for one): the proxy then reserves each handoff for it. A bare
`--decode URL` still works, unreserved (a startup warning says so): any engine
credential that knows the prefill's id and the request id could begin such a
handoff (docs/security.md).

For each `POST /v1/completions` or `/v1/chat/completions`:

1. the proxy picks the decode engine first (round robin), then sends the request
   to the prefill engine with `max_tokens=1` (and `max_completion_tokens=1`),
   `stream=false` and `kv_transfer_params={"do_remote_decode": true}`, plus
   `"kvrc_decode_engine_id": CHILD_ENGINE_ID` when that decode engine has one
   (KvrcConnector publishes the handoff reserved for it: only that engine may
   begin it);
2. the prefill's answer carries `kv_transfer_params` (KvrcConnector's: vLLM's
   Mooncake/NIXL field names plus kvrc's); the original request goes to the
   picked decode engine with those params (over any `kv_transfer_params` the
   client sent, whose other fields pass through), and the decode's answer,
   streamed or not, is passed through unchanged. A client that disconnects
   closes the decode request, which vLLM's server aborts.

If the prefill fails, the request still goes to the decode engine without
params (it computes the prompt itself). `GET /healthz` answers 200; `GET /stats`
the counters. Needs aiohttp (in every vLLM install). Several engines per side:
round robin.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
import sys
import urllib.parse
from collections.abc import Sequence
from typing import Any, NamedTuple

from aiohttp import ClientSession, ClientTimeout, web  # type: ignore[import-not-found]

log = logging.getLogger("kvrc.vllm.proxy")


# kvrc's own bound on a child engine id (coordinator/core/leases.py `_check_id`).
MAX_CHILD_ENGINE_ID_CHARS = 256


class DecodeEngine(NamedTuple):
    url: str  # base URL, no trailing slash
    child_engine_id: str | None  # kvrc's id of it: handoffs are reserved for it; None: not


def engine_url(text: str) -> str:
    """An engine's base URL, http(s)://HOST[:PORT][/PATH], without a trailing slash."""
    try:
        url = urllib.parse.urlsplit(text)
        url.port  # noqa: B018  # ValueError for a bad port
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL: {e}") from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an engine URL: give http(s)://HOST:PORT, e.g. http://127.0.0.1:8200"
        )
    if url.query or url.fragment:
        raise argparse.ArgumentTypeError(f"{text!r}: an engine URL has no ?query or #fragment")
    return text.rstrip("/")


def decode_engine(text: str) -> DecodeEngine:
    """`URL=CHILD_ENGINE_ID` (handoffs reserved for it) or a bare `URL` (unreserved)."""
    url, sep, child = text.partition("=")
    if not sep:
        return DecodeEngine(engine_url(text), None)
    child = child.strip()
    if not child:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the child engine id after '=' is empty; give URL=CHILD_ENGINE_ID "
            "(the decode's kvrc engine id), or the bare URL for unreserved handoffs"
        )
    if (
        len(child) > MAX_CHILD_ENGINE_ID_CHARS
        or not (child.isascii() and child.isprintable())
        or " " in child
    ):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a child engine id is 1..{MAX_CHILD_ENGINE_ID_CHARS} printable ASCII "
            "characters without spaces (as kvrc checks it)"
        )
    return DecodeEngine(engine_url(url), child)


class PdProxy:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str | DecodeEngine]) -> None:
        self._prefill = itertools.cycle([p.rstrip("/") for p in prefill])
        self._decode = itertools.cycle(
            [d if isinstance(d, DecodeEngine) else decode_engine(d) for d in decode]
        )
        self._session: ClientSession | None = None
        self.counters = {
            "requests": 0,
            "handoffs": 0,
            "handoffs_reserved": 0,  # of `handoffs`: reserved for their decode engine
            "prefill_failures": 0,
        }

    async def start(self, app: web.Application) -> None:
        # A decode's response streams for as long as it generates: hours, as vLLM's own
        # proxies allow (600 s cut long generations off); a dead engine is found at connect.
        self._session = ClientSession(timeout=ClientTimeout(total=6 * 3600, sock_connect=30))

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
        # The decode engine first: the prefill publishes the handoff reserved for it.
        decode = next(self._decode)
        to_prefill: dict[str, Any] = {"do_remote_decode": True}
        if decode.child_engine_id is not None:
            to_prefill["kvrc_decode_engine_id"] = decode.child_engine_id
        prefill_body = dict(body)
        prefill_body.update(stream=False, max_tokens=1, kv_transfer_params=to_prefill)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body.pop("stream_options", None)
        # vLLM refuses min_tokens above max_tokens (400): the prefill makes one token.
        prefill_body.pop("min_tokens", None)
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
            if decode.child_engine_id is not None:
                self.counters["handoffs_reserved"] += 1
            passed = client_params if isinstance(client_params, dict) else {}
            body = {**body, "kv_transfer_params": {**passed, **params}}
        else:
            self.counters["prefill_failures"] += 1
        async with self._session.post(decode.url + path, json=body) as reply:
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
    parser.add_argument(
        "--prefill", action="append", required=True, type=engine_url, help="prefill base URL"
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        type=decode_engine,
        metavar="URL[=CHILD_ENGINE_ID]",
        help="decode base URL and the kvrc child engine id it registers with: each handoff "
        "is reserved for it (a bare URL: unreserved handoffs)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--port-file", help="write the bound port here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    unreserved = [d.url for d in args.decode if d.child_engine_id is None]
    if unreserved:
        log.warning(
            "handoffs to %s are unreserved (any engine credential could begin them): "
            "give --decode URL=CHILD_ENGINE_ID to reserve them",
            ", ".join(unreserved),
        )

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
