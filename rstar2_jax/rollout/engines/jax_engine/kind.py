"""The embedded engine's kind (`rollout.engine=jax`): JaxEngine in the trainer's process, on its
devices, with a local copy of the learner's weights in the compute dtype."""

from __future__ import annotations

from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.models.shard_sizes import shard_bytes, split_dim
from rstar2_jax.rollout.engines.base import Engine
from rstar2_jax.rollout.engines.jax_engine.settings import JaxEngineSettings, setting_problems
from rstar2_jax.rollout.engines.jax_engine.weight_swap import SWAP_TIMINGS
from rstar2_jax.rollout.engines.engine_kind import (ENGINES, EngineKind, EnginePlanInputs, EngineWeights, PlanLine,
                                                    RolloutSection)
from rstar2_jax.rollout.engines.jax_engine.kv_pages import kv_bytes_per_position


def engine_mesh(devices=None, own: bool = False):
    """The embedded engine's devices: this process's, all on the tensor axis (weights and KV heads
    split over them, as vLLM's tensor parallelism; the Pallas decode kernels run by heads under
    shard_map, models/attention._by_kv_heads). None (the default device) when there is one; with
    devices of its own (`own`), a mesh of that one, so that the engine lives there."""
    import jax
    devices = jax.local_devices() if devices is None else list(devices)
    from rstar2_jax.core.sharding import make_mesh
    if len(devices) == 1:
        return make_mesh(data=1, fsdp=1, tensor=1, devices=devices) if own else None
    return make_mesh(data=1, fsdp=1, tensor=len(devices), devices=devices)


def split_devices(rollout: RolloutSection, devices: list) -> tuple[list, list]:
    """(the learner's devices, the engine's) out of `devices` (the job's, over every process):
    with `rollout.jax.devices=N`, the last N of each process's go to the engine; else both share
    them all. Refused when a process has fewer than N + 1 (the learner would have none)."""
    n = rollout.jax.devices
    if not n:
        return list(devices), list(devices)
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    engine = []
    for process, own in sorted(by_process.items()):
        if n >= len(own):
            raise ValueError(f"rollout.jax.devices={n} asks for {n} of process {process}'s {len(own)} devices, which "
                             f"leaves the learner {len(own) - n}: set it to at most {len(own) - 1} (0: the engine "
                             "shares the learner's devices)")
        engine += sorted(own, key=lambda d: d.id)[-n:]
    taken = {d.id for d in engine}
    return [d for d in devices if d.id not in taken], engine


def kv_pool_pages(jax_cfg: JaxEngineSettings, max_len: int, model_cfg, dtype_bytes: int) -> int | None:
    """Pages of the embedded engine's paged KV pool: kv_pages, or what kv_memory_gb holds (None:
    unpaged, or slots x max_len's worth)."""
    from rstar2_jax.rollout.engines.jax_engine.kv_pages import kv_bytes_per_position, pages_in_budget
    j = jax_cfg
    if j.kv_pages or not j.kv_memory_gb:
        return j.kv_pages or None
    position = kv_bytes_per_position(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, dtype_bytes)
    pages = pages_in_budget(j.kv_memory_gb * 2**30, j.page_size, position)
    if pages * j.page_size < max_len:
        raise ValueError(f"rollout.jax.kv_memory_gb={j.kv_memory_gb} holds {pages} page(s) of {j.page_size} "
                         f"positions ({position} bytes each), fewer than one rollout.max_len={max_len} sequence")
    return pages


def _build_jax(cfg: RolloutSection, model, tokenizer, seed: int) -> Engine:
    """One JaxEngine on the engine's devices, or (rollout.jax.replicas > 1) one per group of
    them behind a Scheduler (kv_aware, prefix affinity), each with the kind's settings."""
    import jax.numpy as jnp

    from rstar2_jax.rollout.engines.jax_engine.engine import JaxEngine
    j = cfg.jax
    pages = kv_pool_pages(j, cfg.max_len, model.cfg, jnp.dtype(model.dtype).itemsize)
    engines = [JaxEngine(model, tokenizer, j, max_len=cfg.max_len, seed=seed, mesh=mesh,
                         kv_pages=pages, kv_memory_gb=0.0)  # kv_memory_gb is resolved into kv_pages here
               for mesh in replica_meshes(cfg)]
    if len(engines) == 1:
        return engines[0]
    from rstar2_jax.rollout.engines.scheduler import Scheduler
    return Scheduler(engines, policy="kv_aware", affinity=True)


def replica_meshes(cfg: RolloutSection) -> list:
    """Each replica's mesh over this process's share of the engine's devices (split_devices), in
    rollout.jax.replicas contiguous groups; one replica: the whole share (None: the default device)."""
    import jax
    _, engine = split_devices(cfg, jax.devices())
    local = sorted((d for d in engine if d.process_index == jax.process_index()), key=lambda d: d.id)
    n = cfg.jax.replicas
    if n == 1:
        return [engine_mesh(local, own=bool(cfg.jax.devices))]
    if len(local) % n:
        raise ValueError(f"rollout.jax.replicas={n} does not divide the engine's {len(local)} device(s) of this "
                         f"process: set it to a divisor of {len(local)}")
    size = len(local) // n
    return [engine_mesh(local[i * size:(i + 1) * size], own=True) for i in range(n)]


