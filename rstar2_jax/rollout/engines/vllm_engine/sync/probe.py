"""The check after each sync that a vLLM server holds the learner's weights: the server's prompt
log-probs of a fixed token sequence against the JAX model's (VLLMEngine.check_sync), started for
every server once a sync lands (`start_probes`), waited for or collected at the next sync."""

from __future__ import annotations

import concurrent.futures
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from rstar2_jax.models.decoder import Decoder
from rstar2_jax.models.logprobs import token_logprobs
from rstar2_jax.rollout.engines.vllm_engine.sync.report import SyncReport


class WeightSyncError(RuntimeError):
    """A server's log-probs after a sync differ from the learner's: it does not hold its weights."""


_PROBES = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="vllm-probe")  # deferred probes


def probe_logprobs(model: Decoder, tokens: Sequence[int]) -> jax.Array:
    """The model's log-probs of `tokens` (each after the ones before it): the sync probe's reference.
    Dispatched, not waited for (JAX's asynchronous dispatch; `np.asarray` of it waits): a sync
    hands the learner's arrays back as soon as its export is whole, and the forward that reads
    them finishes beside what follows (on the 2-core CPU benchmark it held the trainer's sync
    0.37-0.39 s, now 0.02-0.07 s: BENCHMARKS.md, "vLLM weight sync to 2 CPU servers (files)"). An
    update that donates those arrays meanwhile waits for it: a pending read holds a donated
    buffer. Waited for on several CPU devices (below). Compiled once per architecture: op by op
    it cost 0.2 s of CPU per sync for a 0.3B model."""
    graphdef, params = nnx.split(model)
    out = _probe_jit(graphdef, params, jnp.asarray([list(tokens)], jnp.int32))
    devices = out.sharding.device_set
    if not out.is_fully_addressable:  # parameters split over processes: every process runs this
        from rstar2_jax.core.sharding import gathered
        out = gathered(out).addressable_data(0)
    if len(devices) > 1 and next(iter(devices)).platform == "cpu":
        # Over several devices these programs gather the split weights: a GPU runs each device's
        # programs in the order issued (one stream), nothing says the CPU runtime does, and two
        # programs' collectives taken in different orders by their peers would wait on each other.
        out.block_until_ready()
    return out[0, 1:]


@functools.partial(jax.jit, static_argnums=0)
def _probe_jit(graphdef, params, tokens):
    return token_logprobs(nnx.merge(graphdef, params), tokens)


def start_probes(engines: Sequence, model: Decoder, reference: jax.Array, report: SyncReport):
    """Every server's log-prob probe after a sync landed, on the probe pool: waited for with
    probe="wait", else collected later (VLLMEngine.probe_verdict); report.probe_s fills in as they end.
    One probe per server: engines on the same server share its verdict (two prompt_logprobs
    requests of an adapter in one batch crashed vLLM 0.32's CPU EngineCore once in the suite; its
    prompt-logprobs path maps LoRA per sequence, not per token: vllm-project/vllm#16668, #51594)."""
    probed = time.perf_counter()

    def probed_in(_):
        report.probe_s = max(report.probe_s, time.perf_counter() - probed)
    probes: dict[str, concurrent.futures.Future] = {}
    for e in engines:
        if e.url not in probes:
            probes[e.url] = _PROBES.submit(e.check_sync, model, reference)
            probes[e.url].add_done_callback(probed_in)
        e.pending_probe = probes[e.url]
    if engines[0].probe.waited_for:
        for e in engines:
            e.probe_verdict()
