"""The GRPO-RoC learner: train state, jitted update, batching, optimizer."""

from rstar2_jax.learner.batching import TrainBatch, make_batch
from rstar2_jax.learner.learner import Learner, LearnerConfig, sampler_mismatch
from rstar2_jax.learner.train_step import TrainState, UpdateConfig

__all__ = ["Learner", "LearnerConfig", "TrainBatch", "TrainState", "UpdateConfig", "make_batch", "sampler_mismatch"]
