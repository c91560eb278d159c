"""Run in a subprocess with 8 fake CPU devices (tests/fake_devices.py).

The tiny recipe, asynchronous (rl.max_staleness=1), twice from the same seed: the embedded engine
sharing the learner's 8 devices, and on 4 devices of its own (rollout.jax.devices=4) with the
learner on the other 4. Prints one JSON line: where each side's arrays live, each run's metrics
and its first step's rollouts."""

import asyncio
import json
import sys
import tempfile

import jax

import rstar2_jax.rl.trainer as trainer
from rstar2_jax.algo.advantages import ADVANTAGES, AdvantageSpec
from rstar2_jax.rl.trainer import RLRun
from rstar2_jax.traces import read_traces
from tests.rl.test_async import alternating_signs, moving_config
from tests.rl.test_training import rl_lines

# the random policy solves nothing: advantages of alternating signs make every step's update move
# the weights, so the engine's reshard after it carries new ones (GRPO's would all be zero)
ADVANTAGES["test_alternating_signs"] = AdvantageSpec(alternating_signs)


def run(engine_devices: int, workdir: str) -> dict:
    engines = []

    def keep(*args, **kwargs):  # the run's engine, to see where its arrays are after the run
        engines.append(make_engine(*args, **kwargs))
        return engines[-1]

    make_engine, trainer.make_engine = trainer.make_engine, keep
    try:
        cfg = moving_config(steps=2, max_staleness=1)  # the alternating advantages, every group kept
        cfg.sft.steps = 0  # RL from the random model: the placement is what is compared, not a warm start
        cfg.rollout.jax.devices = engine_devices
        rl_run = RLRun(cfg, workdir)
        asyncio.run(rl_run.run())
    finally:
        trainer.make_engine = make_engine
    engine = engines[-1]
    traces = read_traces(f"{workdir}/traces", columns=["step", "token_ids"])
    first = traces[traces["step"] == 0]
    return dict(learner_on=sorted({d.id for x in jax.tree.leaves(rl_run.learner.model_state()) for d in x.devices()}),
                engine_on=sorted({d.id for x in jax.tree.leaves(engine.state) for d in x.devices()}),
                engine_version=engine.version,
                metrics=rl_lines(workdir), step0=sorted(map(list, first["token_ids"])))


def main():
    assert jax.device_count() == 8, jax.devices()
    out = {name: run(n, tempfile.mkdtemp()) for name, n in (("shared", 0), ("own", 4))}
    print(json.dumps(out, default=float))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
