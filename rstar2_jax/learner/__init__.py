"""The GRPO-RoC learner: train state, jitted update, batching, optimizer."""

from rstar2_jax.learner.batching import TrainBatch, make_batch
from rstar2_jax.learner.learner import Learner, sampler_mismatch
from rstar2_jax.learner.settings import LearnerSettings
from rstar2_jax.learner.train_step import TrainState, UpdateConfig

__all__ = ["Learner", "LearnerSettings", "TrainBatch", "TrainState", "UpdateConfig", "make_batch", "sampler_mismatch"]
