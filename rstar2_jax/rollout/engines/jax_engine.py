"""JaxEngine: the embedded rollout engine, continuous batching over a fixed number of slots.

Each slot holds one request; its KV cache row is the slot's row of one static [slots, max_len]
cache. A new request is prefilled alone (prompt length rounded up to a power of two, so a few
shapes compile) and written into a free row; then every decode step advances all busy slots by
one token in one jitted call. A slot that finishes (EOS, stop string, max_tokens, context full)
is refilled before the next step. Idle slots decode at position `max_len`, where the cache write
is dropped, so they cost compute but never corrupt anything.

A step's attention reads what the model's decode implementation reads: the whole cache with
"xla", only each row's live slots with `model.set_attention(decode="pallas")` (the fast path on
NVIDIA GPUs). `kv_bucket` instead slices the XLA read to the smallest multiple of kv_bucket that
covers every live row (one compiled step per bucket); on an H100 that slice was copied before the
attention and came out slower (BENCHMARKS.md), so it is off by default.

KV reuse across turns (`reuse_kv=True`): when a request ends, its slot keeps the trajectory's KV
(the `session` it came with) until the slot is needed. The trajectory's next turn, whose prompt
extends those tokens, is admitted to that slot and prefills only the new tokens (the tool
response) at their positions; other requests take empty slots first, then the least recently
used one. KV computed by older weights is never reused. Off by default: incremental prefill
gives the same tokens up to float rounding, not bit for bit.

Device work runs on one worker thread, so the asyncio loop stays free for tool calls while the
model runs. `update_weights` swaps the parameter state between decode steps; shapes are unchanged,
so nothing recompiles. Requests in flight continue with the new weights (partial rollouts, for
asynchronous RL): every token records the version that sampled it, and the KV of the tokens
before the swap is kept, as vLLM's pause(mode="keep") keeps it (AReaL recomputes it instead).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from typing import Any, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar2_jax.models.decoder import Decoder, KVCache, init_cache
from rstar2_jax.rollout.engines.base import Completion, Engine, EngineStats, ServerLoad
from rstar2_jax.rollout.sampling import SamplingParams, sample

MIN_PREFILL_BUCKET = 16


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingParams
    stops: tuple[str, ...]
    future: asyncio.Future
    version_start: int = 0
    seed: int = 0                  # token i is sampled with fold_in(key(seed), i)
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # weights that sampled each token
    session: Hashable | None = None


@dataclasses.dataclass
class _Resident:
    """What a free slot still holds: a finished turn's KV, reusable by the same trajectory."""
    session: Hashable
    tokens: list[int]              # the tokens whose KV is in the slot, in order
    version: int                   # weights that computed it
    last_used: int                 # admission counter, for least-recently-used eviction


