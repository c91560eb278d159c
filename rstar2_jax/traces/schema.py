"""The trace schema, writer and reader: every trajectory (kept by RoC or not) as one Parquet row.

One file per RL step, `DIR/step_000042.parquet`, written to a temporary name and renamed, so a
crash loses at most the step in flight and never leaves a half-written file. Read them back as
one pandas DataFrame with `read_traces(DIR)`.

Schema (one row per trajectory):

| column | type | meaning |
|---|---|---|
| run | string | run name |
| step | int64 | RL step (or evaluation index) |
| problem_id | string | id of the problem in its data set |
| sample_index | int32 | which of the problem's rollouts |
| policy_version | int64 | oldest weights version that produced a token of it |
| engine | string | engine that generated it (e.g. "jax", "vllm:http://host:8000") |
| problem | string | problem text |
| gold | string | gold answer |
| response_text | string | everything after the prompt: model turns and tool responses, special tokens included |
| graded_text | string | what the grader read: the model's own tokens decoded without special tokens (EOS, pad, turn markers), one line break between its runs (null: traces written before it was kept) |
| extracted_answer | string | the answer in the run's answer format (data.answer_format; default the \\boxed{} of the last <answer> block), or null: none in that format (a format failure, reward 0) |
| turns | list<struct> | per assistant turn: text, num_tokens, finish_reason, version_start, version_end, tools (list of code, stdin, status, output, latency_s, retries: runs again after the sandbox failed to serve it) |
| token_ids | list<int32> | prompt + response tokens, exactly as trained on |
| loss_mask | list<int8> | 1 on model tokens, 0 on prompt and tool tokens |
| logprobs | list<float32> | sampler log-prob of each model token, 0 elsewhere |
| versions | list<int32> | weights version that sampled each model token, -1 elsewhere (asynchronous runs: several per rollout) |
| kv_versions | list<int32> | oldest weights version whose KV each model token's sampling read (<= versions: a partial rollout keeps the KV from before a sync), -1 elsewhere |
| entropy | list<float32> | entropy of the distribution each token was drawn from (the learner's pass; kept rollouts only, else null) |
| prompt_len | int32 | tokens of the prompt |
| num_response_tokens | int32 | tokens after the prompt |
| num_turns | int32 | assistant turns |
| num_tool_calls | int32 | tool calls (parsed or not) |
| tool_infra_errors | int32 | calls the sandbox failed to serve, after the retry (worker_died, internal: not the code's fault, not in p_err) |
| finish_reason | string | eos, length or max_turns |
| reward | float32 | 1.0 correct, 0.0 otherwise |
| p_err | float32 | tool error ratio (RoC), over the calls the sandbox served |
| p_format | float32 | format penalty (RoC) |
| kept | bool | kept by RoC down-sampling |
| advantage | float32 | GRPO advantage (0 when not kept) |
| generation_s | float32 | seconds waiting for the engine |
| tool_s | float32 | seconds waiting for tools |
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from rstar2_jax.rewards.penalties import infra_error_count
from rstar2_jax.rollout.trajectory import Trajectory

_TOOL = pa.struct([("code", pa.string()), ("stdin", pa.string()), ("status", pa.string()),
                   ("output", pa.string()), ("latency_s", pa.float64()), ("retries", pa.int32())])
_TURN = pa.struct([("text", pa.string()), ("num_tokens", pa.int32()), ("finish_reason", pa.string()),
                   ("version_start", pa.int64()), ("version_end", pa.int64()), ("tools", pa.list_(_TOOL))])
SCHEMA = pa.schema([
    ("run", pa.string()), ("step", pa.int64()), ("problem_id", pa.string()), ("sample_index", pa.int32()),
    ("policy_version", pa.int64()), ("engine", pa.string()), ("problem", pa.string()), ("gold", pa.string()),
    ("response_text", pa.string()), ("graded_text", pa.string()), ("extracted_answer", pa.string()),
    ("turns", pa.list_(_TURN)),
    ("token_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float32())),
    ("versions", pa.list_(pa.int32())), ("kv_versions", pa.list_(pa.int32())),
    ("entropy", pa.list_(pa.float32())), ("prompt_len", pa.int32()), ("num_response_tokens", pa.int32()),
    ("num_turns", pa.int32()),
    ("num_tool_calls", pa.int32()), ("tool_infra_errors", pa.int32()), ("finish_reason", pa.string()),
    ("reward", pa.float32()),
    ("p_err", pa.float32()), ("p_format", pa.float32()), ("kept", pa.bool_()), ("advantage", pa.float32()),
    ("generation_s", pa.float32()), ("tool_s", pa.float32()),
])


def trajectory_record(traj: Trajectory, *, run: str, step: int, problem_id: str, sample_index: int,
                      problem: str = "", gold: str = "", engine: str = "", extracted_answer: str | None = None,
                      reward: float = 0.0, p_err: float = 0.0, p_format: float = 0.0, kept: bool = False,
                      advantage: float = 0.0, entropy: list[float] | None = None) -> dict[str, Any]:
    return {
        "run": run, "step": step, "problem_id": str(problem_id), "sample_index": sample_index,
        "policy_version": traj.min_version, "engine": engine, "problem": problem, "gold": str(gold),
        "response_text": traj.response_text, "graded_text": traj.graded_text, "extracted_answer": extracted_answer,
        "turns": [{**{k: v for k, v in dataclasses.asdict(t).items() if k != "tools"},
                   "tools": [dataclasses.asdict(tool) for tool in t.tools]} for t in traj.turns],
        "token_ids": traj.token_ids, "loss_mask": traj.loss_mask, "logprobs": traj.logprobs,
        "versions": traj.versions or [-1] * len(traj.token_ids),
        "kv_versions": traj.kv_versions or [-1] * len(traj.token_ids),
        "entropy": entropy, "prompt_len": traj.prompt_len, "num_response_tokens": traj.num_response_tokens,
        "num_turns": len(traj.turns), "num_tool_calls": len(traj.tool_statuses),
        "tool_infra_errors": infra_error_count(traj.tool_statuses),
        "finish_reason": traj.finish_reason, "reward": reward, "p_err": p_err, "p_format": p_format,
        "kept": kept, "advantage": advantage, "generation_s": traj.generation_s, "tool_s": traj.tool_s,
    }


class TraceWriter:
    """Writes one Parquet file per step under `directory`."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    def write(self, step: int, records: Iterable[dict[str, Any]]) -> str:
        table = pa.Table.from_pylist(list(records), schema=SCHEMA)
        path = os.path.join(self.directory, f"step_{step:06d}.parquet")
        tmp = path + ".tmp"
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
        return path


def read_traces(path: str | os.PathLike, columns: list[str] | None = None):
    """All traces under a directory (or one file) as a pandas DataFrame, ordered by step."""
    path = os.fspath(path)
    files = sorted(glob.glob(os.path.join(path, "step_*.parquet"))) if os.path.isdir(path) else [path]
    if not files:
        raise FileNotFoundError(f"no step_*.parquet trace files in {path}")
    tables = [pq.read_table(f, columns=columns, schema=SCHEMA) for f in files]
    return pa.concat_tables(tables).to_pandas()
