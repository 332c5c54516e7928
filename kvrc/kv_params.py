"""Codec for `kv_transfer_params` carried through kvrc as opaque bytes.

vLLM's connectors hand each other a dict (NIXL: `remote_block_ids`,
`remote_engine_id`, ...; Mooncake: `transfer_id`, `remote_bootstrap_addr`, ...).
kvrc never looks inside it: the prefill's client encodes the dict, kvrc stores
the bytes, the decode's client decodes them. The round trip must give back the
same dict field for field (I3-identity), so this codec keeps what plain msgpack
or JSON would lose:

- tuples stay tuples (NIXL's `remote_block_ids` is a tuple of lists, one per
  KV group) — msgpack ext type 1 wrapping an array;
- ints of any size (msgpack natively covers -2**63 .. 2**64-1; beyond that,
  ext type 2 with the two's-complement big-endian bytes);
- bytes stay bytes, str stays str, bool stays bool, None, float64;
- unknown extra fields and the dict's key order are kept.

Encoding is deterministic: the same dict (same key order) gives the same bytes.
Decoding is bounded (size and nesting depth) and raises ValueError on anything
it cannot read, so bytes from the wire can never crash or exhaust a reader.
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = [
    "MAX_DEPTH",
    "MAX_ENCODED_BYTES",
    "decode_kv_transfer_params",
    "encode_kv_transfer_params",
]

MAX_ENCODED_BYTES = 1 << 20  # 1 MiB: far above any real connector's params
MAX_DEPTH = 32

_EXT_TUPLE = 1
_EXT_BIGINT = 2
# What msgpack encodes natively as an int.
_MIN_NATIVE_INT = -(1 << 63)
_MAX_NATIVE_INT = (1 << 64) - 1


def _to_wire(value: Any, depth: int, max_depth: int) -> Any:
    if depth > max_depth:
        raise ValueError(f"kv_transfer_params nest deeper than {max_depth} levels")
    # bool before int: bool is an int subclass and must stay a bool.
    if value is None or type(value) in (bool, float, str, bytes):
        return value
    if type(value) is int:
        if _MIN_NATIVE_INT <= value <= _MAX_NATIVE_INT:
            return value
        nbytes = (value.bit_length() + 8) // 8  # + sign bit
        return msgpack.ExtType(_EXT_BIGINT, value.to_bytes(nbytes, "big", signed=True))
    if type(value) is bytearray:
        return bytes(value)
    if type(value) is list:
        return [_to_wire(item, depth + 1, max_depth) for item in value]
    if type(value) is tuple:
        inner = [_to_wire(item, depth + 1, max_depth) for item in value]
        return msgpack.ExtType(_EXT_TUPLE, _pack(inner))
    if type(value) is dict:
        return {
            _to_wire(key, depth + 1, max_depth): _to_wire(item, depth + 1, max_depth)
            for key, item in value.items()
        }
    raise ValueError(
        f"kv_transfer_params cannot carry a value of type {type(value).__name__}; "
        "use None, bool, int, float, str, bytes, list, tuple or dict"
    )


def _pack(wire_value: Any) -> bytes:
    try:
        packed: bytes = msgpack.packb(wire_value, use_bin_type=True, strict_types=True)
    except UnicodeEncodeError as exc:
        raise ValueError(f"kv_transfer_params hold a str that is not valid UTF-8: {exc}") from exc
    return packed


def encode_kv_transfer_params(
    params: dict[Any, Any], *, max_bytes: int = MAX_ENCODED_BYTES, max_depth: int = MAX_DEPTH
) -> bytes:
    """Encode a connector's kv_transfer_params dict; ValueError if it cannot."""
    if type(params) is not dict:
        raise ValueError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    encoded = _pack(_to_wire(params, 1, max_depth))
    if len(encoded) > max_bytes:
        raise ValueError(
            f"kv_transfer_params encode to {len(encoded)} bytes, more than the limit {max_bytes}"
        )
    return encoded


class _Decoder:
    """One decode: the ext hook recurses into tuple payloads, so it counts depth."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.ext_depth = 0

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_BIGINT:
            if not data:
                raise ValueError("kv_transfer_params hold an empty big-int extension")
            return int.from_bytes(data, "big", signed=True)
        if code == _EXT_TUPLE:
            self.ext_depth += 1
            if self.ext_depth > self.max_depth:
                raise ValueError(f"kv_transfer_params nest deeper than {self.max_depth} levels")
            try:
                inner = self.unpack(data)
            finally:
                self.ext_depth -= 1
            if type(inner) is not list:
                raise ValueError("kv_transfer_params hold a tuple extension that is not an array")
            return tuple(inner)
        raise ValueError(f"kv_transfer_params hold an unknown msgpack extension type {code}")

    def unpack(self, data: bytes) -> Any:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=False, use_list=True, ext_hook=self.ext_hook
        )


def _check_depth(value: Any, max_depth: int) -> None:
    # Iterative: a hostile payload must not exhaust the Python stack.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"kv_transfer_params nest deeper than {max_depth} levels")
        if isinstance(item, (list, tuple)):
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, depth + 1))
                stack.append((child, depth + 1))


def decode_kv_transfer_params(
    data: bytes, *, max_bytes: int = MAX_ENCODED_BYTES, max_depth: int = MAX_DEPTH
) -> dict[Any, Any]:
    """Decode bytes made by `encode_kv_transfer_params`; ValueError if they are not."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"kv_transfer_params must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ValueError(
            f"kv_transfer_params are {len(data)} bytes, more than the limit {max_bytes}"
        )
    if len(data) == 0:
        raise ValueError("kv_transfer_params are empty; expected an encoded dict")
    decoder = _Decoder(max_depth)
    try:
        value = decoder.unpack(bytes(data))
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        # msgpack's own errors (ExtraData, FormatError, StackError) are ValueErrors;
        # TypeError: an unhashable map key (e.g. a list).
        raise ValueError(f"kv_transfer_params are not valid: {exc}") from exc
    _check_depth(value, max_depth)
    if type(value) is not dict:
        raise ValueError(f"kv_transfer_params must decode to a dict, got {type(value).__name__}")
    return value
