"""`train --plan`: what a config will do, read off the config alone (no model loaded, no
engine or sandbox started), and `train --helpconfig`: every field with its documentation."""

from __future__ import annotations

import os

import jax

from rstar2_jax.core import sharding
from rstar2_jax.core.config_types import leaves
from rstar2_jax.rl.config import RunConfig
from rstar2_jax.rl.run_dir import RunDirectory, refused_changes
from rstar2_jax.rollout.engines.factory import engine_kind


def describe_plan(cfg: RunConfig, workdir: str, config_mismatch: str = "stop") -> str:
    rl, r = cfg.rl, cfg.rollout
    lines = [f"config OK: run {cfg.run_name!r}, seed {cfg.seed}, run directory {os.path.abspath(workdir)}"]
    lines.append(_run_directory_state(cfg, workdir, config_mismatch))
    lines.append(f"model: {_model_line(cfg)}")
    lines.append(f"mesh: {_mesh_line(cfg)}")
    if cfg.model.lora.enabled:
        a = cfg.model.lora
        lines.append(f"LoRA: rank {a.rank}, alpha {a.alpha:g}, dropout {a.dropout:g} on {', '.join(a.targets)}: trains "
                     f"the adapters only (the base frozen in {cfg.model.dtype}); syncs and checkpoints hold them alone")
    lines.append(f"data: task {cfg.data.task}, format {cfg.format}" +
                 (f", SFT warm start {cfg.sft.steps} steps x {cfg.sft.batch_size}" if cfg.sft.steps else ""))
    lines.append(f"per step: {rl.batch_problems} problems x {rl.rollouts_per_problem} rollouts = "
                 f"{rl.batch_problems * rl.rollouts_per_problem}, RoC {rl.roc.mode} keeps {rl.group_size} per problem; " +
                 _update_rows(cfg) +
                 (f"async, up to {rl.max_staleness} version(s) stale" if rl.max_staleness else "on-policy"))
    for i, stage in enumerate(cfg.stages):
        end = cfg.stages[i + 1].start_step - 1 if i + 1 < len(cfg.stages) else rl.steps - 1
        extra = ""
        if stage.filter_solved_k:
            extra += f", drop problems solved {stage.filter_solved_k}/{stage.filter_solved_k} ({stage.filter_mode})"
        if stage.reset_optimizer:
            extra += ", optimizer reset"
        lines.append(f"stage {i}: steps {stage.start_step}-{end}: {stage.max_response_tokens} tokens, "
                     f"{stage.max_turns} turns{extra}")
    engine = engine_kind(r).describe(r)
    sb = cfg.sandbox
    lines.append(f"engine: {engine}; sandbox: {sb.backend}{sb.spec().describe(sb.settings())}, {sb.tool_state} tools")
    lines.append(f"checkpoints: every {cfg.checkpoint.every} steps, newest {cfg.checkpoint.keep} kept")
    return "\n".join(lines)


class SyncPlanError(ValueError):
    """A weight sync the servers cannot be given from here (train refuses it at --plan and launch)."""


def _update_rows(cfg: RunConfig) -> str:
    """How the learner's passes lay out the rollouts (rl.token_budget; auto resolved as the run will)."""
    from rstar2_jax.learner.settings import AUTO_TOKEN_BUDGET
    from rstar2_jax.rl.memory_plan import resolve_token_budget
    rl = resolve_token_budget(cfg, processes=1).rl
    why = ""
    if cfg.rl.token_budget == AUTO_TOKEN_BUDGET:
        why = (" (rl.token_budget auto: the largest the memory plan fits)" if rl.token_budget > 0 else
               " (rl.token_budget auto: padded, as rl.micro_batches > 1 asks)" if rl.micro_batches > 1 else
               " (rl.token_budget auto: padded on the CPU)")
    if rl.token_budget > 0:
        return f"packed rows of {rl.token_budget} tokens{why}, at most {rl.segments_per_row} rollouts each; "
    return f"{rl.micro_batches} micro-batch(es) of padded rows{why}; "


def sync_refusal(cfg: RunConfig) -> str | None:
    """Why the run's vLLM weight sync cannot work on this host (None: it can, as far as the config
    and this host's devices say; pull without fetchers is a config error already)."""
    return engine_kind(cfg.rollout).host_refusal(cfg.rollout, jax.devices()[0].platform)


def _run_directory_state(cfg: RunConfig, workdir: str, config_mismatch: str) -> str:
    run_dir = RunDirectory(workdir, create=False)
    if not os.path.exists(run_dir.file("config.json")):
        return "run directory: new run"
    changes = run_dir.changes(cfg.to_dict())
    refused = refused_changes(changes)
    state = "resumes the run there"
    if refused:
        verdict = "recorded (--config_mismatch=ok)" if config_mismatch == "ok" else "would STOP the run"
        state += f"; differs from its config.json in {', '.join(refused)}: {verdict}"
    elif changes:
        state += f"; changes it may take: {', '.join(sorted(changes))}"
    return f"run directory: {state}"


def _model_line(cfg: RunConfig) -> str:
    m = cfg.model
    if not m.path:
        return f"tiny random model ({m.tiny_layers} layers, hidden {m.tiny_hidden}), built in the run directory"
    from rstar2_jax.models.flops import param_count
    from rstar2_jax.rl.memory_plan import architecture  # resolves model.path as the run does (models/hub.py)
    arch = architecture(cfg)
    return (f"{m.path}: {arch.family}, {param_count(arch) / 1e9:.2f}B parameters (float32 master weights "
            f"{param_count(arch) * 4 / 2**30:.1f} GiB), compute {m.dtype}, remat {m.remat}")


def _mesh_line(cfg: RunConfig) -> str:
    axes = cfg.mesh.axes()
    try:
        devices, engine = engine_kind(cfg.rollout).devices(cfg.rollout, jax.devices())
    except ValueError as e:  # the engine's own devices leave the learner none on this host
        return f"{axes}: {e}"
    own = f"; the engine on {len(engine)} device(s) of its own" if engine != devices else ""
    try:
        mesh = sharding.make_mesh(**axes, devices=devices)
        return " x ".join(f"{k} {v}" for k, v in mesh.shape.items()) + f" over this host's {len(devices)} device(s)" + own
    except ValueError as e:
        return (f"{axes} cannot be built on this host's {len(devices)} {devices[0].platform} device(s) ({e}); "
                "it is built at launch over all processes' devices")


def describe_fields(cfg: RunConfig) -> str:
    """Every leaf field: path, type, allowed values, current value, documentation."""
    out = []
    for path, f, tp in leaves(RunConfig):
        value = _value_at(cfg, path)
        meta = f.metadata
        allowed = []
        if meta.get("choices") is not None:
            allowed.append("one of " + ", ".join(map(repr, meta["choices"])))
        if meta.get("min") is not None:
            allowed.append(f">= {meta['min']}")
        if meta.get("max") is not None:
            allowed.append(f"<= {meta['max']}")
        type_name = getattr(tp, "__name__", str(tp).replace("typing.", ""))
        out.append(f"{path} = {value!r}  [{type_name}{'; ' + ', '.join(allowed) if allowed else ''}]\n    {meta['doc']}")
    return "\n".join(out)


def _value_at(cfg, path: str):
    obj = cfg
    for part in path.replace("[0]", ".0").split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj
