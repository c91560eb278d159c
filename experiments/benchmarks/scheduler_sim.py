"""Discrete-event simulation of one rollout step across many engines: which dispatch policy
keeps them busy without preemptions?

    python -m experiments.benchmarks.scheduler_sim [--engines 64 --rollouts_per_engine 32 --seeds 3] [--record BENCHMARKS.md]
    python -m experiments.benchmarks.scheduler_sim --pipeline [--steps 6] [--record BENCHMARKS.md]

The policies are the scheduler's own functions (rstar2_jax.rollout.engines.scheduler.POLICIES); the
engines are modelled, not run. Each engine behaves like a vLLM server: continuous batching,
requests admitted first-come first-served while their context fits in its KV cache, and when a
decode step would overflow the cache the most recently admitted request is preempted (its KV
dropped, recomputed by a prefill when it is admitted again). A decode step costs
`step_base + step_per_seq * running + step_per_kv_token * kv_tokens` (weights read once, KV read
per token), a prefill `prefill_per_token` per token not already cached; a trajectory's next turn
on the engine that ran its previous turn finds its prefix cached unless it was evicted (below).

Workload (rStar2-Agent's setting, scaled to the issue's 64 engines x 32 rollouts): turns whose
lengths are log-normal (heavy tail) within an 8K-token budget, a tool call after every turn but
the last (about 5 per trajectory), tool latency log-normal with mean 0.3 s and a 1% tail of
5-second timeouts. Defaults for the engine costs are a 14B model in bf16 on one H100 (28 GB of
weights at ~3 TB/s, 196 KB of KV per token, ~240K tokens of KV cache).

Reported per policy (mean over seeds): makespan (last trajectory done), idle engine share (time
an engine had nothing to run before the makespan, over engines x makespan), preemptions and the
tokens they forced to recompute, prefill tokens (everything not found in an engine's prefix
cache: whole trajectories re-prefilled when a turn moves engines), and the mean number of
requests an engine ran at once. "+ affinity" variants keep a trajectory on the engine of its
previous turn when it fits there (the scheduler's pick_with_affinity).

An engine's prefix cache holds the context of each trajectory that finished a turn there (while
its tool runs) in the KV the running requests leave free; under pressure the least recently
stored prefixes are evicted, and a turn whose prefix was evicted prefills it whole.

`--pipeline` simulates several RL steps, synchronous (rl.max_staleness = 0: rollouts, then the
update, then the weight sync) against the trainer's asynchronous pipeline (k = 1, 2: steps
0..k are released at once; step j is released when the learner has finished and synced step
j-1-k, while the learner trains). Step s trains when its rollouts are all in and the learner is
free; the learner's time is the kept rollouts' tokens (RoC keeps G of 2G: `kept_fraction`) x 6
x parameters (forward + backward: the learner's one pass, rl.old_logprobs=auto; 8 x with the
separate old-log-prob pass, `old_logprob_pass`) at `learner_mfu` of `learner_devices` H100s.
A weight sync costs what was measured for the files path (BENCHMARKS.md, H100 weight sync,
Qwen3-1.7B: export 0.49 GB/s, reload 0.85 GB/s per server, scaled to the model's bf16 bytes):
the learner exports once (it is busy meanwhile), then every engine pauses for one reload
(servers reload in parallel) and its prefix cache is reset; requests running keep their KV
(partial rollouts), trajectories between turns re-prefill.

Three layouts at the same GPU count (`--pipeline`): split (engines on `engines` GPUs, learner on
`learner_devices` others; sync or async), and colocated sync (every GPU generates, then every GPU
trains, as verl's hybrid engine: 2x the engines with half the rollouts each, 2x the learner's
devices, and a weight hand-over in place of `colocated_sync_s` instead of an export + reload).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import itertools
import math
import time

import numpy as np

from experiments.benchmarks import common
from rstar2_jax.rollout.engines.scheduler_policies import POLICIES, EngineLoad, pick_with_affinity, reservation


@dataclasses.dataclass
class SimConfig:
    engines: int = 64
    rollouts_per_engine: int = 32
    rollouts: int | None = None          # per step; None: engines x rollouts_per_engine
    prompt_tokens: int = 300
    budget_tokens: int = 8192            # response budget per trajectory (model + tool tokens)
    mean_tool_calls: float = 5.0         # geometric number of tool-calling turns
    max_turns: int = 15
    turn_tokens_median: float = 250.0    # log-normal turn length ...
    turn_tokens_sigma: float = 1.2       # ... heavy tail
    tool_response_tokens: int = 120
    tool_mean_s: float = 0.3
    tool_sigma: float = 1.0
    tool_timeout_share: float = 0.01
    tool_timeout_s: float = 5.0
    kv_capacity_tokens: int = 240_000
    step_base_s: float = 0.0095          # 28 GB of weights / 3 TB/s
    step_per_seq_s: float = 5e-5
    step_per_kv_token_s: float = 6.5e-8  # 196 KB / 3 TB/s
    prefill_per_token_s: float = 7e-5    # 2 x 14e9 FLOPs / 400 TFLOP/s
    reserve_new_tokens: int | None = None  # kv_aware: None reserves the whole remaining budget
    affinity: bool = False               # a trajectory's next turn goes back to its engine when it fits
    # --pipeline: the learner and the weight sync (14B on its own 64 H100s; bf16 peak 989 TFLOP/s)
    params: float = 14.77e9
    learner_devices: int = 64
    learner_mfu: float = 0.4
    peak_flops: float = 989e12
    kept_fraction: float = 0.5           # RoC trains G of the 2G rollouts it samples
    export_gb_s: float = 0.49            # measured: Qwen3-1.7B export on an H100 host (BENCHMARKS.md)
    reload_gb_s: float = 0.85            # measured: its reload in a fresh process
    # files (a whole export, then parallel reloads) | streamed (the bucketed files sync: each
    # bucket reloaded while the next is written) | staged (the bucketed export while the engines
    # generate, then one reload each: rollout.vllm.reload=staged) | broadcast | colocated (in place)
    sync: str = "files"
    colocated_sync_s: float = 3.0        # colocated: weights handed to the co-located engine in place
    broadcast_s: float = 3.0             # broadcast (NCCL, assumed, not measured): 28 GB at ~10 GB/s
    streamed_export_gb_s: float = 1.60   # measured: the bucketed export of Qwen3-1.7B on an H200 host
    bucket_gb: float = 4.0               # the sync's default bucket (rollout.vllm.sync_bucket_mb = 4096)
    streamed_pause_factor: float = 1.11  # measured: servers pause 1.11x the reload alone (2 CPU servers)
    staged_pause_factor: float = 1.03    # measured: 0.99-1.03x staged, files (2 CPU servers, 2026-11-28)
    # reshard (issue 70: the JaxEngine on devices of its own in one JAX job): the weights move
    # learner mesh -> engine mesh device to device while the engines generate (rollout.jax.swap=
    # landed), then take over at a chunk boundary; requests keep their KV and prefixes.
    # ASSUMED, not measured here: the cross-node bound of one GPU's copy, InfiniBand NDR 400 Gb/s =
    # 50 GB/s a GPU (datasheet; NVLink 4 within a node: 450 GB/s a direction), every engine GPU
    # receiving the whole bf16 model (one replica per GPU); the swap one chunk boundary, 50 ms.
    reshard_gb_s: float = 50.0
    swap_s: float = 0.05
    group_size: int = 16                 # rollouts per problem (a group: what carry cuts)
    carry_fraction: float = 1.0          # rl.staleness: 1.0 = wait; < 1: carry (a step trains once
                                         # this share of its groups are in; the rest join the next)
    # LoRA (model.lora.rank > 0, issue 49): the sync writes the adapters (float32 PEFT files) and each
    # engine stops only for their load (a utility call between engine steps, at the reload's rate);
    # the update forms no weight gradients of the base: its backward is 2 x params FLOPs a token, not 4
    lora_rank: int = 0
    # rl.old_logprobs=separate (or an update of several optimizer steps): a forward pass of its own
    # before the update, 2 x params FLOPs a token more (issue 81: the learner's default skips it)
    old_logprob_pass: bool = False
    # Fed by measurements (pipeline_check: the CPU demo's own costs) in place of the 14B model:
    # trajectories drawn from these (prompt tokens, model tokens of each turn, each call's latency);
    # the learner's seconds per trained token (context of the kept rollouts); at most this many
    # requests running on an engine at once (the JaxEngine's slots). None: the defaults above.
    measured_workload: tuple | None = None
    learner_s_per_token: float | None = None
    max_running: int | None = None

    @property
    def step_rollouts(self) -> int:
        return self.rollouts if self.rollouts is not None else self.engines * self.rollouts_per_engine

    @property
    def learner_flops_per_token(self) -> float:
        """Forward 2 + backward 4 (LoRA: 2) x params, + 2 x params for a separate old-log-prob pass."""
        return self.params * (2 + (2 if self.lora_rank else 4) + (2 if self.old_logprob_pass else 0))

    def learner_s(self, sampled_tokens: int) -> float:
        """The update of a step whose rollouts hold `sampled_tokens` (the learner trains the kept ones)."""
        tokens = sampled_tokens * self.kept_fraction
        if self.learner_s_per_token is not None:
            return tokens * self.learner_s_per_token
        return tokens * self.learner_flops_per_token / (self.learner_devices * self.learner_mfu * self.peak_flops)

    @property
    def sync_gb(self) -> float:
        """What a sync moves: the bf16 model, or with LoRA the float32 adapters of Qwen3-14B."""
        if self.lora_rank:
            from rstar2_jax.models.lora import LoRAConfig, adapter_parameters
            from rstar2_jax.models.shapes import shape
            return 4 * adapter_parameters(LoRAConfig(rank=self.lora_rank), shape("qwen3_14b")) / 1e9
        return 2 * self.params / 1e9

    @property
    def export_s(self) -> float:
        """The learner's share of a sync (files, streamed: it writes the bf16 export)."""
        if self.sync in ("streamed", "staged"):
            return self.sync_gb / self.streamed_export_gb_s
        if self.sync == "reshard":  # the learner's devices send the copy (counted as blocking them)
            return self.sync_gb / self.reshard_gb_s
        return self.sync_gb / self.export_gb_s if self.sync == "files" else 0.0

    @property
    def pause_after_s(self) -> float:
        """From the end of an update to the engines' pause: the whole export (files, staged: the
        engines generate while it is written), its first bucket (streamed), none (broadcast,
        colocated)."""
        if self.sync == "streamed":
            return self.export_s * min(1.0, self.bucket_gb / self.sync_gb)
        return self.export_s

    @property
    def sync_s(self) -> float:
        """How long every engine pauses for a sync."""
        reload = self.sync_gb / self.reload_gb_s
        return {"files": reload, "streamed": self.streamed_pause_factor * reload,
                "staged": self.staged_pause_factor * reload, "broadcast": self.broadcast_s,
                "colocated": self.colocated_sync_s, "reshard": self.swap_s}[self.sync]

    @property
    def keeps_prefixes(self) -> bool:
        """Whether a sync keeps the engines' cached prefixes (the in-flight swap keeps every KV)."""
        return self.sync == "reshard"


