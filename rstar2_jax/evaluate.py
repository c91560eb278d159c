"""Evaluate a model on math benchmarks under the paper's protocol.

    python -m rstar2_jax.evaluate --model DIR --benchmarks aime24,aime25,math500 --data_dir ../shared/data
    python -m rstar2_jax.evaluate --checkpoint runs/tiny_arith --benchmarks math500 --format tiny --limit 50
    python -m rstar2_jax.evaluate --model DIR --engine vllm --url http://127.0.0.1:8000 [--url ...] \
        --benchmarks aime24,gpqa_diamond

Defaults are rStar2-Agent's protocol: 16 samples per problem at temperature 0.6, up to 30,000
tokens and 30 turns. Prints and writes results.json and results.md (pass@1 averaged over samples
with a 95% interval over problems, response tokens, tool calls per problem, tool-error ratio) and
Parquet traces (--out/traces/<benchmark>/). With --engine vllm the servers at --url generate
(several: the KV-aware scheduler) and --model only names the tokenizer (the directory the servers
were started with). Benchmark files (JSONL with problem/answer, question/answer, or an HF-style
solution with a \\boxed{} answer; GPQA-Diamond graded on the option letter) are not shipped: the
public sets come from e.g. the evaluation folders of AReaL or Qwen2.5-Math (see README).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

from absl import app, flags, logging

_MODEL = flags.DEFINE_string("model", None, "HF model directory")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a training run directory: its latest checkpoint")
_BENCHMARKS = flags.DEFINE_list("benchmarks", ["aime24", "aime25", "math500"],
                                "benchmark names (aime24, aime25, math500, amc23, gpqa_diamond) or .jsonl paths")
_DATA_DIR = flags.DEFINE_string("data_dir", "../shared/data", "directory of the benchmark JSONL files")
_SAMPLES = flags.DEFINE_integer("samples", 16, "samples per problem")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "sampling temperature")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 30000, "token budget after the prompt, all turns")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 30, "assistant turns")
_LIMIT = flags.DEFINE_integer("limit", 0, "problems per benchmark (0 = all)")
_FORMAT = flags.DEFINE_enum("format", "rstar2", ["rstar2", "tiny"], "prompt format")
_ENGINE = flags.DEFINE_enum("engine", "jax", ["jax", "vllm"], "rollout engine")
_URL = flags.DEFINE_multi_string("url", [], "vLLM server URL (--engine vllm); repeat for several")
_SCHEDULER = flags.DEFINE_string("scheduler", "kv_aware", "policy over several vLLM servers: kv_aware, "
                                  "round_robin or least_requests")
_SLOTS = flags.DEFINE_integer("slots", 32, "JaxEngine batch slots")
_OUT = flags.DEFINE_string("out", "runs/eval", "output directory")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")


def run_model_dir(checkpoint: str) -> str:
    """The base model directory of a training run (its run.json)."""
    run_file = os.path.join(checkpoint, "run.json")
    if not os.path.exists(run_file):
        raise app.UsageError(f"{checkpoint} is not a training run directory (no run.json)")
    with open(run_file) as f:
        return json.load(f)["model_dir"]


def load_policy(model_dir: str | None, checkpoint: str | None):
    """The model of a HF directory, or of a training run's latest checkpoint."""
    from rstar2_jax import models
    from rstar2_jax.learner import Learner
    from rstar2_jax.rl.checkpoints import RunCheckpoints

    if model_dir is not None:
        return models.load_pretrained(model_dir)
    ckpts = RunCheckpoints(os.path.join(checkpoint, "checkpoints"))
    step = ckpts.latest_step()
    if step is None:
        raise app.UsageError(f"no checkpoint under {checkpoint}/checkpoints")
    template = Learner(models.load_pretrained(run_model_dir(checkpoint)))
    template.state, _ = ckpts.restore(step, template.state)
    ckpts.close()
    return template.model()


def engine_factory(model_dir: str | None, checkpoint: str | None, tokenizer):
    """A function longest_prompt -> async context manager of the engine for one benchmark."""
    from rstar2_jax.rollout.engines import JaxEngine
    from rstar2_jax.rollout.engines.vllm_engine import VLLMEngine
    from rstar2_jax.rollout.scheduler import POLICIES, Scheduler

    if _ENGINE.value == "vllm":
        if not _URL.value:
            raise app.UsageError("--engine vllm needs --url (start a server: python -m rstar2_jax.rollout.serve --model DIR)")
        if _SCHEDULER.value not in POLICIES:
            raise app.UsageError(f"--scheduler must be one of {sorted(POLICIES)}, got {_SCHEDULER.value!r}")

        @contextlib.asynccontextmanager
        async def servers(longest_prompt: int):
            engines = [VLLMEngine(url) for url in _URL.value]
            engine = engines[0] if len(engines) == 1 else Scheduler(engines, _SCHEDULER.value)
            async with engine:
                yield engine
        return servers

    model = load_policy(model_dir, checkpoint)

    def embedded(longest_prompt: int):
        return JaxEngine(model, tokenizer, slots=_SLOTS.value, max_len=longest_prompt + _MAX_TOKENS.value + 1,
                         seed=_SEED.value)
    return embedded


