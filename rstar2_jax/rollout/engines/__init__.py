from rstar2_jax.rollout.engines.base import Completion, Engine, EngineStats, ServerLoad
from rstar2_jax.rollout.engines.factory import ENGINE_KINDS, make_engine
from rstar2_jax.rollout.engines.jax_engine import JaxEngine

__all__ = ["Completion", "ENGINE_KINDS", "Engine", "EngineStats", "JaxEngine", "ServerLoad", "make_engine"]
