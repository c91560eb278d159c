"""The embedded JAX engine: JaxEngine (engine.py) over its decode kernels, KV layouts and slot
strategies; kind.py is its settings (`rollout.jax.*`) and registers it, without loading it.

`from rstar2_jax.rollout.engines.jax_engine import JaxEngine` loads the engine on first use only,
so that the kind's settings import without JAX's compiled programs.
"""


def __getattr__(name):
    if name == "JaxEngine":
        from rstar2_jax.rollout.engines.jax_engine.engine import JaxEngine
        return JaxEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
