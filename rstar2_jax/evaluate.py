"""Evaluate a model on math benchmarks under the paper's protocol.

    python -m rstar2_jax.evaluate --model DIR --benchmarks aime24,aime25,math500 --data_dir ../shared/data
    python -m rstar2_jax.evaluate --checkpoint runs/tiny_arith --benchmarks math500 --format tiny --limit 50

Defaults are rStar2-Agent's protocol: 16 samples per problem at temperature 0.6, up to 30,000
tokens and 30 turns. Writes results.json, results.md and Parquet traces to --out. Benchmark files
(JSONL with problem/answer, or question/answer; GPQA-Diamond graded on the option letter) are not
shipped: the public sets come from e.g. the evaluation folders of AReaL or Qwen2.5-Math.
"""

from __future__ import annotations

import asyncio
import json
import os

from absl import app, flags, logging

_MODEL = flags.DEFINE_string("model", None, "HF model directory")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a training run directory: its latest checkpoint")
_BENCHMARKS = flags.DEFINE_list("benchmarks", ["aime24", "aime25", "math500"], "benchmark names")
_DATA_DIR = flags.DEFINE_string("data_dir", "../shared/data", "directory of the benchmark JSONL files")
_SAMPLES = flags.DEFINE_integer("samples", 16, "samples per problem")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "sampling temperature")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 30000, "token budget after the prompt, all turns")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 30, "assistant turns")
_LIMIT = flags.DEFINE_integer("limit", 0, "problems per benchmark (0 = all)")
_FORMAT = flags.DEFINE_enum("format", "rstar2", ["rstar2", "tiny"], "prompt format")
_ENGINE = flags.DEFINE_enum("engine", "jax", ["jax", "vllm"], "rollout engine")
_SLOTS = flags.DEFINE_integer("slots", 32, "JaxEngine batch slots")
_OUT = flags.DEFINE_string("out", "runs/eval", "output directory")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")


def load_policy(model_dir: str | None, checkpoint: str | None):
    """(model, model_dir) from a HF directory or from a run's latest checkpoint."""
    from rstar2_jax import models
    from rstar2_jax.learner import Learner
    from rstar2_jax.rl.checkpoints import RunCheckpoints

    if (model_dir is None) == (checkpoint is None):
        raise app.UsageError("give exactly one of --model or --checkpoint")
    if model_dir is not None:
        return models.load_pretrained(model_dir), model_dir
    ckpts = RunCheckpoints(os.path.join(checkpoint, "checkpoints"))
    step = ckpts.latest_step()
    if step is None:
        raise app.UsageError(f"no checkpoint under {checkpoint}/checkpoints")
    run_file = os.path.join(checkpoint, "run.json")
    if not os.path.exists(run_file):
        raise app.UsageError(f"{checkpoint} is not a training run directory (no run.json)")
    with open(run_file) as f:
        meta_dir = json.load(f)["model_dir"]
    base = models.load_pretrained(meta_dir)
    template = Learner(base)
    state, _ = ckpts.restore(step, template.state)
    template.state = state
    ckpts.close()
    return template.model(), meta_dir


async def run_eval(model, model_dir: str) -> dict:
    import sandbox
    from rstar2_jax.data.arith import tiny_format
    from rstar2_jax.data.problems import load_problems
    from rstar2_jax.eval_report import BENCHMARK_FILES, benchmark_summary
    from rstar2_jax.models.tokenizer import Tokenizer
    from rstar2_jax.rewards import extract_answer
    from rstar2_jax.rl.evaluation import rollout_problems
    from rstar2_jax.rl.trainer import stable_seed
    from rstar2_jax.rollout import AgentConfig, PromptFormat
    from rstar2_jax.rollout.engines import JaxEngine
    from rstar2_jax.traces import TraceWriter, trajectory_record

    if _ENGINE.value == "vllm":
        raise app.UsageError("--engine vllm needs the vLLM engine (scale-out rollout issue); use --engine jax")
    tokenizer = Tokenizer.from_pretrained(model_dir)
    fmt = tiny_format() if _FORMAT.value == "tiny" else PromptFormat()
    cfg = AgentConfig(format=fmt, max_turns=_MAX_TURNS.value, max_response_tokens=_MAX_TOKENS.value,
                      temperature=_TEMPERATURE.value)
    k = _SAMPLES.value
    results = {}
    async with sandbox.LocalSandbox(workers=max(2, os.cpu_count() or 2)) as sb:
        for name in _BENCHMARKS.value:
            if name not in BENCHMARK_FILES:
                raise app.UsageError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARK_FILES)}")
            problems = load_problems(os.path.join(_DATA_DIR.value, BENCHMARK_FILES[name]), limit=_LIMIT.value or None)
            longest = max(len(tokenizer.encode(fmt.prompt(p.question))) for p in problems)
            async with JaxEngine(model, tokenizer, slots=_SLOTS.value, max_len=longest + _MAX_TOKENS.value + 1,
                                 seed=_SEED.value) as engine:
                scored = await rollout_problems(
                    engine, sb, tokenizer, [p.question for p in problems for _ in range(k)],
                    [p.answer for p in problems for _ in range(k)], cfg,
                    [stable_seed(_SEED.value, name, i, j) for i in range(len(problems)) for j in range(k)])
            results[name] = benchmark_summary(scored, k)
            TraceWriter(os.path.join(_OUT.value, "traces", name)).write(0, [
                trajectory_record(s.trajectory, run=f"eval:{name}", step=0, problem_id=problems[i // k].id,
                                  sample_index=i % k, problem=problems[i // k].question, gold=problems[i // k].answer,
                                  extracted_answer=extract_answer(s.trajectory.response_text), reward=s.reward)
                for i, s in enumerate(scored)])
            print(f"{name}: pass@1 {results[name]['pass@1']:.1%}", flush=True)
    return results


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from rstar2_jax.eval_report import markdown_table

    model, model_dir = load_policy(_MODEL.value, _CHECKPOINT.value)
    results = asyncio.run(run_eval(model, model_dir))
    os.makedirs(_OUT.value, exist_ok=True)
    protocol = {"samples": _SAMPLES.value, "temperature": _TEMPERATURE.value, "max_tokens": _MAX_TOKENS.value,
                "max_turns": _MAX_TURNS.value, "model": _MODEL.value or _CHECKPOINT.value}
    with open(os.path.join(_OUT.value, "results.json"), "w") as f:
        json.dump({"protocol": protocol, "results": results}, f, indent=2)
    table = markdown_table(results)
    with open(os.path.join(_OUT.value, "results.md"), "w") as f:
        f.write(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    app.run(main)
