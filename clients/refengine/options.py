"""Options of one reference-engine rank part (`kvrc engine ...`). Torch-free."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvrc.credentials import ChannelOptions, split_targets
from kvrc.vocabulary import DEFAULT_COORDINATOR

Role = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class EngineOptions:
    role: Role
    engine_id: str
    tp_rank: int
    tp_size: int
    target: str  # the kvrc coordinator, HOST:PORT; replicas: HOST:PORT,HOST:PORT
    leader: str = ""  # HOST:PORT of tp rank 0's control channel (followers only)
    control_host: str = "127.0.0.1"
    model: str = "kvrc/reference"
    num_layers: int = 4
    num_blocks: int = 512
    block_size: int = 16
    num_kv_heads: int = 4  # total, before tensor-parallel sharding
    head_size: int = 64
    kv_dtype: str = "bfloat16"
    kv_layout: str = "NHD"
    device: str = "cpu"
    reuse_opt_in: bool = True
    hash_seed: int = 0
    retention_ms: int = 120_000  # decode: how long blocks stay after a request
    transfer_timeout_ms: int = 10_000
    pin_timeout_ms: int = 2_000
    mooncake_hostname: str = "127.0.0.1"
    mooncake_metadata: str = "P2PHANDSHAKE"
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_port_min: int | None = None
    mooncake_port_max: int | None = None
    # How to reach kvrc (kvrc/credentials.py): TLS, mutual TLS, bearer token.
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_server_name: str | None = None
    token_file: Path | None = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp rank {self.tp_rank} outside tp size {self.tp_size}")
        if self.num_kv_heads % self.tp_size:
            raise ValueError(
                f"{self.num_kv_heads} KV heads do not split over tp size {self.tp_size}"
            )
        if self.tp_rank > 0 and not self.leader:
            raise ValueError("a rank part other than tp rank 0 needs --leader HOST:PORT")
        # A CredentialsError or a bad list (ValueError) now, before the KV is made:
        # a token for a plaintext off-host target too (the same check as connect()).
        split_targets(self.coordinator)
        self.coordinator.check_token_transport()

    @property
    def coordinator(self) -> ChannelOptions:
        """Every channel to kvrc (session, leases, lookups) is made from these."""
        return ChannelOptions(
            self.target,
            ca_cert=self.tls_ca,
            client_cert=self.tls_cert,
            client_key=self.tls_key,
            server_name=self.tls_server_name,
            token_file=self.token_file,
        )

    @property
    def child_engine_id(self) -> str:
        return self.engine_id  # dense engines (dp_size 1) keep the bare engine id

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tp_size


def _port_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH, got {text!r}") from None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineOptions(role="prefill", engine_id="x", tp_rank=0, tp_size=1, target="")
    parser.add_argument("--role", required=True, choices=["prefill", "decode"])
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument(
        "--target",
        default=DEFAULT_COORDINATOR,
        help="kvrc HOST:PORT, or several kvrc replicas comma-separated (HOST:PORT,HOST:PORT): "
        "registers with the first that answers, moves on when it cannot be reached",
    )
    parser.add_argument("--leader", default="", help="tp rank 0's control HOST:PORT")
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--layers", type=int, default=d.num_layers)
    parser.add_argument("--blocks", type=int, default=d.num_blocks, help="KV blocks per rank part")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--kv-heads", type=int, default=d.num_kv_heads, help="total KV heads")
    parser.add_argument("--head-size", type=int, default=d.head_size)
    parser.add_argument("--kv-dtype", default=d.kv_dtype)
    parser.add_argument("--kv-layout", default=d.kv_layout, choices=["NHD", "HND"])
    parser.add_argument("--device", default=d.device, help='"cpu" or "cuda:N"')
    parser.add_argument("--no-reuse-opt-in", action="store_true")
    parser.add_argument("--hash-seed", type=int, default=d.hash_seed)
    parser.add_argument("--retention-ms", type=int, default=d.retention_ms)
    parser.add_argument("--transfer-timeout-ms", type=int, default=d.transfer_timeout_ms)
    parser.add_argument("--pin-timeout-ms", type=int, default=d.pin_timeout_ms)
    parser.add_argument("--mooncake-hostname", default=d.mooncake_hostname)
    parser.add_argument("--mooncake-metadata", default=d.mooncake_metadata)
    parser.add_argument("--mooncake-protocol", default=d.mooncake_protocol)
    parser.add_argument("--mooncake-device", default=d.mooncake_device)
    parser.add_argument("--mooncake-ports", type=_port_range, help="LOW-HIGH (below 32768)")
    parser.add_argument("--log-level", default="WARNING")
    # The same client flags as `kvrc status / drain / quarantine` (coordinator/edges/cli.py).
    parser.add_argument("--tls-ca", type=Path, help="PEM CA that signed kvrc's certificate: TLS")
    parser.add_argument("--tls-cert", type=Path, help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-server-name", help="check kvrc's certificate against this name, not the host"
    )
    parser.add_argument("--token-file", type=Path, help="file holding this engine's bearer token")


def options_from_args(args: argparse.Namespace) -> EngineOptions:
    ports = args.mooncake_ports
    return EngineOptions(
        role=args.role,
        engine_id=args.engine_id,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        target=args.target,
        leader=args.leader,
        model=args.model,
        num_layers=args.layers,
        num_blocks=args.blocks,
        block_size=args.block_size,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
        kv_dtype=args.kv_dtype,
        kv_layout=args.kv_layout,
        device=args.device,
        reuse_opt_in=not args.no_reuse_opt_in,
        hash_seed=args.hash_seed,
        retention_ms=args.retention_ms,
        transfer_timeout_ms=args.transfer_timeout_ms,
        pin_timeout_ms=args.pin_timeout_ms,
        mooncake_hostname=args.mooncake_hostname,
        mooncake_metadata=args.mooncake_metadata,
        mooncake_protocol=args.mooncake_protocol,
        mooncake_device=args.mooncake_device,
        mooncake_port_min=ports[0] if ports else None,
        mooncake_port_max=ports[1] if ports else None,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_server_name=args.tls_server_name,
        token_file=args.token_file,
    )
