"""The multi-turn agent loop: generate a turn, run its tool calls, append the results, repeat.

    traj = await run_agent(engine, sandbox, tokenizer, problem, AgentConfig())

A turn ends where the model ends it (EOS; rStar2-Agent's release) or, in formats with
`tool_call_stops_turn`, at the first `</tool_call>`. One token budget (`max_response_tokens`)
covers everything after the prompt, model and tool tokens alike. The loop stops on a turn
without tool calls, on the budget, or at `max_turns` assistant turns: as in the release, the
tool calls of the last allowed turn are not run (finish_reason "max_turns"). Calls that do not
parse get their parse error back as the tool response. Many trajectories run concurrently
(asyncio.gather): while one waits for the sandbox, the engine keeps decoding the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import TYPE_CHECKING, Callable

from sandbox.client import SandboxClient, SandboxSession

from rstar2_jax.rollout.prompt import PromptFormat, tool_output_text
from rstar2_jax.rollout.engines.sampling import SamplingParams
from rstar2_jax.rollout.tool_calls import ToolCall, parse_tool_calls
from rstar2_jax.rewards.penalties import INFRA_TOOL_STATUSES
from rstar2_jax.rollout.journal import RolloutJournal
from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn, model_text
from rstar2_jax.core.timeline import span

if TYPE_CHECKING:  # the engines import this module's neighbours; the type alone is needed here
    from rstar2_jax.rollout.engines.base import Engine


_SESSIONS = itertools.count()
TOOL_STATES = ("stateless", "session")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    format: PromptFormat = PromptFormat()
    max_turns: int = 10
    max_response_tokens: int = 8192
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    tool_timeout_s: float = 5.0
    max_tool_calls_per_turn: int = 4
    # "stateless": every tool call is a fresh script (the release; it replays earlier cells in
    # the code when it wants state). "session": one live interpreter per trajectory, variables
    # kept across turns (sandbox.Session); a turn's calls then run in order.
    tool_state: str = "stateless"

    def __post_init__(self):
        if self.max_turns < 1 or self.max_response_tokens < 1:
            raise ValueError("max_turns and max_response_tokens must be >= 1")
        if self.tool_state not in TOOL_STATES:
            raise ValueError(f"tool_state must be one of {TOOL_STATES}, got {self.tool_state!r}")


async def _run_tool(sandbox: SandboxClient | SandboxSession, call: ToolCall, timeout: float, retries: int = 0) -> ToolRecord:
    """One call. A call the sandbox failed to serve (INFRA_TOOL_STATUSES: a worker died under it,
    the sandbox was unreachable, its client raised) is run again up to `retries` times (only
    where that is safe: a stateless call); what the model reads then is the last attempt's."""
    if not call.ok:
        return ToolRecord(None, "", "parse_error", call.error, 0.0)
    start = time.monotonic()
    for attempt in range(retries + 1):  # noqa: B007 - read after the loop: the retries that ran
        try:
            with span("tool"):  # wall time for the step breakdown (rstar2_jax.core.timeline)
                result = await sandbox.run(call.code, call.stdin, timeout)
            status, output = result.status, tool_output_text(result)
        except Exception as e:  # noqa: BLE001 - a sandbox failure is a failed call, not a lost trajectory
            status, output = "internal", f"The sandbox could not run this call (not the code's fault): {e}"
        if status not in INFRA_TOOL_STATUSES:
            break
    return ToolRecord(call.code, call.stdin, status, output, time.monotonic() - start, retries=attempt)


async def run_agent(engine: Engine, sandbox: SandboxClient, tokenizer, problem: str, cfg: AgentConfig = AgentConfig(), *,
                    on_turn: Callable[[Turn], None] | None = None, seed: int | None = None,
                    journal: RolloutJournal | None = None) -> Trajectory:
    """seed: makes the trajectory reproducible (each turn samples from its own key) regardless of
    what else the engine is batching; None draws from the engine's stream.
    journal: where the trajectory is saved at every turn boundary, and resumed from (journal.py)."""
    saved = journal.load() if journal is not None else None
    if saved is not None and saved.finished:
        if not saved.trajectory.graded_text:  # saved before the graded text was kept
            saved.trajectory.graded_text = model_text(tokenizer, saved.trajectory)
        return saved.trajectory
    resume = saved.trajectory if saved is not None else None
    if cfg.tool_state == "session":
        async with await sandbox.session() as session:
            if resume is not None:
                await _replay_cells(session, resume, cfg.tool_timeout_s)
            return await _run_agent(engine, session, tokenizer, problem, cfg, on_turn=on_turn, seed=seed,
                                    journal=journal, resume=resume)
    return await _run_agent(engine, sandbox, tokenizer, problem, cfg, on_turn=on_turn, seed=seed, journal=journal,
                            resume=resume)


