"""Subprocess with 8 fake CPU devices: one learner update sharded == unsharded. Prints JSON lines."""

import json

import jax
import numpy as np

from rstar2_jax import sharding
from rstar2_jax.learner import Learner, LearnerConfig, LossConfig
from tests.learner.test_learner import _batch
from tests.models.conftest import random_model, small_config

MESHES = [dict(data=1, fsdp=8, tensor=1), dict(data=2, fsdp=2, tensor=2)]


def flat(learner):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(learner.state.params)])


def main():
    assert jax.device_count() == 8
    cfg = small_config("qwen3", num_heads=8, num_kv_heads=4, vocab_size=256)
    lcfg = LearnerConfig(lr=1e-3, warmup_steps=1, loss=LossConfig(micro_batches=2))
    ref = Learner(random_model(cfg, seed=9), lcfg)
    ref_metrics = ref.update(_batch(seed=1, rows=8, vocab=256))
    for axes in MESHES:
        learner = Learner(random_model(cfg, seed=9), lcfg, mesh=sharding.make_mesh(**axes))
        metrics = learner.update(_batch(seed=1, rows=8, vocab=256))
        spec = str(jax.tree.leaves(learner.state.params)[0].sharding.spec)
        print(json.dumps(dict(mesh=axes, max_param_diff=float(np.abs(flat(learner) - flat(ref)).max()),
                              grad_norm=metrics["grad_norm"], ref_grad_norm=ref_metrics["grad_norm"], spec=spec)))


if __name__ == "__main__":
    main()
