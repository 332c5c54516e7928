"""Deployment profiles: compatibility hash, declared profiles, reuse gate, profiles files."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.errors import KvrcError
from coordinator.core.profiles import (
    LAYOUT_FIELDS,
    DeploymentProfile,
    ReuseReason,
    compatibility_hash,
    declared_profile,
    reuse_status,
)
from coordinator.runtime.config import (
    ConfigError,
    load_declarations,
    load_profiles,
    parse_profiles,
)

BASE = DeploymentProfile(
    model="meta-llama/Llama-3.1-8B",
    block_size=16,
    kv_dtype="bfloat16",
    num_layers=32,
    num_kv_heads=8,
    head_size=128,
    attention_backend="FLASH_ATTN",
    kv_layout="NHD",
    tp_size=2,
    reuse_opt_in=True,
)


def _changed(profile: DeploymentProfile, name: str) -> DeploymentProfile:
    value = getattr(profile, name)
    new: Any = value + 1 if isinstance(value, int) else value + "-x"
    return dataclasses.replace(profile, **{name: new})


def test_compatibility_hash_is_stable_hex_sha256() -> None:
    h = compatibility_hash(BASE)
    assert len(h) == 64 and int(h, 16) >= 0
    assert compatibility_hash(dataclasses.replace(BASE)) == h


@pytest.mark.parametrize("name", LAYOUT_FIELDS)
def test_every_layout_field_changes_the_hash(name: str) -> None:
    assert compatibility_hash(_changed(BASE, name)) != compatibility_hash(BASE)


def test_decode_context_parallelism_changes_the_hash_and_none_keeps_the_old_one() -> None:
    """dcp_size did not count: a dcp=2 engine's blocks (each block's tokens split over
    its ranks) were offered to a dcp=1 engine as interchangeable. At 1 the hash is the
    one kvrc computed before (the literal: BASE's hash then), so no deployment's
    compatibility hash moves."""
    assert compatibility_hash(dataclasses.replace(BASE, dcp_size=2)) != compatibility_hash(BASE)
    assert compatibility_hash(BASE) == (
        "3e97a7a8f82d91ddb0cdae98109a9aa854f64f00811c51744f02fb811158736e"
    )


@pytest.mark.parametrize("name", ["gpu_kind", "reuse_opt_in", "dp_size", "extra"])
def test_non_layout_fields_do_not_change_the_hash(name: str) -> None:
    changes: dict[str, Any] = {
        "gpu_kind": "H200",
        "reuse_opt_in": False,
        "dp_size": 4,
        "extra": (("k", "v"),),
    }
    assert compatibility_hash(dataclasses.replace(BASE, **{name: changes[name]})) == (
        compatibility_hash(BASE)
    )


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=20), st.text(max_size=20))
def test_hash_is_injective_on_string_boundaries(a: str, b: str) -> None:
    # A canonical encoding: moving characters between fields changes the hash.
    p1 = dataclasses.replace(BASE, model=a, model_revision=b)
    p2 = dataclasses.replace(BASE, model=a + b, model_revision="")
    assert (compatibility_hash(p1) == compatibility_hash(p2)) == (b == "")


def test_reuse_gate_order_and_reasons() -> None:
    declared = [declared_profile("llama", {"model": BASE.model, "block_size": 16})]
    off = reuse_status(False, BASE, declared)
    assert (off.enabled, off.reason) == (False, ReuseReason.DISABLED_BY_COORDINATOR)
    not_opted = reuse_status(True, dataclasses.replace(BASE, reuse_opt_in=False), declared)
    assert (not_opted.enabled, not_opted.reason) == (False, ReuseReason.PROFILE_NOT_OPTED_IN)
    undeclared = reuse_status(True, dataclasses.replace(BASE, block_size=32), declared)
    assert (undeclared.enabled, undeclared.reason) == (False, ReuseReason.PROFILE_NOT_DECLARED)
    assert "block_size 32" in undeclared.detail
    on = reuse_status(True, BASE, declared)
    assert (on.enabled, on.reason) == (True, ReuseReason.ENABLED)
    assert "'llama'" in on.detail
    assert reuse_status(True, BASE).reason == ReuseReason.PROFILE_NOT_DECLARED  # none declared


def test_declared_profile_matches_only_pinned_fields() -> None:
    d = declared_profile("p", {"kv_dtype": "bfloat16"})
    assert d.matches(BASE)
    assert d.matches(dataclasses.replace(BASE, model="other", block_size=64))
    assert not d.matches(dataclasses.replace(BASE, kv_dtype="fp8_e4m3"))


@pytest.mark.parametrize(
    ("pins", "needle"),
    [
        ({"modle": "x"}, "unknown field 'modle'"),
        ({"block_size": "16"}, "field 'block_size' must be int"),
        ({"block_size": True}, "field 'block_size' must be int"),
        ({"reuse_opt_in": 1}, "field 'reuse_opt_in' must be bool"),
        ({}, "pins no field"),
        # Values no engine registers: the profile matched nothing, silently.
        ({"block_size": -16}, "field 'block_size' must be >= 1, got -16"),
        ({"tp_size": 0}, "field 'tp_size' must be >= 1, got 0"),
        ({"num_layers": -1}, "field 'num_layers' must be >= 0, got -1"),
        ({"head_size": -8}, "field 'head_size' must be >= 0, got -8"),
    ],
)
def test_declared_profile_rejects_bad_fields(pins: dict[str, object], needle: str) -> None:
    with pytest.raises(KvrcError) as e:
        declared_profile("p", pins)
    assert needle in e.value.message


TOML = """
[[profile]]
name = "llama-bf16"
model = "meta-llama/Llama-3.1-8B"
kv_dtype = "bfloat16"
block_size = 16

[[profile]]
name = "any-fp8"
kv_dtype = "fp8_e4m3"
"""

YAML = """
profile:
  - name: llama-bf16
    model: meta-llama/Llama-3.1-8B
    kv_dtype: bfloat16
    block_size: 16
  - name: any-fp8
    kv_dtype: fp8_e4m3
"""


def test_toml_and_yaml_files_load_the_same_profiles(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text(TOML)
    (tmp_path / "p.yaml").write_text(YAML)
    from_toml = load_profiles(tmp_path / "p.toml")
    assert from_toml == load_profiles(tmp_path / "p.yaml")
    assert [p.name for p in from_toml] == ["llama-bf16", "any-fp8"]
    assert from_toml[0].matches(BASE)
    assert not from_toml[1].matches(BASE)


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("p.toml", "[[profile]]\nname = \n", "invalid TOML"),
        ("p.yaml", "profile: [\n", "invalid YAML"),
        ("p.json", "{}", "unknown extension"),
        ("p.toml", "[[profile]]\nmodel = 'm'\n", "needs a non-empty string 'name'"),
        ("p.toml", "[[profile]]\nname='a'\nmodel='m'\n[[profile]]\nname='a'\nmodel='n'\n", "twice"),
        ("p.toml", "profiles = []\n", "unknown top-level key"),
        ("p.yaml", "profile: {name: a}\n", "must be a list"),
        ("p.toml", "[[link]]\nbandwidth_gbps = 1\n", "latency_ms must be a number"),
        ("p.toml", "[[link]]\nbandwidth_gbps = 0\nlatency_ms = 1\n", "bandwidth must be positive"),
        ("p.toml", "[[link]]\nholders = 3\nbandwidth_gbps = 1\nlatency_ms = 1\n", "holders"),
        ("p.toml", "[[link]]\nspeed = 1\n", "unknown key(s) ['speed']"),
    ],
)
def test_bad_profiles_files_give_one_clear_line(
    tmp_path: Path, name: str, text: str, needle: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_profiles(path)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file_and_empty_document(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_profiles(tmp_path / "absent.toml")
    assert parse_profiles(None) == ()


def test_declared_links_load_beside_the_profiles(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        TOML
        + '[[link]]\nname = "across"\nholders = ["a-*"]\nrequesters = "b-*"\n'
        + "bandwidth_gbps = 0.1\nlatency_ms = 5\n[[link]]\nbandwidth_gbps = 2\nlatency_ms = 0.5\n"
    )
    profiles, links = load_declarations(path)
    assert [p.name for p in profiles] == ["llama-bf16", "any-fp8"]
    assert [(k.name, k.holders, k.requesters) for k in links] == [
        ("across", ("a-*",), ("b-*",)),
        ("", ("*",), ("*",)),  # no patterns: every pair
    ]
    assert links[0].bandwidth_bytes_per_s == 0.1e9 and links[0].latency_ms == 5.0
    assert links[0].matches("a-1", "b-2") and not links[0].matches("b-1", "a-2")


def test_a_pin_of_zero_where_engines_may_register_zero_is_allowed() -> None:
    """0 is "not given" for the model's shape fields: an engine may register it."""
    pinned = declared_profile("p", {"head_size": 0, "num_kv_heads": 0, "num_layers": 0})
    assert pinned.matches(dataclasses.replace(BASE, head_size=0, num_kv_heads=0, num_layers=0))