@dataclasses.dataclass
class Trajectory:
    turns: list[int]                     # model tokens of each turn
    tool_s: list[float]                  # latency of the tool call after each turn but the last
    context: int                         # tokens so far (prompt + everything appended)
    turn: int = 0
    last_engine: int = -1
    done_at: float = 0.0


@dataclasses.dataclass
class Request:
    traj: Trajectory
    new_tokens: int                      # tokens this turn will generate (the engine does not know)
    reserve: int                         # what the scheduler reserved
    generated: int = 0
    cached: bool = False                 # prefix in this engine's cache (no prefill for it)

    @property
    def kv(self) -> int:
        return self.traj.context + self.generated


class Engine:
    def __init__(self, index: int, cfg: SimConfig):
        self.index, self.cfg = index, cfg
        self.running: list[Request] = []
        self.waiting: collections.deque[Request] = collections.deque()
        self.t = 0.0                     # the engine's own clock (end of its last step)
        self.kv_used = 0
        self.reserved = 0
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.prefill_tokens = 0          # tokens prefilled (not found in the prefix cache)
        self.busy_s = 0.0
        self.seq_steps = 0.0             # sum over steps of running requests (for mean batch)
        self.steps = 0
        self.version = 0                 # bumped on every change: stale wake-ups are ignored
        self.prefixes: collections.OrderedDict[int, int] = collections.OrderedDict()  # traj id -> tokens, LRU first
        self.prefix_tokens = 0
        self.evicted_prefixes = 0

    def load(self) -> EngineLoad:
        return EngineLoad(capacity_tokens=self.cfg.kv_capacity_tokens, reserved_tokens=self.reserved,
                          used_tokens=self.kv_used, in_flight=len(self.running) + len(self.waiting))

    def step_time(self, k: int) -> float:
        """Time of the next k decode steps with the current batch (KV grows by n per step)."""
        c, n = self.cfg, len(self.running)
        per = c.step_base_s + c.step_per_seq_s * n + c.step_per_kv_token_s * self.kv_used
        return k * per + c.step_per_kv_token_s * n * k * (k - 1) / 2

    def admit(self):
        c = self.cfg
        while self.waiting:
            req = self.waiting[0]
            # room for its context and one more decode step of every running request
            if self.running and self.kv_used + req.kv + len(self.running) + 1 > c.kv_capacity_tokens:
                break
            if c.max_running is not None and len(self.running) >= c.max_running:
                break
            self.waiting.popleft()
            # a turn whose prefix is still cached here only prefills the tool response
            req.cached = id(req.traj) in self.prefixes
            if req.cached:
                self.prefix_tokens -= self.prefixes.pop(id(req.traj))
            prefill = c.tool_response_tokens if req.cached else req.kv
            self.prefill_tokens += prefill
            self.t += prefill * c.prefill_per_token_s
            self.busy_s += prefill * c.prefill_per_token_s
            self.kv_used += req.kv
            self.running.append(req)
            self.evict()

    def store_prefix(self, traj: Trajectory):
        """A finished turn's KV stays cached for the trajectory's next turn, while there is room."""
        self.prefixes[id(traj)] = traj.context
        self.prefix_tokens += traj.context
        self.evict()

    def evict(self):
        """Least recently stored prefixes go when running requests need their KV."""
        while self.prefixes and self.kv_used + self.prefix_tokens > self.cfg.kv_capacity_tokens:
            self.prefix_tokens -= self.prefixes.popitem(last=False)[1]
            self.evicted_prefixes += 1

    def reset_prefix_cache(self):
        self.prefixes.clear()
        self.prefix_tokens = 0

    def plan(self) -> int:
        """Decode steps until the next thing happens inside the engine (a finish or an overflow)."""
        n = len(self.running)
        to_finish = min(r.new_tokens - r.generated for r in self.running)
        room = (self.cfg.kv_capacity_tokens - self.kv_used) // n
        return max(0, min(to_finish, room))

    def advance(self, k: int):
        dt = self.step_time(k)
        n = len(self.running)
        self.t += dt
        self.busy_s += dt
        self.steps += k
        self.seq_steps += k * n
        self.kv_used += k * n
        for r in self.running:
            r.generated += k
        self.evict()

    def preempt_newest(self):
        r = self.running.pop()
        self.kv_used -= r.kv
        self.preemptions += 1
        self.recomputed_tokens += r.kv
        r.cached = False
        self.waiting.appendleft(r)


