"""The rollout settings (`rollout.*`) and the one way to build an engine from them, shared by
train, evaluate and chat.

ENGINES (engine_kind.py) maps `rollout.engine` to an `EngineKind`: how to build that engine, its
own settings section (`rollout.<kind>.*`, core/part_sections.py) and how to check them, and the facts
the rest of the code needs about it (whether it runs in the trainer's process, how it holds the
learner's weights, what it adds to each device's memory, how --plan names it). Nothing outside
`rollout/engines/` compares an engine's name: it asks the kind. Each kind is its own module
(jax_engine/kind.py, vllm_engine/kind.py), registered by its import below; the engines
themselves are imported when built, so choosing one never loads the other (vLLM's client needs
no JAX engine, and the reverse).
"""

from __future__ import annotations

from rstar2_jax.core.config_types import setting
from rstar2_jax.core.part_sections import PartChoice, part_section
from rstar2_jax.rollout.engines.base import Engine
from rstar2_jax.rollout.engines.engine_kind import ENGINES, EngineKind


def make_engine(cfg: RolloutConfig, model, tokenizer, *, seed: int) -> Engine:
    """The engine `cfg.engine` names. `model`: the embedded engine's model; for vLLM the served
    architecture, used to export and probe synced weights (None: generation only, no sync)."""
    return ENGINES[cfg.engine].build(cfg, model, tokenizer, seed)


def engine_kind(cfg: RolloutConfig) -> EngineKind:
    return ENGINES[cfg.engine]


# Each kind registers itself (one import a kind); `rollout.*` is then built from what registered.
from rstar2_jax.rollout.engines.jax_engine import kind as jax_kind  # noqa: E402, F401
from rstar2_jax.rollout.engines.vllm_engine import kind as vllm_kind  # noqa: E402, F401


DEFAULT_ENGINE = "jax"  # rollout.engine's default: the embedded engine, nothing to start


class _RolloutBase(PartChoice):
    """`rollout.*`: the engine (rollout.engine), the sampling every engine does, and each engine's
    own settings (rollout.<engine>.*; only the chosen engine's are read)."""


# Where each setting of the flat `rollout.*` of earlier versions lives now.
_MOVED = {**{name: f"jax.{name}" for name in ("slots", "reuse_kv", "page_size", "kv_pages", "kv_memory_gb")},
          "vllm_urls": "vllm.urls", "scheduler": "vllm.scheduler",
          **{f"vllm_{name}": f"vllm.{name}" for name in ("export_dtype", "probe_tolerance", "sync", "sync_dir",
                                                         "fetch_urls", "sync_bucket_mb", "sync_host")}}

RolloutConfig = part_section(
    "RolloutConfig", ENGINES, path="rollout", module=__name__, base=_RolloutBase, moved=_MOVED, refuse_unchosen=False,
    selector=("engine", str, setting(DEFAULT_ENGINE, "jax (embedded in the learner process, rollout.jax.*) | vllm (servers, "
                                     "rollout.vllm.*)", choices=ENGINES)),
    common=[
        ("max_len", int, setting(640, "KV per sequence: the longest prompt + every stage's max_response_tokens must "
                                 "fit", min=2)),
        ("temperature", float, setting(1.0, "sampling temperature of training rollouts (0: greedy)", min=0.0)),
        ("tool_timeout_s", float, setting(5.0, "seconds a tool call may run", min=0.001)),
    ])
