"""KvrcConnector's config and version checks (no vLLM needed: clients/vllm/config.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from clients.session import EngineProfile, EngineSession, RankPartRegistration
from clients.vllm import SUPPORTED_VLLM_VERSIONS, UnsupportedVllmVersion, check_vllm_version
from clients.vllm.config import KvrcConfigError, KvrcConnectorConfig, hash_declaration
from coordinator.core.profiles import DeploymentProfile
from coordinator.core.score import hash_config
from coordinator.core.vllm_hashing import HashConfig, Seed
from kvrc.credentials import ChannelOptions, CredentialsError


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
    "value",
    [
        ["kvrc-0:50051", "kvrc-1:50051"],
        "kvrc-0:50051,kvrc-1:50051",
        " kvrc-0:50051 , kvrc-1:50051 ",
    ],
)
def test_kvrc_target_takes_a_list_or_a_comma_separated_string(value: object) -> None:
    config = KvrcConnectorConfig.from_extra(
        {"kvrc_target": value, "kvrc_token_file": __file__, "kvrc_tls": True}
    )
    assert config.kvrc_target == "kvrc-0:50051,kvrc-1:50051"
    assert config.kvrc_targets == ("kvrc-0:50051", "kvrc-1:50051")
    # One ChannelOptions carries them all; EngineSession splits it, credentials on each.
    registration = RankPartRegistration(engine_id="e", profile=EngineProfile("m", 16))
    session = EngineSession(config.channel_options(), registration)
    assert [o.target for o in session.targets] == ["kvrc-0:50051", "kvrc-1:50051"]
    assert all(str(o.token_file) == __file__ for o in session.targets)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (["kvrc-0:50051", ""], "item 2 is empty"),
        ("kvrc-0:50051,,kvrc-1:50051", "item 2 is empty"),
        (["kvrc-0:50051", "kvrc-0:50051"], "'kvrc-0:50051' is listed twice"),
        ("kvrc-0:50051,kvrc-1:99999", "port '99999' is not a number in 1..65535"),
        (["kvrc-0:50051", 50051], "a list of HOST:PORT strings"),
        ([], "no kvrc target given"),
        (50051, "HOST:PORT, a comma-separated string or a list"),
    ],
)
def test_a_bad_kvrc_target_list_names_the_field_and_the_problem(value: object, says: str) -> None:
    with pytest.raises(KvrcConfigError) as caught:
        KvrcConnectorConfig.from_extra({"kvrc_target": value})
    assert caught.value.field == "kvrc_target"
    assert str(caught.value).startswith("KvrcConnector: kv_connector_extra_config.kvrc_target: ")
    assert says in str(caught.value)


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
        ({"stall_dump_s": 0.5}, "stall_dump_s"),
        ({"mooncake_read_sleep_share": 1.0}, "mooncake_read_sleep_share"),
    ],
)
def test_a_bad_field_is_named(extra: dict[str, object], field: str) -> None:
    with pytest.raises(KvrcConfigError) as caught:
        KvrcConnectorConfig.from_extra(extra)
    assert caught.value.field == field
    assert f"kv_connector_extra_config.{field}:" in str(caught.value)


@pytest.mark.parametrize(
    "target",
    ["10.0.0.5:50051", "kvrc.llm.svc:50051", "127.0.0.1:50051,10.0.0.5:50051"],
)
def test_a_token_for_a_plaintext_off_host_target_is_refused_when_the_config_is_read(
    target: str,
) -> None:
    """When the config is read (engine start), not at the first channel: connect()'s
    own check and message."""
    with pytest.raises(KvrcConfigError) as caught:
        KvrcConnectorConfig.from_extra({"kvrc_target": target, "kvrc_token_file": __file__})
    assert caught.value.field == "kvrc_target"
    with pytest.raises(CredentialsError) as same:
        ChannelOptions(target, token_file=Path(__file__)).check_token_transport()
    assert (
        str(caught.value) == f"KvrcConnector: kv_connector_extra_config.kvrc_target: {same.value}"
    )
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "extra",
    [
        {"kvrc_target": "127.0.0.1:50051"},  # loopback: the sidecar default
        {"kvrc_target": "localhost:1,[::1]:2"},
        {"kvrc_target": "10.0.0.5:50051", "kvrc_tls": True},
        {"kvrc_target": "kvrc.llm.svc:50051", "kvrc_ca_cert": __file__},
    ],
)
def test_a_token_over_loopback_or_tls_is_accepted(extra: dict[str, object]) -> None:
    config = KvrcConnectorConfig.from_extra({**extra, "kvrc_token_file": __file__})
    assert config.channel_options().token_file == Path(__file__)
    # Without a token, plaintext off the host stays allowed (nothing secret goes).
    KvrcConnectorConfig.from_extra({"kvrc_target": "10.0.0.5:50051"})


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


def test_decode_context_parallelism_is_refused_at_start() -> None:
    """With DCP vLLM hashes blocks of block_size x DCP tokens and shards each block over
    the DCP ranks: kvrc's hashes and transfer plans would silently name other blocks."""
    from clients.vllm.config import check_parallel_layout

    check_parallel_layout(1, 1)  # control: the default layout
    with pytest.raises(ValueError, match="decode_context_parallel_size > 1 \\(got 2\\)"):
        check_parallel_layout(2)
    with pytest.raises(ValueError, match="prefill_context_parallel_size > 1 \\(got 4\\)"):
        check_parallel_layout(1, 4)


def test_reuse_needs_prefix_caching_recompute_on_failure_and_a_consuming_role() -> None:
    """Prefix loads are an optimisation: a failed one must cost a recompute (vLLM's
    default policy fails the request), and only a consumer's frees wait for in-flight
    steps (a load into a block a running step freed would race its write). Without
    reuse, handoffs are allowed under any policy; the connector warns."""
    from clients.vllm.config import check_engine_settings

    reuse = KvrcConnectorConfig.from_extra({"reuse": True})
    plain = KvrcConnectorConfig.from_extra({})
    good: dict[str, Any] = {
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "prefix_caching": True,
    }
    assert check_engine_settings(reuse, **good) is True
    assert check_engine_settings(reuse, **{**good, "kv_role": "kv_consumer"}) is True
    for change, needle in (
        ({"kv_role": "kv_producer"}, 'set kv_role "kv_both"'),
        ({"kv_load_failure_policy": "fail"}, 'needs kv_load_failure_policy "recompute"'),
        ({"prefix_caching": False}, "needs vLLM's enable_prefix_caching"),
        ({"kv_role": "kv_sideways"}, "'kv_sideways' is not kv_producer/kv_consumer/kv_both"),
    ):
        with pytest.raises(KvrcConfigError) as caught:
            check_engine_settings(reuse, **{**good, **change})
        assert needle in str(caught.value)
    # Without reuse: a producer under vLLM's default policy is allowed (a warning).
    producer: dict[str, Any] = {
        "kv_role": "kv_producer",
        "kv_load_failure_policy": "fail",
        "prefix_caching": False,
    }
    assert check_engine_settings(plain, **producer) is False
    assert check_engine_settings(plain, **{**producer, "kv_load_failure_policy": "recompute"})
