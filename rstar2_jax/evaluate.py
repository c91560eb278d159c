"""Evaluate a model on math benchmarks under the paper's protocol.

    python -m rstar2_jax.evaluate --model DIR --benchmarks aime24,aime25,math500 --data_dir ~/data/math
    python -m rstar2_jax.evaluate --checkpoint runs/tiny_arith --benchmarks my_set.jsonl --limit 5 --samples 4
    python -m rstar2_jax.evaluate --model DIR --engine vllm --url http://127.0.0.1:8000 [--url ...] \
        --benchmarks aime24,gpqa_diamond

Defaults are rStar2-Agent's protocol: 16 samples per problem at temperature 0.6, up to 30,000
tokens and 30 turns; with --checkpoint the token budget and turns default to the run's last
stage, and the budget is capped (with a warning) where the longest prompt plus it would pass the
model's positions. Every benchmark file is read and checked before the first rollout. Each
problem's result is kept as soon as its samples finish (--out/<benchmark>/problems.jsonl, its
traces in --out/traces/<benchmark>/), each benchmark's summary when it finishes (results.json,
results.md: pass@1 averaged over samples with a 95% interval over problems and the per-rollout
metrics of README's metric table), so an interrupted evaluation (Ctrl-C, a crash) resumes where
it stopped when the same command runs again. With --engine vllm the servers at --url generate
(several: the KV-aware scheduler) and --model only names the tokenizer (the directory the servers
were started with). Benchmark files (JSONL with problem/answer, question/answer, or an HF-style
solution with a \\boxed{} answer; GPQA-Diamond graded on the option letter) are not shipped: the
public sets come from e.g. the evaluation folders of AReaL or Qwen2.5-Math (see README). Names
resolve under --data_dir, or $RSTAR2_DATA_DIR when the flag is not given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys

from absl import app, flags, logging

from rstar2_jax import cli
from rstar2_jax.data.jsonl import DataError
from rstar2_jax.data.templates import INSTRUCTIONS, Fixes, kept_template_warnings, recognise
from rstar2_jax.rollout.engines.factory import DEFAULT_ENGINE, ENGINES

_MODEL = flags.DEFINE_string("model", None,
                             "HF model directory, or a hub id (owner/name[@revision]) through the Hugging Face cache")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a training run directory: its latest checkpoint")
_BENCHMARKS = flags.DEFINE_list("benchmarks", ["aime24", "aime25", "math500"],
                                "benchmark names (aime24, aime25, math500, amc23, gpqa_diamond) or .jsonl paths")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "directory of the benchmark JSONL files (default: "
                                 "$RSTAR2_DATA_DIR); not needed when --benchmarks are .jsonl paths")
_SAMPLES = flags.DEFINE_integer("samples", 16, "samples per problem", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "sampling temperature", lower_bound=0.0)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "token budget after the prompt, all turns (default: the "
                                   "run's last stage with --checkpoint, else 30000)", lower_bound=1)
_MAX_TURNS = flags.DEFINE_integer("max_turns", None, "assistant turns (default: the run's last stage with "
                                  "--checkpoint, else 30)", lower_bound=1)
PAPER_MAX_TOKENS, PAPER_MAX_TURNS = 30000, 30
_LIMIT = flags.DEFINE_integer("limit", 0, "problems per benchmark (0 = all)", lower_bound=0)
_FORMAT = flags.DEFINE_string("format", None, "prompt format (rstar2, compact, tiny); default: the run's with "
                               "--checkpoint, else rstar2")
_ANSWER_FORMAT = flags.DEFINE_list("answer_format", [], "where the answer is read (rewards/answer_formats.py: "
                                   "answer_boxed, boxed, dapo, gsm8k, choice_letter): FORMAT for every benchmark "
                                   "and/or BENCHMARK=FORMAT for one; default: the run's data.answer_format, else "
                                   "answer_boxed")
_INSTRUCTIONS = flags.DEFINE_enum("instructions", "strip", list(INSTRUCTIONS), "a public set's own instruction "
                                  "template around a problem (data/templates.py): strip it (the prompt format "
                                  "instructs) or keep it (then grade the format it asks for: --answer_format)")
# The column mapping train takes as data.problems.{question,answer,id}_key: a dotted path each, for
# every benchmark (PATH) or one (BENCHMARK=PATH); a set in a known layout needs none.
_COLUMN_FLAGS = {key: flags.DEFINE_list(f"{key}_key", [], f"the {what} field of a benchmark in another layout, a "
                                        "dotted path (a.b is row['a']['b']): PATH for every benchmark, BENCHMARK=PATH "
                                        f"for one (train: data.problems.{key}_key)")
                 for key, what in (("question", "problem text's"), ("answer", "gold answer's"), ("id", "problem id's"))}
_ENGINE = flags.DEFINE_string("engine", DEFAULT_ENGINE, f"rollout engine: {' | '.join(ENGINES)} (rollout.engine)")
_OUT = flags.DEFINE_string("out", "runs/eval", "output directory")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")


def load_policy(model_dir: str | None, checkpoint: str | None):
    """The model of a HF directory (or a PEFT adapter directory on its base), or of a training
    run's latest checkpoint."""
    from rstar2_jax.core.checkpoints import load_run_policy
    from rstar2_jax.models.adapter_files import load_model_dir

    return load_model_dir(model_dir) if model_dir is not None else load_run_policy(checkpoint)


