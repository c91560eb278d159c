"""One of 2 learner processes (2 fake CPU devices each, gloo collectives): a packed update over
the 4 devices of both (data 2 x fsdp 2: packed rows split over them) against this process's own
padded update on one device, from the same weights and batch; and that packed update (one pass:
the old log-probs from its own forward) against the same with a separate old-log-prob pass (issue
81). Prints one JSON line.

    python -m tests.learner.packed_processes_main PROCESS_ID COORDINATOR_PORT"""

import json
import sys

import jax


def main():
    process_id, port = int(sys.argv[1]), int(sys.argv[2])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())

    import numpy as np
    import optax

    from rstar2_jax.core import sharding
    from rstar2_jax.learner import Learner, LearnerSettings
    from tests.learner.test_learner import _batch
    from tests.models.conftest import random_model, small_config

    def flat(learner):
        return np.concatenate([np.asarray(sharding.gathered(x)).ravel() for x in jax.tree.leaves(learner.state.params)])

    cfg = small_config("qwen3", num_heads=4, num_kv_heads=2, vocab_size=256)
    # the reference: padded rows, one local device, no mesh
    ref = Learner(random_model(cfg, seed=9), LearnerSettings(micro_batches=2), optimizer=optax.sgd(1.0))
    start = flat(ref)
    ref_metrics = ref.update(ref_batch := _batch(seed=1, rows=10, vocab=256, rows_multiple=1))
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=1)
    learner = Learner(random_model(cfg, seed=9), LearnerSettings(token_budget=64), mesh=mesh, optimizer=optax.sgd(1.0))
    metrics = learner.update(batch := _batch(seed=1, rows=10, vocab=256, rows_multiple=1))
    inside = np.arange(batch.tokens.shape[1])[None] < batch.lengths[:, None]
    separate = Learner(random_model(cfg, seed=9), LearnerSettings(token_budget=64, old_logprobs="separate"), mesh=mesh,
                       optimizer=optax.sgd(1.0))
    sep_metrics = separate.update(sep_batch := _batch(seed=1, rows=10, vocab=256, rows_multiple=1))
    print(json.dumps(dict(
        one_pass=metrics["old_logprob_pass"] == 0.0 and sep_metrics["old_logprob_pass"] == 1.0,
        one_vs_separate_step_diff=float(np.abs(flat(learner) - flat(separate)).max()),
        one_vs_separate_grad_norm=(metrics["grad_norm"], sep_metrics["grad_norm"]),
        one_vs_separate_logprob_diff=float(np.abs(np.where(inside, batch.old_logprobs - sep_batch.old_logprobs, 0)).max()),
        process=process_id, max_step_diff=float(np.abs((flat(learner) - start) - (flat(ref) - start)).max()),
        max_step=float(np.abs(flat(ref) - start).max()), grad_norm=metrics["grad_norm"],
        ref_grad_norm=ref_metrics["grad_norm"], policy_loss=metrics["policy_loss"],
        ref_policy_loss=ref_metrics["policy_loss"], packed_rows=metrics["packed_rows"],
        old_logprob_diff=float(np.abs(np.where(inside, batch.old_logprobs - ref_batch.old_logprobs, 0)).max()),
        spec=str(jax.tree.leaves(learner.state.params)[0].sharding.spec))), flush=True)


if __name__ == "__main__":
    main()
