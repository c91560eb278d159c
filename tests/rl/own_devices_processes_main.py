"""One process of a two-process job (tests/rl/test_own_devices.py launches two, 2 fake CPU devices
each, jax.distributed over loopback): the tiny recipe asynchronous (rl.max_staleness=1) with the
embedded engine sharing the process's devices (rollout.jax.devices=0) or on one of its own (=1).
Prints one JSON line: the global ids of the devices the learner's arrays span, of this process's
engine's, and the run's RL metrics.

    python -m tests.rl.own_devices_processes_main WORKDIR ENGINE_DEVICES --coordinator=H:P --num_processes=2 --process_id=I
"""

import asyncio
import json
import sys

import jax

import rstar2_jax.rl.trainer as trainer
from rstar2_jax.algo.advantages import ADVANTAGES, AdvantageSpec
from rstar2_jax.rl.trainer import RLRun
from tests.rl.test_async import alternating_signs, moving_config
from tests.rl.test_training import rl_lines

# the random policy solves nothing: advantages of alternating signs make every step's update move
# the weights, so the engine's reshard after it carries new ones (GRPO's would all be zero)
ADVANTAGES["test_alternating_signs"] = AdvantageSpec(alternating_signs)


def main(workdir: str, engine_devices: int, coordinator: str, num_processes: int, process_id: int):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)
    engines = []

    def keep(*args, **kwargs):  # the run's engine, to see where its arrays are after the run
        engines.append(make_engine(*args, **kwargs))
        return engines[-1]

    make_engine, trainer.make_engine = trainer.make_engine, keep
    cfg = moving_config(steps=2, max_staleness=1)  # the alternating advantages, every group kept
    cfg.sft.steps = 0  # RL from the random model: the placement is what is compared, not a warm start
    cfg.distributed = True
    cfg.rollout.jax.devices = engine_devices
    cfg.sandbox.local.workers = 1
    rl_run = RLRun(cfg, workdir)
    asyncio.run(rl_run.run())
    state = rl_run.learner.model_state()
    out = dict(process=jax.process_index(),
               learner_on=sorted({d.id for x in jax.tree.leaves(state) for d in x.sharding.device_set}),
               engine_on=sorted({d.id for x in jax.tree.leaves(engines[-1].state) for d in x.devices()}),
               engine_version=engines[-1].version,
               local=sorted(d.id for d in jax.local_devices()),
               metrics=rl_lines(workdir) if jax.process_index() == 0 else [])
    print(json.dumps(out, default=float), flush=True)


if __name__ == "__main__":
    flags = dict(a[2:].split("=", 1) for a in sys.argv[3:])
    main(sys.argv[1], int(sys.argv[2]), flags["coordinator"], int(flags["num_processes"]), int(flags["process_id"]))