async def _replay_cells(session, traj: Trajectory, timeout: float):
    """A resumed trajectory's live interpreter rebuilt: its recorded cells run again, in order
    (their outputs are already in the trajectory and are not read again)."""
    for turn in traj.turns:
        for tool in turn.tools:
            if tool.code is not None:
                await _run_tool(session, ToolCall(tool.code, code=tool.code, stdin=tool.stdin), timeout)


async def _run_agent(engine, sandbox, tokenizer, problem, cfg, *, on_turn, seed, journal=None,
                     resume: Trajectory | None = None) -> Trajectory:
    fmt = cfg.format
    session = next(_SESSIONS)  # names this trajectory to the engine: its turns share one prefix
    if resume is None:
        prompt_ids = tokenizer.encode(fmt.prompt(problem))
        traj = Trajectory(prompt_len=len(prompt_ids), token_ids=[], loss_mask=[], logprobs=[])
        traj.append(prompt_ids, 0)
    else:  # saved at a turn boundary: the next thing to do is sample turn len(turns)
        traj = resume
    for turn_index in range(len(traj.turns), cfg.max_turns):
        budget = cfg.max_response_tokens - traj.num_response_tokens
        if budget <= 0:
            traj.finish_reason = "length"
            break
        sampling = SamplingParams(max_tokens=budget, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                  seed=None if seed is None else seed * 1009 + turn_index)
        start = time.monotonic()
        with span("request"):  # this trajectory's turn in the engine: whose work the step breakdown counts
            comp = await engine.generate(traj.token_ids, sampling,
                                         stop=[fmt.tool_call_end] if fmt.tool_call_stops_turn else [], session=session)
        traj.generation_s += time.monotonic() - start
        traj.append(comp.token_ids, 1, comp.logprobs, comp.versions(), comp.kv_versions())
        turn = Turn(tokenizer.decode(comp.token_ids), len(comp.token_ids), comp.finish_reason,
                    comp.version_start, comp.version_end)
        traj.turns.append(turn)

        calls = (parse_tool_calls(turn.text, fmt.tool_call_start, fmt.tool_call_end, fmt.tool_name)
                 if comp.finish_reason != "length" else [])
        if comp.finish_reason == "stop" and not calls:
            calls = [ToolCall(turn.text, error=f"Tool call error: {fmt.tool_call_end} without {fmt.tool_call_start}")]
        if not calls:
            traj.finish_reason = comp.finish_reason  # eos: answered; length: out of budget
            if on_turn:
                on_turn(turn)
            break
        if turn_index + 1 >= cfg.max_turns:
            traj.finish_reason = "max_turns"  # the release stops here, before running the last turn's tools
            if on_turn:
                on_turn(turn)
            break

        start = time.monotonic()
        calls = calls[:cfg.max_tool_calls_per_turn]
        if cfg.tool_state == "session":  # one interpreter: the calls see each other's variables, in order
            turn.tools = [await _run_tool(sandbox, c, cfg.tool_timeout_s) for c in calls]
        else:  # a stateless call is safe to run again when the sandbox failed to serve it
            turn.tools = list(await asyncio.gather(*(_run_tool(sandbox, c, cfg.tool_timeout_s, retries=1)
                                                     for c in calls)))
        traj.tool_s += time.monotonic() - start
        if on_turn:
            on_turn(turn)
        closed = comp.finish_reason == "eos"
        for tool in turn.tools:
            tool.shown = fmt.truncate(tool.output)
        tool_ids = fmt.tool_turn_ids(tokenizer, [t.output for t in turn.tools], assistant_turn_closed=closed)
        if traj.num_response_tokens + len(tool_ids) >= cfg.max_response_tokens:
            traj.finish_reason = "length"  # no room for the results and another turn
            break
        traj.append(tool_ids, 0)
        if journal is not None:
            journal.save(traj, finished=False)
    traj.response_text = tokenizer.decode(traj.token_ids[traj.prompt_len:])
    traj.graded_text = model_text(tokenizer, traj)
    if journal is not None:
        journal.save(traj, finished=True)
    return traj
