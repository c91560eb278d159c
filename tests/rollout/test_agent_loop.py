"""The agent loop with the real sandbox: a scripted engine (a fake, beside the real JaxEngine
test at the bottom) makes the model's side deterministic."""

import asyncio
import os
import signal
import json
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sandbox
from sandbox.result import ExecResult
from rstar2_jax import models
from rstar2_jax.rewards import answer_reward
from rstar2_jax.rollout import AgentConfig, compact_format, run_agent
from rstar2_jax.rollout.engines import Completion, JaxEngine
from rstar2_jax.rollout.prompt import TOOL_NAME


def call(code, stdin=""):
    return "<tool_call>" + json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}}) + "</tool_call>"


class ScriptedEngine:
    """Replays assistant turns as tokens; records the prompts it was given."""

    def __init__(self, tokenizer, turns, delay_s=0.0):
        self.tokenizer, self.turns, self.delay_s = tokenizer, list(turns), delay_s
        self.prompts = []
        self.version = 7

    async def generate(self, prompt_ids, sampling, stop=(), *, session=None):
        self.prompts.append(list(prompt_ids))
        await asyncio.sleep(self.delay_s)
        text = self.turns[min(len(self.prompts) - 1, len(self.turns) - 1)]
        ids = self.tokenizer.encode(text)
        reason = "stop" if any(text.endswith(s) for s in stop) else "eos" if text.endswith("<|im_end|>") else "length"
        if len(ids) > sampling.max_tokens:
            ids, reason = ids[:sampling.max_tokens], "length"
        return Completion(ids, [-0.5] * len(ids), reason, self.version, self.version)


def run(coro_fn, workers=2):
    async def go():
        async with sandbox.LocalSandbox(workers=workers, preload=("math",)) as sb:
            return await coro_fn(sb)
    return asyncio.run(go())


FMT = compact_format()


def test_tool_call_runs_and_its_output_is_appended_with_mask_zero(tokenizer):
    turns = ["Let me compute. " + call("print(12345 * 6789)"),
             "So <answer>\\boxed{83810205}</answer><|im_end|>"]
    engine = ScriptedEngine(tokenizer, turns)
    traj = run(lambda sb: run_agent(engine, sb, tokenizer, "12345*6789?", AgentConfig(format=FMT)))

    assert traj.finish_reason == "eos" and len(traj.turns) == 2
    tool = traj.turns[0].tools[0]
    assert (tool.status, tool.output) == ("ok", "83810205\n")
    tool_text = FMT.tool_turn(["83810205\n"], assistant_turn_closed=False)
    assert traj.response_text == turns[0] + tool_text + turns[1]
    # masks: prompt 0, model tokens 1, tool tokens 0; log-probs only on model tokens
    n0, nt = len(tokenizer.encode(turns[0])), len(tokenizer.encode(tool_text))
    expected_mask = [0] * traj.prompt_len + [1] * n0 + [0] * nt + [1] * len(tokenizer.encode(turns[1]))
    assert traj.loss_mask == expected_mask
    assert all((lp == -0.5) == (m == 1) for lp, m in zip(traj.logprobs, traj.loss_mask))
    # token in, token out: the second request is exactly the trajectory so far
    assert engine.prompts[1] == traj.token_ids[:traj.prompt_len + n0 + nt]
    assert traj.turns[0].version_start == 7 and traj.min_version == 7
    assert answer_reward(traj.response_text, "83810205") == 1.0


def test_malformed_call_gets_its_parse_error_back(tokenizer):
    turns = ["<tool_call>{oops}</tool_call>", "ok <answer>\\boxed{1}</answer><|im_end|>"]
    traj = run(lambda sb: run_agent(ScriptedEngine(tokenizer, turns), sb, tokenizer, "p", AgentConfig(format=FMT)))
    (tool,) = traj.turns[0].tools
    assert tool.status == "parse_error" and "invalid JSON" in tool.output
    assert "<tool_response>\nTool call error: invalid JSON" in traj.response_text
    assert traj.tool_statuses == ["parse_error"] and traj.finish_reason == "eos"


def test_execution_errors_and_timeouts_are_reported_to_the_model(tokenizer):
    turns = [call("1/0"), call("import time\ntime.sleep(5)"), "<answer>\\boxed{0}</answer><|im_end|>"]
    cfg = AgentConfig(format=FMT, tool_timeout_s=0.5)
    traj = run(lambda sb: run_agent(ScriptedEngine(tokenizer, turns), sb, tokenizer, "p", cfg))
    assert traj.tool_statuses == ["error", "timeout"]
    assert "ZeroDivisionError" in traj.turns[0].tools[0].output
    assert "Timeout" in traj.turns[1].tools[0].output


