"""Solve one problem interactively with tool calls, printed turn by turn.

    python -m rstar2_jax.chat --model DIR --prompt "Solve 2x + 3y = 7, x - y = 1"
    python -m rstar2_jax.chat --checkpoint runs/tiny_arith --prompt "What is 123*45?"   # a run's policy, its format

Like rStar2-Agent's chat_with_tool_call example, on the embedded JaxEngine and LocalSandbox.
"""

from __future__ import annotations

import asyncio

from absl import app, flags, logging

from rstar2_jax import cli

_MODEL = flags.DEFINE_string("model", None,
                             "HF model directory, or a hub id (owner/name[@revision]) through the Hugging Face cache")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a training run directory: its latest checkpoint and format")
_PROMPT = flags.DEFINE_string("prompt", "Solve the system of equations: 2x + 3y = 7, x - y = 1", "the problem")
_FORMAT = flags.DEFINE_string("format", None, "prompt format the model was trained in: rstar2, compact or "
                               "tiny (the CPU demo's); default: the run's with --checkpoint, else rstar2")
_ANSWER_FORMAT = flags.DEFINE_string("answer_format", None, "where the final answer is read (answer_boxed, boxed, dapo, "
                                     "gsm8k, choice_letter); default: the run's with --checkpoint, else answer_boxed")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "sampling temperature; 0 = greedy", lower_bound=0.0)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 2048, "token budget after the prompt, all turns", lower_bound=1)
_MAX_TURNS = flags.DEFINE_integer("max_turns", 10, "assistant turns", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_ISOLATION = flags.DEFINE_enum("isolation", "strict", ["strict", "basic"], "sandbox isolation")


def _print_turn(turn):
    print(f"\n--- assistant ({turn.num_tokens} tokens, {turn.finish_reason}) ---\n{turn.text}")
    for tool in turn.tools:
        print(f"--- tool: {tool.status} in {tool.latency_s * 1000:.0f} ms ---\n{tool.output}")


async def _chat(model, model_dir: str, format_name: str, answer_format: str):
    import sandbox
    from rstar2_jax.models.tokenizer import Tokenizer
    from rstar2_jax.rewards import ANSWER_FORMATS
    from rstar2_jax.rollout import AgentConfig, make_format, run_agent
    from rstar2_jax.rollout.engines import RolloutConfig, make_engine
    from rstar2_jax.rollout.engines.jax_engine.settings import JaxEngineSettings

    fmt = make_format(format_name)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    cfg = AgentConfig(format=fmt, max_turns=_MAX_TURNS.value, max_response_tokens=_MAX_TOKENS.value,
                      temperature=_TEMPERATURE.value)
    print(fmt.prompt(_PROMPT.value))
    max_len = len(tokenizer.encode(fmt.prompt(_PROMPT.value))) + _MAX_TOKENS.value + 1
    # engine by name: a chat is one sequence on the embedded engine, on the model it loaded
    engine_cfg = RolloutConfig(engine="jax", jax=JaxEngineSettings(slots=1), max_len=max_len, temperature=_TEMPERATURE.value)
    async with sandbox.LocalSandbox(workers=2, isolation=_ISOLATION.value) as sb, \
            make_engine(engine_cfg, model, tokenizer, seed=_SEED.value) as engine:
        traj = await run_agent(engine, sb, tokenizer, _PROMPT.value, cfg, on_turn=_print_turn)
    print(f"\n=== {traj.finish_reason}: {len(traj.turns)} turns, {traj.num_response_tokens} tokens, "
          f"{len(traj.tool_statuses)} tool calls; answer ({answer_format}): "
          f"{ANSWER_FORMATS[answer_format].extract(traj.graded_text)!r}")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from rstar2_jax.core.checkpoints import load_run_policy, run_info
    from rstar2_jax.models.adapter_files import base_dir_of, load_model_dir
    from rstar2_jax.rollout import FORMATS

    if (_MODEL.value is None) == (_CHECKPOINT.value is None):
        raise app.UsageError("give exactly one of --model or --checkpoint")
    model_dir = cli.model_dir(_MODEL.value)  # a directory, or a hub id through the cache
    run = run_info(_CHECKPOINT.value) if _CHECKPOINT.value else {}
    format_name = _FORMAT.value or run.get("format", "rstar2")
    if format_name not in FORMATS:
        raise app.UsageError(f"--format: {FORMATS.problem(format_name)}")
    from rstar2_jax.rewards import ANSWER_FORMATS, DEFAULT_ANSWER_FORMAT
    answer_format = _ANSWER_FORMAT.value or run.get("answer_format", DEFAULT_ANSWER_FORMAT)
    if answer_format not in ANSWER_FORMATS:
        raise app.UsageError(f"--answer_format: {ANSWER_FORMATS.problem(answer_format)}")
    model = load_model_dir(model_dir) if model_dir else load_run_policy(_CHECKPOINT.value)  # a HF dir or an adapter
    asyncio.run(_chat(model, base_dir_of(model_dir) if model_dir else run["model_dir"], format_name, answer_format))


if __name__ == "__main__":
    cli.run(main)
