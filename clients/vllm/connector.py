"""`KvrcConnector`: vLLM's KV connector API (v1) on top of kvrc and Mooncake.

    --kv-transfer-config '{"kv_connector": "KvrcConnector",
        "kv_connector_module_path": "clients.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "engine_id": "prefill-0",
        "kv_connector_extra_config": {"kvrc_target": "127.0.0.1:50051", "reuse": true}}'

The scheduler side (EngineCore) is `clients.vllm.scheduler.KvrcScheduler`, the
worker side (each Worker, one per TP rank) `clients.vllm.worker.KvrcWorker`.
Identity: one vLLM engine per data-parallel rank is one kvrc child engine,
named by kvrc's rule (`engine_id`, or `<engine_id>_dp<rank>` when dp_size > 1);
each TP worker is one of its rank parts.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import vllm  # type: ignore[import-not-found]

from clients.vllm import check_vllm_version

check_vllm_version(vllm.__version__)

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found]  # noqa: E402

from clients.session import EngineProfile, RankPartRegistration  # noqa: E402
from clients.vllm.config import (  # noqa: E402
    KvrcConfigError,
    KvrcConnectorConfig,
    check_engine_settings,
    check_parallel_layout,
)
from clients.vllm.metadata import KvrcConnectorMetadata, KvrcWorkerMetadata  # noqa: E402

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig  # type: ignore[import-not-found]
    from vllm.forward_context import ForwardContext  # type: ignore[import-not-found]
    from vllm.v1.core.block_pool import BlockPool  # type: ignore[import-not-found]
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # type: ignore[import-not-found]
    from vllm.v1.core.sched.output import SchedulerOutput  # type: ignore[import-not-found]
    from vllm.v1.kv_cache_interface import KVCacheConfig  # type: ignore[import-not-found]
    from vllm.v1.outputs import KVConnectorOutput  # type: ignore[import-not-found]
    from vllm.v1.request import Request  # type: ignore[import-not-found]

log = logging.getLogger("kvrc.vllm")

__all__ = ["KvrcConfigError", "KvrcConnector", "KvrcConnectorConfig"]


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    engine_id: str
    dp_rank: int
    dp_size: int
    child_engine_id: str


def engine_identity(vllm_config: Any) -> EngineIdentity:
    kv = vllm_config.kv_transfer_config
    if not kv.engine_id:
        raise KvrcConfigError("engine_id", "kv_transfer_config.engine_id must be set")
    parallel = vllm_config.parallel_config
    dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    # kvrc's own naming rule (RankPartRegistration.resolved_child_engine_id)
    child = RankPartRegistration(
        engine_id=kv.engine_id,
        profile=EngineProfile(model="", block_size=1),
        dp_rank=dp_rank,
        dp_size=dp_size,
    ).resolved_child_engine_id
    return EngineIdentity(kv.engine_id, dp_rank, dp_size, child)


class KvrcConnector(KVConnectorBase_V1):  # type: ignore[misc]
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv = self._kv_transfer_config
        self.config = KvrcConnectorConfig.from_extra(kv.kv_connector_extra_config)
        if not check_engine_settings(
            self.config,
            kv_role=kv.kv_role,
            kv_load_failure_policy=kv.kv_load_failure_policy,
            prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        ):
            log.warning(
                "KvrcConnector: kv_load_failure_policy=%r: a failed handoff load fails the "
                'request; set "recompute" to recompute instead',
                kv.kv_load_failure_policy,
            )
        parallel = vllm_config.parallel_config
        check_parallel_layout(
            int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
            int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
        )
        self.identity = engine_identity(vllm_config)
        # vLLM's busy loop and the connector's kvrc thread share the GIL: a 5 ms switch
        # interval makes every hand-over of an RPC cost up to 5 ms.
        if sys.getswitchinterval() > self.config.switch_interval_s:
            sys.setswitchinterval(self.config.switch_interval_s)
        self._scheduler: Any = None
        self._worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            from clients.vllm.scheduler import KvrcScheduler

            self._scheduler = KvrcScheduler(vllm_config, self.config, self.identity)
        else:
            from clients.vllm.worker import KvrcWorker

            self._worker = KvrcWorker(vllm_config, self.config, self.identity)

    # --- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvrcConnectorMetadata)
        self._worker.start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # nothing is pushed: peers pull from the registered KV memory

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._worker.get_finished()
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = self._worker.finished.take_errors()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        counters, outcomes = self._worker.finished.take_meta()
        if not counters and not outcomes:
            return None
        return KvrcWorkerMetadata(counters, outcomes)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # --- scheduler side ----------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._scheduler.bind_pool(kv_cache_manager.block_pool, kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._scheduler.bind_pool(gpu_block_pool)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        matched: tuple[int | None, bool] = self._scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        return matched

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        finished: tuple[bool, dict[str, Any] | None] = self._scheduler.request_finished(
            request, block_ids
        )
        return finished

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()
