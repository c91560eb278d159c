"""Run in a subprocess with 8 fake CPU devices (XLA_FLAGS set by the caller, before jax loads).

Saves a random model, loads it onto each mesh straight from safetensors, and compares the
sharded jitted forward with the unsharded one. Prints one JSON line per mesh.
"""

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar2_jax import models
from rstar2_jax.core import sharding
from tests.models.conftest import random_model, small_config

MESHES = [dict(data=1, fsdp=8, tensor=1), dict(data=1, fsdp=4, tensor=2), dict(data=2, fsdp=2, tensor=2)]


def main():
    assert jax.device_count() == 8, jax.devices()
    # 8 heads / 4 kv heads / vocab 256 divide every mesh axis, so everything really shards.
    cfg = small_config("qwen3", num_heads=8, num_kv_heads=4, vocab_size=256)
    tmp = tempfile.mkdtemp()
    models.save_pretrained(random_model(cfg, seed=7), tmp)
    reference = models.load_pretrained(tmp)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(8, 40)), jnp.int32)
    want = np.asarray(nnx.jit(lambda m, t: m(t))(reference, tokens))

    for axes in MESHES:
        mesh = sharding.make_mesh(**axes)
        model = models.load_pretrained(tmp, mesh=mesh)
        q_spec = model.layers[0].attn.q_proj.get_value().sharding.spec
        embed_spec = model.embed.get_value().sharding.spec
        data_sharding = sharding.named_sharding(mesh, ("batch", "sequence"), tokens.shape)
        with jax.set_mesh(mesh):
            got = nnx.jit(lambda m, t: m(t))(model, jax.device_put(tokens, data_sharding))
        out_spec = got.sharding.spec
        diff = float(np.abs(np.asarray(got) - want).max())
        print(json.dumps(dict(mesh=axes, max_abs_diff=diff, q_proj_spec=str(q_spec),
                              embed_spec=str(embed_spec), logits_spec=str(out_spec),
                              q_proj_shards=len(model.layers[0].attn.q_proj.get_value().addressable_shards))))
        sys.stdout.flush()
    print(json.dumps(host_memory_while_loading()))


def host_memory_while_loading() -> dict:
    """Peak host allocations (tracemalloc: numpy buffers and Python objects) while a model 13x
    its largest tensor loads onto 8 devices, and whether every array landed on its sharding."""
    import os
    import tracemalloc

    from safetensors import safe_open

    cfg = small_config("qwen3", num_heads=8, num_kv_heads=4, vocab_size=256, num_layers=4, hidden_size=512,
                       intermediate_size=2048)
    tmp = tempfile.mkdtemp()
    models.save_pretrained(random_model(cfg, seed=3), tmp)
    with safe_open(os.path.join(tmp, "model.safetensors"), "np") as f:
        sizes = [f.get_tensor(k).nbytes for k in f.keys()]
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    tracemalloc.start()
    model = models.load_pretrained(tmp, mesh=mesh)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    params = nnx.state(model, nnx.Param)
    want = sharding.param_shardings(params, mesh)
    placed = jax.tree.map(lambda x, s: x.sharding == s, params, want)
    return dict(check="host_memory", peak_bytes=peak, largest_tensor_bytes=max(sizes), model_bytes=sum(sizes),
                all_on_intended_sharding=all(jax.tree.leaves(placed)),
                sharded_params=sum(len(x.sharding.spec) > 0 and any(x.sharding.spec)
                                   for x in jax.tree.leaves(params)))


if __name__ == "__main__":
    main()
