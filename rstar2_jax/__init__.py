"""rstar2-jax: agentic reinforcement learning (rStar2-Agent, GRPO-RoC) in JAX."""

__version__ = "0.1.0"
