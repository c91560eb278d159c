"""Rollout engines: the interface (base.py), the factory (factory.py) and the implementations,
which load when first used (`make_engine` or `engines.JaxEngine`), never on import."""

from rstar2_jax.rollout.engines.base import Completion, Engine, EngineStats, PromptTooLong, ServerLoad
from rstar2_jax.rollout.engines.factory import ENGINES, RolloutConfig, engine_kind, make_engine
from rstar2_jax.rollout.engines.jax_engine.kind import engine_mesh

__all__ = ["Completion", "ENGINES", "Engine", "EngineStats", "JaxEngine", "PromptTooLong", "RolloutConfig",
           "ServerLoad", "engine_kind", "engine_mesh", "make_engine"]


def __getattr__(name):
    if name == "JaxEngine":
        from rstar2_jax.rollout.engines.jax_engine.engine import JaxEngine
        return JaxEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