def _define_engine_flags() -> dict[str, str]:
    """Each engine kind's flags (EngineKind.cli_flags), typed, defaulted and described by its
    settings' fields: a new engine's flags come with its kind. Returns {field under rollout.: flag}."""
    define = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float, str: flags.DEFINE_string}
    out = {}
    for name, kind in ENGINES.items():
        fields = {f.name: f for f in dataclasses.fields(kind.settings)}
        for flag, field in kind.cli_flags:
            f = fields[field]
            doc = f"--engine {name}: {f.metadata['doc']} (rollout.{name}.{field})"
            if isinstance(f.default, tuple):
                flags.DEFINE_multi_string(flag, list(f.default), doc + "; repeat for several")
            else:
                define[type(f.default)](flag, f.default, doc)
            out[f"{name}.{field}"] = f"--{flag}"
    return out


# The engine flags, as the RolloutConfig fields they set (errors name the flag). The flags of the
# engine not chosen are left out (they would be refused as another engine's settings).
ENGINE_FLAGS = {"engine": "--engine", "temperature": "--temperature", **_define_engine_flags()}


def rollout_config(max_tokens: int):
    """The RolloutConfig the engine flags describe (train builds the same from rollout.*); its
    max_len is set per benchmark."""
    from rstar2_jax.rollout.engines import RolloutConfig

    engine = flags.FLAGS.engine
    values: dict = {}
    for field, flag in ENGINE_FLAGS.items():
        part, _, name = field.rpartition(".")
        if part and part != engine:
            continue
        value = getattr(flags.FLAGS, flag[2:])
        (values.setdefault(part, {}) if part else values)[name] = tuple(value) if isinstance(value, list) else value
    # checked at the shortest max_len a benchmark can need (a one-token prompt); each benchmark's
    # own max_len is checked again when its engine is built
    shortest = max_tokens + 2
    if engine in ENGINES:  # (an unknown one is refused by the parse below)
        own, _ = ENGINES[engine].settings.parse(values.get(engine, {}))  # (its problems: reported below)
        shortest = _whole_granules(shortest, ENGINES[engine].context_granule(own) if own is not None else 1)
    section, problems = RolloutConfig.parse({**values, "max_len": shortest})
    if problems:
        raise app.UsageError("\n".join(f"{ENGINE_FLAGS.get(p.path.split('[')[0], p.path)}: {p.message}"
                                       for p in problems))
    return section


