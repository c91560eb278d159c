"""GRPO-RoC training from an ml-collections config.

    python -m rstar2_jax.train --config=experiments/tiny_arith.py --workdir=runs/tiny_arith \
        [--config.rl.roc.mode=off] [--config.rl.steps=40]

Any field is overridable as --config.a.b=value; an unknown field or a bad value stops with a clear
message before anything runs (--plan: only that, the run's plan and its memory per device; a run
whose memory plan passes the device's memory is refused before any weight loads). Re-running with the same
--workdir resumes from its last checkpoint, with the same config (or changes the run may take,
such as more rl.steps; --config_mismatch=ok records any other change).
"""

from __future__ import annotations

import os
import sys

from absl import flags, logging
from ml_collections import config_flags

from rstar2_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config (a .py file with get_config())")
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, traces, metrics", required=True)
_COORDINATOR = flags.DEFINE_string("coordinator", None, "with --config.distributed: HOST:PORT of process 0 "
                                   "(unset: detected from the cluster environment, e.g. SLURM)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "with --coordinator: how many processes")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "with --coordinator: this process's index")
_PLAN = flags.DEFINE_bool("plan", False, "check the config, build the mesh and print the run's plan and memory per "
                          "device (refused if it does not fit); loads no model, starts nothing")
_STAGE = flags.DEFINE_multi_string("stage", [], "a stage's setting, [INDEX.]FIELD=VALUE, as often as needed: "
                                    "--stage=0.max_response_tokens=8000 --stage=1.max_turns=10; no INDEX: every "
                                    "stage; the next INDEX adds a stage (with its start_step). The list "
                                    "config.stages cannot be overridden by --config.stages (rl/stage_flags.py)")
_PLAN_MODEL = flags.DEFINE_string("plan_model", None, "with --plan: the architecture to plan for, without its weights "
                                   "(e.g. on a login node): a shape (qwen3_0p6b, qwen3_1p7b, qwen3_4b, qwen3_14b), its "
                                   "hub id (Qwen/Qwen3-14B), a config.json or a directory holding one; replaces "
                                   "model.path for the plan")
_HELPCONFIG = flags.DEFINE_bool("helpconfig", False, "print every field of --config: value, allowed values, meaning")
_CONFIG_MISMATCH = flags.DEFINE_enum("config_mismatch", "stop", ["stop", "ok"],
                                     "re-running a run directory with a config that differs from its config.json: "
                                     "stop (name the keys) or ok (record the change in config_history.jsonl)")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from absl import app

    from rstar2_jax.rl.memory_plan import MemoryPlanError, plan_for_launch
    from rstar2_jax.rl.plan import SyncPlanError, describe_fields, describe_plan, sync_refusal
    from rstar2_jax.rl.run_dir import RunDirectory
    from rstar2_jax.rl.step_metrics import format_results
    from rstar2_jax.rl.config import validate
    from rstar2_jax.rl.idle_watch import RunNotLearning
    from rstar2_jax.rl.trainer import run

    cfg = _CONFIG.value
    if cfg is None:
        raise app.UsageError("--config is required, e.g. --config=experiments/tiny_arith.py")
    if _STAGE.value:  # then the same checks as the file's stages (validate below)
        from rstar2_jax.rl.stage_flags import apply_stage_flags
        cfg.stages = apply_stage_flags(list(cfg.stages), _STAGE.value)
    if _HELPCONFIG.value:
        from rstar2_jax.rl.config import RunConfig
        parsed, _ = RunConfig.parse(cfg.to_dict())
        print(describe_fields(parsed or RunConfig()))
        return
    if _PLAN_MODEL.value is not None:
        if not _PLAN.value:
            raise app.UsageError("--plan_model is for --plan (a run trains the weights model.path names)")
        cfg.model.path = plan_model_dir(_PLAN_MODEL.value)
    # Checked before anything starts (jax.distributed included), against the process count
    # given (--num_processes) or one; RLRun checks again against the job's real count.
    run_cfg = validate(cfg, processes_count=_NUM_PROCESSES.value or 1)
    for warning in run_cfg.warnings():
        print(f"warning: {warning}", file=sys.stderr)
    if _PLAN.value:
        run_cfg = planned_device(run_cfg)
        print(describe_plan(run_cfg, _WORKDIR.value, _CONFIG_MISMATCH.value))
        memory = plan_for_launch(run_cfg, _NUM_PROCESSES.value or 1)
        print(memory.table())
        if memory.refusal():
            raise MemoryPlanError(memory.refusal())
        if refusal := sync_refusal(run_cfg):
            raise SyncPlanError(refusal)
        return
    # every process refuses a mismatching run directory here, before the job starts
    RunDirectory(_WORKDIR.value, create=False).check_config(run_cfg.to_dict(), _CONFIG_MISMATCH.value)
    import jax
    if run_cfg.distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; before any backend starts
        jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    # every process makes the same plan, so all refuse together
    refusal = plan_for_launch(run_cfg, jax.process_count()).refusal()  # before any weight is loaded
    if refusal:
        raise MemoryPlanError(refusal)
    if refusal := sync_refusal(run_cfg):
        raise SyncPlanError(refusal)
    try:
        results = run(cfg, _WORKDIR.value, config_mismatch=_CONFIG_MISMATCH.value)
    except KeyboardInterrupt:
        interrupted(_WORKDIR.value)
    except RunNotLearning as e:  # rl.idle.stop_after: the cause, no traceback
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except BaseException:
        if run_cfg.distributed:
            stop_job()
        raise
    print("\n" + format_results(results))
    workdir = os.path.abspath(_WORKDIR.value)
    print(f"\nresults: {workdir}/results.json, metrics.jsonl, traces/ (every rollout), checkpoints/\n"
          f"next: python -m rstar2_jax.evaluate --checkpoint {workdir} --benchmarks aime24,math500 (held-out "
          f"benchmarks); RSTAR2_RUN={workdir} make notebook (the traces); python -m rstar2_jax.chat "
          f"--checkpoint {workdir} (the policy, turn by turn)")


def interrupted(workdir: str):
    """Ctrl-C: one line saying what is kept and how to go on, no traceback, exit status 130."""
    from rstar2_jax.core.checkpoints import RunCheckpoints
    ckpts = RunCheckpoints(os.path.join(workdir, "checkpoints"))
    try:
        latest = ckpts.latest_step()
    finally:
        ckpts.close()
    kept = (f"its checkpoint after {latest} RL step(s) (the steps since run again; the rollouts that had "
            "finished are kept and reused)" if latest is not None else "no checkpoint yet (it starts over)")
    print(f"\ninterrupted: {workdir} keeps {kept}; the same command resumes it", file=sys.stderr)
    raise SystemExit(130)


def plan_model_dir(spec: str) -> str:
    """A directory holding only the config.json of `spec` (models/shapes.plan_architecture): what
    model.path needs for a plan, which reads the architecture and never the weights."""
    import atexit
    import json
    import shutil
    import tempfile

    from rstar2_jax.models.shapes import plan_architecture
    try:
        arch = plan_architecture(spec)
    except ValueError as e:
        from absl import app
        raise app.UsageError(str(e)) from None
    out = tempfile.mkdtemp(prefix="rstar2-plan-model-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # a plan leaves nothing behind
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(arch.to_hf_dict(), f)
    print(f"planning for {spec} ({arch.num_layers} layers, hidden {arch.hidden_size}): its config.json alone")
    return out


def planned_device(run_cfg):
    """The run config a plan is checked against: where no device memory is known (a login node's
    CPU, no mesh.device_memory_gb or mesh.device_kind) an H100's, said so, rather than a plan
    nothing bounds (its auto token budget grew to thousands of GiB of activations)."""
    import dataclasses

    from rstar2_jax.rl.memory_plan import device_capacity
    if device_capacity(run_cfg) is not None:
        return run_cfg
    print("no device memory known here: planned for an H100 (76 GiB usable); mesh.device_kind=h200|mi300x or "
          "mesh.device_memory_gb=N for another device")
    return dataclasses.replace(run_cfg, mesh=dataclasses.replace(run_cfg.mesh, device_kind="h100"))


def stop_job():
    """Leave a multi-process job at once after an error (e.g. a collective failed because another
    process died): print it and exit 1. A normal exit would first wait in jax.distributed's
    shutdown barrier for every process, which a dead one never reaches: minutes, then an abort.
    The job resumes from its last checkpoint."""
    import os
    import traceback

    import jax
    if jax.process_count() > 1:
        traceback.print_exc()
        print(f"process {jax.process_index()} of {jax.process_count()} stopped: the job resumes from its last "
              "checkpoint when every process is started again", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    from rstar2_jax.models.hub import ModelNotFound
    from rstar2_jax.rl.memory_plan import MemoryPlanError
    from rstar2_jax.rl.plan import SyncPlanError
    from rstar2_jax.rl.config import RunConfig
    from rstar2_jax.rl.run_dir import ConfigMismatchError
    cli.run(main, config_flag=_CONFIG, config_type=RunConfig,
            expected=(ConfigMismatchError, MemoryPlanError, SyncPlanError, ModelNotFound))
