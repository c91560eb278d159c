"""Subprocess with 8 fake CPU devices, the memory plan's lines against the bytes of live arrays:
- what a vLLM sync's export holds beyond the learner's (sharded) parameters, sampled from
  jax.live_arrays() at every tensor it hands to the writer, against the "weight sync" line (one
  JSON line per layout path, "what": "export");
- what the embedded engine holds once built as the trainer builds it (its bf16 copy of the
  weights, split over the process's devices, and its KV cache, rows or pages), against the
  "engine weights" and "KV pool" lines (one JSON line per KV layout, "what": "engine");
- what the learner holds between updates (float32 parameters and AdamW's moments, split over
  an FSDP mesh of the 8 devices) against the "parameters" and "optimizer" lines ("what":
  "learner")."""

import collections
import contextlib
import json
import os
import tempfile

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from experiments import tiny_arith
from rstar2_jax.core import sharding
from rstar2_jax.models import checkpoint
from rstar2_jax.models.decoder import Decoder
from rstar2_jax.core import processes
from rstar2_jax.rl.config import RunConfig
from rstar2_jax.rl.memory_plan import architecture, memory_plan, mesh_sizes
from rstar2_jax.rollout.engines.vllm_engine.sync import export as weight_export
from rstar2_jax.rollout.engines import engine_mesh, make_engine


def per_device_bytes() -> collections.Counter:
    """Bytes of the distinct buffers on each device (an array and the per-shard arrays made from
    it share buffers: counted once)."""
    buffers = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            buffers[shard.device.id, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    out = collections.Counter()
    for (device, _), nbytes in buffers.items():
        out[device] += nbytes
    return out


def tiny_run(max_response_tokens: int | None = None, **settings):
    """tiny_arith's run at 2 layers x 256 hidden (every line of the plan many KiB), with
    `settings` ("section__field" or "section__part__field": value) and the stages' max_response_tokens set; (config, its
    architecture)."""
    c = tiny_arith.get_config()
    c.model.tiny_layers, c.model.tiny_hidden = 2, 256
    for key, value in settings.items():
        *sections, field = key.split("__")
        node = c
        for name in sections:
            node = node[name]
        setattr(node, field, value)
    if max_response_tokens is not None:
        c.stages = [{**stage, "max_response_tokens": max_response_tokens} for stage in c.stages]
    cfg, problems = RunConfig.parse(c.to_dict())
    assert not problems, problems
    return cfg, architecture(cfg)


# A run whose rollouts are on vLLM servers, synced in bf16: the export's settings
VLLM_RUN = dict(rollout__engine="vllm", rollout__vllm__urls=("http://127.0.0.1:1",),
                rollout__vllm__export_dtype="bfloat16")


@contextlib.contextmanager
def most_held_during_export(reference: collections.Counter):
    """While it is open, the export samples per_device_bytes() at every tensor it hands on; yields
    [the most bytes any device held beyond `reference`], filled in as it goes."""
    unsampled, extra = weight_export.host_tensors, [0]

    def sampled(bucket, arrays, to_host=True):
        for x in unsampled(bucket, arrays, to_host):
            now = per_device_bytes()
            extra[0] = max(extra[0], max(now[d] - reference[d] for d in now))
            yield x

    weight_export.host_tensors = sampled
    try:
        yield extra
    finally:
        weight_export.host_tensors = unsampled


def main():
    assert jax.device_count() == 8
    export_lines()
    engine_lines()
    learner_lines()


def learner_lines():
    """The learner as RLRun.session builds it: the model's parameters loaded onto the run's mesh,
    then Learner(own_params=True), which adds the optimizer state."""
    import jax.numpy as jnp

    from rstar2_jax.learner import Learner, LearnerSettings

    cfg, arch = tiny_run()
    plan = memory_plan(arch, cfg, devices=8, devices_per_process=8, capacity=None)
    baseline = per_device_bytes()
    mesh = sharding.make_mesh(**mesh_sizes(cfg, 8))
    model = Decoder(arch, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    model = nnx.merge(graphdef, jax.device_put(params, sharding.param_shardings(params, mesh)))
    learner = Learner(model, LearnerSettings(), mesh=mesh, own_params=True)
    del model, params
    now = per_device_bytes()
    print(json.dumps(dict(what="learner", mesh=mesh_sizes(cfg, 8), extra=[now[d] - baseline[d] for d in sorted(now)],
                          line=plan.line("parameters").bytes + plan.line("optimizer").bytes)), flush=True)
    del learner


def engine_lines():
    """The engine built as RLRun.session builds it: a bf16 copy of the learner's split float32
    parameters placed on the engine's mesh (RLRun.engine_weights), then make_engine."""
    import jax.numpy as jnp

    for page_size in (0, 16):
        # fewer pages than slots x max_len / page_size (64)
        cfg, arch = tiny_run(64, model__dtype="bfloat16", rollout__jax__slots=8, rollout__max_len=128,
                             rollout__jax__page_size=page_size, rollout__jax__kv_pages=24 if page_size else 0)
        plan = memory_plan(arch, cfg, devices=8, devices_per_process=8, capacity=None)
        graphdef, params = nnx.split(Decoder(arch, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), nnx.Param)
        params = jax.device_put(params, sharding.param_shardings(params, sharding.make_mesh(**mesh_sizes(cfg, 8))))
        baseline = per_device_bytes()
        mesh = engine_mesh()
        weights = processes.local_copy(params, jnp.bfloat16, sharding.param_shardings(params, mesh))
        engine = make_engine(cfg.rollout, nnx.merge(graphdef, weights), None, seed=0)
        del weights  # the engine holds what it needs
        now = per_device_bytes()
        print(json.dumps(dict(what="engine", page_size=page_size, extra=[now[d] - baseline[d] for d in sorted(now)],
                              weights_line=plan.line("engine weights").bytes, kv_line=plan.line("KV pool").bytes,
                              kv_how=plan.line("KV pool").how, engine_devices=len(mesh.devices.flat))), flush=True)
        del engine, params


def export_lines():
    cfg, arch = tiny_run(**VLLM_RUN)
    plan = memory_plan(arch, cfg, devices=8, devices_per_process=8, capacity=None)
    graphdef, params = nnx.split(Decoder(arch, rngs=nnx.Rngs(0)), nnx.Param)
    params = jax.device_put(params, sharding.param_shardings(params, sharding.make_mesh(**mesh_sizes(cfg, 8))))
    model = nnx.merge(graphdef, params)
    export = weight_export.model_plan(model, "bfloat16", 1 << 30)
    arrays = weight_export.param_arrays(model)
    for on_device in (True, False):  # the accelerator path (the device lays out) and the CPU one (casts only)
        weight_export.lays_out_on_device = lambda on_device=on_device: on_device
        slots = weight_export.ExportSlots(tempfile.mkdtemp())
        slot = slots.begin(export)
        with most_held_during_export(per_device_bytes()) as extra:
            for bucket in export.buckets:
                slots.write(slot, bucket, arrays)
        sharded = all(len(x.sharding.device_set) == 8 for x in arrays.values())
        written = {}
        for name in export.file_names:
            written.update(load_file(os.path.join(slot, name)))
        reference = checkpoint.model_params_host(model, "bfloat16")
        equal = set(written) == set(reference) and all(np.array_equal(written[k], v) for k, v in reference.items())
        print(json.dumps(dict(what="export", on_device=on_device, extra=extra[0], line=plan.line("weight sync").bytes,
                              buckets=len(export.buckets), sharded=sharded, equal=equal,
                              files=sorted(os.listdir(slot)))), flush=True)
        slots.close()


if __name__ == "__main__":
    main()
