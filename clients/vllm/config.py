"""`kv_connector_extra_config` of KvrcConnector: parsed once, every field checked.

A bad value fails engine start with one `KvrcConfigError` naming the field.

| field | default | meaning |
| --- | --- | --- |
| `kvrc_target` | `127.0.0.1:50051` | kvrc's gRPC `host:port`, or several kvrc replicas (below) |
| `kvrc_tls` | false | TLS with the system CAs |
| `kvrc_ca_cert`, `kvrc_client_cert`, `kvrc_client_key` | none | PEM paths (mutual TLS) |
| `kvrc_server_name` | none | certificate name to check instead of the target host |
| `kvrc_token_file` | none | bearer token file (needs TLS, or a loopback `kvrc_target`) |
| `reuse` | false | opt this engine into prefix loads (kvrc must have reuse on, too) |
| `min_blocks` | 2 | a prefix load must bring at least this many blocks |
| `mooncake_protocol` | `tcp` | Mooncake transport: `tcp` here, `rdma` on RDMA hosts |
| `mooncake_device` | `""` | Mooncake device name (RDMA NIC), empty for tcp |
| `mooncake_hostname` | `$VLLM_HOST_IP` or `127.0.0.1` | address peers read this engine's KV at |
| `mooncake_read_sleep_share` | 0.5 | a read sleeps this share of its predicted time first |
| `lookup_timeout_ms` | 300 | longest a request waits for Lookup + grant |
| `lookup_step_wait_ms` | 5 | longest one scheduler step waits, in all, for those answers |
| `pin_timeout_ms` | 1000 | how long kvrc waits for the holder's pin |
| `transfer_timeout_ms` | 10000 | deadline of one Mooncake read |
| `handoff_wait_ms` | 15000 | how long the decode waits for the prefill's handoff to be READY |
| `handoff_hold_s` | 120 | a prefill frees a handoff's blocks after this even without a release |
| `register_timeout_s` | 30 | a worker waits this long to register, then serves without kvrc |
| `switch_interval_s` | 0.0005 | the process's GIL switch interval (kvrc's thread vs vLLM's loop) |
| `stall_dump_s` | 0 (off) | a worker's kvrc thread stalled this long dumps all stacks to stderr |
| `model_name` | the model path | the profile's model name (engines exchanging KV must agree) |
| `stats_file` | none | the scheduler side's counters, as JSON, once a step (tests, demos) |
| `test_faults` | false | tests only: honour a request's `kvrc_test_fault` |

Several kvrc replicas sharing one `--store`: `kvrc_target` is a list,
`["kvrc-0:50051", "kvrc-1:50051"]`, or the same comma-separated,
`"kvrc-0:50051,kvrc-1:50051"` (an empty item, a repeat or a bad port is refused).
Each rank part registers with the first that answers, in this order, and moves to
the next only when its replica cannot be reached (docs/operations.md). Give every
engine the same list, in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvrc.credentials import ChannelOptions, parse_targets
from kvrc.vocabulary import (
    DEFAULT_COORDINATOR,
    PROFILE_EXTRA_HASH_ALGO,
    PROFILE_EXTRA_HASH_SEED,
    PROFILE_EXTRA_INT_HASHES,
    PROFILE_HASH_SEED_UNSET,
)


class KvrcConfigError(ValueError):
    """A bad `kv_connector_extra_config` field; the message names it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"KvrcConnector: kv_connector_extra_config.{field}: {problem}")
        self.field = field


