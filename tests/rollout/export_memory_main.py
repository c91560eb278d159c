"""Subprocess with 8 fake CPU devices: the device memory a vLLM sync's export holds beyond the
learner's (sharded) parameters, sampled from jax.live_arrays() at every tensor it hands to the
writer, against the memory plan's "weight sync" line. Prints JSON lines (one per layout path)."""

import collections
import json
import os
import tempfile

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from experiments import tiny_arith
from rstar2_jax import sharding
from rstar2_jax.models import checkpoint
from rstar2_jax.models.decoder import Decoder
from rstar2_jax.rl.config import RunConfig
from rstar2_jax.rl.memory_plan import architecture, memory_plan, mesh_sizes
from rstar2_jax.rollout.engines import weight_export


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


def main():
    assert jax.device_count() == 8
    c = tiny_arith.get_config()
    c.model.tiny_layers, c.model.tiny_hidden = 2, 256
    c.rollout.engine, c.rollout.vllm_urls, c.rollout.vllm_export_dtype = "vllm", ("http://127.0.0.1:1",), "bfloat16"
    c.rollout.page_size = c.rollout.kv_pages = 0
    c.rollout.kv_memory_gb = 0.0
    cfg, problems = RunConfig.parse(c.to_dict())
    assert not problems, problems
    arch = architecture(cfg)
    plan = memory_plan(arch, cfg, devices=8, devices_per_process=8, capacity=None)
    graphdef, params = nnx.split(Decoder(arch, rngs=nnx.Rngs(0)), nnx.Param)
    params = jax.device_put(params, sharding.param_shardings(params, sharding.make_mesh(**mesh_sizes(cfg, 8))))
    model = nnx.merge(graphdef, params)
    export = weight_export.model_plan(model, "bfloat16", 1 << 30)
    arrays = weight_export.param_arrays(model)
    unsampled = weight_export.host_tensors
    for on_device in (True, False):  # the accelerator path (the device lays out) and the CPU one (casts only)
        weight_export.lays_out_on_device = lambda: on_device
        baseline, extra = per_device_bytes(), [0]

        def sampled(bucket, arrays):
            for x in unsampled(bucket, arrays):
                now = per_device_bytes()
                extra[0] = max(extra[0], max(now[d] - baseline[d] for d in now))
                yield x

        weight_export.host_tensors = sampled
        slots = weight_export.ExportSlots(tempfile.mkdtemp())
        slot = slots.begin(export)
        for bucket in export.buckets:
            slots.write(slot, bucket, arrays)
        sharded = all(len(x.sharding.device_set) == 8 for x in arrays.values())
        written = {}
        for name in export.file_names:
            written.update(load_file(os.path.join(slot, name)))
        reference = checkpoint.model_params_host(model, "bfloat16")
        equal = set(written) == set(reference) and all(np.array_equal(written[k], v) for k, v in reference.items())
        print(json.dumps(dict(on_device=on_device, extra=extra[0], line=plan.line("weight sync").bytes,
                              buckets=len(export.buckets), sharded=sharded, equal=equal,
                              files=sorted(os.listdir(slot)))), flush=True)
        slots.close()


if __name__ == "__main__":
    main()
