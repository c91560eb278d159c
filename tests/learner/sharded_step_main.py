"""Subprocess with 8 fake CPU devices: one learner update sharded == unsharded. Prints JSON lines."""

import dataclasses
import json

import jax
import numpy as np

from rstar2_jax.core import sharding
from rstar2_jax.learner import Learner, LearnerSettings
from rstar2_jax.models import lora
from tests.learner.test_learner import _batch
from tests.models.conftest import random_model, small_config

MESHES = [dict(data=1, fsdp=8, tensor=1), dict(data=2, fsdp=2, tensor=2)]


def flat(learner):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(learner.state.params)])


def main():
    assert jax.device_count() == 8
    cfg = small_config("qwen3", num_heads=8, num_kv_heads=4, vocab_size=256)
    lcfg = LearnerSettings(lr=1e-3, warmup_steps=1, micro_batches=2)
    ref = Learner(random_model(cfg, seed=9), lcfg)
    ref_metrics = ref.update(_batch(seed=1, rows=8, vocab=256))
    for axes in MESHES:
        learner = Learner(random_model(cfg, seed=9), lcfg, mesh=sharding.make_mesh(**axes))
        metrics = learner.update(_batch(seed=1, rows=8, vocab=256))
        spec = str(jax.tree.leaves(learner.state.params)[0].sharding.spec)
        print(json.dumps(dict(mesh=axes, max_param_diff=float(np.abs(flat(learner) - flat(ref)).max()),
                              grad_norm=metrics["grad_norm"], ref_grad_norm=ref_metrics["grad_norm"], spec=spec)))
    # packed rows (one per device: 8 per micro-batch) over data=2 x fsdp=4 == the padded reference
    packed = Learner(random_model(cfg, seed=9), dataclasses.replace(lcfg, micro_batches=1, token_budget=64),
                     mesh=sharding.make_mesh(data=2, fsdp=4, tensor=1))
    metrics = packed.update(_batch(seed=1, rows=8, vocab=256))
    print(json.dumps(dict(mesh="packed", max_param_diff=float(np.abs(flat(packed) - flat(ref)).max()),
                          grad_norm=metrics["grad_norm"], ref_grad_norm=ref_metrics["grad_norm"],
                          packed_rows=metrics["packed_rows"], width=packed.width,
                          spec=str(jax.tree.leaves(packed.state.params)[0].sharding.spec))))
    # 3 rows over data=2 x fsdp=4 with 2 micro-batches: the learner pads to 16 rows itself, so
    # every micro-batch splits over the 8 devices (before, 3 rows were silently replicated).
    ref = Learner(random_model(cfg, seed=9), lcfg)
    ref_metrics = ref.update(_batch(seed=2, rows=3, vocab=256, rows_multiple=1))
    learner = Learner(random_model(cfg, seed=9), lcfg, mesh=sharding.make_mesh(data=2, fsdp=4, tensor=1))
    batch = _batch(seed=2, rows=3, vocab=256, rows_multiple=1)
    seen = []
    put = learner._put
    learner._put = lambda x: seen.append(put(x)) or seen[-1]
    metrics = learner.update(batch)
    print(json.dumps(dict(mesh="padded", max_param_diff=float(np.abs(flat(learner) - flat(ref)).max()),
                          grad_norm=metrics["grad_norm"], ref_grad_norm=ref_metrics["grad_norm"],
                          spec=str(seen[-1].sharding.spec), rows=int(seen[-1].shape[0]),
                          rows_multiple=learner.rows_multiple, entropy_rows=int(batch.entropy.shape[0]))))
    # LoRA (models/lora.py): adapters trained over fsdp=8 with the frozen base split as full training
    # splits it == the one-device LoRA learner
    def adapted():
        return lora.attach(random_model(cfg, seed=9), lora.LoRAConfig(rank=4, alpha=8.0), seed=3)
    ref = Learner(adapted(), lcfg)
    ref_metrics = ref.update(_batch(seed=1, rows=8, vocab=256))
    learner = Learner(adapted(), lcfg, mesh=sharding.make_mesh(data=1, fsdp=8, tensor=1))
    metrics = learner.update(_batch(seed=1, rows=8, vocab=256))
    base_specs = {str(x.sharding.spec) for x in jax.tree.leaves(learner.frozen)}
    print(json.dumps(dict(mesh="lora", max_param_diff=float(np.abs(flat(learner) - flat(ref)).max()),
                          grad_norm=metrics["grad_norm"], ref_grad_norm=ref_metrics["grad_norm"],
                          spec=" ".join(sorted(base_specs)), trained=len(jax.tree.leaves(learner.state.params)))))


if __name__ == "__main__":
    main()