@dataclass(frozen=True, slots=True)
class KvrcConnectorConfig:
    kvrc_target: str = DEFAULT_COORDINATOR  # a list is kept comma-joined: "a:1,b:2"
    kvrc_tls: bool = False
    kvrc_ca_cert: str = ""
    kvrc_client_cert: str = ""
    kvrc_client_key: str = ""
    kvrc_server_name: str = ""
    kvrc_token_file: str = ""
    reuse: bool = False
    min_blocks: int = 2
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_hostname: str = ""
    mooncake_read_sleep_share: float = 0.5
    lookup_timeout_ms: int = 300
    lookup_step_wait_ms: int = 5
    pin_timeout_ms: int = 1000
    transfer_timeout_ms: int = 10_000
    handoff_wait_ms: int = 15_000
    handoff_hold_s: float = 120.0
    register_timeout_s: float = 30.0
    switch_interval_s: float = 0.0005
    stall_dump_s: float = 0.0
    model_name: str = ""
    stats_file: str = ""
    # Tests only: honour a request's `kvrc_test_fault` kv_transfer_param
    # ("corrupt": noise over the loaded blocks after a good read, the negative
    # control that proves an output comparison can fail; "delay-before-pull=S";
    # "delay-lookup=S": the scheduler's prefix lookup asks kvrc S late).
    test_faults: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvrcConnectorConfig:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise KvrcConfigError(unknown[0], f"unknown field; known: {', '.join(sorted(known))}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            if name == "kvrc_target":
                values[name] = _coerce_targets(value)
                continue
            default = known[name].default
            values[name] = _coerce(name, value, type(default))
        config = cls(**values)
        config._check()
        return config

    def _check(self) -> None:
        self.kvrc_targets  # noqa: B018  # KvrcConfigError now, not at connect
        if self.min_blocks < 1:
            raise KvrcConfigError("min_blocks", f"must be >= 1, got {self.min_blocks}")
        if self.mooncake_protocol not in ("tcp", "rdma", "nvlink", "efa", "cxl"):
            raise KvrcConfigError(
                "mooncake_protocol", f"{self.mooncake_protocol!r} is not tcp/rdma/nvlink/efa/cxl"
            )
        for name, low, high in (
            ("lookup_timeout_ms", 1, 10_000),
            ("lookup_step_wait_ms", 0, 10_000),
            ("pin_timeout_ms", 10, 60_000),
            ("transfer_timeout_ms", 100, 600_000),
            ("handoff_wait_ms", 0, 600_000),
        ):
            value = getattr(self, name)
            if not low <= value <= high:
                raise KvrcConfigError(name, f"must be in {low}..{high}, got {value}")
        if not 0 <= self.mooncake_read_sleep_share < 1:
            raise KvrcConfigError(
                "mooncake_read_sleep_share",
                f"must be in [0, 1), got {self.mooncake_read_sleep_share}",
            )
        if not 1 <= self.handoff_hold_s <= 3600:
            raise KvrcConfigError(
                "handoff_hold_s", f"must be in 1..3600, got {self.handoff_hold_s}"
            )
        if not 0.00001 <= self.switch_interval_s <= 0.1:
            raise KvrcConfigError(
                "switch_interval_s", f"must be in 0.00001..0.1, got {self.switch_interval_s}"
            )
        if not (self.stall_dump_s == 0 or 1 <= self.stall_dump_s <= 3600):
            raise KvrcConfigError(
                "stall_dump_s", f"must be 0 (off) or in 1..3600, got {self.stall_dump_s}"
            )
        if not 0 < self.register_timeout_s <= 600:
            raise KvrcConfigError(
                "register_timeout_s", f"must be in (0, 600], got {self.register_timeout_s}"
            )
        for name in ("kvrc_ca_cert", "kvrc_client_cert", "kvrc_client_key", "kvrc_token_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise KvrcConfigError(name, f"{path!r} is not a readable file")
        if bool(self.kvrc_client_cert) != bool(self.kvrc_client_key):
            raise KvrcConfigError("kvrc_client_key", "a client certificate needs its key")
        try:
            # A token for a plaintext off-host target: refused now, at engine start, not
            # at the first channel (the same check and message as connect()).
            self.channel_options().check_token_transport()
        except ValueError as e:
            raise KvrcConfigError("kvrc_target", str(e)) from None

    @property
    def kvrc_targets(self) -> tuple[str, ...]:
        """Every kvrc replica, in the order each rank part tries them."""
        try:
            return parse_targets(self.kvrc_target)
        except ValueError as e:
            raise KvrcConfigError("kvrc_target", str(e)) from None

    def channel_options(self) -> ChannelOptions:
        """All targets in one (comma-joined): `EngineSession` splits them; see config."""
        return ChannelOptions(
            target=self.kvrc_target,
            tls=self.kvrc_tls,
            ca_cert=Path(self.kvrc_ca_cert) if self.kvrc_ca_cert else None,
            client_cert=Path(self.kvrc_client_cert) if self.kvrc_client_cert else None,
            client_key=Path(self.kvrc_client_key) if self.kvrc_client_key else None,
            server_name=self.kvrc_server_name or None,
            token_file=Path(self.kvrc_token_file) if self.kvrc_token_file else None,
        )

    @property
    def hostname(self) -> str:
        return self.mooncake_hostname or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


def _coerce_targets(value: Any) -> str:
    """A list or a comma-separated string, checked and kept as "a:1,b:2"."""
    if isinstance(value, (list, tuple)):
        if not all(isinstance(t, str) for t in value):
            raise KvrcConfigError("kvrc_target", f"a list of HOST:PORT strings, got {value!r}")
    elif not isinstance(value, str):
        raise KvrcConfigError(
            "kvrc_target", f"HOST:PORT, a comma-separated string or a list, got {value!r}"
        )
    try:
        return ",".join(parse_targets(value))
    except ValueError as e:
        raise KvrcConfigError("kvrc_target", str(e)) from None


def _coerce(name: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "on", "off", "1", "0"):
            return value.lower() in ("true", "on", "1")
        raise KvrcConfigError(name, f"must be a boolean, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise KvrcConfigError(name, f"must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise KvrcConfigError(name, f"must be an integer, got {value!r}") from None
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise KvrcConfigError(name, f"must be a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise KvrcConfigError(name, f"must be a number, got {value!r}") from None
    if not isinstance(value, str):
        raise KvrcConfigError(name, f"must be a string, got {value!r}")
    return value


def vllm_instance_id(vllm_config: Any) -> str:
    """vLLM's id of one engine instance: the same in its scheduler side and its workers
    (they get the same config), another in an engine given the same engine_id."""
    return str(getattr(vllm_config, "instance_id", "") or "")


def hash_declaration(cache_config: Any, env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """How this engine hashes its blocks, for kvrc's token-id Score (docs/score.md):
    vLLM's --prefix-caching-hash-algo, PYTHONHASHSEED verbatim (or "unset") and
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (vLLM's default "1")."""
    algo = str(getattr(cache_config, "prefix_caching_hash_algo", "") or "")
    if not algo:
        return ()  # nothing to declare: kvrc refuses token-id Scores for this engine
    int_hashes = env.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    return (
        (PROFILE_EXTRA_HASH_ALGO, algo),
        (PROFILE_EXTRA_HASH_SEED, env.get("PYTHONHASHSEED", PROFILE_HASH_SEED_UNSET)),
        (PROFILE_EXTRA_INT_HASHES, "0" if int_hashes in ("0", "false", "False") else "1"),
    )


def check_parallel_layout(
    decode_context_parallel_size: int, prefill_context_parallel_size: int = 1
) -> None:
    """ValueError for a vLLM layout the connector cannot serve: with decode context
    parallelism vLLM hashes blocks of block_size x DCP tokens and shards each block's KV
    over the DCP ranks, while kvrc's blocks, hashes and transfer plans are per
    `cache_config.block_size` (vLLM's own NixlPushConnector refuses it too); prefill
    context parallel ranks are not rank parts the connector registers or plans for."""
    for name, size in (
        ("decode_context_parallel_size", decode_context_parallel_size),
        ("prefill_context_parallel_size", prefill_context_parallel_size),
    ):
        if size > 1:
            raise ValueError(
                f"KvrcConnector does not support {name} > 1 (got {size}): run the engine "
                "without context parallelism"
            )


def check_engine_settings(
    config: KvrcConnectorConfig, *, kv_role: str, kv_load_failure_policy: str, prefix_caching: bool
) -> bool:
    """The vLLM settings the connector's own options need; KvrcConfigError naming what
    to change. False where a handoff's failed load would fail its request (vLLM's
    default policy): allowed, the connector warns."""
    if kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise KvrcConfigError("kv_role", f"{kv_role!r} is not kv_producer/kv_consumer/kv_both")
    recompute = kv_load_failure_policy == "recompute"
    if not config.reuse:
        return recompute
    if not prefix_caching:
        raise KvrcConfigError("reuse", "prefix reuse needs vLLM's enable_prefix_caching")
    if not recompute:
        # A prefix load is an optimisation: its failure must cost a recompute, never
        # the request.
        raise KvrcConfigError(
            "reuse",
            f'prefix reuse needs kv_load_failure_policy "recompute", got '
            f"{kv_load_failure_policy!r}: a failed load would fail the request",
        )
    if kv_role == "kv_producer":
        # vLLM defers block frees behind in-flight steps (async scheduling, PP) only for
        # consumers: a load into a block a running step freed would race its write.
        raise KvrcConfigError(
            "reuse",
            'prefix reuse loads KV into this engine: set kv_role "kv_both" (it still hands '
            'off to decode engines), not "kv_producer"',
        )
    return True
