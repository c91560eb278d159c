"""The vLLM engine: VLLMEngine (engine.py), a client (client.py) of vLLM servers (server.py, the
servers' own plugins in plugins/) and the learner's weight sync into them (sync/); kind.py is its
settings (`rollout.vllm.*`) and registers it, without loading it.

`from rstar2_jax.rollout.engines.vllm_engine import VLLMEngine` loads the engine on first use only.
"""


def __getattr__(name):
    if name == "VLLMEngine":
        from rstar2_jax.rollout.engines.vllm_engine.engine import VLLMEngine
        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
