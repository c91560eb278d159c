"""Evaluate a model on math benchmarks under the paper's protocol.

    python -m rstar2_jax.evaluate --model DIR --benchmarks aime24,aime25,math500 --data_dir ~/data/math
    python -m rstar2_jax.evaluate --checkpoint runs/tiny_arith --benchmarks my_set.jsonl --limit 50
    python -m rstar2_jax.evaluate --model DIR --engine vllm --url http://127.0.0.1:8000 [--url ...] \
        --benchmarks aime24,gpqa_diamond

Defaults are rStar2-Agent's protocol: 16 samples per problem at temperature 0.6, up to 30,000
tokens and 30 turns. Prints and writes results.json and results.md (pass@1 averaged over samples
with a 95% interval over problems, response tokens, tool calls per problem, tool-error ratio) and
Parquet traces (--out/traces/<benchmark>/). With --engine vllm the servers at --url generate
(several: the KV-aware scheduler) and --model only names the tokenizer (the directory the servers
were started with). Benchmark files (JSONL with problem/answer, question/answer, or an HF-style
solution with a \\boxed{} answer; GPQA-Diamond graded on the option letter) are not shipped: the
public sets come from e.g. the evaluation folders of AReaL or Qwen2.5-Math (see README). Names
resolve under --data_dir, or $RSTAR2_DATA_DIR when the flag is not given.
"""

from __future__ import annotations

import asyncio
import json
import os

from absl import app, flags, logging

from rstar2_jax import cli

_MODEL = flags.DEFINE_string("model", None, "HF model directory")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a training run directory: its latest checkpoint")
_BENCHMARKS = flags.DEFINE_list("benchmarks", ["aime24", "aime25", "math500"],
                                "benchmark names (aime24, aime25, math500, amc23, gpqa_diamond) or .jsonl paths")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "directory of the benchmark JSONL files (default: "
                                 "$RSTAR2_DATA_DIR); not needed when --benchmarks are .jsonl paths")
_SAMPLES = flags.DEFINE_integer("samples", 16, "samples per problem", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "sampling temperature", lower_bound=0.0)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 30000, "token budget after the prompt, all turns", lower_bound=1)
_MAX_TURNS = flags.DEFINE_integer("max_turns", 30, "assistant turns", lower_bound=1)
_LIMIT = flags.DEFINE_integer("limit", 0, "problems per benchmark (0 = all)", lower_bound=0)
_FORMAT = flags.DEFINE_string("format", None, "prompt format (rstar2, compact, tiny); default: the run's with "
                               "--checkpoint, else rstar2")
_ENGINE = flags.DEFINE_string("engine", "jax", "rollout engine: jax (embedded) or vllm (servers at --url)")
_URL = flags.DEFINE_multi_string("url", [], "vLLM server URL (--engine vllm); repeat for several")
_SCHEDULER = flags.DEFINE_string("scheduler", "kv_aware", "policy over several vLLM servers: kv_aware, "
                                  "round_robin or least_requests")
_SLOTS = flags.DEFINE_integer("slots", 32, "JaxEngine batch slots", lower_bound=1)
_PAGE_SIZE = flags.DEFINE_integer("page_size", 0, "JaxEngine paged KV: positions per page (0: one max_len row per slot)",
                                  lower_bound=0)
_KV_PAGES = flags.DEFINE_integer("kv_pages", 0, "JaxEngine paged KV: pages in the pool (0: slots x max_len / page_size)",
                                 lower_bound=0)
_OUT = flags.DEFINE_string("out", "runs/eval", "output directory")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")


def load_policy(model_dir: str | None, checkpoint: str | None):
    """The model of a HF directory, or of a training run's latest checkpoint."""
    from rstar2_jax import models
    from rstar2_jax.checkpoints import load_run_policy

    return models.load_pretrained(model_dir) if model_dir is not None else load_run_policy(checkpoint)


# The engine flags, as the RolloutConfig fields they set (errors name the flag).
ENGINE_FLAGS = {"engine": "--engine", "vllm_urls": "--url", "scheduler": "--scheduler", "slots": "--slots",
                "page_size": "--page_size", "kv_pages": "--kv_pages", "temperature": "--temperature"}


