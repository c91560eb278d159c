"""`rollout.jax.*`: the embedded engine's settings and their rules, in one place for the config
check (kind.py) and the engine (engine.py), neither of which the other imports for them."""

from __future__ import annotations

import dataclasses
from typing import Iterator

from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.rollout.engines.jax_engine.decode_chunks import DEFAULT_DECODE_STEPS
from rstar2_jax.rollout.engines.jax_engine.weight_swap import INFLIGHT_KVS, SWAP_TIMINGS


@dataclasses.dataclass(frozen=True)
class JaxEngineSettings(Section):
    """`rollout.jax.*`: the embedded engine's decode slots and KV cache."""
    slots: int = setting(32, "sequences decoded together", min=1)
    reuse_kv: bool = setting(False, "keep a trajectory's KV between turns (prefill only new tokens)")
    page_size: int = setting(0, "0 = one rollout.max_len KV row per slot; N = paged KV, pages of N positions", min=0)
    kv_pages: int = setting(0, "paged: pages in the pool (0 = kv_memory_gb's, else slots x max_len / page_size)",
                            min=0)
    kv_memory_gb: float = setting(0.0, "paged: the KV pool's size in GiB, all the engine's devices together "
                                  "(0 = kv_pages); the pool holds as many pages as fit", min=0.0)
    devices: int = setting(0, "devices of its own: the last N of each process's devices hold the engine (weights and "
                           "KV split over them), the learner the rest, and after each update the weights move "
                           "device to device (a reshard); 0: the engine shares the learner's devices", min=0)
    swap: str = setting("next_chunk", "when an update's weights take over mid-request: next_chunk (the next dispatch, "
                        "which waits for the copy; the same every run) | landed (once the copy is on the device: "
                        "decoding never waits for it, the old weights kept until then; where it lands is timing's)",
                        choices=SWAP_TIMINGS)
    inflight_kv: str = setting("keep", "what requests in flight keep when new weights take over: keep (their KV, "
                               "computed by the old weights: PipelineRL's in-flight update) | recompute (their "
                               "context prefilled again by the new weights, as after a preemption)", choices=INFLIGHT_KVS)
    replicas: int = setting(1, "data-parallel copies of the engine over its devices (rollout.jax.devices, else the "
                            "process's): each holds the weights on devices / replicas of them (split by heads "
                            "within) with its own slots and KV; the scheduler's kv_aware policy with prefix "
                            "affinity picks one per turn, as among vLLM servers", min=1)
    decode_steps: int = setting(DEFAULT_DECODE_STEPS, "decode steps per dispatch: above 1 a device loop decodes "
                                "chunks of this many tokens, the next dispatched before the last is read (same "
                                "tokens; 1: one host round trip per token; rollout/engines/jax_engine/decode_chunks.py)", min=1)
    exit_check_steps: int = setting(1, "decode steps between a chunk's checks that a slot is still live (it ends "
                                    "early when none is); divides decode_steps. 1: every step; decode_steps: the "
                                    "chunk runs whole, a loop whose trip count XLA knows, so a GPU queues it without "
                                    "waiting on the host between steps (same tokens; jax_engine/decode_chunks.py)", min=1)


def setting_problems(j: JaxEngineSettings, max_len: int) -> Iterator[tuple[str, str]]:
    """The rules between `rollout.jax.*` and rollout.max_len: (field, why) for each broken one,
    the one copy that the config check and JaxEngine both read."""
    if j.page_size and max_len % j.page_size:
        yield "page_size", f"{j.page_size} must divide rollout.max_len={max_len}"
    if j.kv_pages and not j.page_size:
        yield "kv_pages", "needs rollout.jax.page_size > 0 (kv_pages sizes the paged KV pool)"
    if j.kv_memory_gb and not j.page_size:
        yield "kv_memory_gb", "needs rollout.jax.page_size > 0 (it sizes the paged KV pool)"
    if j.kv_memory_gb and j.kv_pages:
        yield "kv_memory_gb", "and rollout.jax.kv_pages both size the pool: set one (the other 0)"
    if j.devices and j.devices % j.replicas:
        yield "replicas", (f"{j.replicas} does not divide rollout.jax.devices={j.devices}: each replica takes an "
                           "equal group of the engine's devices")
    if j.exit_check_steps > 0 and j.decode_steps % j.exit_check_steps:
        yield "exit_check_steps", (f"{j.exit_check_steps} does not divide rollout.jax.decode_steps="
                                   f"{j.decode_steps}: a chunk checks for a live slot between equal blocks of steps")
    if j.kv_pages and j.page_size and j.kv_pages * j.page_size < max_len:
        yield "kv_pages", (f"{j.kv_pages} x page_size={j.page_size} cannot hold one max_len={max_len} sequence")


def engine_settings(settings: JaxEngineSettings | None, max_len: int, overrides: dict) -> JaxEngineSettings:
    """`settings` (default: the section's defaults) with `overrides` by field name (None: the
    section's value), checked as the config is: every problem at once, as a ValueError."""
    values = {**(settings or JaxEngineSettings()).to_dict(), **{k: v for k, v in overrides.items() if v is not None}}
    section = JaxEngineSettings.from_mapping(values)
    problems = [f"{field}: {message}" for field, message in setting_problems(section, max_len)]
    if problems:
        raise ValueError("JaxEngine: " + "; ".join(problems))
    return section