def engine_factory(model_dir: str | None, checkpoint: str | None, tokenizer, cfg):
    """A function max_len -> async context manager of the engine for one benchmark (the embedded
    engine's KV is sized to the benchmark's longest prompt + its token budget)."""
    from rstar2_jax.rollout.engines import engine_kind, make_engine

    model = load_policy(model_dir, checkpoint) if engine_kind(cfg).embedded else None  # served: the servers' weights

    def engine_for(max_len: int):
        max_len = _whole_granules(max_len, engine_kind(cfg).context_granule(getattr(cfg, cfg.engine)))  # paged: pages
        sized = type(cfg).from_mapping({**cfg.to_dict(), "max_len": max_len})  # ConfigValueError if the pages cannot hold it
        return make_engine(sized, model, tokenizer, seed=_SEED.value)
    return engine_for


def _whole_granules(length: int, granule: int) -> int:
    return -(-length // granule) * granule


def run_defaults(checkpoint: str | None, max_tokens: int | None, max_turns: int | None) -> tuple[int, int]:
    """(max_tokens, max_turns): as given, else the run's last stage (--checkpoint), else the paper's."""
    stage = {}
    if checkpoint:
        config_path = os.path.join(checkpoint, "config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                stages = json.load(f).get("stages") or [{}]
            stage = stages[-1]
    return (max_tokens or stage.get("max_response_tokens") or PAPER_MAX_TOKENS,
            max_turns or stage.get("max_turns") or PAPER_MAX_TURNS)


def token_budget(longest_prompt: int, max_tokens: int, positions: int, name: str) -> int:
    """`max_tokens`, or less where the longest prompt plus it would pass the model's positions."""
    room = positions - longest_prompt - 1
    if max_tokens <= room:
        return max_tokens
    if room < 1:
        raise app.UsageError(f"{name}: its longest prompt ({longest_prompt} tokens) leaves no room in the model's "
                             f"{positions} positions")
    print(f"warning: {name}: the longest prompt ({longest_prompt} tokens) + --max_tokens={max_tokens} pass the "
          f"model's {positions} positions; the budget is capped at {room} tokens", file=sys.stderr)
    return room


def questions_of(bench, problems) -> list[str]:
    """What the model is asked (multiple choice: with the instruction to box the letter)."""
    from rstar2_jax.reports.eval_report import CHOICE_INSTRUCTION
    return [p.question + (CHOICE_INSTRUCTION if bench.multiple_choice else "") for p in problems]


class BenchmarkResults:
    """One benchmark's results on disk: a JSONL line per finished problem (its samples' outcomes),
    written once all its samples are graded and its traces are written, so a restart skips it."""

    def __init__(self, out: str, name: str):
        from rstar2_jax.traces import TraceWriter

        self.path = os.path.join(out, name, "problems.jsonl")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.traces = TraceWriter(os.path.join(out, "traces", name))

    def done(self) -> dict[int, list]:
        """problem index -> its samples' RolloutOutcomes, for the problems already finished. A last
        line cut short by a crash is dropped (that problem runs again)."""
        from rstar2_jax.data.jsonl import read_appended_jsonl
        from rstar2_jax.rollout.scoring import RolloutOutcome

        return {row["index"]: [RolloutOutcome(r, tuple(st), n, bool(f)) for r, st, n, f in
                               zip(row["rewards"], row["tool_statuses"], row["response_tokens"],
                                   row.get("format_failures", [False] * len(row["rewards"])))]
                for row in read_appended_jsonl(self.path, "evaluation results")}

    def add(self, index: int, problem_id: str, records: list[dict], outcomes: list) -> None:
        self.traces.write(index, records)  # traces first: a kept line always has its traces
        with open(self.path, "a") as f:
            f.write(json.dumps({"index": index, "id": problem_id, "rewards": [o.reward for o in outcomes],
                                "tool_statuses": [list(o.tool_statuses) for o in outcomes],
                                "response_tokens": [o.response_tokens for o in outcomes],
                                "format_failures": [o.format_failure for o in outcomes]}) + "\n")
            f.flush()
            os.fsync(f.fileno())


async def evaluate_benchmark(make_engine, sb, tokenizer, fmt, cfg, bench, problems, answer_format: str) -> dict:
    """Rollouts of one benchmark's unfinished problems (k samples each, all in flight together),
    each problem kept as it finishes; the summary over every problem."""
    from tqdm.auto import tqdm

    from rstar2_jax.reports.eval_report import benchmark_summary
    from rstar2_jax.rewards import Grader
    from rstar2_jax.rollout.scoring import RolloutOutcome, rollout_problems
    from rstar2_jax.core.seeding import stable_seed
    from rstar2_jax.traces import trajectory_record

    kept = BenchmarkResults(_OUT.value, bench.name)
    done = kept.done()
    questions = questions_of(bench, problems)
    todo = [i for i in range(len(problems)) if i not in done]
    k = _SAMPLES.value
    if todo:
        if done:
            print(f"{bench.name}: {len(done)} of {len(problems)} problems kept from an earlier run", flush=True)
        longest = max(len(tokenizer.encode(fmt.prompt(questions[i]))) for i in todo)
        grader = Grader(answer_format, multiple_choice=bench.multiple_choice)

        async def problem(engine, i: int, bar):
            scored = await rollout_problems(engine, sb, tokenizer, [questions[i]] * k, [problems[i].answer] * k, cfg,
                                            [stable_seed(_SEED.value, bench.name, i, j) for j in range(k)],
                                            grader=grader, progress=bar)
            records = [trajectory_record(s.trajectory, run=f"eval:{bench.name}", step=0, problem_id=problems[i].id,
                                         sample_index=j, problem=questions[i], gold=problems[i].answer,
                                         engine=_ENGINE.value, extracted_answer=s.answer,
                                         reward=s.reward) for j, s in enumerate(scored)]
            outcomes = [RolloutOutcome.of(s) for s in scored]
            kept.add(i, problems[i].id, records, outcomes)
            done[i] = outcomes

        with tqdm(total=len(todo) * k, desc=bench.name, dynamic_ncols=True) as bar:
            async with make_engine(longest + cfg.max_response_tokens + 1) as engine:
                await asyncio.gather(*(problem(engine, i, bar) for i in todo))
    return benchmark_summary([o for i in range(len(problems)) for o in done[i]], k)


async def run_eval(make_engine, tokenizer, benchmarks, fmt, budgets: dict[str, int], max_turns: int,
                   answer_formats: dict[str, str], on_result) -> dict:
    import sandbox
    from rstar2_jax.rollout import AgentConfig

    results = {}
    async with sandbox.LocalSandbox(workers=max(2, os.cpu_count() or 2)) as sb:
        for bench, problems in benchmarks:
            cfg = AgentConfig(format=fmt, max_turns=max_turns, max_response_tokens=budgets[bench.name],
                              temperature=_TEMPERATURE.value)
            results[bench.name] = r = await evaluate_benchmark(make_engine, sb, tokenizer, fmt, cfg, bench, problems,
                                                               answer_formats[bench.name])
            print(f"{bench.name}: pass@1 {r['pass@1']:.1%} (format failures {r['format_failure_rate']:.1%} in "
                  f"{answer_formats[bench.name]})", flush=True)
            on_result(results)
    return results


def per_benchmark(flag: str, specs: list[str], names: list[str], problems: list[str]) -> list[tuple[list[str], str, str]]:
    """A per-benchmark flag's entries (VALUE for every benchmark, BENCHMARK=VALUE for one) as
    (the benchmarks it sets, value, the entry); an entry naming no --benchmarks goes to `problems`."""
    out = []
    for spec in specs:
        name, _, value = spec.rpartition("=")
        if name and name not in names:
            problems.append(f"--{flag}={spec}: {name!r} is not among --benchmarks ({', '.join(names)})")
        else:
            out.append(([name] if name else list(names), value, spec))
    return out


def benchmark_answer_formats(specs: list[str], names: list[str], default: str) -> dict[str, str]:
    """--answer_format's entries (FORMAT, BENCHMARK=FORMAT) as benchmark -> format; every error at once."""
    from rstar2_jax.rewards import ANSWER_FORMATS

    formats, problems = dict.fromkeys(names, default), []
    for targets, fmt, spec in per_benchmark("answer_format", specs, names, problems):
        if (why := ANSWER_FORMATS.problem(fmt)) is not None:
            problems.append(f"--answer_format={spec}: {why}")
        else:
            formats.update(dict.fromkeys(targets, fmt))
    if problems:
        raise app.UsageError("; ".join(problems))
    return formats


def benchmark_columns(specs: dict[str, list[str]], names: list[str]):
    """--question_key / --answer_key / --id_key (PATH, BENCHMARK=PATH) as benchmark -> Columns; every
    error at once."""
    from rstar2_jax.data.problems import Columns

    chosen = {name: {} for name in names}
    problems = []
    for key, entries in specs.items():
        for targets, path, spec in per_benchmark(f"{key}_key", entries, names, problems):
            if not path:
                problems.append(f"--{key}_key={spec}: give a field's dotted path")
            for bench in targets if path else ():
                chosen[bench][key] = path
    for name, keys in chosen.items():
        if bool(keys.get("question")) != bool(keys.get("answer")):
            given, missing = ("question", "answer") if keys.get("question") else ("answer", "question")
            problems.append(f"--{given}_key for {name} needs --{missing}_key too (a mapping names both fields)")
    if problems:
        raise app.UsageError("; ".join(problems))
    return {name: Columns(**keys) for name, keys in chosen.items()}


def evaluate_names(message: str) -> str:
    """A data error's fix in evaluate's flags: train's data.problems.X_key is evaluate's --X_key."""
    return message.replace("--config.data.problems.", "--").replace("data.problems.", "--")


# What evaluate's warnings tell the user to set: its flags, not train's config keys.
EVALUATE_FIXES = Fixes(answer_format="--answer_format={}", strip="--instructions=strip", prompt_format="--format={}",
                       keeping="--instructions=keep", grading="--answer_format {}")


def instruction_warnings(stored, instructions: str, answer_formats: dict[str, str], prompt_format: str,
                         prompt_asks: str) -> list[str]:
    """What train warns of, for each benchmark as stored: with --instructions=keep, a recognised
    template that asks for another answer format than the benchmark is graded in, or than the
    prompt format asks for itself (two conflicting instructions)."""
    if instructions != "keep":
        return []
    out = []
    for bench, problems in stored:
        names = {name for name, _ in map(recognise, (p.question for p in problems)) if name is not None}
        out += kept_template_warnings(names, bench.path, answer_formats[bench.name], prompt_format, prompt_asks,
                                      EVALUATE_FIXES)
    return out


def check_protocol(protocol: dict) -> None:
    """--out keeps one protocol's results: a resumed evaluation must be the same one."""
    path = os.path.join(_OUT.value, "protocol.json")
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        from rstar2_jax.rewards import DEFAULT_ANSWER_FORMAT  # protocols written before answer formats: the default
        earlier.setdefault("answer_formats", dict.fromkeys(protocol["answer_formats"], DEFAULT_ANSWER_FORMAT))
        earlier.setdefault("instructions", protocol["instructions"])  # before templates: sets had none we strip
        earlier.setdefault("columns", {name: {} for name in protocol.get("columns", {})})  # before mappings: none
        differs = sorted(k for k in set(earlier) | set(protocol) if earlier.get(k) != protocol.get(k))
        if differs:
            raise app.UsageError(f"--out={_OUT.value} holds the results of another evaluation (it differs in "
                                 f"{', '.join(differs)}): give another --out, or remove it to start again")
    os.makedirs(_OUT.value, exist_ok=True)
    with open(path, "w") as f:
        json.dump(protocol, f, indent=2)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from rstar2_jax.core.checkpoints import run_info
    from rstar2_jax.models.adapter_files import base_dir_of
    from rstar2_jax.data.problems import load_problems
    from rstar2_jax.data.templates import apply_instructions
    from rstar2_jax.reports.eval_report import markdown_table, resolve_benchmark
    from rstar2_jax.models.config import ModelConfig
    from rstar2_jax.models.tokenizer import Tokenizer
    from rstar2_jax.rewards import DEFAULT_ANSWER_FORMAT
    from rstar2_jax.rollout import make_format

    if (_MODEL.value is None) == (_CHECKPOINT.value is None):
        raise app.UsageError("give exactly one of --model or --checkpoint")
    max_tokens, max_turns = run_defaults(_CHECKPOINT.value, _MAX_TOKENS.value, _MAX_TURNS.value)
    engine_cfg = rollout_config(max_tokens)
    model_path = cli.model_dir(_MODEL.value)  # a directory, or a hub id through the cache
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
    answer_formats = benchmark_answer_formats(_ANSWER_FORMAT.value, [b.name for b in benchmarks],
                                              run.get("answer_format", DEFAULT_ANSWER_FORMAT))
    columns = benchmark_columns({key: flag.value for key, flag in _COLUMN_FLAGS.items()}, [b.name for b in benchmarks])
    # every file read and checked whole (a malformed line: DataError with file and line) before any
    # rollout, --limit or not; then the first --limit problems of each are evaluated
    try:
        stored = [(bench, load_problems(bench.path, columns=columns[bench.name])[:_LIMIT.value or None])
                  for bench in benchmarks]
    except DataError as e:
        raise DataError(evaluate_names(str(e))) from None
    for warning in instruction_warnings(stored, _INSTRUCTIONS.value, answer_formats, format_name,
                                        fmt.answer_format):
        print(f"warning: {warning}", file=sys.stderr)
    loaded = [(bench, [dataclasses.replace(p, question=apply_instructions(p.question, _INSTRUCTIONS.value))
                       for p in problems]) for bench, problems in stored]
    model_dir = base_dir_of(model_path) if model_path else run["model_dir"]  # an adapter's: its base's
    tokenizer = Tokenizer.from_pretrained(model_dir)
    positions = ModelConfig.from_json_file(os.path.join(model_dir, "config.json")).max_position_embeddings
    budgets = {bench.name: token_budget(max(len(tokenizer.encode(fmt.prompt(q))) for q in questions_of(bench, problems)),
                                        max_tokens, positions, bench.name)
               for bench, problems in loaded}
    protocol = {"answer_formats": answer_formats, "instructions": _INSTRUCTIONS.value,
                "samples": _SAMPLES.value, "temperature": _TEMPERATURE.value, "max_tokens": max_tokens,
                "max_turns": max_turns, "model": _MODEL.value or _CHECKPOINT.value, "engine": engine_cfg.engine,
                # the chosen engine's own settings (vllm: its server URLs, ...), as its section holds them
                "engine_settings": getattr(engine_cfg, engine_cfg.engine).to_dict(),
                "format": format_name, "seed": _SEED.value, "limit": _LIMIT.value,
                # the column mapping of each benchmark that has one ({} where its layout was detected)
                "columns": {name: {k: v for k, v in dataclasses.asdict(c).items() if v} for name, c in columns.items()}}
    check_protocol(protocol)

    def write(results):
        with open(os.path.join(_OUT.value, "results.json"), "w") as f:
            json.dump({"protocol": {**protocol, "token_budgets": budgets}, "results": results}, f, indent=2)
        with open(os.path.join(_OUT.value, "results.md"), "w") as f:
            f.write(markdown_table(results) + "\n")

    make_engine = engine_factory(model_path, _CHECKPOINT.value, tokenizer, engine_cfg)
    try:
        results = asyncio.run(run_eval(make_engine, tokenizer, loaded, fmt, budgets, max_turns, answer_formats, write))
    except KeyboardInterrupt:
        print(f"\ninterrupted: every finished problem is kept in {_OUT.value}; the same command resumes there",
              file=sys.stderr)
        raise SystemExit(130) from None
    print("\n" + markdown_table(results))


if __name__ == "__main__":
    cli.run(main)