def test_budget_is_shared_by_all_turns(tokenizer):
    turns = [call("print('x' * 50)")] * 10
    cfg = AgentConfig(format=FMT, max_response_tokens=150)
    traj = run(lambda sb: run_agent(ScriptedEngine(tokenizer, turns), sb, tokenizer, "p", cfg))
    assert traj.finish_reason == "length"
    assert traj.num_response_tokens <= 150


def test_max_turns(tokenizer):
    turns = [call("print(1)")]
    cfg = AgentConfig(format=FMT, max_turns=3, max_response_tokens=5000)
    traj = run(lambda sb: run_agent(ScriptedEngine(tokenizer, turns), sb, tokenizer, "p", cfg))
    # as in the release: the last allowed turn's tool calls are not run, and nothing follows it
    assert traj.finish_reason == "max_turns" and len(traj.turns) == 3 and traj.tool_statuses == ["ok"] * 2
    assert traj.loss_mask[-1] == 1 and traj.response_text.endswith("</tool_call>")


def test_slow_tool_calls_do_not_block_other_trajectories(tokenizer):
    turns = [call("import time\ntime.sleep(0.5)\nprint('done')"), "<answer>\\boxed{1}</answer><|im_end|>"]

    async def many(sb):
        start = time.monotonic()
        trajs = await asyncio.gather(*(run_agent(ScriptedEngine(tokenizer, turns, delay_s=0.2), sb, tokenizer,
                                                 f"p{i}", AgentConfig(format=FMT)) for i in range(6)))
        return trajs, time.monotonic() - start

    trajs, elapsed = run(many, workers=6)
    assert all(t.tool_statuses == ["ok"] for t in trajs)
    assert elapsed < 2.5, f"6 x (0.2 + 0.5 + 0.2) s took {elapsed:.1f} s: trajectories ran one after another"


def test_real_engine_multi_turn_logprobs_align_with_the_learner(tiny_model, tokenizer):
    """JaxEngine + real sandbox: a trajectory with a tool turn (the random model ends a turn with
    </tool_call> by chance; seeds are tried until one does) has sampler log-probs equal to the
    learner's recomputation over the whole multi-turn sequence, and zeros where the mask is 0."""
    cfg = AgentConfig(format=FMT, max_response_tokens=160, max_turns=3, temperature=1.0)

    async def attempt(sb, seed):
        async with JaxEngine(tiny_model, tokenizer, slots=8, max_len=512, seed=seed) as eng:
            return await asyncio.gather(*(run_agent(eng, sb, tokenizer, f"{i} + {i}", cfg) for i in range(8)))

    async def search(sb):
        for seed in range(25):
            for traj in await attempt(sb, seed):
                if len(traj.turns) >= 2:
                    return traj
        return None

    traj = run(search, workers=2)
    assert traj is not None, "no multi-turn trajectory in 200 random rollouts"
    assert traj.turns[0].finish_reason == "stop" and traj.turns[0].tools[0].status == "parse_error"
    tokens = jnp.asarray([traj.token_ids], jnp.int32)
    learner = np.asarray(nnx.jit(lambda m, t: models.token_logprobs(m, t, temperature=1.0))(tiny_model, tokens))[0]
    mask = np.asarray(traj.loss_mask, bool)
    assert mask.sum() > 0 and (~mask[traj.prompt_len:]).sum() > 0  # model and tool tokens both present
    np.testing.assert_allclose(np.asarray(traj.logprobs)[mask], learner[mask], atol=2e-4)
    assert not np.any(np.asarray(traj.logprobs)[~mask])


def test_release_format_turns_end_with_the_model_s_own_eos_and_it_is_trained(tokenizer):
    """rStar2-Agent's release: the model ends a tool-call turn with <|im_end|> itself (trained,
    mask 1); the tool turn follows it directly and opens the next turn with the <reason> header."""
    from rstar2_jax.rollout import PromptFormat
    fmt = PromptFormat()
    turns = [call("print(6*7)") + "<|im_end|>", "ok</reason><answer>\\boxed{42}</answer><|im_end|>"]
    engine = ScriptedEngine(tokenizer, turns)
    cfg = AgentConfig(format=fmt, max_turns=4, max_response_tokens=5000)
    traj = run(lambda sb: run_agent(engine, sb, tokenizer, "p", cfg))
    assert traj.finish_reason == "eos" and traj.tool_statuses == ["ok"]
    first = tokenizer.encode(turns[0])
    start = traj.prompt_len
    assert traj.token_ids[start:start + len(first)] == first and set(traj.loss_mask[start:start + len(first)]) == {1}
    tool_turn = "<|im_start|>user\n<tool_response>\n42\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>"
    assert traj.response_text == turns[0] + tool_turn + turns[1]
    assert engine.prompts[1] == traj.token_ids[:start + len(first) + len(tokenizer.encode(tool_turn))]