def rollout_config():
    """The RolloutConfig the engine flags describe (train builds the same from rollout.*); its
    max_len is set per benchmark."""
    from rstar2_jax.rollout.engines import RolloutConfig
    from rstar2_jax.rollout.engines.kv_pages import pages_for

    values = {field: getattr(flags.FLAGS, flag[2:]) for field, flag in ENGINE_FLAGS.items()}
    # checked at the shortest max_len a benchmark can need (a one-token prompt); each benchmark's
    # own max_len is checked again when its engine is built
    shortest = _MAX_TOKENS.value + 2
    if values["page_size"]:
        shortest = pages_for(shortest, values["page_size"]) * values["page_size"]
    section, problems = RolloutConfig.parse({**values, "vllm_urls": tuple(values["vllm_urls"]), "max_len": shortest})
    if problems:
        raise app.UsageError("\n".join(f"{ENGINE_FLAGS.get(p.path.split('[')[0], p.path)}: {p.message}"
                                       for p in problems))
    return section


def engine_factory(model_dir: str | None, checkpoint: str | None, tokenizer, cfg):
    """A function longest_prompt -> async context manager of the engine for one benchmark (the
    embedded engine's KV is sized to the benchmark's longest prompt + --max_tokens)."""
    from rstar2_jax.rollout.engines import make_engine
    from rstar2_jax.rollout.engines.kv_pages import pages_for

    model = load_policy(model_dir, checkpoint) if cfg.engine == "jax" else None  # vllm: the servers' weights

    def engine_for(longest_prompt: int):
        max_len = longest_prompt + _MAX_TOKENS.value + 1
        if cfg.page_size:  # whole pages
            max_len = pages_for(max_len, cfg.page_size) * cfg.page_size
        sized = type(cfg).from_mapping({**cfg.to_dict(), "max_len": max_len})  # ConfigValueError if the pages cannot hold it
        return make_engine(sized, model, tokenizer, seed=_SEED.value)
    return engine_for


async def evaluate_benchmark(make_engine, sb, tokenizer, fmt, cfg, bench) -> dict:
    """Rollouts of one benchmark (k samples per problem), its summary, and its traces."""
    from tqdm.auto import tqdm

    from rstar2_jax.data.problems import load_problems
    from rstar2_jax.eval_report import CHOICE_INSTRUCTION, benchmark_summary
    from rstar2_jax.rewards import answer_reward, choice_reward, extract_answer
    from rstar2_jax.rollout.scoring import rollout_problems, stable_seed
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


async def run_eval(make_engine, tokenizer, benchmarks, fmt) -> dict:
    import sandbox
    from rstar2_jax.rollout import AgentConfig

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
    from rstar2_jax.checkpoints import run_info
    from rstar2_jax.eval_report import markdown_table, resolve_benchmark
    from rstar2_jax.models.tokenizer import Tokenizer
    from rstar2_jax.rollout import make_format

    if (_MODEL.value is None) == (_CHECKPOINT.value is None):
        raise app.UsageError("give exactly one of --model or --checkpoint")
    engine_cfg = rollout_config()
    cli.check_model_dir(_MODEL.value)
    run = run_info(_CHECKPOINT.value) if _CHECKPOINT.value else {}
    format_name = _FORMAT.value or run.get("format", "rstar2")
    try:
        fmt = make_format(format_name)
        data_dir = _DATA_DIR.value if _DATA_DIR.value is not None else os.environ.get("RSTAR2_DATA_DIR")
        benchmarks = [resolve_benchmark(name, data_dir) for name in _BENCHMARKS.value]
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    for bench in benchmarks:
        if not os.path.exists(bench.path):
            raise app.UsageError(f"benchmark file not found: {bench.path} (see README: Evaluation)")
    model_dir = _MODEL.value or run["model_dir"]
    tokenizer = Tokenizer.from_pretrained(model_dir)
    make_engine = engine_factory(_MODEL.value, _CHECKPOINT.value, tokenizer, engine_cfg)
    results = asyncio.run(run_eval(make_engine, tokenizer, benchmarks, fmt))  # a malformed line: DataError
    os.makedirs(_OUT.value, exist_ok=True)
    protocol = {"samples": _SAMPLES.value, "temperature": _TEMPERATURE.value, "max_tokens": _MAX_TOKENS.value,
                "max_turns": _MAX_TURNS.value, "model": _MODEL.value or _CHECKPOINT.value, "engine": engine_cfg.engine,
                "urls": _URL.value, "format": format_name, "seed": _SEED.value}
    with open(os.path.join(_OUT.value, "results.json"), "w") as f:
        json.dump({"protocol": protocol, "results": results}, f, indent=2)
    table = markdown_table(results)
    with open(os.path.join(_OUT.value, "results.md"), "w") as f:
        f.write(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    cli.run(main)