def make_workload(cfg: SimConfig, rng: np.random.Generator) -> list[Trajectory]:
    if cfg.measured_workload is not None:  # measured trajectories, drawn with replacement
        picks = rng.integers(0, len(cfg.measured_workload), cfg.step_rollouts)
        return [Trajectory(list(turns), list(tools), prompt)
                for prompt, turns, tools in (cfg.measured_workload[i] for i in picks)]
    out = []
    for _ in range(cfg.step_rollouts):
        calls = min(cfg.max_turns - 1, int(rng.geometric(1.0 / (cfg.mean_tool_calls + 1))) - 1)
        turns, budget = [], cfg.budget_tokens
        for _i in range(calls + 1):
            n = int(min(budget, max(1, rng.lognormal(math.log(cfg.turn_tokens_median), cfg.turn_tokens_sigma))))
            turns.append(n)
            budget -= n + cfg.tool_response_tokens
            if budget <= 0:
                break
        mu = math.log(cfg.tool_mean_s) - cfg.tool_sigma ** 2 / 2
        tools = [cfg.tool_timeout_s if rng.random() < cfg.tool_timeout_share else float(rng.lognormal(mu, cfg.tool_sigma))
                 for _ in turns[:-1]]
        out.append(Trajectory(turns, tools, cfg.prompt_tokens))
    return out


