"""What per-owner accounting (rollout/engines/accounting.py) adds to each JaxEngine decode step.

    python -m experiments.benchmarks.engine_accounting [--slots 32] [--owners 3] [--steps 20000]

Times OwnerLedger.charge_decode for a full batch of `slots` requests spread over `owners` RL
steps, the one call the engine makes per decode step; compare with the step itself
(BENCHMARKS.md, "JaxEngine on the CPU": 3.4 ms at 16 slots for the tiny model).
"""

from __future__ import annotations

import argparse
import time

from rstar2_jax.rollout.engines.accounting import OwnerLedger


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--owners", type=int, default=3)
    p.add_argument("--steps", type=int, default=20000)
    args = p.parse_args(argv)
    ledger = OwnerLedger(args.slots)
    owners = [("rollout", i % args.owners) for i in range(args.slots)]
    start = time.perf_counter()
    for _ in range(args.steps):
        ledger.charge_decode(owners, 0.0, 0.001, args.slots)
    per_step = (time.perf_counter() - start) / args.steps
    print(f"charge_decode, {args.slots} slots over {args.owners} owners: {per_step * 1e6:.1f} us per decode step")


if __name__ == "__main__":
    main()
