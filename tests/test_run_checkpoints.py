"""A run's checkpoints read back quietly (issue 80 item 6): a resume, chat and evaluate open the
run with a fresh manager, which logged four 'Item ... could not be restored' warnings a read."""

import jax.numpy as jnp

from rstar2_jax.core.checkpoints import RunCheckpoints


def test_a_fresh_manager_restores_every_item_without_a_warning(tmp_path, caplog):
    state, reference = {"w": jnp.arange(3.0)}, {"w": jnp.ones(3)}
    base = {"model": "tiny"}
    saver = RunCheckpoints(str(tmp_path / "ck"), base=base)
    saver.save(4, state, {"rl_step": 4}, reference=reference)
    saver.close()
    with caplog.at_level("WARNING"):
        reader = RunCheckpoints(str(tmp_path / "ck"), base=base)
        got, meta = reader.restore(reader.latest_step(), state)
        ref = reader.restore_reference(4, reference)
        reader.close()
    assert meta == {"rl_step": 4} and got["w"].tolist() == [0.0, 1.0, 2.0] and ref["w"].tolist() == [1.0] * 3
    noisy = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert noisy == []
