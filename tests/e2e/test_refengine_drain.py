"""The reference engine with real processes: credentials flags and `kvrc drain`.

One cluster: `kvrc serve --auth-tokens` on loopback (every RPC needs a bearer
token) and two tp=1 prefill reference engines started with `--token-file`.
An engine without a token is refused, so the engines' sessions, lookups and
lease calls all go through `kvrc/credentials.py`. Then `kvrc drain p1`
(the real CLI, with an admin token): p1 logs that it drains and asks for no
new prefix load, while a request is still served by recomputing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import REPO, wait_until
from refengine_blocks import tokens

from clients.refengine.channel import Channel
from clients.refengine.demo import BLOCK_SIZE, Cluster, EngineGroup, child_process_env
from clients.refengine.options import EngineOptions
from kvrc.credentials import ChannelOptions, connect
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(150)

MOONCAKE_PORTS = "26500-26999"
TOKENS = {
    "p0": "p0-token-0123456789abcdef",
    "p1": "p1-token-0123456789abcdef",
    "admin": "admin-token-0123456789abcdef",
}


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Cluster, dict[str, EngineGroup], dict[str, Path]]]:
    workdir = Path(tmp_path_factory.mktemp("drain"))
    files = {}
    for name, token in TOKENS.items():
        files[name] = workdir / f"{name}.token"
        files[name].write_text(token + "\n")
    (workdir / "tokens.toml").write_text(
        f'[[token]]\nname = "p0"\ntoken = "{TOKENS["p0"]}"\nengine_ids = ["p0"]\n\n'
        f'[[token]]\nname = "p1"\ntoken = "{TOKENS["p1"]}"\nengine_ids = ["p1"]\n\n'
        f'[[token]]\nname = "admin"\ntoken = "{TOKENS["admin"]}"\nroles = ["admin"]\n'
    )
    c = Cluster(workdir)
    try:
        c.start_coordinator("--auth-tokens", str(workdir / "tokens.toml"))
        extra = ["--mooncake-ports", MOONCAKE_PORTS]
        groups = c.start_engines(
            [
                ("p0", "prefill", 1, [*extra, "--token-file", str(files["p0"])]),
                ("p1", "prefill", 1, [*extra, "--token-file", str(files["p1"])]),
            ]
        )
        yield c, {g.engine_id: g for g in groups}, files
    finally:
        c.stop()
    assert c.coordinator is not None
    assert "Traceback" not in c.coordinator.stderr_path.read_text(errors="replace")


@pytest.fixture
async def engines(
    cluster: tuple[Cluster, dict[str, EngineGroup], dict[str, Path]],
) -> AsyncIterator[dict[str, Channel]]:
    _, groups, _ = cluster
    channels = {
        name: await Channel.connect("127.0.0.1", g.control_port, name=name)
        for name, g in groups.items()
    }
    for channel in channels.values():
        ready = await channel.call("ready", timeout_s=120.0, wait_s=100.0)
        assert ready["reuse_enabled"], ready
    yield channels
    for channel in channels.values():
        await channel.close()


async def call(channel: Channel, op: str, **args: Any) -> Any:
    return await channel.call(op, timeout_s=90.0, **args)


async def inventory_entries(target: str, admin_token: Path, child_engine_id: str) -> int:
    async with connect(ChannelOptions(target, token_file=admin_token)) as channel:
        status = await pb_grpc.AdminServiceStub(channel).GetStatus(pb.StatusRequest(), timeout=5)
    for child in status.child_engines:
        if child.state.child_engine_id == child_engine_id:
            return int(child.inventory_entries)
    return 0


def test_engine_credentials_flags_become_channel_options() -> None:
    """`kvrc engine --tls-* --token-file` reach ChannelOptions (the one client path)."""
    from clients.cli import build_parser

    args = build_parser().parse_args(
        [
            "engine",
            "--role=prefill",
            "--engine-id=e",
            "--target=kvrc.test:1",
            "--tls-ca=/ca.pem",
            "--tls-cert=/c.pem",
            "--tls-key=/k.pem",
            "--tls-server-name=kvrc.internal",
            "--token-file=/t",
        ]
    )
    from clients.refengine.options import options_from_args

    options = options_from_args(args).coordinator
    assert options == ChannelOptions(
        "kvrc.test:1",
        ca_cert=Path("/ca.pem"),
        client_cert=Path("/c.pem"),
        client_key=Path("/k.pem"),
        server_name="kvrc.internal",
        token_file=Path("/t"),
    )
    with pytest.raises(ValueError, match="client certificate needs its key"):
        EngineOptions(
            role="prefill", engine_id="e", tp_rank=0, tp_size=1, target="x:1", tls_cert=Path("/c")
        )


def test_an_engine_without_a_token_is_refused(
    cluster: tuple[Cluster, dict[str, EngineGroup], dict[str, Path]],
) -> None:
    c, _, _ = cluster
    group = EngineGroup("px", "prefill", 1)
    child = c.spawn("px-tp0", c.engine_argv(group, 0, ["--mooncake-ports", MOONCAKE_PORTS]))
    refused = child.wait_event("refused", 90.0)
    assert refused["code"] == "UNAUTHENTICATED", refused
    assert child.process.wait(30) == 3


async def test_drain_stops_new_prefix_loads_and_the_engine_still_serves(
    cluster: tuple[Cluster, dict[str, EngineGroup], dict[str, Path]],
    engines: dict[str, Channel],
) -> None:
    c, groups, files = cluster
    admin = files["admin"]
    # Before the drain: p1 loads p0's prefix (lookups and leases carry p1's token).
    first = tokens(1, 64)
    await call(engines["p0"], "prefill", request_id="a1", tokens=first, decode="")

    async def published(n: int) -> bool:
        return await inventory_entries(c.target, admin, "p0") >= n

    await wait_until(lambda: published(64 // BLOCK_SIZE), timeout_s=20)
    loaded = await call(
        engines["p1"], "prefill", request_id="b1", tokens=first + tokens(2, 32), decode=""
    )
    assert loaded["load"] == "loaded", loaded
    assert loaded["blocks_loaded"] == 64 // BLOCK_SIZE

    # kvrc drain p1, through the real CLI with the admin token.
    argv = [sys.executable, "-m", "coordinator", "drain", "p1", "--target", c.target]
    drained = await asyncio.to_thread(
        subprocess.run,
        [*argv, "--token-file", str(admin), "--json"],
        cwd=REPO,
        env=child_process_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert drained.returncode == 0, drained.stderr
    assert json.loads(drained.stdout)["child_engine_ids"] == ["p1"]
    note = groups["p1"].leader.wait_event("draining", 20.0)
    assert note["engine_id"] == "p1"
    assert "draining" in groups["p1"].leader.stderr_tail()  # logged for the operator

    # A prefix p0 holds and p1 does not: p1 no longer asks for it, it recomputes.
    second = tokens(3, 64)
    await call(engines["p0"], "prefill", request_id="a2", tokens=second, decode="")
    await wait_until(lambda: published(2 * 64 // BLOCK_SIZE), timeout_s=20)
    grants_before = len([e for e in groups["p1"].leader.events() if e["event"] == "granted"])
    served = await call(
        engines["p1"], "prefill", request_id="b2", tokens=second + tokens(4, 16), decode=""
    )
    assert served["load"] == "skipped (draining)", served
    assert served["blocks_loaded"] == 0
    assert served["blocks_recomputed"] == 80 // BLOCK_SIZE
    stats = await call(engines["p1"], "stats")
    assert stats["draining"] is True
    assert stats["loads_skipped_draining"] == 1
    grants_after = len([e for e in groups["p1"].leader.events() if e["event"] == "granted"])
    assert grants_after == grants_before
    # The blocks it computed are its own: served locally next time.
    again = await call(engines["p1"], "prefill", request_id="b3", tokens=second, decode="")
    assert again["blocks_local"] == 64 // BLOCK_SIZE