def test_session_tool_state_keeps_variables_across_turns(tokenizer):
    turns = ["First " + call("x = 6 * 7\nprint('set')"),
             "Then " + call("print(x + 1)"),
             "So <answer>\\boxed{43}</answer><|im_end|>"]

    def agent(state):
        engine = ScriptedEngine(tokenizer, turns)
        return run(lambda sb: run_agent(engine, sb, tokenizer, "q", AgentConfig(format=FMT, tool_state=state)))

    session, stateless = agent("session"), agent("stateless")
    assert [t.tools[0].output for t in session.turns[:2]] == ["set\n", "43\n"]
    second = stateless.turns[1].tools[0]
    assert second.status == "error" and "NameError: name 'x' is not defined" in second.output
    with pytest.raises(ValueError, match="tool_state must be one of"):
        AgentConfig(tool_state="jupyter")


class DyingEngine(ScriptedEngine):
    """Raises (the process 'dies') when asked for turn `die_at` the first time."""

    def __init__(self, tokenizer, turns, die_at):
        super().__init__(tokenizer, turns)
        self.die_at = die_at

    async def generate(self, prompt_ids, sampling, stop=(), *, session=None):
        if len(self.prompts) == self.die_at:
            self.die_at = None
            raise SystemExit("killed mid-trajectory")
        return await super().generate(prompt_ids, sampling, stop, session=session)


@pytest.mark.parametrize("state", ["session", "stateless"])
def test_a_trajectory_killed_mid_turns_resumes_from_its_journal_where_it_was(tokenizer, tmp_path, state):
    """Killed before its third turn: the resumed run keeps the saved turns (tokens, log-probs,
    versions, tool results), rebuilds the session from its recorded cells (x is still set) and
    ends as the uninterrupted run; a finished trajectory is returned from the journal as is."""
    from rstar2_jax.rollout.journal import StepJournal
    turns = ["First " + call("x = 6 * 7\nprint('set')"),
             "Then " + call("print(x + 1)"),
             "Again " + call("print(x + 2)"),
             "So <answer>\\boxed{43}</answer><|im_end|>"]
    cfg = AgentConfig(format=FMT, tool_state=state)
    straight = run(lambda sb: run_agent(ScriptedEngine(tokenizer, turns), sb, tokenizer, "q", cfg))
    journal = StepJournal(str(tmp_path), step=3).rollout(0, "q", 5, cfg)
    dying = DyingEngine(tokenizer, turns, die_at=2)
    with pytest.raises(SystemExit):
        run(lambda sb: run_agent(dying, sb, tokenizer, "q", cfg, journal=journal))
    saved = journal.load()
    assert not saved.finished and len(saved.trajectory.turns) == 2
    resumed_engine = ScriptedEngine(tokenizer, turns[2:])
    resumed = run(lambda sb: run_agent(resumed_engine, sb, tokenizer, "q", cfg, journal=journal))
    assert len(resumed_engine.prompts) == 2  # turns 3 and 4 only: the first two were not sampled again
    assert resumed_engine.prompts[0] == saved.trajectory.token_ids
    for field in ("token_ids", "loss_mask", "logprobs", "versions", "kv_versions", "response_text", "finish_reason"):
        assert getattr(resumed, field) == getattr(straight, field), field
    assert [t.tools[0].output for t in resumed.turns[:3]] == [t.tools[0].output for t in straight.turns[:3]]
    assert journal.load().finished
    again = run(lambda sb: run_agent(ScriptedEngine(tokenizer, ["never"]), sb, tokenizer, "q", cfg, journal=journal))
    assert again.token_ids == straight.token_ids
    # another rollout's identity, or tokens of weights newer than the restored ones: not resumed
    assert StepJournal(str(tmp_path), step=3).rollout(0, "q", 6, cfg).load() is None
    assert StepJournal(str(tmp_path), step=3, max_version=6).rollout(0, "q", 5, cfg).load() is None
    assert StepJournal(str(tmp_path), step=3, max_version=7).rollout(0, "q", 5, cfg).load() is not None