def simulate(cfg: SimConfig, policy: str, seed: int, steps: int = 1, max_staleness: int | None = None
             ) -> dict[str, float]:
    """One step's rollouts (max_staleness None), or `steps` RL steps with the learner: step j's
    rollouts are released when the learner has finished (and synced) step j - 1 - max_staleness,
    as the trainer's producer does; step s trains when its rollouts are done and the learner is
    free; its sync pauses every engine for cfg.sync_s and resets their prefix caches."""
    rng = np.random.default_rng(seed)
    by_step = [make_workload(cfg, rng) for _ in range(steps)]
    trajs = [t for step in by_step for t in step]
    step_of = {id(t): s for s, step in enumerate(by_step) for t in step}
    # groups (rl.staleness): group g of step s is rollouts [g * size, (g + 1) * size)
    group_of = {id(t): (s, i // cfg.group_size) for s, step in enumerate(by_step) for i, t in enumerate(step)}
    group_left = collections.Counter(group_of.values())
    groups = [len({g for (s2, g) in group_left if s2 == s}) for s in range(steps)]
    wanted = [max(1, math.ceil(cfg.carry_fraction * n)) for n in groups]
    done_groups = [0] * steps            # a step's own groups complete
    carried_into: list[set] = [set() for _ in range(steps + 1)]  # groups a step waits for
    trained_tokens = [0] * steps
    trained_rollouts = [0] * steps
    trained = [False] * steps
    remaining = [len(step) for step in by_step]
    released = [0.0] * steps
    rollouts_done = [0.0] * steps
    learned = []                         # when each step's update and sync were done
    learner_busy = []                    # (start, end) of each update and its export
    learner_free = 0.0
    engines = [Engine(i, cfg) for i in range(cfg.engines)]
    pick = POLICIES[policy]
    events: list = []                    # (time, seq, kind, payload)
    seq = itertools.count()
    held: collections.deque[Request] = collections.deque()  # waiting for the scheduler (kv_aware)
    turn_counter = itertools.count()
    now = 0.0

    def budget_left(t: Trajectory) -> int:
        return cfg.budget_tokens - (t.context - cfg.prompt_tokens)

    def dispatch(req: Request) -> bool:
        loads = [e.load() for e in engines]
        home = req.traj.last_engine if cfg.affinity and req.traj.last_engine >= 0 else None
        i = pick_with_affinity(pick, loads, req.reserve, next(turn_counter), home)
        if i is None:
            return False
        e = engines[i]
        req.traj.last_engine = i
        e.reserved += req.reserve
        e.waiting.append(req)
        kick(e)
        return True

    def submit(t: Trajectory):
        new = t.turns[t.turn]
        req = Request(t, new, reservation(t.context, budget_left(t), cfg.reserve_new_tokens))
        if held or not dispatch(req):
            held.append(req)

    def kick(e: Engine):
        """Bring the engine to `now`, admit what fits, schedule its next internal event."""
        if e.running and e.t < now:      # part-way through a plan: finish the steps done by now
            k = e.plan()
            lo, hi = 0, k
            while lo < hi:               # most whole steps that end by `now`
                mid = (lo + hi + 1) // 2
                if e.t + e.step_time(mid) <= now:
                    lo = mid
                else:
                    hi = mid - 1
            e.advance(lo)
        if not e.running:
            e.t = max(e.t, now)
        e.admit()
        e.version += 1
        if e.running:
            k = e.plan()
            heapq.heappush(events, (e.t + e.step_time(k), next(seq), "engine", (e.index, e.version)))

    def pause(e: Engine):
        """A weight sync: stop after the last whole decode step done by now (the step in flight
        is redone), wait sync_s, forget the prefix cache."""
        kick(e)
        e.t = max(e.t, now) + cfg.sync_s
        if not cfg.keeps_prefixes:
            e.reset_prefix_cache()
        e.version += 1
        if e.running:
            heapq.heappush(events, (e.t + e.step_time(e.plan()), next(seq), "engine", (e.index, e.version)))

    def release(j: int):
        released[j] = now
        for t in by_step[j]:
            submit(t)

    def step_done(s: int):
        """Step s's rollouts are in (under carry: its quota of groups and every group carried
        into it): the learner takes it when free, then syncs. Its unfinished groups join s + 1."""
        nonlocal learner_free
        trained[s] = True
        rollouts_done[s] = now
        if max_staleness is None:
            return
        own = {(s, g) for g in range(groups[s])}
        unfinished = {key for key in own if group_left[key]}
        carried_into[s + 1] |= unfinished
        members = [t for t in by_step[s] if group_of[id(t)] not in unfinished] + \
            [t for t in trajs if group_of[id(t)] in carried_into[s]]
        trained_tokens[s] = sum(t.context for t in members)
        trained_rollouts[s] = len(members)
        update_end = max(now, learner_free) + cfg.learner_s(trained_tokens[s])
        learner_free = update_end + cfg.export_s
        learner_busy.append((update_end - cfg.learner_s(trained_tokens[s]), learner_free))
        heapq.heappush(events, (update_end + cfg.pause_after_s, next(seq), "sync", s))

    def ready(s: int) -> bool:
        return (s < steps and not trained[s] and done_groups[s] >= wanted[s]
                and not any(group_left[key] for key in carried_into[s]) and (s == 0 or trained[s - 1]))

    first = 1 if max_staleness is None else min(steps, 1 + max_staleness)
    for j in range(first):
        release(j)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "tool":
            submit(payload)
            continue
        if kind == "sync":  # step `payload` trained: new weights go to every engine
            for e in engines:
                pause(e)
            heapq.heappush(events, (now + cfg.sync_s, next(seq), "synced", payload))
            continue
        if kind == "synced":
            learned.append(max(now, learner_free))
            j = payload + 1 + max_staleness
            if j < steps:
                release(j)
            continue
        index, version = payload
        e = engines[index]
        if version != e.version:
            continue
        e.advance(e.plan())
        finished = [r for r in e.running if r.generated >= r.new_tokens]
        for r in finished:
            e.running.remove(r)
            e.kv_used -= r.kv
            e.reserved -= r.reserve
            t = r.traj
            t.context += r.new_tokens
            t.turn += 1
            if t.turn < len(t.turns):
                e.store_prefix(t)
                t.context += cfg.tool_response_tokens
                heapq.heappush(events, (e.t + t.tool_s[t.turn - 1], next(seq), "tool", t))
            else:
                t.done_at = e.t
                s_t = step_of[id(t)]
                remaining[s_t] -= 1
                key = group_of[id(t)]
                group_left[key] -= 1
                if not group_left[key]:
                    done_groups[s_t] += 1
                now = e.t
                if max_staleness is None:
                    if not remaining[s_t]:
                        step_done(s_t)
                else:  # this completion may make this step, or the one it was carried into, ready
                    for candidate in (s_t, s_t + 1):
                        while ready(candidate):
                            step_done(candidate)
                            candidate += 1
        if not finished and e.running and e.plan() == 0:
            e.preempt_newest()
        now = e.t
        kick(e)
        if finished:
            while held and dispatch(held[0]):
                held.popleft()
    makespan = max(t.done_at for t in trajs)
    end = learned[-1] if learned else makespan
    busy = sum(min(e.busy_s, end) for e in engines)
    decode_steps = sum(e.steps for e in engines)
    return {"makespan_s": makespan, "idle_share": 1 - busy / (len(engines) * end),
            "preemptions": sum(e.preemptions for e in engines) / steps,
            "recomputed_tokens": sum(e.recomputed_tokens for e in engines) / steps,
            "prefill_tokens": sum(e.prefill_tokens for e in engines) / steps,
            "evicted_prefixes": sum(e.evicted_prefixes for e in engines) / steps,
            "mean_batch": sum(e.seq_steps for e in engines) / max(1, decode_steps),
            "tool_calls": sum(len(t.tool_s) for t in trajs) // steps,
            "step_s": end / steps,
            "rollout_s": float(np.mean([d - r for d, r in zip(rollouts_done, released)])),
            "learner_s": float(np.mean([cfg.learner_s(n or sum(t.context for t in step))
                                        for n, step in zip(trained_tokens, by_step)])),
            "carried_groups": sum(len(c) for c in carried_into) / steps,
            # the pipeline once full: time between syncs after the first k + 1 (its start-up)
            "steady_step_s": (float(np.mean(np.diff(learned[(max_staleness or 0) + 1:])))
                              if len(learned) > (max_staleness or 0) + 2 else end / steps),
            "trained_rollouts": sum(trained_rollouts), "carried_past_end": len(carried_into[steps]),
            **_steady_shares(cfg, learned, learner_busy, max_staleness or 0)}


def _steady_shares(cfg: SimConfig, learned: list[float], learner_busy: list[tuple[float, float]], k: int
                   ) -> dict[str, float]:
    """Over the steady window (after the pipeline's first k + 1 syncs): the share of the time the
    learner's GPUs update or export, and the share every engine stands paused for syncs."""
    if len(learned) <= k + 2:
        return {"learner_busy_share": float("nan"), "sync_pause_share": float("nan")}
    lo, hi = learned[k + 1], learned[-1]
    busy = sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in learner_busy)
    syncs = sum(1 for t in learned if lo < t <= hi)
    return {"learner_busy_share": busy / (hi - lo), "sync_pause_share": syncs * cfg.sync_s / (hi - lo)}


def limiter(result: dict[str, float]) -> str:
    """What limits a steady asynchronous step: the learner (its GPUs never wait), the engines
    (never idle), the sync (engines stand paused a fifth of the time or more), else the staleness
    bound (both sides wait: engines at the bound for the next version, the learner for a step's
    slowest rollouts)."""
    if result["learner_busy_share"] >= 0.9:
        return "learner"
    if result["idle_share"] <= 0.1:
        return "engines"
    if result["sync_pause_share"] >= 0.2:
        return "sync"
    return "staleness bound"


def best_split(evaluate, gpus: int, start: int) -> tuple[int, dict, dict[int, float]]:
    """The learner GPU count in [1, gpus - 1] whose steady step (`evaluate(n)` -> a result) is
    shortest: from `start`, a walk by doubling strides in the direction that shortens the step,
    then a pattern search with halving strides around the best (the step is near-unimodal in the
    split: more learner GPUs shorten the update and slow the rollouts); the shortest of all the
    counts tried. (count, its result, every count tried -> its steady step)."""
    tried: dict[int, dict] = {}

    def cost(n: int) -> float:
        n = min(max(n, 1), gpus - 1)
        if n not in tried:
            tried[n] = evaluate(n)
        return tried[n]["steady_step_s"]

    best, stride = start, max(1, start // 4)
    for direction in (1, -1):
        while cost(best + direction * stride) < cost(best):
            best, stride = min(max(best + direction * stride, 1), gpus - 1), stride * 2
    while True:  # a pattern search: move to the shorter neighbour at this stride, else halve it
        nearest = min((min(max(n, 1), gpus - 1) for n in (best - stride, best + stride)), key=cost)
        if cost(nearest) < cost(best):
            best = nearest
        elif stride == 1:
            break
        else:
            stride //= 2
    # the simulated step is not smooth in the split (one seed): every count tried is a measurement
    best = min(tried, key=lambda n: tried[n]["steady_step_s"])
    return best, tried[best], {n: r["steady_step_s"] for n, r in sorted(tried.items())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--rollouts_per_engine", type=int, default=32)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--reserve", type=int, nargs="*", default=[1024],
                   help="extra kv_aware variants that reserve this many new tokens per turn (not the whole budget)")
    p.add_argument("--kv_capacity", type=int, nargs="*", default=[240_000, 60_000],
                   help="KV cache tokens per engine, one scenario each (240K: 14B on an H100; less: memory pressure)")
    p.add_argument("--pipeline", action="store_true", help="several RL steps: synchronous vs asynchronous (k = 1, 2)")
    p.add_argument("--steps", type=int, default=6, help="--pipeline: RL steps per run")
    p.add_argument("--rebased", action="store_true", help="the pipeline on what exists: streamed sync, carry")
    p.add_argument("--gpus", type=int, nargs="*", default=[64, 128], help="--rebased: GPU counts")
    p.add_argument("--rollouts", type=int, default=16_384, help="--rebased: rollouts per step")
    p.add_argument("--group_size", type=int, default=32, help="--rebased: rollouts per problem (what carry cuts)")
    p.add_argument("--carry", type=float, default=0.75, help="--rebased: rl.staleness.carry_fraction")
    p.add_argument("--split_sync", choices=("staged", "streamed", "reshard"), default="staged",
                   help="--rebased: how the split schedules' engines take a sync (rollout.vllm.reload)")
    p.add_argument("--lora_rank", type=int, default=0, help="--rebased: LoRA adapters of this rank (0: full training)")
    p.add_argument("--old_logprob_pass", action="store_true",
                   help="--rebased: the learner runs a separate old-log-prob pass (rl.old_logprobs=separate)")
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)
    if args.rebased:
        return run_rebased(args, argv)
    if args.pipeline:
        return run_pipeline(args, argv)
    for capacity in args.kv_capacity:
        run_scenario(args, SimConfig(engines=args.engines, rollouts_per_engine=args.rollouts_per_engine,
                                     kv_capacity_tokens=capacity), argv)


def run_scenario(args, base: SimConfig, argv):
    variants = [("round_robin", base), ("least_requests", base), ("kv_aware (whole budget)", base)]
    variants += [(f"kv_aware (reserve {r})", dataclasses.replace(base, reserve_new_tokens=r)) for r in args.reserve]
    variants += [("least_requests + affinity", dataclasses.replace(base, affinity=True))]
    variants += [(f"kv_aware (reserve {r}) + affinity", dataclasses.replace(base, reserve_new_tokens=r, affinity=True))
                 for r in args.reserve]
    header = ["policy", "makespan s", "idle engine share", "preemptions", "recomputed tokens", "prefill tokens",
              "mean batch", "sim wall s"]
    rows = []
    for name, cfg in variants:
        policy = name.split(" ")[0]
        start = time.perf_counter()
        runs = [simulate(cfg, policy, seed) for seed in range(args.seeds)]
        mean = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
        spread = {k: float(np.std([r[k] for r in runs])) for k in runs[0]}
        rows.append((name, f"{mean['makespan_s']:.1f} ± {spread['makespan_s']:.1f}", f"{mean['idle_share']:.1%}",
                     f"{mean['preemptions']:.0f}", f"{mean['recomputed_tokens']:,.0f}",
                     f"{mean['prefill_tokens']:,.0f}", f"{mean['mean_batch']:.1f}",
                     f"{time.perf_counter() - start:.1f}"))
    config = (f"{args.engines} engines x {args.rollouts_per_engine} rollouts, {args.seeds} seeds (mean ± std), "
              f"~{runs[0]['tool_calls']} tool calls per step; engine model: 14B bf16 on one H100, "
              f"{base.kv_capacity_tokens:,} KV tokens per engine, {base.budget_tokens}-token budget (module docstring)")
    command = common.command_line("experiments.benchmarks.scheduler_sim", argv)
    common.record(args.record, f"Rollout scheduler simulation: {base.kv_capacity_tokens:,} KV tokens per engine",
                  command.strip(), config, common.markdown_table(header, rows), group=common.PIPELINE)


def run_rebased(args, argv):
    """The pipeline on what exists (issues 47, 81): the sync as built, carry, packed learner rows,
    for the 14B recipe (rl.batch_problems x group_size x oversample rollouts per step) at each GPU
    count, against the colocated synchronous step. Each asynchronous schedule on the engine/learner
    split that makes its steady step shortest (`best_split`: a search, from the split by the
    colocated step's work), with what then limits it. Every schedule with affinity (the
    scheduler's default)."""
    header = ["GPUs", "schedule", "engines + learner GPUs", "steady s per step", "vs colocated sync (steady)",
              "wall s per step", "rollout s", "learner s", "learner busy", "idle engine share", "limited by",
              "splits tried (learner GPUs: steady s)"]
    rows = []
    for gpus in args.gpus:
        colocated = SimConfig(engines=gpus, rollouts=args.rollouts, reserve_new_tokens=1024, affinity=True,
                              learner_devices=gpus, sync="colocated", group_size=args.group_size,
                              lora_rank=args.lora_rank, old_logprob_pass=args.old_logprob_pass)
        runs = [simulate(colocated, "kv_aware", seed, args.steps, 0) for seed in range(args.seeds)]
        colocated_s = float(np.mean([r["steady_step_s"] for r in runs]))
        # where the search starts: the learner's share of the colocated step's work (rollouts on
        # every GPU, then the update on every GPU)
        rollout, learner = (float(np.mean([r[k] for r in runs])) for k in ("rollout_s", "learner_s"))
        by_work = max(1, round(gpus * learner / (rollout + learner)))
        mean = {key: float(np.mean([r[key] for r in runs])) for key in runs[0]}
        rows.append((gpus, "sync, colocated", f"{gpus} (shared)", f"{colocated_s:.1f}", "1.00x",
                     f"{mean['step_s']:.1f}", f"{mean['rollout_s']:.1f}", f"{mean['learner_s']:.1f}", "", "", "", ""))
        for name, carry, k in (("async k=1, wait", 1.0, 1), (f"async k=1, carry {args.carry}", args.carry, 1),
                               (f"async k=2, carry {args.carry}", args.carry, 2)):
            start = time.perf_counter()

            def evaluate(n_learner: int, gpus=gpus, colocated=colocated, carry=carry, k=k) -> dict:
                cfg = dataclasses.replace(colocated, engines=gpus - n_learner, learner_devices=n_learner,
                                          sync=args.split_sync, carry_fraction=carry)
                got = [simulate(cfg, "kv_aware", seed, args.steps, k) for seed in range(args.seeds)]
                return {key: float(np.mean([r[key] for r in got])) for key in got[0]}

            n_learner, mean, tried = best_split(evaluate, gpus, by_work)
            rows.append((gpus, name, f"{gpus - n_learner} + {n_learner}", f"{mean['steady_step_s']:.1f}",
                         f"{colocated_s / mean['steady_step_s']:.2f}x", f"{mean['step_s']:.1f}",
                         f"{mean['rollout_s']:.1f}", f"{mean['learner_s']:.1f}", f"{mean['learner_busy_share']:.0%}",
                         f"{mean['idle_share']:.1%}", limiter(mean),
                         ", ".join(f"{n}: {t:.1f}" for n, t in tried.items())))
            print(rows[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
    b = SimConfig(sync=args.split_sync, lora_rank=args.lora_rank, old_logprob_pass=args.old_logprob_pass)
    paused = (f"the engines pause after the first {b.bucket_gb:.0f} GB bucket ({b.pause_after_s:.1f} s) for "
              f"{b.sync_s:.0f} s ({b.streamed_pause_factor}x a reload at {b.reload_gb_s} GB/s)"
              if b.sync == "streamed" else
              f"a device-to-device reshard at {b.reshard_gb_s} GB/s a GPU (ASSUMED: InfiniBand NDR's datasheet "
              f"figure; {b.pause_after_s:.2f} s) while the engines generate, then an in-flight swap of "
              f"{b.swap_s} s that keeps every KV and prefix" if b.sync == "reshard" else
              f"the engines generate through it, then pause for {b.sync_s:.1f} s ({b.staged_pause_factor}x a reload "
              f"at {b.reload_gb_s} GB/s)")
    passes = ("a separate old-log-prob pass: 8" if b.old_logprob_pass else "one pass (rl.old_logprobs=auto): 6")
    config = (f"{args.rollouts} rollouts per step in groups of {args.group_size} (the 14B recipe: 512 problems x 16 x "
              f"oversample 2 = 16,384; RoC trains {b.kept_fraction:.0%}), {args.steps} RL steps (steady: the mean "
              f"time between syncs after the pipeline's first k + 1), {args.seeds} seed(s), "
              f"kv_aware (reserve 1024) + affinity; each asynchronous schedule on the split that minimises its "
              f"steady step (searched from the split by the colocated step's work); {b.sync} sync: the "
              + (f"learner sends {b.sync_gb:.2f} GB" if b.sync == "reshard" else
                 f"learner exports {b.sync_gb:.2f} GB at {b.streamed_export_gb_s} GB/s ({b.export_s:.1f} s)")
              + (f" (LoRA rank {b.lora_rank}: the adapters; no weight gradients of the base)" if b.lora_rank else "")
              + f", {paused}; colocated: every GPU generates, then every GPU trains, {b.colocated_sync_s:.0f} s "
              f"hand-over; learner {passes} x params FLOPs a kept token at {b.learner_mfu:.0%} MFU (packed rows: "
              "real tokens only); limited by: learner (busy >= 90%), engines (idle <= 10%), sync (paused >= 20%), "
              "else the staleness bound")
    command = common.command_line("experiments.benchmarks.scheduler_sim", argv)
    what = f"LoRA rank {b.lora_rank}" if b.lora_rank else "packed learner"
    passes_title = "separate old-log-prob pass" if b.old_logprob_pass else "one learner pass"
    common.record(args.record, f"RL pipeline simulation: {b.sync} sync, {what}, {passes_title}, best split (issue 81)",
                  command.strip(), config, common.markdown_table(header, rows), group=common.PIPELINE)


def run_pipeline(args, argv):
    for sync in ("files", "broadcast"):
        run_pipeline_with(args, argv, sync)


def run_pipeline_with(args, argv, sync: str):
    """Synchronous (split and colocated) against asynchronous steps at the same GPU count; the
    split layouts sync by `sync`."""
    split = SimConfig(engines=args.engines, rollouts_per_engine=args.rollouts_per_engine, reserve_new_tokens=1024,
                      learner_devices=args.engines, sync=sync)
    gpus = split.engines + split.learner_devices
    colocated = dataclasses.replace(split, engines=gpus, rollouts=split.step_rollouts, learner_devices=gpus,
                                    sync="colocated")
    # the same GPUs split by the work: the learner gets an eighth (its update then still fits
    # inside a step's rollouts), the engines the rest
    learner_eighth = dataclasses.replace(split, engines=gpus - gpus // 8, rollouts=split.step_rollouts,
                                         learner_devices=gpus // 8)
    header = ["schedule", "wall s per step", "vs colocated sync", "vs split sync", "rollout s", "learner s",
              "prefill tokens per step", "evicted prefixes", "idle engine share"]
    rows = []
    for affinity in (False, True):
        schedules = [("sync, colocated", dataclasses.replace(colocated, affinity=affinity), 0),
                     ("sync, split", dataclasses.replace(split, affinity=affinity), 0),
                     ("async k=1, split", dataclasses.replace(split, affinity=affinity), 1),
                     ("async k=2, split", dataclasses.replace(split, affinity=affinity), 2),
                     (f"async k=2, {learner_eighth.engines} engines + {learner_eighth.learner_devices} learner",
                      dataclasses.replace(learner_eighth, affinity=affinity), 2)]
        base = {}
        for name, cfg, k in schedules:
            runs = [simulate(cfg, "kv_aware", seed, args.steps, k) for seed in range(args.seeds)]
            mean = {key: float(np.mean([r[key] for r in runs])) for key in runs[0]}
            spread = float(np.std([r["step_s"] for r in runs]))
            if k == 0:
                base.setdefault(name.replace(",", ""), mean["step_s"])
            colocated_s, split_s = base.get("sync colocated"), base.get("sync split")
            rows.append((name + (" + affinity" if affinity else ""), f"{mean['step_s']:.1f} ± {spread:.1f}",
                         f"{colocated_s / mean['step_s']:.2f}x", f"{split_s / mean['step_s']:.2f}x" if split_s else "",
                         f"{mean['rollout_s']:.1f}", f"{mean['learner_s']:.1f}", f"{mean['prefill_tokens']:,.0f}",
                         f"{mean['evicted_prefixes']:,.0f}", f"{mean['idle_share']:.1%}"))
    config = (f"{gpus} H100s in every schedule; {args.steps} RL steps of {split.engines * split.rollouts_per_engine} "
              f"rollouts, {args.seeds} seeds (mean ± std), kv_aware (reserve 1024). Split: {split.engines} engines + "
              f"{split.learner_devices} learner GPUs, sync by {sync}: learner {split.export_s:.0f} s + engines paused "
              f"{split.sync_s:.0f} s; colocated: {colocated.engines} engines then {colocated.learner_devices} learner "
              f"GPUs, hand-over {colocated.sync_s:.0f} s; the same split by the work: {learner_eighth.engines} engines + "
              f"{learner_eighth.learner_devices} learner GPUs; learner {split.learner_mfu:.0%} MFU on the kept "
              f"{split.kept_fraction:.0%} of the tokens; {split.kv_capacity_tokens:,} KV tokens per engine")
    command = common.command_line("experiments.benchmarks.scheduler_sim", argv)
    common.record(args.record, f"RL pipeline simulation, weight sync by {sync}: synchronous vs asynchronous steps",
                  command.strip(), config, common.markdown_table(header, rows), group=common.PIPELINE)


if __name__ == "__main__":
    main()
