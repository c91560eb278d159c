"""Packed rows against padded rows in the learner (rl.token_budget, learner/packing.py).

    python -m experiments.benchmarks.packing ratios [--traces RUN_DIR] [--record BENCHMARKS.md]
    python -m experiments.benchmarks.packing cpu_update [--record BENCHMARKS.md]
    python -m experiments.benchmarks.packing gpu [--model qwen3_1p7b] [--rollouts 48] [--record ...]

ratios: positions computed per real token, padded (rows as wide as the longest, rounded up to
32 as the trainer does) against packed (rows of rollout.max_len), on a run's kept rollouts
(--traces: each step's kept rows, as the update saw them) and on the pipeline simulation's length
mix (experiments/benchmarks/scheduler_sim.py: log-normal turns in an 8K budget, the 14B recipe).

cpu_update: `Learner.update` (old-log-prob pass included) on the tiny model, padded against
packed, side by side in one process on the same batches (the simulation's mix shrunk 16x).

gpu: (1) cuDNN's packed attention against XLA's segment-masked attention on packed rows, bf16
(log-probs and the gradient); (2) the learner's step on a realistic mix (the simulation's
lengths), padded with cuDNN attention against packed with cuDNN's packed attention: time, and
MFU counting the real tokens' FLOPs (each rollout its own causal sequence) over the datasheet
bf16 peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

from experiments.benchmarks import common

# the padded baseline: rows at a multiple of 32 tokens, as the trainer padded them when BENCHMARKS.md's
# packing figures were recorded (rl.pad_width_multiple now defaults to 128: more padding, fewer shapes)
PAD_MULTIPLE = 32


def simulation_lengths(n: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Trajectory lengths (prompt + model turns + tool responses) of the pipeline simulation's
    workload, optionally shrunk by `scale`."""
    from experiments.benchmarks.scheduler_sim import SimConfig, make_workload
    cfg = SimConfig(rollouts=n)
    out = [cfg.prompt_tokens + sum(t.turns) + cfg.tool_response_tokens * (len(t.turns) - 1)
           for t in make_workload(cfg, np.random.default_rng(seed))]
    return np.maximum((np.array(out) * scale).astype(int), 8)


def trace_lengths(run_dir: str) -> list[np.ndarray]:
    """Per RL step, the token counts of the rollouts the update trained on (traces/*.jsonl)."""
    from rstar2_jax.traces import load_run
    df = load_run(run_dir).traces(columns=["step", "kept", "token_ids"])
    df = df[df["kept"]]
    return [np.array([len(t) for t in group["token_ids"]]) for _, group in sorted(df.groupby("step"))]