def test_the_journal_appends_each_turn_and_reads_past_a_torn_line_and_newer_weights(tokenizer, tmp_path):
    """A save appends only what the trajectory gained (its file grows by a line per turn); a torn
    last line (a kill mid-write) is ignored; a turn sampled by weights newer than the restored
    ones is cut off, and the file is cut back to what was used before new turns go on it."""
    from rstar2_jax.rollout.journal import RolloutJournal
    from rstar2_jax.rollout.trajectory import Trajectory, Turn
    path = str(tmp_path / "r.jsonl")
    traj = Trajectory(prompt_len=2, token_ids=[], loss_mask=[], logprobs=[])
    traj.append([5, 6], 0)
    writer = RolloutJournal(path, "id", None)
    for version in (1, 2, 3):  # three turns, the last one sampled by version 3
        traj.append([7, 8], 1, [-0.25, -0.5], [version, version])
        traj.turns.append(Turn("t", 2, "stop", version, version))
        writer.save(traj, finished=False)
    lines = open(path).read().splitlines()
    assert len(lines) == 4 and json.loads(lines[2])["token_ids"] == [7, 8]  # header + one line per turn
    with open(path, "a") as f:
        f.write('{"token_ids": [9')  # torn
    whole = RolloutJournal(path, "id", None).load()
    assert whole.trajectory.token_ids == traj.token_ids and whole.trajectory.versions == traj.versions
    cut = RolloutJournal(path, "id", max_version=2)
    saved = cut.load()
    assert len(saved.trajectory.turns) == 2 and saved.trajectory.token_ids == traj.token_ids[:6]
    saved.trajectory.append([4], 1, [-1.0], [2])
    saved.trajectory.turns.append(Turn("u", 1, "eos", 2, 2))
    saved.trajectory.finish_reason = "eos"
    cut.save(saved.trajectory, finished=True)
    again = RolloutJournal(path, "id", None).load()
    assert again.finished and again.trajectory.token_ids == [5, 6, 7, 8, 7, 8, 4]
    assert RolloutJournal(path, "other id", None).load() is None


def test_a_call_whose_worker_is_killed_is_run_again_and_is_not_the_policy_s_error(tokenizer):
    """The sandbox worker running a tool call is SIGKILLed mid-call: the (stateless) call is run
    again once and its output is what the model reads (retries=1, status ok); p_err counts only
    the calls the sandbox served, and the reward is what the answer earns."""
    from sandbox.pool import child_pids, running_calls
    from rstar2_jax.rewards import tool_error_ratio
    turns = ["Slow " + call("import time\ntime.sleep(1.5)\nprint(6 * 7)"), "Fast " + call("print(1 + 1)"),
             "So <answer>\\boxed{42}</answer><|im_end|>"]

    async def scenario(sb):
        async def kill_the_first_call():
            while True:
                for worker in child_pids(sb.zygote_pid):
                    if running_calls(worker):
                        os.kill(worker, signal.SIGKILL)
                        return
                await asyncio.sleep(0.01)
        killer = asyncio.create_task(kill_the_first_call())
        traj = await run_agent(ScriptedEngine(tokenizer, turns), sb, tokenizer, "q",
                               AgentConfig(format=FMT, tool_timeout_s=10))
        await asyncio.wait_for(killer, 5)
        return traj

    traj = run(scenario)
    first, second = traj.turns[0].tools[0], traj.turns[1].tools[0]
    assert (first.status, first.output, first.retries) == ("ok", "42\n", 1)
    assert second.status == "ok" and second.retries == 0
    assert tool_error_ratio(traj.tool_statuses) == 0.0
    assert answer_reward(traj.response_text, "42") == 1.0


class FailingSession:
    """A session whose first call meets a dead worker (a fake beside the real test above)."""

    def __init__(self):
        self.calls = 0

    async def run(self, code, stdin="", timeout=None):
        self.calls += 1
        if self.calls == 1:
            return ExecResult("worker_died", stderr="WorkerDied: killed")
        return ExecResult("ok", stdout="2\n")

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        pass


class SessionsOnly:
    def __init__(self):
        self.opened = FailingSession()

    async def session(self):
        return self.opened


def test_a_session_s_call_is_not_run_again_and_its_infra_failure_is_left_out_of_p_err(tokenizer):
    """A session's call cannot be re-run safely (its interpreter's state is gone): it stays
    worker_died and p_err leaves it out (the one call the sandbox served ran cleanly: 0.0)."""
    from rstar2_jax.rewards import tool_error_ratio
    from rstar2_jax.rewards.penalties import infra_error_count
    turns = ["First " + call("x = 1"), "Then " + call("print(x + 1)"), "So <answer>\\boxed{2}</answer><|im_end|>"]
    sb = SessionsOnly()
    traj = asyncio.run(run_agent(ScriptedEngine(tokenizer, turns), sb, tokenizer, "q",
                                 AgentConfig(format=FMT, tool_state="session")))
    assert traj.tool_statuses == ["worker_died", "ok"] and sb.opened.calls == 2  # no retry in a session
    assert infra_error_count(traj.tool_statuses) == 1 and tool_error_ratio(traj.tool_statuses) == 0.0
    assert tool_error_ratio(["worker_died", "internal"]) == 0.5  # nothing served: neutral, as without calls
    assert tool_error_ratio(["worker_died", "error"]) == 1.0
