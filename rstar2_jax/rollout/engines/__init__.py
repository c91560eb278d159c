from rstar2_jax.rollout.engines.base import Completion, Engine
from rstar2_jax.rollout.engines.jax_engine import JaxEngine

__all__ = ["Completion", "Engine", "JaxEngine"]