class JaxEngine(Engine):
    def __init__(self, model: Decoder, tokenizer, *, slots: int = 8, max_len: int = 2048, seed: int = 0,
                 eos_ids: Sequence[int] | None = None, kv_bucket: int | None = None, reuse_kv: bool = False):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if kv_bucket is not None and kv_bucket < 1:
            raise ValueError(f"kv_bucket must be >= 1, got {kv_bucket}")
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.slots = slots
        self.max_len = max_len
        self.kv_bucket = kv_bucket
        self.stats = EngineStats(slots=slots)
        self.reuse_kv = reuse_kv
        self._resident: list[_Resident | None] = [None] * slots
        self._admissions = 0
        self._busy: list[tuple[float, float]] = []  # (start, end) of device work, time.monotonic
        self.version = 0
        self.eos_ids = frozenset(model.cfg.eos_token_ids if eos_ids is None else eos_ids)
        self._graphdef, self._state = nnx.split(model)
        self._cache = init_cache(model.cfg, slots, max_len, dtype=model.dtype)
        # Seeds for requests that bring none: drawn once per request, at admission.
        self._seeds = np.random.default_rng(seed)
        self._active: list[_Request | None] = [None] * slots
        self._queue: asyncio.Queue[_Request] | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jax-engine")
        self._stop_ids: dict[str, int] = {}
        graphdef = self._graphdef

        def row_keys(seeds, counters):
            # one key per row, derived on device: a row's sample depends only on its own seed
            # and position, never on what else shares the batch
            return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)

        def fill_row(state, cache: KVCache, row: KVCache, slot, tokens, start, length, seed, temperature, top_k, top_p):
            """Run `tokens` (the first `length` real) at positions start.. on `row`, write the row
            into the cache at `slot`, and sample the first new token."""
            model = nnx.merge(graphdef, state)
            positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
            logits, row = model(tokens, positions, cache=row)
            keys = tuple(jax.lax.dynamic_update_slice_in_dim(k, r, slot, 0) for k, r in zip(cache.keys, row.keys))
            values = tuple(jax.lax.dynamic_update_slice_in_dim(v, r, slot, 0)
                           for v, r in zip(cache.values, row.values))
            last = jax.lax.dynamic_index_in_dim(logits[0], length - 1, 0, keepdims=True)
            first_key = row_keys(seed[None], jnp.zeros((1,), jnp.int32))
            token, logp = sample(last, first_key, temperature[None], top_k[None], top_p[None])
            return KVCache(keys, values), token[0], logp[0]

        def prefill(state, cache: KVCache, slot, tokens, length, *sampling):
            """A whole prompt into a fresh row."""
            row = init_cache(self.cfg, 1, cache.max_len, dtype=cache.keys[0].dtype)
            return fill_row(state, cache, row, slot, tokens, 0, length, *sampling)

        def extend(state, cache: KVCache, slot, tokens, start, length, *sampling):
            """New tokens at positions start.. of a slot that already holds the KV of positions < start."""
            row = KVCache(tuple(jax.lax.dynamic_slice_in_dim(k, slot, 1, 0) for k in cache.keys),
                          tuple(jax.lax.dynamic_slice_in_dim(v, slot, 1, 0) for v in cache.values))
            return fill_row(state, cache, row, slot, tokens, start, length, *sampling)

        def decode(state, cache: KVCache, tokens, positions, seeds, counters, temperature, top_k, top_p, kv_len):
            model = nnx.merge(graphdef, state)
            logits, cache = model(tokens[:, None], positions[:, None], cache=cache, kv_len=kv_len)
            token, logp = sample(logits[:, 0], row_keys(seeds, counters), temperature, top_k, top_p)
            return cache, token, logp

        # The cache is donated: updated in place, never copied per step.
        self._prefill = jax.jit(prefill, donate_argnums=(1,))
        self._extend = jax.jit(extend, donate_argnums=(1,))
        self._decode = jax.jit(decode, donate_argnums=(1,), static_argnames=("kv_len",))

    # ------------------------------------------------------------------------------------------
    # public interface

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       stop: Sequence[str] = (), *, session: Hashable | None = None) -> Completion:
        self._ensure_running()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        future = asyncio.get_running_loop().create_future()
        req = _Request(prompt, sampling, tuple(stop) + tuple(sampling.stop), future, self.version, session=session)
        if len(prompt) >= self.max_len or sampling.max_tokens == 0:
            return Completion([], [], "length", self.version, self.version)
        await self._queue.put(req)
        return await future

    def update_weights(self, params: Any, version: int | None = None) -> None:
        """Swap in new parameters (an nnx.State of this model's variables, or a Decoder)."""
        state = nnx.split(params)[1] if isinstance(params, nnx.Module) else params
        old_shapes = jax.tree.map(lambda x: (x.shape, x.dtype), self._state)
        new_shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
        if old_shapes != new_shapes:
            raise ValueError("update_weights: the new parameters do not match the engine's model")
        self._state = state
        self.version = self.version + 1 if version is None else version

    def precompile(self, prompt_lengths: Sequence[int] = ()) -> None:
        """Compile the prefill for these prompt lengths and the decode step for every kv bucket
        now, so that a timed or latency-sensitive run never stops to compile. Call before use."""
        if self._loop_task is not None:
            raise RuntimeError("precompile before the engine starts serving")
        for n in prompt_lengths:
            bucket = self._prefill_bucket(int(n))
            self._cache, *_ = self._prefill(self._state, self._cache, jnp.int32(0), jnp.zeros((1, bucket), jnp.int32),
                                            jnp.int32(1), jnp.uint32(0), jnp.float32(1), jnp.int32(0), jnp.float32(1))
        inputs, _ = self._decode_inputs()  # no request yet: every slot idle, every write dropped
        lengths = [None] if self.kv_bucket is None else sorted({self._kv_len(n) for n in range(1, self.max_len + 1,
                                                                                               self.kv_bucket)})
        for kv_len in lengths:
            self._cache, _, _ = self._decode(self._state, self._cache, *inputs, kv_len=kv_len)
        jax.block_until_ready(self._cache)

    async def close(self):
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        self._executor.shutdown(wait=True)

    async def __aenter__(self):
        self._ensure_running()
        return self

    @property
    def steps(self) -> int:
        """Decode steps run so far."""
        return self.stats.decode_steps

    def load(self) -> ServerLoad:
        """Load in the scheduler's terms: every slot owns a max_len row of KV, so capacity is
        slots x max_len tokens and a busy slot uses its whole row."""
        busy = self.busy_slots
        return ServerLoad(kv_usage=busy / self.slots, kv_capacity_tokens=self.slots * self.max_len, running=busy,
                          waiting=self._queue.qsize() if self._queue is not None else 0)

    @property
    def busy_slots(self) -> int:
        return sum(r is not None for r in self._active)

    # ------------------------------------------------------------------------------------------
    # scheduling loop

    def _ensure_running(self):
        if self._loop_task is None or self._loop_task.done():
            if self._loop_task is not None and self._loop_task.exception():
                raise RuntimeError("the engine loop died") from self._loop_task.exception()
            self._queue = self._queue or asyncio.Queue()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self):
        loop = asyncio.get_running_loop()
        try:
            while True:
                while None in self._active and not self._queue.empty():
                    req = self._queue.get_nowait()
                    await self._admit(loop, self._choose_slot(req), req)
                if not any(self._active):
                    await self._admit_when_available(loop)
                    continue
                await self._step(loop)
        except Exception as e:  # fail every waiting request loudly rather than hang it
            for req in self._active:
                if req is not None and not req.future.done():
                    req.future.set_exception(e)
            while not self._queue.empty():
                req = self._queue.get_nowait()
                if not req.future.done():
                    req.future.set_exception(e)
            raise

    async def _admit_when_available(self, loop):
        req = await self._queue.get()
        await self._admit(loop, self._choose_slot(req), req)

    def _reusable(self, slot: int, req: _Request) -> int:
        """How many leading tokens of `req.prompt` have their KV in `slot` (0: none usable)."""
        r = self._resident[slot]
        if (not self.reuse_kv or r is None or req.session is None or r.session != req.session
                or r.version != self.version or len(r.tokens) >= len(req.prompt)
                or req.prompt[:len(r.tokens)] != r.tokens):
            return 0
        return len(r.tokens)

    def _choose_slot(self, req: _Request) -> int:
        """A free slot for `req`: the one holding its trajectory's KV, else an empty one, else the
        least recently used (whose resident KV is dropped)."""
        free = [i for i, a in enumerate(self._active) if a is None]
        for i in free:
            if self._reusable(i, req):
                return i
        empty = [i for i in free if self._resident[i] is None]
        if empty:
            return empty[0]
        return min(free, key=lambda i: self._resident[i].last_used)


    async def _admit(self, loop, slot: int, req: _Request):
        if req.future.done():  # cancelled by the caller while queued
            return
        reuse = self._reusable(slot, req)
        self._resident[slot] = None
        self._admissions += 1
        n = len(req.prompt) - reuse  # tokens to prefill
        tokens = np.zeros((1, self._prefill_bucket(n)), np.int32)
        tokens[0, :n] = req.prompt[reuse:]
        s = req.sampling
        req.version_start = self.version
        # any Python int is a valid seed; the device sees its low 32 bits
        req.seed = (s.seed if s.seed is not None else int(self._seeds.integers(2 ** 32))) % 2 ** 32
        sampling_args = (jnp.uint32(req.seed), jnp.float32(s.temperature), jnp.int32(s.top_k), jnp.float32(s.top_p))
        if reuse:
            fn, args = self._extend, (self._state, self._cache, jnp.int32(slot), jnp.asarray(tokens), jnp.int32(reuse),
                                      jnp.int32(n)) + sampling_args
        else:
            fn, args = self._prefill, (self._state, self._cache, jnp.int32(slot), jnp.asarray(tokens),
                                       jnp.int32(n)) + sampling_args

        version = self.version  # the weights in `args`, whatever a sync does while they run

        def run():
            start = time.monotonic()
            cache, token, logp = fn(*args)
            token, logp = int(token), float(logp)
            self.stats.prefill_s += self._record_busy(start)
            return cache, token, logp

        self._cache, token, logp = await loop.run_in_executor(self._executor, run)
        self.stats.prefill_tokens += n
        self.stats.reused_tokens += reuse
        self._active[slot] = req
        self._append(slot, token, logp, version)

    def _decode_inputs(self):
        """The decode step's per-slot arrays from the active requests (idle slots: dropped writes)."""
        tokens = np.zeros(self.slots, np.int32)
        positions = np.full(self.slots, self.max_len, np.int32)  # idle: the write is dropped
        temperature = np.ones(self.slots, np.float32)
        top_k = np.zeros(self.slots, np.int32)
        top_p = np.ones(self.slots, np.float32)
        seeds = np.zeros(self.slots, np.uint32)
        counters = np.zeros(self.slots, np.int32)
        for slot, req in enumerate(self._active):
            if req is not None:
                seeds[slot] = req.seed
                counters[slot] = len(req.generated)
                tokens[slot] = req.generated[-1]
                positions[slot] = len(req.prompt) + len(req.generated) - 1
                temperature[slot] = req.sampling.temperature
                top_k[slot] = req.sampling.top_k
                top_p[slot] = req.sampling.top_p
        arrays = (tokens, positions, seeds, counters, temperature, top_k, top_p)
        return tuple(jnp.asarray(a) for a in arrays), [int(p) for p in positions if p < self.max_len]

    async def _step(self, loop):
        inputs, busy = self._decode_inputs()
        args = (self._state, self._cache) + inputs
        version = self.version
        kv_len = self._kv_len(max(busy) + 1)

        def run():
            start = time.monotonic()
            cache, token, logp = self._decode(*args, kv_len=kv_len)
            token, logp = np.asarray(token), np.asarray(logp)
            self.stats.decode_s += self._record_busy(start)
            return cache, token, logp

        self._cache, sampled, logps = await loop.run_in_executor(self._executor, run)
        self.stats.decode_steps += 1
        self.stats.busy_slot_steps += len(busy)
        for slot, req in enumerate(self._active):
            if req is not None:
                self._append(slot, int(sampled[slot]), float(logps[slot]), version)

    def _record_busy(self, start: float) -> float:
        """Keep (start, now) as device work; its duration."""
        end = time.monotonic()
        self._busy.append((start, end))
        return end - start

    def take_busy_intervals(self) -> list[tuple[float, float]]:
        """(start, end) of the device work since the last call (time.monotonic), and forget them."""
        out, self._busy = self._busy, []
        return out

    def _prefill_bucket(self, prompt_len: int) -> int:
        """Prompts are padded to a power of two (a few compiled prefill shapes)."""
        return min(self.max_len, max(MIN_PREFILL_BUCKET, 1 << (prompt_len - 1).bit_length()))

    def _kv_len(self, needed: int) -> int | None:
        """The cache prefix a step reads: `needed` slots rounded up to a bucket (None: all)."""
        if self.kv_bucket is None:
            return None
        return min(self.max_len, -(-needed // self.kv_bucket) * self.kv_bucket)

    def _append(self, slot: int, token: int, logp: float, version: int):
        req = self._active[slot]
        req.generated.append(token)
        req.logprobs.append(logp)
        req.versions.append(version)
        finish, stop_string = None, None
        if token in self.eos_ids:
            finish = "eos"
        else:
            stop_string = self._matched_stop(req)
            if stop_string is not None:
                finish = "stop"
            elif len(req.generated) >= req.sampling.max_tokens or len(req.prompt) + len(req.generated) >= self.max_len:
                finish = "length"
        if finish is not None:
            self._active[slot] = None
            if self.reuse_kv and req.session is not None:
                # the last sampled token was never fed through the model: its KV is not there
                self._resident[slot] = _Resident(req.session, req.prompt + req.generated[:-1], req.version_start,
                                                 self._admissions)
            if not req.future.done():
                req.future.set_result(Completion(req.generated, req.logprobs, finish, req.version_start,
                                                 self.version, stop_string, tuple(req.versions)))

    def _matched_stop(self, req: _Request) -> str | None:
        for stop in req.stops:
            if req.generated[-1] == self._single_token_id(stop):
                return stop
            # the same text may also arrive as several ordinary tokens
            window = req.generated[-(len(stop.encode()) + 2):]
            if self.tokenizer.decode(window).endswith(stop):
                return stop
        return None

    def _single_token_id(self, stop: str) -> int | None:
        if stop not in self._stop_ids:
            ids = self.tokenizer.encode(stop)
            self._stop_ids[stop] = ids[0] if len(ids) == 1 else -1
        found = self._stop_ids[stop]
        return None if found < 0 else found