async def evaluate_benchmark(make_engine, sb, tokenizer, fmt, cfg, bench) -> dict:
    """Rollouts of one benchmark (k samples per problem), its summary, and its traces."""
    from tqdm.auto import tqdm

    from rstar2_jax.data.problems import load_problems
    from rstar2_jax.eval_report import CHOICE_INSTRUCTION, benchmark_summary
    from rstar2_jax.rewards import answer_reward, choice_reward, extract_answer
    from rstar2_jax.rl.evaluation import rollout_problems
    from rstar2_jax.rl.trainer import stable_seed
    from rstar2_jax.traces import TraceWriter, trajectory_record

    problems = load_problems(bench.path, limit=_LIMIT.value or None)
    questions = [p.question + (CHOICE_INSTRUCTION if bench.multiple_choice else "") for p in problems]
    longest = max(len(tokenizer.encode(fmt.prompt(q))) for q in questions)
    k = _SAMPLES.value
    with tqdm(total=len(problems) * k, desc=bench.name, dynamic_ncols=True) as bar:
        async with make_engine(longest) as engine:
            scored = await rollout_problems(
                engine, sb, tokenizer, [q for q in questions for _ in range(k)],
                [p.answer for p in problems for _ in range(k)], cfg,
                [stable_seed(_SEED.value, bench.name, i, j) for i in range(len(problems)) for j in range(k)],
                grader=choice_reward if bench.multiple_choice else answer_reward, progress=bar)
    TraceWriter(os.path.join(_OUT.value, "traces", bench.name)).write(0, [
        trajectory_record(s.trajectory, run=f"eval:{bench.name}", step=0, problem_id=problems[i // k].id,
                          sample_index=i % k, problem=questions[i // k], gold=problems[i // k].answer,
                          engine=_ENGINE.value, extracted_answer=extract_answer(s.trajectory.response_text),
                          reward=s.reward)
        for i, s in enumerate(scored)])
    return benchmark_summary(scored, k)


async def run_eval(make_engine, tokenizer, benchmarks) -> dict:
    import sandbox
    from rstar2_jax.data.arith import tiny_format
    from rstar2_jax.rollout import AgentConfig, PromptFormat

    fmt = tiny_format() if _FORMAT.value == "tiny" else PromptFormat()
    cfg = AgentConfig(format=fmt, max_turns=_MAX_TURNS.value, max_response_tokens=_MAX_TOKENS.value,
                      temperature=_TEMPERATURE.value)
    results = {}
    async with sandbox.LocalSandbox(workers=max(2, os.cpu_count() or 2)) as sb:
        for bench in benchmarks:
            results[bench.name] = await evaluate_benchmark(make_engine, sb, tokenizer, fmt, cfg, bench)
            print(f"{bench.name}: pass@1 {results[bench.name]['pass@1']:.1%}", flush=True)
    return results


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from rstar2_jax.data.jsonl import DataError
    from rstar2_jax.eval_report import markdown_table, resolve_benchmark
    from rstar2_jax.models.tokenizer import Tokenizer

    if (_MODEL.value is None) == (_CHECKPOINT.value is None):
        raise app.UsageError("give exactly one of --model or --checkpoint")
    try:
        benchmarks = [resolve_benchmark(name, _DATA_DIR.value) for name in _BENCHMARKS.value]
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    for bench in benchmarks:
        if not os.path.exists(bench.path):
            raise app.UsageError(f"benchmark file not found: {bench.path} (see README: Evaluation)")
    model_dir = _MODEL.value or run_model_dir(_CHECKPOINT.value)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    make_engine = engine_factory(_MODEL.value, _CHECKPOINT.value, tokenizer)
    try:
        results = asyncio.run(run_eval(make_engine, tokenizer, benchmarks))
    except DataError as e:  # a malformed benchmark line: file and line, no traceback
        raise app.UsageError(str(e)) from None
    os.makedirs(_OUT.value, exist_ok=True)
    protocol = {"samples": _SAMPLES.value, "temperature": _TEMPERATURE.value, "max_tokens": _MAX_TOKENS.value,
                "max_turns": _MAX_TURNS.value, "model": _MODEL.value or _CHECKPOINT.value, "engine": _ENGINE.value,
                "urls": _URL.value, "format": _FORMAT.value, "seed": _SEED.value}
    with open(os.path.join(_OUT.value, "results.json"), "w") as f:
        json.dump({"protocol": protocol, "results": results}, f, indent=2)
    table = markdown_table(results)
    with open(os.path.join(_OUT.value, "results.md"), "w") as f:
        f.write(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    app.run(main)
