"""JaxEngine: the embedded rollout engine, continuous batching over a fixed number of slots.

Each slot holds one request; by default its KV cache row is the slot's row of one static
[slots, max_len] cache (paged KV below). A new request is prefilled alone (prompt length
rounded up to a power of two, so a few shapes compile) and written into a free row; then every
decode step advances all busy slots by one token in one jitted call. A slot that finishes (EOS,
stop string, max_tokens, context full) is refilled before the next step. Idle slots decode at
position `max_len`, where the cache write is dropped, so they cost compute but never corrupt
anything.

A step's attention reads what the model's decode implementation reads: the whole cache with
"xla", only each row's live slots with `model.set_attention(decode="pallas")` (the fast path on
NVIDIA GPUs). (Reading an XLA prefix of the cache instead, `kv_bucket`, was removed: on an H100
the slice was copied before the attention and came out slower; BENCHMARKS.md.)

Paged KV (`page_size=N`): the cache is instead a pool of `kv_pages` pages of N positions and
each slot a page table, so memory follows the tokens written rather than slots x max_len: give
the engine more slots than max_len rows would fit and requests are admitted while there are
free pages for their prompts (first come, first served). A decode step that needs a page when
none is free takes one from a resident (below), else preempts the most recently admitted
request, which frees its pages and waits at the head of the queue; readmitted, it prefills its
prompt and what it had generated, and samples on with the same per-token keys (vLLM's
preemption by recompute). Decode attention reads the pages through the table: the Pallas
paged kernel with `decode="pallas"`, an XLA gather otherwise.

The two layouts are one `KVLayout` object each (jax_engine/kv_layouts.py: SlotRows, PagedKV), chosen at
construction: the engine schedules requests and keeps the residents; the layout says where their
KV is. The jitted steps are in jax_engine/kernels.py.

KV reuse across turns (`reuse_kv=True`): when a request ends, the trajectory's KV (the `session`
it came with) stays in the engine as a resident, and the trajectory's next turn, whose prompt
extends those tokens, prefills only the new tokens (the tool response) at their positions. With
slot rows a resident lives in its slot until the slot is needed (other requests take empty
slots first, then the least recently used); with pages it keeps only its pages, whichever slot
the next turn lands in, until they are needed (least recently used first). KV computed by older
weights is never reused. Off by default: incremental prefill gives the same tokens up to float
rounding, not bit for bit.

Device work runs on one worker thread, so the asyncio loop stays free for tool calls while the
model runs. `update_weights` swaps the parameter state between decode steps; shapes are unchanged,
so nothing recompiles. Requests in flight continue with the new weights (partial rollouts, for
asynchronous RL): every token records the version that sampled it, and the KV of the tokens
before the swap is kept, as vLLM's pause(mode="keep") keeps it (AReaL recomputes it instead); so
every token also records the oldest version whose KV it read (the version of the request's
latest prefill: decode steps only add KV of the same or newer weights).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from typing import Any, Hashable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rstar2_jax.core import sharding as sharding_lib
from rstar2_jax.models.decoder import Decoder
from rstar2_jax.rollout.engines.accounting import OwnerLedger, current_owner
from rstar2_jax.rollout.engines.base import (Completion, Engine, EngineStats, ServerLoad, checked_prompt,
                                            empty_completion)
from rstar2_jax.rollout.engines.jax_engine.decode_chunks import ChunkedDecode
from rstar2_jax.rollout.engines.jax_engine.decode_step import StepDecode
from rstar2_jax.rollout.engines.jax_engine.kernels import engine_kernels
from rstar2_jax.rollout.engines.jax_engine.settings import JaxEngineSettings, engine_settings
from rstar2_jax.rollout.engines.jax_engine.kv_layouts import KVLayout, PagedKV, SlotRows
from rstar2_jax.rollout.engines.jax_engine.slot_requests import Request, Resident
from rstar2_jax.rollout.engines.jax_engine.weight_swap import INFLIGHT_KVS, SWAP_TIMINGS, LiveWeights
from rstar2_jax.rollout.engines.sampling import SamplingParams

MIN_PREFILL_BUCKET = 16


class JaxEngine(Engine):
    def __init__(self, model: Decoder, tokenizer, settings: JaxEngineSettings | None = None, *, max_len: int,
                 seed: int = 0, eos_ids: Sequence[int] | None = None, mesh: Mesh | None = None, **overrides):
        """settings: `rollout.jax.*` (kind.py's JaxEngineSettings, where every default and rule is;
        None: its defaults), with `overrides` of its fields by name (None: the section's value):
        slots, reuse_kv, page_size (0: one max_len row per slot; N: paged KV in N-position pages),
        kv_pages (0: slots x max_len / N, the rows' memory), decode_steps (above 1: chunks, the
        next dispatched before the last is read: jax_engine/decode_chunks.py), exit_check_steps,
        swap (when new weights take over while requests decode: jax_engine/weight_swap.py) and
        inflight_kv (what requests in flight keep then). A bad value raises ValueError naming
        every problem, as the config check does.
        mesh: devices the weights and KV are split over (`engine_mesh`: this process's devices on
        the tensor axis, heads and MLP width split as vLLM's tensor parallelism); None: one device."""
        s = self.settings = engine_settings(settings, max_len, overrides)
        slots, page_size = s.slots, s.page_size or None
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.slots = slots
        self.max_len = max_len
        self.stats = EngineStats(slots=slots)
        self.ledger = OwnerLedger(slots)  # the same work, charged to the owners of the requests served
        self.reuse_kv = s.reuse_kv
        self.page_size = page_size
        self.kv: KVLayout = (SlotRows(slots, max_len) if page_size is None
                             else PagedKV(slots, max_len, page_size, s.kv_pages or None))
        self.residents: dict[Hashable, Resident] = {}  # by session
        self._admissions = 0
        self.eos_ids = frozenset(model.cfg.eos_token_ids if eos_ids is None else eos_ids)
        self.mesh = mesh
        if mesh is not None and model.decode_attention == "pallas":  # the kernels run by heads on the mesh
            model = nnx.merge(*nnx.split(model)).set_attention(decode_mesh=mesh)  # a new module: the caller's is kept
        self._graphdef, state = nnx.split(model)
        # the weights that sample, and the next version while it lands (jax_engine/weight_swap.py)
        self.weights = LiveWeights(self._placed(state), SWAP_TIMINGS[s.swap], INFLIGHT_KVS[s.inflight_kv])
        self.cache = self._placed_cache(self.kv.make_cache(model.cfg, model.dtype))
        # Seeds for requests that bring none: drawn once per request, at admission.
        self._seeds = np.random.default_rng(seed)
        self.active: list[Request | None] = [None] * slots
        self._waiting: collections.deque[Request] = collections.deque()
        self._arrived: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jax-engine")
        self._stop_ids: dict[str, int] = {}
        self.kernels = engine_kernels(self._graphdef, self.cfg)
        # how the loop decodes: K tokens a dispatch in a device loop, or one (the reference)
        self.decoder: ChunkedDecode | StepDecode = (ChunkedDecode(slots, s.decode_steps, s.exit_check_steps)
                                                     if s.decode_steps > 1 else StepDecode())

    # ------------------------------------------------------------------------------------------
    # public interface

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       stop: Sequence[str] = (), *, session: Hashable | None = None) -> Completion:
        self._ensure_running()
        prompt, budget = checked_prompt(prompt_ids, sampling.max_tokens, self.max_len)
        if budget <= 0:
            return empty_completion(self.version)
        future = asyncio.get_running_loop().create_future()
        req = Request(prompt, sampling, tuple(stop) + tuple(sampling.stop), future, self.version, session=session,
                       owner=current_owner())
        self._waiting.append(req)
        self._arrived.set()
        return await future

    @property
    def version(self) -> int:
        return self.weights.version

    @property
    def state(self):
        return self.weights.state

    def update_weights(self, params: Any, version: int | None = None) -> None:
        """Swap in new parameters (an nnx.State of this model's variables, or a Decoder): when
        they take over is rollout.jax.swap's (jax_engine/weight_swap.py)."""
        state = nnx.split(params)[1] if isinstance(params, nnx.Module) else params
        old_shapes = jax.tree.map(lambda x: (x.shape, x.dtype), self.state)
        new_shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
        if old_shapes != new_shapes:
            raise ValueError("update_weights: the new parameters do not match the engine's model")
        version = self.version + 1 if version is None else version
        self.weights.give(self._placed(state), version, self._decoding(), any(self.active))

    def _decoding(self) -> bool:
        return any(self.active) or self.decoder.in_flight is not None

    async def weights_at_least(self, version: int) -> None:
        """Until weights of `version` or newer have taken over (swap="landed": once their copy
        lands, or the engine runs dry)."""
        def wake():
            self._ensure_running()
            self._arrived.set()  # an idle loop wakes and takes them over
        await self.weights.at_least(version, wake)

    def _placed(self, state):
        """Parameters on the engine's mesh by the model's logical axes (kept where they already are)."""
        if self.mesh is None:
            return state
        targets = sharding_lib.param_shardings(state, self.mesh)
        return jax.tree.map(lambda x, t: x if x.sharding == t else jax.device_put(x, t), state, targets)

    def _placed_cache(self, cache):
        """KV split by heads over the mesh's tensor axis, as the k/v projections that write it."""
        if self.mesh is None:
            return cache
        axes = self.kv.cache_axes
        place = lambda x: jax.device_put(x, sharding_lib.named_sharding(self.mesh, axes, x.shape))  # noqa: E731
        return cache._replace(keys=tuple(map(place, cache.keys)), values=tuple(map(place, cache.values)))

    def precompile(self, prompt_lengths: Sequence[int] = ()) -> None:
        """Compile the prefill for these prompt lengths and the decode step for every kv bucket
        now, so that a timed or latency-sensitive run never stops to compile. Call before use."""
        if self._loop_task is not None:
            raise RuntimeError("precompile before the engine starts serving")
        for n in prompt_lengths:
            tokens = np.zeros((1, self._prefill_bucket(int(n))), np.int32)  # as _admit passes them: NumPy
            sampling = (np.uint32(0), np.int32(0), np.float32(1), np.int32(0), np.float32(1))
            fn, where = self.kv.idle_prefill(self.kernels)
            self.cache, *_ = fn(self.state, self.cache, where, tokens, np.int32(0), np.int32(1), *sampling)
        self.decoder.precompile(self)
        jax.block_until_ready(self.cache)

    async def close(self):
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # we are being cancelled too: not ours to swallow
                    raise
            self._loop_task = None
        self.executor.shutdown(wait=True)

    async def __aenter__(self):
        self._ensure_running()
        return self

    @property
    def steps(self) -> int:
        """Decode steps run so far."""
        return self.stats.decode_steps

    def load(self) -> ServerLoad:
        """Load in the scheduler's terms (usage and capacity: the KV layout's, jax_engine/kv_layouts.py)."""
        busy = self.busy_slots
        usage, capacity = self.kv.load(busy)
        return ServerLoad(kv_usage=usage, kv_capacity_tokens=capacity, running=busy, waiting=len(self._waiting))

    @property
    def busy_slots(self) -> int:
        return sum(r is not None for r in self.active)

    # ------------------------------------------------------------------------------------------
    # scheduling loop

    def _ensure_running(self):
        if self._loop_task is None or self._loop_task.done():
            if self._loop_task is not None and self._loop_task.exception():
                raise RuntimeError("the engine loop died") from self._loop_task.exception()
            self._arrived = self._arrived or asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self):
        loop = asyncio.get_running_loop()
        try:
            while True:
                self.weights.at_boundary(self._decoding(), any(self.active))
                if self.weights.needs_recompute:
                    await self._recompute_kv(loop)
                await self._admit_waiting(loop)
                if not any(self.active):
                    if self.decoder.in_flight is not None:
                        await self.decoder.drain(self, loop)  # its requests may all have finished
                        continue
                    self._arrived.clear()
                    await self._arrived.wait()
                    continue
                # paged: the pages each row's next writes land in (may evict or preempt)
                self.kv.before_decode(self, self.decoder.lookahead)
                if not any(self.active):  # cannot happen (one sequence fits the pool), but never step on nothing
                    continue
                await self.decoder.step(self, loop)
        except Exception as e:  # fail every waiting request loudly rather than hang it
            for req in [*self.active, *self._waiting]:
                if req is not None and not req.future.done():
                    req.future.set_exception(e)
            raise

    async def _recompute_kv(self, loop):
        """inflight_kv="recompute": every request in flight gives up its KV (older weights') and
        waits at the head of the queue, to be prefilled again by the new weights. The chunk in
        flight was sampled before the swap: its tokens are read first and kept."""
        self.weights.needs_recompute = False
        await self.decoder.drain(self, loop)
        for slot in reversed(range(self.slots)):  # the queue's head: slot 0's request first
            if self.active[slot] is not None:
                self.preempt(slot)

    async def _admit_waiting(self, loop):
        """Admit waiting requests, first come first served, while a slot (and room in the KV
        layout for the request's prompt) is free."""
        while self._waiting and None in self.active:
            req = self._waiting[0]
            if req.future.done():  # cancelled by the caller while queued
                self._waiting.popleft()
                continue
            resident = self._reusable(req)
            if not self.kv.make_room(self, req, resident):
                return  # the head waits for pages; nothing overtakes it
            self._waiting.popleft()
            await self._admit(loop, self._choose_slot(resident), req, resident)

    def _reusable(self, req: Request) -> Resident | None:
        """The resident whose KV is a prefix of `req`'s prompt, if there is one to reuse."""
        r = self.residents.get(req.session) if self.reuse_kv and req.session is not None else None
        if (r is None or req.generated or r.version != self.version or len(r.tokens) >= len(req.prompt)
                or req.prompt[:len(r.tokens)] != r.tokens):
            return None
        return r

    def _choose_slot(self, resident: Resident | None) -> int:
        """A free slot, as the KV layout chooses it (slot rows: the one holding the reused KV)."""
        return self.kv.choose_slot(self, [i for i, a in enumerate(self.active) if a is None], resident)

    def drop_resident(self, session: Hashable) -> None:
        del self.residents[session]
        self.kv.drop_resident(session)

    async def _admit(self, loop, slot: int, req: Request, resident: Resident | None):
        context = req.context()
        reuse = len(resident.tokens) if resident is not None else 0
        if req.session is not None and req.session in self.residents:
            if resident is not None:  # its KV is reused: it becomes this request's row
                self.kv.take_resident(req.session, slot)
                del self.residents[req.session]
            else:  # superseded by this turn
                self.drop_resident(req.session)
        self._admissions += 1
        req.admitted = self._admissions
        n = len(context) - reuse  # tokens to prefill
        tokens = np.zeros((1, self._prefill_bucket(n)), np.int32)
        tokens[0, :n] = context[reuse:]
        s = req.sampling
        if not req.generated:  # a first admission (a readmitted request keeps its seed and start)
            req.version_start = self.version
            # any Python int is a valid seed; the device sees its low 32 bits
            req.seed = (s.seed if s.seed is not None else int(self._seeds.integers(2 ** 32))) % 2 ** 32
        # NumPy scalars and arrays: jit transfers them as they are (jnp.asarray would compile a
        # program per new shape and dtype)
        sampling_args = (np.uint32(req.seed), np.int32(len(req.generated)), np.float32(s.temperature),
                         np.int32(s.top_k), np.float32(s.top_p))
        fn, where = self.kv.prefill(self.kernels, slot, len(context), reuse)
        args = (self.state, self.cache, where, tokens, np.int32(reuse), np.int32(n)) + sampling_args

        version = self.version  # the weights in `args`, whatever a sync does while they run
        # reused KV was computed by the same weights (_reusable), so the row's oldest KV is this prefill's
        req.kv_version = version

        def run():
            start = time.monotonic()
            cache, token, logp = fn(*args)
            token, logp = int(token), float(logp)
            return cache, token, logp, start, time.monotonic()  # the device work's interval

        self.cache, token, logp, start, end = await loop.run_in_executor(self.executor, run)
        self.stats.prefill_s += end - start
        self.stats.prefill_tokens += n
        self.stats.reused_tokens += reuse
        self.ledger.charge_prefill(req.owner, start, end, n, reuse)
        self._set_slot(slot, req)
        self.append(slot, token, logp, version)

    def preempt(self, slot: int):
        """Free the slot and its pages; the request waits at the head of the queue."""
        req = self.active[slot]
        self._set_slot(slot, None)
        self.kv.free_row(slot)
        self._waiting.appendleft(req)
        self.stats.preemptions += 1
        self.ledger.charge_preemption(req.owner)

    def _set_slot(self, slot: int, req: Request | None) -> None:
        """The one place a slot changes hands: the chunk loop's carry is then stale for it."""
        self.active[slot] = req
        self.decoder.changed(slot)

    def remaining(self, req: Request) -> int:
        """Tokens `req` may still sample before its budget or the KV room ends it ("length")."""
        return min(req.sampling.max_tokens - len(req.generated), self.max_len - len(req.context()))

    def device_stop_ids(self, req: Request) -> tuple[int, ...]:
        """The token ids that end `req` inside the decode loop: EOS and its one-token stops (a
        stop string that is several tokens is matched by the host, between chunks)."""
        single = (self._single_token_id(stop) for stop in req.stops)
        return tuple(sorted(self.eos_ids)) + tuple(t for t in single if t is not None)

    def take_owned(self, owner: Hashable):
        return self.ledger.take(owner)

    def _prefill_bucket(self, prompt_len: int) -> int:
        """Prompts are padded to a power of two (a few compiled prefill shapes)."""
        return min(self.max_len, max(MIN_PREFILL_BUCKET, 1 << (prompt_len - 1).bit_length()))

    def append(self, slot: int, token: int, logp: float, version: int):
        req = self.active[slot]
        req.generated.append(token)
        req.logprobs.append(logp)
        req.versions.append(version)
        req.kv_versions.append(req.kv_version)
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
            self._set_slot(slot, None)
            self._keep_or_free(slot, req)
            if not req.future.done():
                req.future.set_result(Completion(req.generated, req.logprobs, finish, req.version_start,
                                                 self.version, stop_string, tuple(req.versions),
                                                 tuple(req.kv_versions)))

    def _keep_or_free(self, slot: int, req: Request):
        """A finished request's KV: kept as its trajectory's resident (reuse_kv), else freed."""
        # the last sampled token was never fed through the model: its KV is not there
        tokens = req.context()[:-1]
        if self.reuse_kv and req.session is not None:
            if req.session in self.residents:  # two requests of one session at once: keep the later
                self.drop_resident(req.session)
            # the KV stays where the layout keeps it: the slot's row, or the row's pages
            self.residents[req.session] = Resident(tokens, req.version_start, self._admissions,
                                                     self.kv.keep(slot, req.session, tokens))
        else:
            self.kv.free_row(slot)

    def _matched_stop(self, req: Request) -> str | None:
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