def _mesh(cfg: RolloutSection, decode_attention: str):  # (every decode attention splits by heads)
    """Where the learner's weights are copied for the engine: its (first replica's) mesh; other
    replicas take them from there, device to device."""
    return replica_meshes(cfg)[0]


def _check_jax(cfg: RolloutSection):
    for field, message in setting_problems(cfg.jax, cfg.max_len):
        yield f"jax.{field}", message


def _weights(cfg: RolloutSection, compute_dtype: str) -> EngineWeights:
    # the engine samples with the compute dtype's weights, as the learner computes with them; on
    # devices of its own it never shares the learner's arrays (they are on other devices)
    return EngineWeights(dtype=compute_dtype, split=True, own_devices=bool(cfg.jax.devices))


def _engine_devices(devices_per_process: int, own: int = 0) -> int:
    return own or devices_per_process  # as engine_mesh


def _plan(x: EnginePlanInputs) -> tuple[list[PlanLine], int]:
    import jax.numpy as jnp

    b = jnp.dtype(DTYPES[x.compute_dtype]).itemsize
    # each device holds one replica's share: weights and KV split over a replica's devices
    engine_devices = max(_engine_devices(x.devices_per_process, x.rollout.jax.devices) // x.rollout.jax.replicas, 1)
    mesh = {"data": 1, "fsdp": 1, "tensor": engine_devices}
    shares = _weights(x.rollout, x.compute_dtype).shares(learner_devices=x.devices, on_policy=x.on_policy)
    weights = PlanLine("engine weights", 0.0 if shares else shard_bytes(x.arch, mesh, b),
                       "shares the learner's (float32, one device, on-policy)" if shares else
                       f"{x.compute_dtype}, split over {engine_devices} device(s)",
                       "more devices for the engine (it splits over its devices: rollout.jax.devices, fewer "
                       "rollout.jax.replicas), or rollout.engine=vllm (rollouts on other GPUs)")
    lines = [weights, PlanLine("KV pool", *_kv_pool(x, engine_devices, b),
                               "a smaller rollout.jax.kv_memory_gb (paged KV: rollout.jax.page_size), fewer "
                               "rollout.jax.slots, or rollout.engine=vllm")]
    if SWAP_TIMINGS[x.rollout.jax.swap].waits_for_landing and not shares:  # the next version lands beside the one decoding
        lines.insert(1, PlanLine("landing weights", weights.bytes, "rollout.jax.swap=landed: the next version's "
                                 "copy, beside the one decoding until it lands",
                                 "rollout.jax.swap=next_chunk (one copy of the engine's weights)"))
    return lines, engine_devices


def _kv_pool(x: EnginePlanInputs, engine_devices: int, b: int) -> tuple[float, str]:
    r, j, arch = x.rollout, x.rollout.jax, x.arch
    position = kv_bytes_per_position(arch.num_layers, arch.num_kv_heads, arch.head_dim, b)
    if j.page_size:
        pages = kv_pool_pages(j, r.max_len, arch, b) or j.slots * r.max_len // j.page_size
        positions, what = pages * j.page_size, f"{pages} pages of {j.page_size}"
    else:
        positions, what = j.slots * r.max_len, f"{j.slots} slots x {r.max_len}"
    split = arch.num_kv_heads // split_dim(arch.num_kv_heads, "kv_heads", {"data": 1, "fsdp": 1, "tensor": engine_devices})
    return positions * position / split, f"{what} positions x {position / 2**10:.3g} KiB, split {split} way(s)"


def _attention_refusal(r: RolloutSection, decode_attention: str) -> str | None:
    if decode_attention == "pallas" and not r.jax.page_size and r.max_len % 128:  # the ragged kernel's blocks
        return f"pallas needs rollout.max_len to be a multiple of 128 (or paged KV), got {r.max_len}"
    return None


def _describe(r: RolloutSection) -> str:
    j = r.jax
    return (f"jax, {j.slots} slots x {r.max_len} KV positions" + (f", paged ({j.page_size} per page)" if j.page_size else "")
            + (f", {j.replicas} data-parallel replicas" if j.replicas > 1 else ""))


ENGINES.register("jax", EngineKind(
    build=_build_jax, settings=JaxEngineSettings, check=_check_jax, embedded=True,
    samples_like_learner=lambda r, compute_dtype: compute_dtype == "float32",
    weights=_weights, plan=_plan, describe=_describe, host_refusal=lambda r, platform: None,
    attention_refusal=_attention_refusal,
    devices=split_devices, mesh=_mesh, devices_of_its_own=lambda r: r.jax.devices,
    context_granule=lambda own: own.page_size or 1,  # paged KV: whole pages
    cli_flags=(("slots", "slots"), ("page_size", "page_size"), ("kv_pages", "kv_pages"))))
