"""Stages from the command line (issue 80 item 3): train --stage=I.FIELD=VALUE."""

import os
import subprocess
import sys

import pytest

from experiments import tiny_arith
from rstar2_jax.core.config_types import ConfigValueError
from rstar2_jax.rl.stage_flags import apply_stage_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_stage_s_settings_every_stage_s_and_a_new_stage():
    stages = list(tiny_arith.get_config().stages)
    out = apply_stage_flags(stages, ["0.max_response_tokens=300", "max_turns=3", "1.start_step=5",
                                     "1.max_response_tokens=380", "1.reset_optimizer=true"])
    assert len(out) == 2 and out[0]["max_response_tokens"] == 300 and out[1]["max_response_tokens"] == 380
    assert [s["max_turns"] for s in out] == [3, 3] and out[1]["start_step"] == 5 and out[1]["reset_optimizer"] is True
    assert {k: v for k, v in out[1].items() if k not in ("start_step", "max_response_tokens", "reset_optimizer")} == {
        k: v for k, v in out[0].items() if k not in ("start_step", "max_response_tokens", "reset_optimizer")}
    assert stages[0]["max_response_tokens"] != 300  # the file's list is not changed in place


def test_every_bad_stage_flag_at_once():
    stages = list(tiny_arith.get_config().stages)
    with pytest.raises(ConfigValueError) as e:
        apply_stage_flags(stages, ["0.max_tokens=3", "5.max_turns=2", "0.max_turns=many", "max_turns", "1.max_turns=2"])
    text = str(e.value)
    assert "--stage=0.max_tokens=3: stages have no field 'max_tokens'" in text
    assert "--stage=5.max_turns=2: there are stages 0-0" in text
    assert "--stage=0.max_turns=many: invalid literal" in text
    assert "--stage=max_turns: expected [INDEX.]FIELD=VALUE" in text
    assert "--stage=1.start_step=N is needed: stage 1 is new" in text


def test_train_checks_stage_flags_as_it_checks_the_file():
    """Through the CLI: the same bounds as the experiment file's stages (max_len), with --plan."""
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.train", "--config=experiments/tiny_arith.py",
                           "--workdir=/tmp/never-created-stage-flags", "--plan", "--stage=0.max_response_tokens=100000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "stages[0].max_response_tokens: must be in (0, rollout.max_len=" in proc.stderr, \
        proc.stderr[-2000:]
    assert not os.path.exists("/tmp/never-created-stage-flags")
