"""The paper's difficulty filter before a stage (rStar2-Agent, section 5: before stage 3 the
final stage-2 policy samples 8 rollouts for every training problem and the problems it solves
8/8 are removed, 42K -> 17.3K).

Several trainer processes share the work (each runs its share of every chunk's rollouts, the
counts are gathered) and the primary process alone writes the file; every process reads it when
the stage begins, before any process can write to it (the first chunk's gather waits for all).

Resumable: each problem's result is appended to `<workdir>/prefilter/stage<i>.jsonl` as soon as
its rollouts are graded ({"id", "solved", "k"}); a restarted run reads the file and samples only
the problems not in it. A line cut short by a crash is the last line; it is dropped and its problem
sampled again. `stage<i>.summary.json` records the outcome.
"""

from __future__ import annotations

import json
import os
from typing import Awaitable, Callable, Sequence

from tqdm.auto import tqdm

from rstar2_jax.data.jsonl import read_appended_jsonl
from rstar2_jax.rl.seeds import prefilter_seeds


def read_results(path: str) -> dict[str, int]:
    """problem id -> rollouts solved, from a pre-filter file (missing file: nothing yet)."""
    return {str(row["id"]): int(row["solved"]) for row in read_appended_jsonl(path, "pre-filter results")}


async def prefilter_solved(problems: Sequence, k: int, path: str,
                           solve: Callable[[Sequence, int], Awaitable[list[int]]], chunk: int,
                           desc: str = "pre-filter", write: bool = True) -> set[str]:
    """Ids of the problems solved k out of k. `solve(problems, k)` returns, per problem, how many
    of its k rollouts scored; it is called on chunks of `chunk` problems not yet in `path`.
    `write`: this process appends the results (one process per run directory)."""
    done = read_results(path)
    if write:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _drop_cut_line(path)
    todo = [p for p in problems if p.id not in done]
    with tqdm(total=len(problems), initial=len(problems) - len(todo), desc=desc, dynamic_ncols=True) as bar:
        for start in range(0, len(todo), chunk):
            part = todo[start:start + chunk]
            counts = await solve(part, k)
            done.update({p.id: int(n) for p, n in zip(part, counts)})
            if write:
                with open(path, "a", encoding="utf-8") as f:
                    for p, n in zip(part, counts):
                        f.write(json.dumps({"id": p.id, "solved": int(n), "k": k}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            bar.update(len(part))
    ids = {p.id for p in problems}
    solved = {i for i, n in done.items() if n >= k and i in ids}
    summary = {"problems": len(ids), "solved_k_of_k": len(solved), "kept": len(ids) - len(solved), "k": k}
    if write:
        with open(os.path.splitext(path)[0] + ".summary.json", "w") as f:
            json.dump(summary, f, indent=2)
    return solved


def _drop_cut_line(path: str):
    """Truncate a last line that a crash cut short (no newline after it), so appends stay whole."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


async def prefilter_stage(producer, problems, cfg, stage_i: int, step: int, path: str) -> set[str]:
    """The pre-pass before stage `stage_i`: its filter_solved_k rollouts of every problem, through
    the rollout producer (every process's share, gathered), chunk by chunk, resumable from
    `path`; the ids solved k/k."""
    from rstar2_jax.core import processes

    agent = producer.agent(step)

    async def solve(chunk, k):
        seeds = prefilter_seeds(cfg.seed, stage_i, [p.id for p in chunk], k)
        rewards = [s.reward for s in await producer.rollouts(chunk, k, agent, seeds)]
        return [sum(r > 0 for r in rewards[i * k:(i + 1) * k]) for i in range(len(chunk))]

    return await prefilter_solved(problems, cfg.stages[stage_i].filter_solved_k, path, solve,
                                  chunk=cfg.rl.batch_problems, desc=f"stage {stage_i} pre-filter",
                                  write=processes.is_primary())
