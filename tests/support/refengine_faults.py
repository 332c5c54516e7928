"""The reference engine with pull faults: real failures, provoked on purpose.

    python tests/support/refengine_faults.py --fault-dir DIR <kvrc engine flags>

is `kvrc engine` with a `FaultHook` as its pull hook (clients/refengine/pull_hook.py),
so the production engine carries no test-only code. A test arms faults per request
and rank part before it sends the request, and every rank part reads them at its
pull; the engine's command channel is unchanged:

    faults = PullFaults(workdir / "faults")
    cluster = Cluster(workdir, engine_command=faults.engine_command())
    ...
    faults.arm("req-2", {1: "bad-remote-address"}, tp_size=2)
    await channel.call("prefill", request_id="req-2", ...)

Faults (FAULT_KINDS):

* "bad-remote-address": the part's read goes past the source's registered memory;
  Mooncake's peer refuses it (a real FAILED slice).
* "delay-before-pull=S": the part waits S seconds (0..60) between grant and read,
  after printing `{"event": "pull_delayed", "lease_id", "seconds"}` (a test freezes
  or kills the source, or lets the lease deadline pass, meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from clients.refengine.pull_hook import PullContext
from clients.transfer import TransferPlan

FAULT_KINDS = ("bad-remote-address", "delay-before-pull=S")
_FAR = 1 << 46  # past any registered memory of the peer
SCRIPT = Path(__file__).resolve()


def parse_faults(raw: Mapping[Any, Any], tp_size: int) -> dict[int, str]:
    """`{tp_rank: fault}`, checked before anything runs (ValueError names what is wrong)."""
    faults: dict[int, str] = {}
    for rank, fault in raw.items():
        kind, _, value = str(fault).partition("=")
        if not 0 <= int(rank) < tp_size:
            raise ValueError(f"test fault for tp rank {rank} of a tp {tp_size} engine")
        if kind == "delay-before-pull":
            if not 0 <= float(value) <= 60:
                raise ValueError(f"delay-before-pull must be 0..60 s, got {value!r}")
        elif kind != "bad-remote-address" or value:
            raise ValueError(f"unknown test fault {fault!r}; known: {FAULT_KINDS}")
        faults[int(rank)] = str(fault)
    return faults


def _fault_file(directory: Path, request_id: str) -> Path:
    return directory / f"{quote(request_id, safe='')}.json"


class PullFaults:
    """The test side: where faults are armed, and the engine command that reads them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def engine_command(self, python: str = sys.executable) -> list[str]:
        """The argv prefix of `kvrc engine` with this hook (`Cluster(engine_command=...)`)."""
        return [python, str(SCRIPT), "--fault-dir", str(self.directory)]

    def arm(self, request_id: str, faults: Mapping[int, str], *, tp_size: int) -> None:
        """Every rank part of the engine serving `request_id` applies its fault at its pull."""
        checked = parse_faults(faults, tp_size)
        path = _fault_file(self.directory, request_id)
        staging = path.with_suffix(".tmp")
        staging.write_text(json.dumps({str(rank): fault for rank, fault in checked.items()}))
        os.replace(staging, path)  # whole, never half-written, when a part reads it


@dataclasses.dataclass(frozen=True)
class FaultHook:
    """The engine side (a PullHook): applies the fault armed for this request and rank part."""

    directory: Path

    async def before_pull(self, context: PullContext, plan: TransferPlan) -> TransferPlan:
        path = _fault_file(self.directory, context.request_id)
        try:
            armed: dict[str, str] = json.loads(path.read_text())
        except FileNotFoundError:
            return plan
        kind, _, value = armed.get(str(context.tp_rank), "").partition("=")
        if kind == "bad-remote-address":
            far = tuple(address + _FAR for address in plan.remote_addresses)
            return dataclasses.replace(plan, remote_addresses=far)
        if kind == "delay-before-pull":
            from clients.refengine.engine import emit

            emit("pull_delayed", lease_id=context.lease_id, seconds=float(value))
            await asyncio.sleep(float(value))
        return plan


def main(argv: list[str] | None = None) -> int:
    from clients.refengine.engine import run_from_args  # torch, Mooncake: in the engine only
    from clients.refengine.options import add_engine_arguments

    parser = argparse.ArgumentParser(
        prog="refengine_faults", description="kvrc engine with test pull faults"
    )
    parser.add_argument("--fault-dir", type=Path, required=True, help="PullFaults.directory")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args, pull_hook=FaultHook(args.fault_dir))


if __name__ == "__main__":
    sys.exit(main())
