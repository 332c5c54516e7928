"""The paged KV cache: layout arithmetic, compatibility checks, registration."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from clients.kv_cache import (
    IncompatibleLayoutError,
    KvCacheLayout,
    KvEndpointDescription,
    KvRegionDescription,
    PagedKvCache,
    check_compatible,
)
from clients.mooncake_engine import MooncakeConfig, MooncakeTransferEngine

LAYOUT = KvCacheLayout(
    num_layers=3, num_blocks=10, block_size=16, num_kv_heads=4, head_size=32, dtype="bfloat16"
)


@pytest.fixture(scope="module")
def engine() -> MooncakeTransferEngine:
    return MooncakeTransferEngine(MooncakeConfig())


def test_block_bytes_and_shapes_follow_the_layout() -> None:
    assert LAYOUT.block_bytes == 2 * 16 * 4 * 32 * 2
    assert LAYOUT.layer_shape == (10, 2, 16, 4, 32)
    hnd = replace(LAYOUT, kv_layout="HND")
    assert hnd.layer_shape == (10, 2, 4, 16, 32)
    assert hnd.block_bytes == LAYOUT.block_bytes
    assert replace(LAYOUT, dtype="fp8_e4m3").block_bytes == LAYOUT.block_bytes // 2
    assert replace(LAYOUT, dtype="float32").block_bytes == LAYOUT.block_bytes * 2


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_block_address_is_base_plus_id_times_block_bytes(kv_layout: str) -> None:
    layout = replace(LAYOUT, kv_layout=kv_layout)
    cache = PagedKvCache(layout)
    for layer in range(layout.num_layers):
        base = cache.layers[layer].data_ptr()
        for block_id in (0, 1, 7, 9):
            view = cache.block(layer, block_id)
            assert view.data_ptr() == base + block_id * layout.block_bytes
            assert view.is_contiguous()
            assert view.numel() * view.element_size() == layout.block_bytes
    # Writing one block through its byte view touches exactly that block.
    cache.block_bytes_view(1, 4).fill_(0xAB)
    assert int(cache.layers[1].view(torch.uint8).count_nonzero()) == layout.block_bytes
    assert int(cache.layers[0].view(torch.uint8).count_nonzero()) == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "float16"),  # same bytes, different meaning
        ("kv_layout", "HND"),  # same bytes, different order
        ("block_size", 8),
        ("num_kv_heads", 8),  # e.g. a peer with another tp_size
        ("head_size", 64),
        ("num_layers", 4),
    ],
)
def test_check_compatible_names_the_differing_field(field: str, value: Any) -> None:
    remote = replace(LAYOUT, **{field: value})
    with pytest.raises(IncompatibleLayoutError, match=f"differ in {field}"):
        check_compatible(LAYOUT, remote)
    with pytest.raises(IncompatibleLayoutError, match=f"differ in {field}"):
        check_compatible(remote, LAYOUT)


def test_block_counts_may_differ() -> None:
    check_compatible(LAYOUT, replace(LAYOUT, num_blocks=1000))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dtype": "int4"}, "dtype"),
        ({"kv_layout": "NDH"}, "kv_layout"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_size": -1}, "block_size"),
        ({"head_size": 1 << 30}, "head_size"),
    ],
)
def test_bad_layouts_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(LAYOUT, **changes)


def test_layout_dict_round_trip_and_malformed_input() -> None:
    assert KvCacheLayout.from_dict(LAYOUT.to_dict()) == LAYOUT
    data = LAYOUT.to_dict()
    del data["head_size"]
    with pytest.raises(ValueError, match="malformed"):
        KvCacheLayout.from_dict(data)


def test_wrap_adopts_existing_tensors_and_checks_them() -> None:
    tensors = [torch.zeros(LAYOUT.layer_shape, dtype=torch.bfloat16) for _ in range(3)]
    cache = PagedKvCache.wrap(LAYOUT, tensors)
    assert cache.layers[2] is tensors[2]
    with pytest.raises(ValueError, match="3 layers"):
        PagedKvCache.wrap(LAYOUT, tensors[:2])
    with pytest.raises(ValueError, match="dtype"):
        PagedKvCache.wrap(LAYOUT, [t.to(torch.float16) for t in tensors])
    with pytest.raises(ValueError, match="shape"):
        PagedKvCache.wrap(LAYOUT, [t[:5] for t in tensors])
    strided = [torch.zeros((10, 2, 4, 16, 32), dtype=torch.bfloat16).transpose(2, 3)] * 3
    with pytest.raises(ValueError, match="contiguous"):
        PagedKvCache.wrap(LAYOUT, strided)


def test_register_once_and_describe(engine: MooncakeTransferEngine) -> None:
    cache = PagedKvCache(LAYOUT, device="cpu")
    with pytest.raises(RuntimeError, match="register"):
        cache.describe()
    endpoint = cache.register(engine)
    assert cache.registered
    assert cache.register(engine) is endpoint  # once: a second call changes nothing
    with pytest.raises(RuntimeError, match="already registered"):
        cache.register(MooncakeTransferEngine(MooncakeConfig()))
    assert endpoint.session_name == engine.session_name
    assert endpoint.layout == LAYOUT
    assert [region.base_addr for region in endpoint.regions] == [
        tensor.data_ptr() for tensor in cache.layers
    ]
    assert {region.block_len for region in endpoint.regions} == {LAYOUT.block_bytes}
    assert KvEndpointDescription.from_json(endpoint.to_json()) == endpoint
    cache.unregister()
    assert not cache.registered
    # The memory can be registered again (Mooncake refuses overlapping registrations).
    assert cache.register(engine) == endpoint
    cache.unregister()


def test_wrapped_separate_tensors_register_each(engine: MooncakeTransferEngine) -> None:
    tensors = [torch.ones(LAYOUT.layer_shape, dtype=torch.bfloat16) for _ in range(3)]
    cache = PagedKvCache.wrap(LAYOUT, tensors)
    endpoint = cache.register(engine)
    assert [region.base_addr for region in endpoint.regions] == [t.data_ptr() for t in tensors]
    cache.unregister()


def test_endpoint_descriptions_are_validated() -> None:
    region = KvRegionDescription(
        layer=0, base_addr=4096, block_len=LAYOUT.block_bytes, num_blocks=10
    )
    one_layer = replace(LAYOUT, num_layers=1)
    good = KvEndpointDescription.from_parts(
        backend="mooncake", session_name="h:1", layout=one_layer, regions=[region]
    )
    assert good.region_for_layer(0) == region
    cases: list[tuple[list[KvRegionDescription], str, str]] = [
        ([], "h:1", "0 regions"),
        ([replace(region, layer=1)], "h:1", "describes layer 1"),
        ([replace(region, block_len=1)], "h:1", "block_len"),
        ([replace(region, num_blocks=11)], "h:1", "num_blocks"),
        ([replace(region, base_addr=0)], "h:1", "base_addr"),
        ([region], "", "session_name"),
    ]
    for regions, session, message in cases:
        with pytest.raises(ValueError, match=message):
            KvEndpointDescription.from_parts(
                backend="mooncake", session_name=session, layout=one_layer, regions=regions
            )
    with pytest.raises(ValueError, match="malformed"):
        KvEndpointDescription.from_json('{"backend": "mooncake"}')
    with pytest.raises(ValueError, match="malformed"):
        KvEndpointDescription.from_json("not json")
