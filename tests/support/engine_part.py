"""A real engine rank-part process for tests, built on clients/session.py.

    python tests/engine_part.py --target 127.0.0.1:PORT --engine-id e1 --tp-rank 0 --tp-size 2

Prints one JSON line when registered (`{"registered": true, ...}`) or refused
(`{"registered": false, "code": "ALREADY_EXISTS", "message": ...}`, exit 3),
then one line per readiness change or re-registration, and stays alive until
killed. SIGTERM closes the session cleanly and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from clients.errors import KvrcClientError
from clients.session import (
    ChildEngineState,
    EngineProfile,
    EngineSession,
    RankPartRegistration,
    RegisterAck,
    SessionHandler,
)
from kvrc.vocabulary import TransferEndpoint


def emit(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


class Printer(SessionHandler):
    def __init__(self) -> None:
        self.started = False

    async def on_registered(self, ack: RegisterAck) -> None:
        if self.started:  # the first registration is printed by main()
            emit({"event": "registered", "session_id": ack.session_id, "ready": ack.state.ready})

    async def on_state(self, state: ChildEngineState) -> None:
        emit(
            {
                "event": "state",
                "ready": state.ready,
                "parts_present": state.parts_present,
                "parts_expected": state.parts_expected,
            }
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--child-engine-id", default="")
    for name in ("tp", "pp", "pcp", "dp"):
        p.add_argument(f"--{name}-rank", type=int, default=0)
        p.add_argument(f"--{name}-size", type=int, default=1)
    p.add_argument("--model", default="test-model")
    p.add_argument("--kv-dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reuse-opt-in", action="store_true")
    p.add_argument("--session-name", default="")
    p.add_argument("--metadata-hex", default="", help="endpoint agent_metadata, hex")
    p.add_argument("--no-reconnect", action="store_true")
    return p.parse_args()


async def main() -> int:
    args = parse_args()
    registration = RankPartRegistration(
        engine_id=args.engine_id,
        child_engine_id=args.child_engine_id,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        pp_rank=args.pp_rank,
        pp_size=args.pp_size,
        pcp_rank=args.pcp_rank,
        pcp_size=args.pcp_size,
        dp_rank=args.dp_rank,
        dp_size=args.dp_size,
        profile=EngineProfile(
            model=args.model,
            block_size=args.block_size,
            kv_dtype=args.kv_dtype,
            reuse_opt_in=args.reuse_opt_in,
        ),
        endpoint=TransferEndpoint(
            backend="mooncake",
            session_name=args.session_name,
            agent_metadata=bytes.fromhex(args.metadata_hex),
        ),
    )
    handler = Printer()
    session = EngineSession(
        args.target,
        registration,
        handler,
        reconnect=not args.no_reconnect,
        backoff_initial_s=0.05,
        backoff_max_s=0.5,
    )
    try:
        ack = await session.start()
    except KvrcClientError as e:
        emit({"registered": False, "code": e.code.name, "message": e.message})
        return 3
    handler.started = True
    emit(
        {
            "registered": True,
            "session_id": ack.session_id,
            "incarnation": ack.incarnation,
            "child_engine_id": ack.state.child_engine_id,
            "ready": ack.state.ready,
            "parts_present": ack.state.parts_present,
            "parts_expected": ack.state.parts_expected,
            "compatibility_hash": ack.compatibility_hash,
            "reuse_reason": ack.reuse.reason,
        }
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    await session.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
