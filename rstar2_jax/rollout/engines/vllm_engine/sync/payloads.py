"""What a sync moves to the vLLM servers, a typed object each VLLMEngine picks once from its
model: the whole weights (`WHOLE_WEIGHTS`: an export every server reloads, vllm_engine/sync/push.py) or, for
a model with LoRA adapters, only the adapters (`ADAPTERS`: PEFT files each server loads by
version, vllm_engine/sync/adapters.py). The engine asks it how to push, how another trainer process takes
part, what requests name, whether a completion's version is exact and how a restarted server
gets the weights back; it never asks which one it holds."""

from __future__ import annotations

from typing import Any, Sequence

from rstar2_jax.rollout.engines.vllm_engine.sync import adapters as adapter_sync
from rstar2_jax.rollout.engines.vllm_engine.sync.report import SyncReport
from rstar2_jax.rollout.engines.vllm_engine.sync.probe import probe_logprobs
from rstar2_jax.rollout.engines.vllm_engine.sync.push import push_weights
from rstar2_jax.rollout.engines.vllm_engine.sync.export import param_arrays, take_part
from rstar2_jax.rollout.engines.vllm_engine.sync.synced_server import SyncedServer


class WholeWeights:
    name = "whole weights"
    # a completion may straddle a reload: its tokens are stamped with the oldest version that can
    # have sampled them (Completion.version_start), the newest with the engine's version
    exact_versions = False
    can_land_in_background = True  # an export whole before its reload (sync_wait=export)
    loaded_by_name = False         # reloaded in place, any SyncWay carries it (NCCL too)

    def push(self, engines: Sequence[SyncedServer], params: Any, version: int, **kwargs) -> SyncReport:
        return push_weights(engines, params, version, **kwargs)

    def take_part(self, engine: SyncedServer, params: Any) -> None:
        model = engine.as_model(params)
        take_part(engine.export_plan(model), param_arrays(model))
        probe_logprobs(model, engine.probe_tokens)

    def served_name(self, engine: SyncedServer) -> str:
        return engine.model_name

    def restore(self, engine: SyncedServer) -> None:
        engine.reload_whole_weights()


class Adapters:
    name = "LoRA adapters"
    exact_versions = True           # a request names one adapter version: it samples every token
    can_land_in_background = False  # megabytes: always waited for
    loaded_by_name = True          # PEFT files loaded under a name per version (no NCCL; a restarted server 404s it)

    def push(self, engines: Sequence[SyncedServer], params: Any, version: int, **kwargs) -> SyncReport:
        return adapter_sync.push_adapters(engines, params, version)

    def take_part(self, engine: SyncedServer, params: Any) -> None:
        adapter_sync.take_part(params, engine)

    def served_name(self, engine: SyncedServer) -> str:
        """This version's adapter; before the first adapter sync the base, which is what zero
        adapters compute."""
        return adapter_sync.adapter_name(engine.version) if engine.synced_dir else engine.model_name

    def restore(self, engine: SyncedServer) -> None:
        adapter_sync.restore(engine)


WHOLE_WEIGHTS, ADAPTERS = WholeWeights(), Adapters()
