"""Run in a subprocess with 8 fake CPU devices (tests/fake_devices.py).

The embedded engine over this process's 8 devices (weights and KV split by heads on the tensor
axis) against the same engine on one device: greedy tokens, bf16 weights, paged KV sized by a
memory budget (float32 for the token comparison, then bf16). Prints one JSON line.
"""

import asyncio
import json
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

from rstar2_jax import models
from rstar2_jax.models import tiny
from rstar2_jax.models.tokenizer import Tokenizer
from rstar2_jax.rollout.engines import JaxEngine, engine_mesh
from rstar2_jax.rollout.engines.jax_engine.kind import kv_pool_pages
from rstar2_jax.rollout.engines.jax_engine.settings import JaxEngineSettings
from rstar2_jax.rollout.engines.jax_engine.kv_pages import kv_bytes_per_position
from rstar2_jax.rollout.engines.sampling import SamplingParams


def main():
    assert jax.device_count() == 8, jax.devices()
    # 8 query and 8 KV heads, MLP and vocabulary divisible by 8: every matrix really splits.
    model_dir = tiny.build_tiny_model(tempfile.mkdtemp(), seed=11, num_heads=8, num_kv_heads=8, head_dim=32,
                                      hidden_size=128, intermediate_size=256)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    fp32 = models.load_pretrained(model_dir)
    bf16 = models.load_pretrained(model_dir, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    position_bytes = kv_bytes_per_position(fp32.cfg.num_layers, fp32.cfg.num_kv_heads, fp32.cfg.head_dim, 4)
    budget_gb = 6 * 64 * position_bytes / 2**30  # 6 pages of 64 positions
    cfg, max_len = JaxEngineSettings(slots=3, page_size=64, kv_memory_gb=budget_gb), 128
    prompts = [tokenizer.encode(f"problem {i}: {'x' * i}") for i in range(5)]

    async def greedy(model, devices, decode="xla", paged=True):
        dtype_bytes = jnp.dtype(model.dtype).itemsize
        model = nnx.merge(*nnx.split(model)).set_attention(decode=decode)  # a clone: the fixture's stays xla
        async with JaxEngine(model, tokenizer, slots=cfg.slots, max_len=max_len, page_size=cfg.page_size if paged else None,
                             kv_pages=kv_pool_pages(cfg, max_len, model.cfg, dtype_bytes) if paged else None,
                             mesh=engine_mesh(devices)) as engine:
            outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=24, temperature=0.0))
                                          for p in prompts))
            q = nnx.merge(engine._graphdef, engine.state).layers[0].attn.q_proj.get_value()
            keys = engine.cache.keys[0]
            return dict(tokens=[o.token_ids for o in outs], pages=engine.kv.pool.num_pages if paged else 0,
                        q_proj_shard_fraction=q.addressable_shards[0].data.size / q.size, q_proj_dtype=str(q.dtype),
                        kv_shard_fraction=keys.addressable_shards[0].data.size / keys.size)

    async def own_devices():
        """The learner's weights on devices 0-3 (fsdp), the engine on 4-7 (tensor): a sync is a
        device-to-device reshard (processes.local_copy onto the engine's shardings, as the trainer's
        engine_weights makes it); timed against the same copy onto all eight (the engine sharing them)."""
        import time

        from rstar2_jax.core import sharding
        from rstar2_jax.core.processes import local_copy
        learner_devices, engine_devices = jax.devices()[:4], jax.devices()[4:]
        learner_mesh = sharding.make_mesh(data=1, fsdp=4, tensor=1, devices=learner_devices)
        state = nnx.state(fp32, nnx.Param)
        params = jax.device_put(state, sharding.param_shardings(state, learner_mesh))
        mesh = engine_mesh(engine_devices, own=True)
        times = {}
        for name, target in (("own", mesh), ("shared", engine_mesh(jax.devices()))):
            copies = []
            for _ in range(4):
                start = time.perf_counter()
                copy = local_copy(params, None, sharding.param_shardings(params, target))
                jax.block_until_ready(copy)
                copies.append(time.perf_counter() - start)
            times[name] = sorted(copies)[1]
        engine_model = models.load_pretrained(model_dir)  # other weights until the sync lands
        nnx.update(engine_model, jax.tree.map(lambda x: x * 0.5, nnx.state(engine_model, nnx.Param)))
        async with JaxEngine(engine_model, tokenizer, slots=cfg.slots, max_len=max_len, mesh=mesh) as engine:
            start = time.perf_counter()
            engine.update_weights(local_copy(params, None, sharding.param_shardings(params, mesh)), version=1)
            jax.block_until_ready(engine.state)
            sync_s = time.perf_counter() - start
            outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=24, temperature=0.0))
                                          for p in prompts))
            engine_on = {d.id for leaf in jax.tree.leaves(engine.state) for d in leaf.devices()}
            engine_on |= {d.id for d in engine.cache.keys[0].devices()}
        learner_on = {d.id for leaf in jax.tree.leaves(params) for d in leaf.devices()}
        return dict(tokens=[o.token_ids for o in outs], versions=sorted({v for o in outs for v in o.token_versions}),
                    engine_on=sorted(engine_on), learner_on=sorted(learner_on), sync_s=sync_s,
                    copy_own_s=times["own"], copy_shared_s=times["shared"])

    async def replicas():
        """rollout.jax.devices=4, replicas=4 (issue 70 item 2): the kind builds four one-device
        engines on devices 4-7 behind the kv_aware scheduler with prefix affinity; a sync from the
        learner's copy (onto the first replica's mesh) reaches each, device to device."""
        import dataclasses

        from rstar2_jax.core import sharding
        from rstar2_jax.core.processes import local_copy
        from rstar2_jax.rollout.engines import RolloutConfig, engine_kind
        base = RolloutConfig()
        rollout = dataclasses.replace(base, max_len=max_len, jax=dataclasses.replace(
            base.jax, devices=4, replicas=4, slots=cfg.slots))
        kind = engine_kind(rollout)
        engine_model = models.load_pretrained(model_dir)  # other weights until the sync lands
        nnx.update(engine_model, jax.tree.map(lambda x: x * 0.5, nnx.state(engine_model, nnx.Param)))
        engine = kind.build(rollout, engine_model, tokenizer, 0)
        async with engine:
            state = nnx.state(fp32, nnx.Param)
            mesh = kind.mesh(rollout, "xla")
            engine.update_weights(local_copy(state, None, sharding.param_shardings(state, mesh)), version=1)
            outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=24, temperature=0.0),
                                                          session=i) for i, p in enumerate(prompts)))
            again = await engine.generate(prompts[0] + outs[0].token_ids, SamplingParams(max_tokens=4, temperature=0.0),
                                          session=0)  # the trajectory's next turn: back to its home
            on = [sorted({d.id for leaf in jax.tree.leaves(e.state) for d in leaf.devices()}) for e in engine.engines]
            return dict(tokens=[o.token_ids for o in outs], versions=[e.version for e in engine.engines], on=on,
                        dispatched=list(engine.dispatched), stayed=engine.stayed, next_turn=again.token_ids)

    own = asyncio.run(own_devices())
    replicated = asyncio.run(replicas())
    split = asyncio.run(greedy(fp32, jax.devices()))
    single = asyncio.run(greedy(fp32, jax.devices()[:1]))
    split_bf16 = asyncio.run(greedy(bf16, jax.devices()))
    # the Pallas decode kernels (interpreted on the CPU) by heads over 8 devices against one device
    pallas = {f"{layout}_{where}": asyncio.run(greedy(fp32, devices, "pallas", paged=layout == "paged"))["tokens"]
              for layout in ("paged", "rows") for where, devices in (("split", jax.devices()), ("single", jax.devices()[:1]))}
    print(json.dumps(dict(split=split, single=single, split_bf16=split_bf16, own=own, replicas=replicated,
                          mesh_of_8=dict(engine_mesh().shape),
                          pallas=pallas, pallas_mesh=dict(engine_mesh().shape))))


if __name__ == "__main__":
    main()
