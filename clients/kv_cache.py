"""A rank part's paged KV cache: torch tensors, registered once with Mooncake.

Layout (docs/mooncake.md): per layer one tensor shaped
`[num_blocks, 2 (K, V), block_size, num_kv_heads, head_size]` ("NHD") or
`[num_blocks, 2, num_kv_heads, block_size, head_size]` ("HND"). Both are block
major, so one block of one layer is one contiguous run of `block_bytes` bytes at
`base + block_id * block_bytes`: a block moves as one transfer entry per layer,
and contiguous block runs coalesce.

The device comes from configuration ("cpu" here, "cuda:N" on GPU hosts). This
module is free of protobuf: it describes itself with frozen dataclasses that
map one to one onto the protocol's `TransferEndpoint`/`KvRegion`
(see `clients.transfer.endpoint_to_proto`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from clients.mooncake_engine import MooncakeTransferEngine

# Protocol dtype names (DeploymentProfile.kv_dtype) -> torch dtypes.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}
KV_LAYOUTS = ("NHD", "HND")
# Bounds that keep a malformed description from asking for absurd allocations.
_MAX_DIM = 1 << 20
_MAX_LAYERS = 1024


class IncompatibleLayoutError(ValueError):
    """Two KV caches cannot exchange blocks; raised before any byte moves."""


@dataclass(frozen=True, slots=True)
class KvCacheLayout:
    """The shape of one rank part's KV cache (its own shard of the KV heads)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    kv_layout: str = "NHD"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout {self.kv_layout!r} is not one of {KV_LAYOUTS}")
        if not 1 <= self.num_layers <= _MAX_LAYERS:
            raise ValueError(f"num_layers must be in 1..{_MAX_LAYERS}, got {self.num_layers}")
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not 1 <= value <= _MAX_DIM:
                raise ValueError(f"{name} must be in 1..{_MAX_DIM}, got {value}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        if self.kv_layout == "NHD":
            return (2, self.block_size, self.num_kv_heads, self.head_size)
        return (2, self.num_kv_heads, self.block_size, self.head_size)

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_blocks, *self.block_shape)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (K and V) in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.element_size

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KvCacheLayout:
        try:
            return cls(
                num_layers=int(data["num_layers"]),
                num_blocks=int(data["num_blocks"]),
                block_size=int(data["block_size"]),
                num_kv_heads=int(data["num_kv_heads"]),
                head_size=int(data["head_size"]),
                dtype=str(data["dtype"]),
                kv_layout=str(data.get("kv_layout", "NHD")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed KV cache layout {dict(data)!r}: {exc}") from exc


def check_compatible(local: KvCacheLayout, remote: KvCacheLayout) -> None:
    """Raise `IncompatibleLayoutError` naming the first field that differs.

    Block counts may differ (each engine sizes its own pool); everything that
    gives a byte of a block its meaning must match.
    """
    for field in ("dtype", "kv_layout", "block_size", "num_kv_heads", "head_size", "num_layers"):
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            raise IncompatibleLayoutError(
                f"KV layouts differ in {field}: local {mine!r}, remote {theirs!r}; "
                "refusing to transfer between heterogeneous layouts"
            )


@dataclass(frozen=True, slots=True)
class KvRegionDescription:
    """One registered memory region: one layer's blocks (K and V interleaved)."""

    layer: int
    base_addr: int
    block_len: int
    num_blocks: int
    kv_index: int = 0  # 0: K and V share the region (this layout)

    def block_address(self, block_id: int) -> int:
        return self.base_addr + block_id * self.block_len


@dataclass(frozen=True, slots=True)
class KvEndpointDescription:
    """Everything a peer needs to read this rank part's blocks."""

    backend: str
    session_name: str
    layout: KvCacheLayout
    regions: tuple[KvRegionDescription, ...]

    def region_for_layer(self, layer: int) -> KvRegionDescription:
        return self.regions[layer]

    def to_json(self) -> str:
        return json.dumps(
            {
                "backend": self.backend,
                "session_name": self.session_name,
                "layout": self.layout.to_dict(),
                "regions": [asdict(region) for region in self.regions],
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> KvEndpointDescription:
        try:
            data = json.loads(text)
            return cls.from_parts(
                backend=str(data["backend"]),
                session_name=str(data["session_name"]),
                layout=KvCacheLayout.from_dict(data["layout"]),
                regions=[KvRegionDescription(**region) for region in data["regions"]],
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed KV endpoint description: {exc}") from exc

    @classmethod
    def from_parts(
        cls,
        *,
        backend: str,
        session_name: str,
        layout: KvCacheLayout,
        regions: Sequence[KvRegionDescription],
    ) -> KvEndpointDescription:
        """Validated construction: one region per layer, in layer order, sized by the layout."""
        if not session_name:
            raise ValueError("session_name must not be empty")
        if len(regions) != layout.num_layers:
            raise ValueError(f"{len(regions)} regions for {layout.num_layers} layers")
        for layer, region in enumerate(regions):
            if region.layer != layer:
                raise ValueError(f"region {layer} describes layer {region.layer}")
            if region.block_len != layout.block_bytes:
                raise ValueError(
                    f"layer {layer}: block_len {region.block_len} != layout's {layout.block_bytes}"
                )
            if region.num_blocks != layout.num_blocks:
                raise ValueError(
                    f"layer {layer}: num_blocks {region.num_blocks} != layout's {layout.num_blocks}"
                )
            if region.base_addr <= 0 or region.base_addr >= 1 << 64:
                raise ValueError(f"layer {layer}: base_addr {region.base_addr} is not an address")
        return cls(backend, session_name, layout, tuple(regions))


class PagedKvCache:
    """Per-layer KV tensors of one rank part, on any device, registered once.

    `PagedKvCache(layout, device="cpu")` allocates one backing tensor (so the
    whole cache is one registration); `PagedKvCache.wrap(layout, tensors)` adopts
    an engine's existing per-layer tensors.
    """

    def __init__(self, layout: KvCacheLayout, *, device: str | torch.device = "cpu") -> None:
        backing = torch.zeros(
            (layout.num_layers, *layout.layer_shape), dtype=layout.torch_dtype, device=device
        )
        self._init(layout, tuple(backing.unbind(0)), backing)

    @classmethod
    def wrap(cls, layout: KvCacheLayout, layers: Sequence[torch.Tensor]) -> PagedKvCache:
        if len(layers) != layout.num_layers:
            raise ValueError(f"{len(layers)} tensors for {layout.num_layers} layers")
        devices = {tensor.device for tensor in layers}
        if len(devices) != 1:
            raise ValueError(f"layer tensors live on several devices: {sorted(map(str, devices))}")
        for index, tensor in enumerate(layers):
            if tuple(tensor.shape) != layout.layer_shape:
                raise ValueError(
                    f"layer {index} has shape {tuple(tensor.shape)}, expected {layout.layer_shape}"
                )
            if tensor.dtype != layout.torch_dtype:
                raise ValueError(f"layer {index} has dtype {tensor.dtype}, expected {layout.dtype}")
            if not tensor.is_contiguous():
                raise ValueError(f"layer {index} is not contiguous")
        cache = cls.__new__(cls)
        cache._init(layout, tuple(layers), None)
        return cache

    def _init(
        self,
        layout: KvCacheLayout,
        layers: tuple[torch.Tensor, ...],
        backing: torch.Tensor | None,
    ) -> None:
        self.layout = layout
        self.layers = layers
        self.device = layers[0].device
        self._backing = backing  # keeps the single allocation alive
        self._endpoint: KvEndpointDescription | None = None
        self._engine: MooncakeTransferEngine | None = None
        self._registered_spans: tuple[tuple[int, int], ...] = ()

    @property
    def registered(self) -> bool:
        return self._endpoint is not None

    def register(self, engine: MooncakeTransferEngine) -> KvEndpointDescription:
        """Register the cache's memory with `engine` (once) and describe it."""
        if self._endpoint is not None:
            if self._endpoint.session_name != engine.session_name:
                raise RuntimeError(
                    f"cache already registered with {self._endpoint.session_name}, "
                    f"not {engine.session_name}"
                )
            return self._endpoint
        location = f"cuda:{self.device.index or 0}" if self.device.type == "cuda" else "*"
        spans = self._memory_spans()
        done: list[tuple[int, int]] = []
        try:
            for address, length in spans:
                engine.register(address, length, location=location)
                done.append((address, length))
        except BaseException:
            for address, _ in done:  # all or nothing
                engine.unregister(address)
            raise
        self._registered_spans = tuple(spans)
        self._engine = engine
        self._endpoint = KvEndpointDescription.from_parts(
            backend="mooncake",
            session_name=engine.session_name,
            layout=self.layout,
            regions=[
                KvRegionDescription(
                    layer=layer,
                    base_addr=tensor.data_ptr(),
                    block_len=self.layout.block_bytes,
                    num_blocks=self.layout.num_blocks,
                )
                for layer, tensor in enumerate(self.layers)
            ],
        )
        return self._endpoint

    def unregister(self) -> None:
        """Withdraw the memory from the transfer engine (before freeing the tensors).

        Mooncake refuses to register memory overlapping a stale registration, so a
        cache must be unregistered before its memory is reused. The caller makes
        sure no read into it is in flight (`clients.transfer.InFlightReads`).
        """
        if self._engine is None:
            return
        for address, _ in self._registered_spans:
            self._engine.unregister(address)
        self._engine, self._endpoint, self._registered_spans = None, None, ()

    def describe(self) -> KvEndpointDescription:
        if self._endpoint is None:
            raise RuntimeError("register the cache with a transfer engine before describing it")
        return self._endpoint

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        """View of one block (K and V) of one layer."""
        return self.layers[layer][block_id]

    def block_bytes_view(self, layer: int, block_id: int) -> torch.Tensor:
        """The raw bytes of one block: compare these, not values (NaN != NaN)."""
        return self.layers[layer][block_id].reshape(-1).view(torch.uint8)

    def _memory_spans(self) -> list[tuple[int, int]]:
        """Contiguous (address, length) spans covering every layer, merged."""
        spans: list[tuple[int, int]] = []
        for address in sorted(tensor.data_ptr() for tensor in self.layers):
            length = self.layout.layer_bytes
            if spans and spans[-1][0] + spans[-1][1] == address:
                spans[-1] = (spans[-1][0], spans[-1][1] + length)
            elif spans and address < spans[-1][0] + spans[-1][1]:
                raise ValueError("layer tensors overlap in memory")
            else:
                spans.append((address, length))
        return spans
