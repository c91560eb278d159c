"""rstar2-jax: agentic reinforcement learning (rStar2-Agent, GRPO-RoC) in JAX."""

from sandbox.moved_modules import install as _install_moved

__version__ = "0.1.0"

# issue 82: prefixes became packages; an old path fails with its new one named (sandbox/moved_modules.py)
_install_moved("rstar2_jax", {
    "ablation": "reports.ablation",
    "checkpoints": "core.checkpoints",
    "config_types": "core.config_types",
    "eval_report": "reports.eval_report",
    "part_sections": "core.part_sections",
    "processes": "core.processes",
    "registry": "core.registry",
    "rollout.engines.adapter_sync": "rollout.engines.vllm_engine.sync.adapters",
    "rollout.engines.background_sync": "rollout.engines.vllm_engine.sync.background",
    "rollout.engines.decode_chunks": "rollout.engines.jax_engine.decode_chunks",
    "rollout.engines.decode_step": "rollout.engines.jax_engine.decode_step",
    "rollout.engines.export_roots": "rollout.engines.vllm_engine.sync.export_roots",
    "rollout.engines.jax_kernels": "rollout.engines.jax_engine.kernels",
    "rollout.engines.jax_kind": "rollout.engines.jax_engine.kind",
    "rollout.engines.kv_layouts": "rollout.engines.jax_engine.kv_layouts",
    "rollout.engines.kv_pages": "rollout.engines.jax_engine.kv_pages",
    "rollout.engines.nccl_sync": "rollout.engines.vllm_engine.sync.nccl_group",
    "rollout.engines.reach": "rollout.engines.vllm_engine.sync.reach",
    "rollout.engines.shared_export": "rollout.engines.vllm_engine.sync.shared_export",
    "rollout.engines.slot_requests": "rollout.engines.jax_engine.slot_requests",
    "rollout.engines.sync_payloads": "rollout.engines.vllm_engine.sync.payloads",
    "rollout.engines.sync_report": "rollout.engines.vllm_engine.sync.report",
    "rollout.engines.vllm_client": "rollout.engines.vllm_engine.client",
    "rollout.engines.vllm_kind": "rollout.engines.vllm_engine.kind",
    "rollout.engines.vllm_modes": "rollout.engines.vllm_engine.modes",
    "rollout.engines.vllm_probe": "rollout.engines.vllm_engine.sync.probe",
    "rollout.engines.vllm_push": "rollout.engines.vllm_engine.sync.push",
    "rollout.engines.vllm_server": "rollout.engines.vllm_engine.server",
    "rollout.engines.weight_export": "rollout.engines.vllm_engine.sync.export",
    "rollout.engines.weight_pull": "rollout.engines.vllm_engine.sync.fetcher",  # the file server: sync.file_server
    "rollout.engines.weight_swap": "rollout.engines.jax_engine.weight_swap",
    "seeding": "core.seeding",
    "sharding": "core.sharding",
    "shared_jit": "core.shared_jit",
    "timeline": "core.timeline",
})
