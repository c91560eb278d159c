"""Rollout traces: the Parquet schema, writer and reader, and what notebooks need to read a run.

    from rstar2_jax import traces
    run = traces.load_run("runs/tiny_arith")        # config, metrics, results, traces
    df = traces.with_trajectory_columns(run.traces())
    traces.step_stats(df)                            # per step, positive/negative x kept/dropped
    print(traces.render_trajectory(df.iloc[0], html=False))
"""

from rstar2_jax.traces.entropy import (FORKING, REFLECTION, frequent_strings, high_entropy_tokens, role_shares,
                                       token_roles)
from rstar2_jax.traces.run import Run, filter_traces, load_run, step_stats, with_trajectory_columns
from rstar2_jax.traces.schema import SCHEMA, TraceWriter, read_traces, trajectory_record
from rstar2_jax.traces.view import answer_context, render_trajectory

__all__ = ["FORKING", "REFLECTION", "Run", "SCHEMA", "TraceWriter", "answer_context", "filter_traces", "frequent_strings",
           "high_entropy_tokens", "load_run", "read_traces", "render_trajectory", "role_shares", "step_stats",
           "token_roles", "trajectory_record", "with_trajectory_columns"]
