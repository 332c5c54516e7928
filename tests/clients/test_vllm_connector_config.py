"""KvrcConnector's config and version checks (no vLLM needed: clients/vllm/config.py)."""

from __future__ import annotations

import pytest

from clients.vllm import SUPPORTED_VLLM_VERSIONS, UnsupportedVllmVersion, check_vllm_version
from clients.vllm.config import KvrcConfigError, KvrcConnectorConfig, hash_declaration
from coordinator.core.profiles import DeploymentProfile
from coordinator.core.score import hash_config
from coordinator.core.vllm_hashing import HashConfig, Seed


def test_defaults_are_sensible_and_reuse_is_off() -> None:
    config = KvrcConnectorConfig.from_extra(None)
    assert config.reuse is False
    assert config.kvrc_target == "127.0.0.1:50051"
    assert config.mooncake_protocol == "tcp"
    assert config.min_blocks == 2


def test_values_are_coerced() -> None:
    config = KvrcConnectorConfig.from_extra(
        {"reuse": "on", "min_blocks": "3", "handoff_hold_s": 5, "kvrc_target": "10.0.0.2:7000"}
    )
    assert (config.reuse, config.min_blocks, config.handoff_hold_s) == (True, 3, 5.0)
    assert config.channel_options().target == "10.0.0.2:7000"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"min_blocks": 0}, "min_blocks"),
        ({"kvrc_target": "no-port"}, "kvrc_target"),
        ({"reuse": "maybe"}, "reuse"),
        ({"mooncake_protocol": "udp"}, "mooncake_protocol"),
        ({"lookup_timeout_ms": 0}, "lookup_timeout_ms"),
        ({"transfer_timeout_ms": "soon"}, "transfer_timeout_ms"),
        ({"kvrc_ca_cert": "/nonexistent.pem"}, "kvrc_ca_cert"),
        ({"nonsense": 1}, "nonsense"),
    ],
)
def test_a_bad_field_is_named(extra: dict[str, object], field: str) -> None:
    with pytest.raises(KvrcConfigError) as caught:
        KvrcConnectorConfig.from_extra(extra)
    assert caught.value.field == field
    assert f"kv_connector_extra_config.{field}:" in str(caught.value)


def test_supported_vllm_versions() -> None:
    assert "0.32.0" in SUPPORTED_VLLM_VERSIONS
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(UnsupportedVllmVersion, match=r"0\.32\.0; this is vLLM 0\.9\.1"):
        check_vllm_version("0.9.1")


class _CacheConfig:
    prefix_caching_hash_algo = "sha256_cbor"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PYTHONHASHSEED": "0"}, HashConfig("sha256_cbor", 16, "0")),
        ({}, HashConfig("sha256_cbor", 16, Seed.UNSET)),
        (
            {"PYTHONHASHSEED": "7", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"},
            HashConfig("sha256_cbor", 16, "7", int_hashes=False),
        ),
    ],
)
def test_the_engine_declares_its_hashing_as_kvrc_score_reads_it(
    env: dict[str, str], expected: HashConfig
) -> None:
    # The connector's side (profile extra) and the coordinator's (docs/score.md) agree.
    extra = hash_declaration(_CacheConfig(), env)
    assert hash_config("e", DeploymentProfile(model="m", block_size=16, extra=extra)) == expected
    assert hash_declaration(object(), env) == ()  # no algorithm known: nothing declared
