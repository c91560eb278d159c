"""One of 2 trainer processes (2 fake CPU devices each, gloo collectives): the memory plan's lines
for a run split over processes, against the bytes of live arrays on this process's devices.

- learner: float32 parameters + AdamW's moments, split over the 4 devices of both processes,
  against the "parameters" + "optimizer" lines;
- export: a vLLM sync's export of those parameters in bf16. Each tensor is gathered whole by
  both processes (process 0 writes the buckets, process 1 takes part in the gathers only, as
  push_to_servers and take_part_in_sync do); sampled at every tensor, against the "weight sync"
  line, which counts two whole tensors when the parameters are split over processes.

    python -m tests.rl.plan_memory_processes_main PROCESS_ID COORDINATOR_PORT
Prints one JSON line ("what": "processes")."""

import json
import sys
import tempfile

import jax


def main():
    process_id, port = int(sys.argv[1]), int(sys.argv[2])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())

    import jax.numpy as jnp
    from flax import nnx

    from rstar2_jax.core import sharding
    from rstar2_jax.learner import Learner, LearnerSettings
    from rstar2_jax.models.decoder import Decoder
    from rstar2_jax.rl.memory_plan import memory_plan, mesh_sizes
    from rstar2_jax.rollout.engines.vllm_engine.sync import export as weight_export
    from tests.rl.plan_memory_main import VLLM_RUN, most_held_during_export, per_device_bytes, tiny_run

    cfg, arch = tiny_run(**VLLM_RUN)
    plan = memory_plan(arch, cfg, devices=4, devices_per_process=2, capacity=None)

    baseline = per_device_bytes()
    mesh = sharding.make_mesh(**mesh_sizes(cfg, 4))
    graphdef, params = nnx.split(Decoder(arch, dtype=jnp.float32, rngs=nnx.Rngs(0)), nnx.Param)
    model = nnx.merge(graphdef, jax.device_put(params, sharding.param_shardings(params, mesh)))
    del params
    learner = Learner(model, LearnerSettings(), mesh=mesh, own_params=True)
    held = per_device_bytes()
    state = [held[d] - baseline[d] for d in sorted(held)]

    model = nnx.merge(learner.graphdef, learner.model_state())
    export = weight_export.model_plan(model, "bfloat16", 1 << 30)
    arrays = weight_export.param_arrays(model)
    with most_held_during_export(held) as extra:
        if process_id == 0:
            slots = weight_export.ExportSlots(tempfile.mkdtemp())
            slot = slots.begin(export)
            for bucket in export.buckets:
                slots.write(slot, bucket, arrays)
            slots.close()
        else:
            weight_export.take_part(export, arrays)
    split = all(not x.is_fully_addressable for x in arrays.values() if x.ndim == 2)
    print(json.dumps(dict(what="processes", process=process_id, state=state,
                          state_line=plan.line("parameters").bytes + plan.line("optimizer").bytes,
                          export_extra=extra[0], sync_line=plan.line("weight sync").bytes,
                          sync_how=plan.line("weight sync").how, split_over_processes=split)), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