def padded_positions(lengths: np.ndarray, rows_multiple: int = 1) -> int:
    width = -(-int(lengths.max()) // PAD_MULTIPLE) * PAD_MULTIPLE
    return -(-len(lengths) // rows_multiple) * rows_multiple * width


def packed_positions(lengths: np.ndarray, budget: int) -> int:
    """The positions the learner computes for `lengths` in rows of `budget` (its default bound on
    rollouts a row)."""
    from rstar2_jax.learner import LearnerSettings
    from rstar2_jax.learner.packing import plan_packing
    return plan_packing(lengths, budget, 1, LearnerSettings().segments_per_row).computed_tokens


def ratios(args):
    rows, sources = [], []
    if args.traces:
        steps = trace_lengths(args.traces)
        for budget in map(int, (args.budget or "640,1280,2560").split(",")):
            padded = [padded_positions(v) / v.sum() for v in steps]
            packed = [packed_positions(v, budget) / v.sum() for v in steps]
            rows.append([f"run's {len(steps)} steps, budget {budget}", f"{np.mean([len(v) for v in steps]):.0f}",
                         f"{np.mean([v.mean() for v in steps]):.0f}", max(int(v.max()) for v in steps),
                         f"{np.mean(padded):.2f} ({min(padded):.2f}-{max(padded):.2f})",
                         f"{np.mean(packed):.3f} ({min(packed):.3f}-{max(packed):.3f})"])
        sources.append(f"the kept rollouts of each step of {args.traces} (a run's traces)")
    for n in (512, 2048):
        lengths = simulation_lengths(n, seed=0)
        budget = 8192 + 300 + 64 * 2  # a row must hold the longest a stage allows (prompt + budget)
        budget = -(-budget // 512) * 512
        for b in (budget, 2 * budget):
            real = lengths.sum()
            rows.append([f"simulation, {n} rollouts, budget {b}", n, f"{lengths.mean():.0f}", int(lengths.max()),
                         f"{padded_positions(lengths) / real:.2f}", f"{packed_positions(lengths, b) / real:.3f}"])
    table = common.markdown_table(["batch", "rollouts (per step)", "mean tokens", "longest",
                                   "padded / real (mean, range)", "packed / real (mean, range)"], rows)
    table += "\n\n" + budgets_and_devices()
    print(table)
    common.record(args.record, "Packed rows: computed positions per real token", common.command_line(
        "experiments.benchmarks.packing", sys.argv[1:]), "; ".join(sources) + "; the scheduler simulation's "
        "workload (log-normal turns, 8,192-token budget, 300-token prompts)", table, group=common.LEARNER)


def budgets_and_devices(widths=(1, 2, 4, 8), budgets=(0, 8704, 32768)) -> str:
    """Packed positions per real token by budget (0: the longest rollout) and by the devices a
    micro-batch splits over, on a small update like the demo's (48 rollouts of ~210 tokens: the
    simulation's mix shrunk 16x) and on the simulation's 512 rollouts (issue 70: <= 1.05 at any
    budget and device count)."""
    from rstar2_jax.learner import LearnerSettings
    from rstar2_jax.learner.packing import plan_packing
    rows = []
    for label, lengths in (("demo-like, 48 rollouts", simulation_lengths(48, scale=0.063)),
                           ("simulation, 512 rollouts", simulation_lengths(512))):
        for budget in budgets:
            b = budget or int(lengths.max())
            if b < lengths.max():
                continue
            ratios = [plan_packing(lengths, b, w, LearnerSettings().segments_per_row).computed_tokens / lengths.sum()
                      for w in widths]
            rows.append([label, f"{b}" + (" (the longest)" if not budget else ""), *(f"{r:.3f}" for r in ratios)])
    return common.markdown_table(["batch", "budget", *(f"packed / real, {w} device{'s' * (w > 1)}" for w in widths)],
                                 rows)


def against_padded(header: list[str], out: dict[str, tuple[float, float]], padded: str) -> str:
    """The printed table of {variant: (median seconds, computed positions per real token)}, each
    variant's time also as a ratio to the `padded` one's."""
    base = out[padded][0]
    rows = [[name, f"{t * 1e3:.0f}", f"{t / base:.2f}", f"{c:.2f}"] for name, (t, c) in out.items()]
    table = common.markdown_table([*header, "time / padded", "computed / real"], rows)
    print(table)
    return table


def cpu_update(args):
    import jax
    import optax

    from rstar2_jax.learner import Learner, LearnerSettings, make_batch
    from rstar2_jax.models.decoder import Decoder
    from rstar2_jax.models.tiny import tiny_config
    from flax import nnx
    import jax.numpy as jnp

    cfg = tiny_config(num_layers=2, hidden_size=128, vocab_size=320)
    rng = np.random.default_rng(0)
    batches = []
    for seed in list(range(args.steps)) * 2:  # the same batches twice: time the second pass
        lengths = simulation_lengths(args.rollouts, seed=seed, scale=1 / 16)
        toks = [list(rng.integers(1, 320, n)) for n in lengths]
        masks = [[0] * min(20, n - 1) + [1] * (n - min(20, n - 1)) for n in lengths]
        batches.append(make_batch(toks, masks, [[0.0] * n for n in lengths], list(rng.normal(size=len(lengths))),
                                  pad_multiple=PAD_MULTIPLE))
    max_len = max(int(b.lengths.max()) for b in batches)
    budget = -(-max_len // 64) * 64
    out = {}
    for name, settings in (("padded", LearnerSettings(micro_batches=4, token_entropy=True)),
                           (f"packed, budget {budget}", LearnerSettings(token_budget=budget, token_entropy=True)),
                           (f"packed, budget {2 * budget}", LearnerSettings(token_budget=2 * budget,
                                                                            token_entropy=True))):
        model = Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        learner = Learner(model, settings, optimizer=optax.sgd(1e-3))
        times, metrics = [], None
        for i, b in enumerate(batches):
            b = make_batch([list(t[:n]) for t, n in zip(b.tokens, b.lengths)],
                           [list(m[:n]) for m, n in zip(b.loss_mask, b.lengths)],
                           [[0.0] * n for n in b.lengths], list(b.advantages), pad_multiple=PAD_MULTIPLE)
            start = time.perf_counter()
            metrics = learner.update(b)
            jax.block_until_ready(learner.state.params)
            if i >= len(batches) // 2:  # the first pass over the batches compiles every shape
                times.append(time.perf_counter() - start)
        out[name] = (float(np.median(times)), metrics["computed_per_real_token"])
        print(name, out[name], flush=True)
    table = against_padded(["path", "update ms (median)"], out, "padded")
    common.record(args.record, "Packed rows: learner update on this CPU", common.command_line(
        "experiments.benchmarks.packing", sys.argv[1:]),
        f"tiny model (2 layers, 128 wide), {args.rollouts} rollouts per update, the simulation's lengths / 16 "
        f"(longest {max_len}), padded: 4 micro-batches; packed: XLA attention (a [budget, budget] score matrix "
        "per row, masked by segment); old-log-prob + entropy pass "
        f"and one SGD step; {args.steps} batches twice, the median of the second pass (the first compiles "
        "each shape: a packed micro-batch's length takes one of 32 values per octave)", table, group=common.LEARNER)


def sft(args):
    """SFT steps on the CPU demo's own traces (experiments/tiny_arith.py: its task, format and
    tiny model), padded rows against packed rows (sft.token_budget), the variants taking turns
    step by step (this VM is shared: they see the same noise)."""
    import tempfile

    import jax

    from rstar2_jax.data.tasks import make_task
    from rstar2_jax.learner.packing import plan_packing
    from rstar2_jax.learner.sft import SFTTrainer, iterate_batches
    from rstar2_jax.models import load_pretrained
    from rstar2_jax.models.resolve import resolve
    from rstar2_jax.models.tokenizer import Tokenizer
    from rstar2_jax.rollout.prompt import make_format
    from experiments import tiny_arith

    c = tiny_arith.get_config()
    model_dir = resolve(c.model, tempfile.mkdtemp(), c.seed)  # the demo's tiny model, as a run builds it
    tokenizer = Tokenizer.from_pretrained(model_dir)
    data = make_task(c.data, c.seed).sft_data(tokenizer, make_format(c.format), c.sft.examples, seed=c.seed + 2)
    batches = [b for _, b in zip(range(args.steps), iterate_batches(data, c.sft.batch_size, c.seed))]
    longest = max(len(t) for t, _ in data)
    budgets = [int(b) for b in args.budget.split(",")] if args.budget else [longest, 2 * longest]
    variants = {"padded (multiple of 32)": 0, **{f"packed, budget {b}": b for b in budgets}}
    trainers = {name: SFTTrainer(load_pretrained(model_dir), lr=c.sft.lr,
                                 warmup_steps=c.sft.warmup_steps, pad_multiple=32, token_budget=b)
                for name, b in variants.items()}
    times = {name: [] for name in variants}
    for i, batch in enumerate(batches * 2):  # the first pass compiles every shape; the second is timed
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step(batch)
            jax.block_until_ready(trainer.state.params)
            if i >= len(batches):
                times[name].append(time.perf_counter() - start)
    real = sum(len(t) for b in batches for t, _ in b)
    padded = sum(len(b) * -(-max(len(t) for t, _ in b) // 32) * 32 for b in batches)
    computed = {name: padded if not budget else sum(
        plan_packing(np.array([len(t) for t, _ in b]), budget).rows * budget for b in batches)
        for name, budget in variants.items()}
    table = against_padded(["rows", "SFT step ms (median)"],
                           {name: (float(np.median(t)), computed[name] / real) for name, t in times.items()},
                           "padded (multiple of 32)")
    common.record(args.record, "Packed SFT rows: the demo's warm start on this CPU", common.command_line(
        "experiments.benchmarks.packing", sys.argv[1:]),
        f"experiments/tiny_arith.py's task, format and tiny model (2 layers, 128 wide), {c.sft.batch_size} traces "
        f"per step (longest trace {longest} tokens); {args.steps} steps twice, the second pass timed (the first "
        "compiles each shape), the variants taking turns step by step", table, group=common.LEARNER)


def gpu(args):
    common.enable_compile_cache()
    print(common.device_line(), flush=True)
    results = {"device": common.device_line()}
    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    if not args.skip_checks:
        _gpu_checks(results)
    _gpu_learner(args, results, out_path)


def _gpu_checks(results: dict):
    """(1) cuDNN packed attention == XLA segment-masked attention on packed rows (bf16)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rstar2_jax.learner.packing import plan_packing
    from rstar2_jax.learner import LearnerSettings
    from rstar2_jax.learner.train_step import UpdateConfig, packed_logprobs
    from rstar2_jax.models import Decoder
    from rstar2_jax.models.tiny import tiny_config

    small = tiny_config(num_layers=2, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=4,
                        head_dim=128, vocab_size=4096)
    lengths = np.array([700, 500, 400, 300, 148, 1000, 900])
    plan = plan_packing(lengths, 2048, 1)
    rng = np.random.default_rng(0)
    tokens = np.zeros((len(lengths), 1024), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(1, 4096, n)
    mb = {"tokens": plan.pack(tokens), **plan.layout()}
    mb = {k: jnp.asarray(v) for k, v in mb.items()}
    inside = jnp.asarray(plan.layout()["positions"] > 0)
    out = {}
    update_cfg = UpdateConfig.of(LearnerSettings(), temperature=1.0)
    for impl in ("xla", "cudnn"):
        model = Decoder(small, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
        model.set_attention(full=impl)
        graphdef, params = nnx.split(model, nnx.Param)
        lp_fn = jax.jit(lambda p, b, g=graphdef: packed_logprobs(g, p, b, update_cfg))
        loss = jax.jit(jax.grad(lambda p, b, g=graphdef: jnp.sum(jnp.where(inside, packed_logprobs(
            g, p, b, update_cfg), 0.0))))
        try:
            out[impl] = (np.asarray(lp_fn(params, mb)), loss(params, mb))
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run is the result
            out[impl] = None
            results[f"packed_{impl}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(impl, "FAILED", results[f"packed_{impl}_error"], flush=True)
    if out.get("xla") is not None and out.get("cudnn") is not None:
        m = np.asarray(inside)
        lp_diff = float(np.abs(out["cudnn"][0] - out["xla"][0])[m].max())
        g_x = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(out["xla"][1])])
        g_c = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(out["cudnn"][1])])
        results["nonfinite_grads"] = {impl: int(sum((~np.isfinite(np.asarray(x, np.float32))).sum()
                                                    for x in jax.tree.leaves(out[impl][1]))) for impl in out}
        results["packed_cudnn_vs_xla"] = dict(logprob_max_abs=lp_diff, logprob_mean_abs=float(
            np.abs(out["cudnn"][0] - out["xla"][0])[m].mean()), grad_rel=float(np.linalg.norm(g_c - g_x) /
                                                                               np.linalg.norm(g_x)))
        print("cudnn packed vs xla packed:", results["packed_cudnn_vs_xla"], "non-finite gradient entries:",
              results["nonfinite_grads"], flush=True)
    del out
    gc.collect()


def _gpu_learner(args, results: dict, out_path: str):
    """(2) the learner on a realistic mix: padded (cuDNN) against packed (cuDNN packed); each
    variant's peak, and for packed ones the plan (`train --plan`'s lines) and XLA's memory analysis
    of the steady micro-batch program (an accumulator in hand). Results are written after each
    variant, so a run cut short keeps what it measured. The device's peak is the process's: run
    one variant per process to read each one's."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from rstar2_jax.learner import Learner, LearnerSettings, make_batch
    from rstar2_jax.learner.packing import plan_packing
    from rstar2_jax.models import Decoder, flops
    from rstar2_jax.models.tiny import tiny_config

    smoke = args.model == "tiny"  # a CPU rehearsal of this script: a tiny model, lengths / 16
    if not smoke:  # the bf16 matmul rate this machine reaches, beside the datasheet's
        results["matmul_tflops"] = common.matmul_rate() / 1e12
    cfg = tiny_config(num_layers=2) if smoke else common.shape(args.model)
    lengths = simulation_lengths(args.rollouts, seed=1, scale=1 / 16 if smoke else 1.0)
    lengths = np.minimum(lengths, 8192 + 512)
    rng = np.random.default_rng(1)
    toks = [list(rng.integers(1, cfg.vocab_size, n)) for n in lengths]
    masks = [[0] * 300 + [1] * (n - 300) if n > 300 else [0] + [1] * (n - 1) for n in lengths]
    real_flops = sum(flops.train_step_flops(cfg, int(n), 1) for n in lengths)
    real_fwd = sum(flops.forward_flops(cfg, int(n), 1) for n in lengths)
    results["mix"] = dict(rollouts=len(lengths), mean=float(lengths.mean()), max=int(lengths.max()),
                          real_tokens=int(lengths.sum()))
    print("mix", results["mix"], flush=True)
    variants = [v.split(":") for v in args.variants.split(",")]
    for name, arg, remat, *bound in variants:
        segments = int(bound[0]) if bound else LearnerSettings().segments_per_row
        settings = LearnerSettings(lr=1e-6, warmup_steps=1, token_entropy=False, segments_per_row=segments,
                                   **({"micro_batches": int(arg)} if name == "padded" else {"token_budget": int(arg)}))
        label = ":".join([name, arg, remat, *bound])
        try:
            model = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0), remat=remat)
            model.set_attention(full=args.attention)
            learner = Learner(model, settings, optimizer=optax.adamw(1e-6), own_params=True)
            del model
            analysed = _capture_packed_program(learner) if name == "packed" else None

            rows_multiple = int(arg) if name == "padded" else 1
            adv_rng = np.random.default_rng(2)  # every variant sees the same advantages: equal updates

            def batch(rows_multiple=rows_multiple, adv_rng=adv_rng):
                return make_batch(toks, masks, [[0.0] * len(t) for t in toks], list(adv_rng.normal(size=len(toks))),
                                  pad_multiple=64, rows_multiple=rows_multiple)
            start = time.perf_counter()
            learner.update(batch())
            compile_s = time.perf_counter() - start
            times, lp_times, metrics = [], [], None
            for _ in range(args.steps):
                b = batch()
                start = time.perf_counter()
                b.old_logprobs = learner.batch_logprobs(b)
                lp_times.append(time.perf_counter() - start)
                start = time.perf_counter()
                metrics = learner.update(b)
                jax.block_until_ready(learner.state.params)
                times.append(time.perf_counter() - start)
            t, t_lp = float(np.median(times)), float(np.median(lp_times))
            peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2 ** 30
            results[label] = dict(step_s=t, logprob_pass_s=t_lp, compile_s=compile_s, peak_gib=peak,
                                  computed_per_real=metrics["computed_per_real_token"],
                                  grad_norm=metrics["grad_norm"], policy_loss=metrics["policy_loss"],
                                  real_tok_per_s=float(lengths.sum() / t),
                                  mfu_real=real_flops / t / common.H100_DENSE_BF16,
                                  mfu_real_with_logprob_pass=(real_flops + real_fwd) / (t + t_lp) / common.H100_DENSE_BF16)
            if analysed is not None and analysed.args is not None:
                a = analysed.memory_analysis()
                results[label].update(xla_arguments_gib=a.argument_size_in_bytes / 2 ** 30,
                                      xla_temporaries_gib=a.temp_size_in_bytes / 2 ** 30,
                                      xla_outputs_gib=a.output_size_in_bytes / 2 ** 30)
            if name == "packed":
                plan = plan_packing(lengths, int(arg), 1, segments)  # what the learner packed (one device)
                results[label]["segment_bound"] = int(plan.layout()["segment_lengths"].shape[1])
                try:
                    results[label].update(_plan_gib(args.model, int(arg), remat, args.attention, segments))
                except BaseException as e:  # noqa: BLE001 - the measurement stands without the plan
                    results[label]["plan_error"] = repr(e)[:300]
            print(label, results[label], flush=True)
            learner = None
            gc.collect()
        except Exception as e:  # noqa: BLE001 - an OOM is a result too
            results[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(label, results[label], flush=True)
            learner = None
            gc.collect()
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


class _capture_packed_program:
    """Wraps a learner's packed-gradients program to keep the abstract arguments of its first call
    with an accumulator (the steady micro-batch program), for XLA's memory analysis afterwards."""

    def __init__(self, learner):
        self.jitted, self.args = learner._packed_gradients, None
        learner._packed_gradients = self

    def __call__(self, *args):
        import jax
        if self.args is None and args[1] is not None:
            self.args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                     if isinstance(x, jax.Array) else x, args)
        return self.jitted(*args)

    def memory_analysis(self):
        return self.jitted.lower(*self.args).compile().memory_analysis()


def _plan_gib(model: str, budget: int, remat: str, attention: str, segments: int) -> dict:
    """`train --plan`'s learner lines for a packed update of `model` at `budget` on one device,
    rows holding at most `segments` rollouts."""
    from experiments.benchmarks.memory_plan_gpu import run_config
    from rstar2_jax.rl.memory_plan import GiB, memory_plan
    cfg = run_config(2, min(8192 + 1024, budget), remat=remat, token_budget=budget, attention=attention,
                     segments_per_row=segments)
    plan = memory_plan(common.shape(model), cfg, devices=1, devices_per_process=1, capacity=None)
    lines = {line.name: line.bytes / GiB for line in plan.lines
             if line.name in ("parameters", "gradients", "optimizer", "activations")}
    return {"plan_gib": sum(lines.values()), "plan_lines_gib": lines}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["ratios", "cpu_update", "sft", "gpu"])
    p.add_argument("--traces", help="a run directory whose traces give the kept rollouts' lengths")
    p.add_argument("--budget", default=None, help="ratios: packed rows' budgets for --traces (640,1280,2560); "
                   "sft: the packed variants' budgets (the longest trace and twice it)")
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="qwen3_1p7b")
    p.add_argument("--variants", default="padded:16:dots,packed:32768:dots",
                   help="gpu: name:arg:remat[:segments], padded:<micro-batches> or packed:<token budget>, "
                   "segments: rl.segments_per_row (default its default)")
    p.add_argument("--attention", default="cudnn", help="gpu: the learner's attention (xla: a CPU rehearsal)")
    p.add_argument("--skip_checks", action="store_true", help="gpu: only the learner's variants")
    p.add_argument("--json", default="packing_gpu.json", help="gpu: the results file (under $OUT when set)")
    p.add_argument("--record")
    args = p.parse_args(argv)
    {"ratios": ratios, "cpu_update": cpu_update, "sft": sft, "gpu": gpu}[args.what](args)


if __name__ == "__main__":
    main()
