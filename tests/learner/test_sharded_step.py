"""The train step on 8 fake CPU devices equals the single-device step."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.learner.sharded_step_main"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("index", [0, 1], ids=["fsdp=8", "data=2,fsdp=2,tensor=2"])
def test_sharded_update_equals_unsharded(results, index):
    r = results[index]
    # Adam divides by sqrt(v): for near-zero gradients, reduction-order noise moves a weight by up
    # to ~lr; a wrong sharding moves many weights by ~lr. lr = 1e-3 here.
    assert r["max_param_diff"] < 5e-5, r
    assert abs(r["grad_norm"] - r["ref_grad_norm"]) < 1e-5 * r["ref_grad_norm"], r
    assert "fsdp" in r["spec"], r  # parameters really are sharded
