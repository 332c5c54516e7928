"""kv_transfer_params codec: field-for-field round trips of both connectors' shapes."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrc.kv_params import decode_kv_transfer_params, encode_kv_transfer_params

# vLLM NIXL connector's request_finished() shape, plus fields a newer vLLM might add.
NIXL_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": ([1, 2, 3, 4], [7, 8]),  # a tuple: one list per KV group
    "remote_engine_id": "prefill-0_dp3",
    "remote_request_id": "cmpl-7f3a-0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 4,
    "pp_size": 1,
    "dcp_size": 1,
    "remote_num_tokens": 2048,
    "remote_blocks_expiry_time": 1764673200.125,
    "transfer_mode": "READ",
    # unknown extras must survive
    "x_future_field": {"nested": [(1, 2), {"k": b"\x00\xff"}], "none": None},
    "x_big": 2**70,
}

MOONCAKE_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "transfer_id": "xfer-000042",
    "remote_bootstrap_addr": "http://10.0.0.8:8998",
    "remote_engine_id": "prefill-1",
    "x_vendor_metadata": b"\x01\x02\x03opaque",
    "x_negative_big": -(2**80),
}


def assert_same(a: Any, b: Any) -> None:
    """Equality that also checks types (True != 1, (1,) != [1]) and NaN/-0.0."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    else:
        assert a == b


@pytest.mark.parametrize("params", [NIXL_PARAMS, MOONCAKE_PARAMS], ids=["nixl", "mooncake"])
def test_connector_shapes_round_trip_field_for_field(params: dict[str, Any]) -> None:
    decoded = decode_kv_transfer_params(encode_kv_transfer_params(params))
    assert_same(decoded, params)


def test_nixl_remote_block_ids_stay_a_tuple_of_lists() -> None:
    decoded = decode_kv_transfer_params(encode_kv_transfer_params(NIXL_PARAMS))
    assert isinstance(decoded["remote_block_ids"], tuple)
    assert all(type(group) is list for group in decoded["remote_block_ids"])
    assert decoded["x_big"] == 2**70


def test_encoding_is_deterministic() -> None:
    copy = dict(NIXL_PARAMS)
    assert encode_kv_transfer_params(NIXL_PARAMS) == encode_kv_transfer_params(copy)


def test_bool_and_int_stay_distinct() -> None:
    decoded = decode_kv_transfer_params(encode_kv_transfer_params({"a": True, "b": 1, "c": 0}))
    assert decoded["a"] is True and type(decoded["b"]) is int and type(decoded["c"]) is int


def test_unsupported_type_is_refused() -> None:
    with pytest.raises(ValueError, match="set"):
        encode_kv_transfer_params({"a": {1, 2}})
    with pytest.raises(ValueError, match="must be a dict"):
        encode_kv_transfer_params([1, 2])  # type: ignore[arg-type]


def test_encode_too_deep_or_too_large_is_refused() -> None:
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper"):
        encode_kv_transfer_params({"deep": deep})
    with pytest.raises(ValueError, match="more than the limit"):
        encode_kv_transfer_params({"blob": b"x" * 200}, max_bytes=100)


def test_decode_refuses_oversized_input() -> None:
    data = encode_kv_transfer_params({"blob": b"x" * 200})
    with pytest.raises(ValueError, match="more than the limit"):
        decode_kv_transfer_params(data, max_bytes=100)


def test_decode_refuses_deep_nesting_of_lists_and_tuples() -> None:
    deep_list: Any = 1
    for _ in range(50):
        deep_list = [deep_list]
    with pytest.raises(ValueError, match="deeper"):
        decode_kv_transfer_params(msgpack.packb({"a": deep_list}))
    deep_tuple: Any = 1
    for _ in range(50):
        deep_tuple = (deep_tuple,)
    with pytest.raises(ValueError, match="deeper"):
        decode_kv_transfer_params(encode_kv_transfer_params({"a": deep_tuple}, max_depth=100))
    # Far deeper than any stack: still a clean ValueError.
    hostile = b"\x81\xa1a" + b"\x91" * 100_000 + b"\x01"
    with pytest.raises(ValueError):
        decode_kv_transfer_params(hostile)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01\x02",  # a list, not a dict
        b"\x81\xa1a",  # truncated
        msgpack.packb({"a": 1}) + b"\x00",  # trailing bytes
        msgpack.packb({"a": msgpack.ExtType(9, b"zz")}),  # unknown extension
        msgpack.packb({"a": msgpack.ExtType(1, b"\x01")}),  # tuple ext not an array
        msgpack.packb({"a": msgpack.ExtType(2, b"")}),  # empty big int
        b"\x81\x91\x01\x01",  # a list as a map key (unhashable)
    ],
)
def test_decode_refuses_malformed_bytes_with_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_kv_transfer_params(data)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=20)
    | st.binary(max_size=20)
)
_keys = st.text(max_size=10, alphabet=st.characters(exclude_categories=["Cs"])) | st.integers(
    -1000, 1000
)
_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(_keys, children, max_size=4)
    ),
    max_leaves=25,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=6))
def test_arbitrary_nested_values_round_trip(params: dict[Any, Any]) -> None:
    encoded = encode_kv_transfer_params(params)
    assert encode_kv_transfer_params(params) == encoded
    assert_same(decode_kv_transfer_params(encoded), params)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_value_error(data: bytes) -> None:
    try:
        decoded = decode_kv_transfer_params(data)
    except ValueError:
        return
    assert isinstance(decoded, dict)
