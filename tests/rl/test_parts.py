"""Issue 71: a part is its module and one import, for every kind. A module written outside the
repository registers a toy engine, sandbox backend, task, advantage estimator, RoC mode, policy
loss and off-policy correction; one import of it, and one RL step runs with all of them chosen by
name (tests/rl/parts_main.py, in a process of its own: the registries are global). The toy loss
and sandbox have settings of their own, set in the config like a built-in part's
(rl.loss.toy_loss.scale, sandbox.toy_sandbox.workers), though they registered after the
sections were built."""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOY_PARTS = textwrap.dedent('''
    """Toy parts, each the registry's own API and nothing else of the repository changed."""
    import collections
    import dataclasses

    import numpy as np

    import sandbox
    from rstar2_jax.core.config_types import Section, setting
    from rstar2_jax.algo.advantages import register_advantage
    from rstar2_jax.algo.corrections.base import Correction, register_correction
    from rstar2_jax.algo.losses.base import LossTerms, register_loss
    from rstar2_jax.algo.roc import PaperSelection, paper_selection
    from rstar2_jax.data.tasks import TASKS, register_task
    from rstar2_jax.core.part_sections import NoSettings
    from rstar2_jax.rl.roc_modes import ROC_MODES, RoCMode, paper_penalties
    from rstar2_jax.rollout.engines.engine_kind import ENGINES
    from rstar2_jax.rollout.sandbox_backends.base import SANDBOXES, SandboxBackend

    CALLS = collections.Counter()


    def _jax_engine(cfg, model, tokenizer, seed):  # the embedded engine, each request counted
        engine = ENGINES["jax"].build(cfg, model, tokenizer, seed)
        generate = engine.generate

        async def counted(*args, **kwargs):
            CALLS["engine.generate"] += 1
            return await generate(*args, **kwargs)
        engine.generate = counted
        return engine


    ENGINES.register("toy_engine", dataclasses.replace(ENGINES["jax"], build=_jax_engine))


    class _CountingSandbox(sandbox.LocalSandbox):
        async def run(self, *args, **kwargs):
            CALLS["sandbox.run"] += 1
            return await super().run(*args, **kwargs)


    @dataclasses.dataclass(frozen=True)
    class ToySandboxSettings(Section):
        workers: int = setting(1, "worker processes", min=1)


    def _sandbox(cfg):
        CALLS["sandbox.build"] += 1
        CALLS["sandbox.workers"] = cfg.settings("toy_sandbox").workers
        return _CountingSandbox(workers=cfg.settings("toy_sandbox").workers, isolation="strict")


    SANDBOXES.register("toy_sandbox", SandboxBackend(_sandbox, ToySandboxSettings))


    @register_task("toy_task", has_sft_data=True)
    def toy_task(data_cfg, seed):
        CALLS["task.build"] += 1
        return dataclasses.replace(TASKS["arith"].build(data_cfg, seed), name="toy_task")


    @register_advantage("toy_advantage")
    def toy_advantage(rewards, s=None):
        CALLS["advantage"] += 1
        r = np.asarray(rewards, np.float64)
        return (r - r.mean()).astype(np.float32)


    def _select(*args, **kwargs):
        CALLS["roc.select"] += 1
        return paper_selection(*args, **kwargs)


    ROC_MODES.register("toy_roc", RoCMode(_select, paper_penalties, PaperSelection))


    @dataclasses.dataclass(frozen=True)
    class ToyLossSettings(Section):
        scale: float = setting(1.0, "multiplies the loss", min=0.0)


    @register_loss("toy_loss", settings=ToyLossSettings, stats=())
    def toy_loss(inputs, s):
        CALLS["loss (traced)"] += 1
        CALLS["loss.scale"] = s.scale
        return LossTerms(-s.scale * inputs.token_advantages * inputs.logprobs, {})


    @register_correction("toy_correction", settings=NoSettings, level="token")
    def toy_correction(x, s):
        CALLS["correction (traced)"] += 1
        return Correction.weights(x.token_log_ratio() * 0 + 1)
''')


def test_one_rl_step_runs_with_a_toy_part_of_every_kind_from_one_import(tmp_path):
    (tmp_path / "toy_parts.py").write_text(TOY_PARTS)
    proc = subprocess.run([sys.executable, "-m", "tests.rl.parts_main", str(tmp_path), str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    calls = json.loads(proc.stdout.strip().splitlines()[-1])
    kinds = ("engine.generate", "sandbox.build", "task.build", "advantage", "roc.select", "loss (traced)",
             "correction (traced)")
    assert all(calls.get(k, 0) > 0 for k in kinds), calls
    assert (calls["loss.scale"], calls["sandbox.workers"]) == (3.0, 2), calls  # their own settings, as set
