"""LoRA adapters on a real vLLM CPU server (--enable-lora, runtime loading): a sync moves only the
adapters, the server's log-probs under them match the learner's and the JaxEngine's, requests name
one version for their whole completion, old versions are unloaded, a failed sync keeps the last
adapter, and a restarted server gets the current adapter back."""

import asyncio
import json
import os
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax import models
from rstar2_jax.learner import Learner, LearnerSettings, make_batch
from rstar2_jax.models import lora
from rstar2_jax.rollout.engines import JaxEngine
from rstar2_jax.rollout.engines.vllm_engine.sync import adapters as adapter_sync
from rstar2_jax.rollout.engines.vllm_engine.engine import VLLMEngine
from rstar2_jax.rollout.engines.vllm_engine.server import ServerOptions, VLLMServer, free_port
from rstar2_jax.rollout.engines.sampling import SamplingParams
from tests.rollout.test_vllm_engine import VLLM_PYTHON, jax_logprobs, restarted_if_it_died

pytestmark = pytest.mark.slow  # a real vLLM CPU server


@pytest.fixture(scope="module")
def shared_lora_server(tiny_dir, tmp_path_factory):
    opts = ServerOptions(port=free_port(), dtype="float32", max_model_len=1024, cpu_kv_cache_gib=1, eager=True,
                         lora_rank=4)
    server = VLLMServer(tiny_dir, opts, python=VLLM_PYTHON,
                        log_path=os.path.join(str(tmp_path_factory.mktemp("vllm_lora")), "server.log"))
    server.start().wait_ready(timeout=600)
    yield server
    server.stop()


@pytest.fixture
def lora_server(shared_lora_server):
    yield from restarted_if_it_died(shared_lora_server)


def lora_learner(tiny_dir):
    model = lora.attach(models.load_pretrained(tiny_dir), lora.LoRAConfig(rank=4, alpha=8.0), seed=0)
    return Learner(model, LearnerSettings(lr=2e-2, warmup_steps=0))


def update(learner, seed):
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 256, 48).tolist() for _ in range(4)]
    learner.update(make_batch(rows, [[0] * 8 + [1] * 40] * 4, [[-5.0] * 48] * 4, [1.0, -1.0, 0.5, -0.5],
                              pad_multiple=16))


def served_names(server) -> set[str]:
    return {m["id"] for m in json.load(urllib.request.urlopen(server.url + "/v1/models"))["data"]}


def test_adapter_syncs_match_the_learner_and_the_jax_engine(lora_server, tiny_dir, tokenizer, monkeypatch):
    learner = lora_learner(tiny_dir)
    # no server restarts here: a dead engine fails the test in a minute, not the default ten
    engine = VLLMEngine(lora_server.url, learner.model(), restart_timeout=60)
    assert engine.adapters == lora.LoRAConfig(rank=4, alpha=8.0)
    prompt = tokenizer.encode("<|im_start|>user\nWhat is 12+34?<|im_end|>\n<|im_start|>assistant\n")
    full_bytes = sum(x.size * 4 for x in jax.tree.leaves(learner.model_state()))
    for version in (1, 2):
        update(learner, version)
        engine.update_weights(learner.model_state(), version)
        assert engine.probe_verdict() <= engine.probe_tolerance  # the deferred probe: served == learner
        assert engine.served_name == adapter_sync.adapter_name(version)
        assert engine.last_sync.ok and engine.last_sync.bytes < 0.25 * full_bytes
    policy = learner.model()
    ids = prompt + tokenizer.encode("46")
    np.testing.assert_allclose(engine.prompt_logprobs(ids), jax_logprobs(policy, ids)[1:], atol=1e-3)

    async def both():
        greedy = await engine.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0))
        async with JaxEngine(policy, tokenizer, slots=2, max_len=256) as jax_engine:
            reference = await jax_engine.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0))
        return greedy, reference
    greedy, reference = asyncio.run(both())
    assert greedy.token_ids == reference.token_ids and len(greedy.token_ids) == 32
    np.testing.assert_allclose(greedy.logprobs, reference.logprobs, atol=1e-3)
    assert (greedy.version_start, greedy.version_end) == (2, 2)  # one adapter sampled every token

    # vLLM reads an adapter's files at its load, not at every step that serves it (a load with
    # load_inplace would: then a step after the files went would kill the engine process)
    served_dir = engine.loaded_adapters[2]
    os.rename(served_dir, served_dir + ".away")
    try:
        again = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0)))
    finally:
        os.rename(served_dir + ".away", served_dir)
    assert again.token_ids == greedy.token_ids[:8]

    # a sync whose load fails keeps the last adapter (still loaded: nothing to roll back)
    real_load = adapter_sync.load_on_server
    monkeypatch.setattr(adapter_sync, "load_on_server", lambda e, d, v: (_ for _ in ()).throw(OSError("disk gone")))
    update(learner, 3)
    engine.update_weights(learner.model_state(), 3)
    assert not engine.last_sync.ok and "disk gone" in engine.last_sync.error and engine.sync_failures == 1
    assert engine.version == 2 and engine.served_name == adapter_sync.adapter_name(2)
    monkeypatch.setattr(adapter_sync, "load_on_server", real_load)
    for version in (3, 4, 5):
        engine.update_weights(learner.model_state(), version)
        engine.probe_verdict()
    # the KEEP newest versions stay loaded; older ones are unloaded and their files removed
    names = served_names(lora_server)
    assert {adapter_sync.adapter_name(v) for v in (3, 4, 5)} <= names
    assert not names & {adapter_sync.adapter_name(v) for v in (1, 2)}
    assert sorted(os.listdir(engine.sync_root)) == ["adapter_v3", "adapter_v4", "adapter_v5"]
    float32_bytes = engine.last_sync.bytes
    asyncio.run(engine.close())

    # adapters in the servers' dtype (rollout.vllm.export_dtype): the server takes bfloat16 files
    # and serves them; the sync moves about half the bytes (the config file is the rest)
    half = VLLMEngine(lora_server.url, learner.model(), restart_timeout=60, export_dtype=jnp.bfloat16,
                      probe_tolerance=5e-2)
    half.update_weights(learner.model_state(), 6)
    assert half.last_sync.ok and half.probe_verdict() <= 5e-2
    assert half.last_sync.bytes < 0.6 * float32_bytes
    asyncio.run(half.close())


def test_adapters_reach_a_server_through_its_fetcher_beside_a_files_engine(lora_server, tiny_dir, tmp_path):
    """sync=pull: the fetcher beside the server copies the two PEFT files from the trainer's export
    server, the server loads that copy; one sync to two engines (pull and files) lands on both."""
    from rstar2_jax.rollout.engines.vllm_engine.sync.push import push_to_servers
    from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import WeightFetcher
    learner = lora_learner(tiny_dir)
    update(learner, 11)
    fetcher = WeightFetcher(str(tmp_path / "pulled"))
    try:
        pulled = VLLMEngine(lora_server.url, learner.model(), sync="pull", fetch_url=fetcher.url)
        files = VLLMEngine(lora_server.url, learner.model())
        report = push_to_servers([pulled, files], learner.model_state(), 1)
        assert report.ok, report.error
        assert pulled.probe_verdict() <= pulled.probe_tolerance and files.probe_verdict() <= files.probe_tolerance
        assert pulled.loaded_adapters[1] == str(tmp_path / "pulled" / "v1")
        assert sorted(os.listdir(tmp_path / "pulled" / "v1"))[:2] == ["adapter", "adapter_config.json"]
        assert files.loaded_adapters[1].startswith(pulled.sync_root)  # the lead engine writes the one export
        for e in (pulled, files):
            asyncio.run(e.close())
    finally:
        fetcher.close()


def test_a_restarted_server_gets_the_current_adapter_back(lora_server, tiny_dir, tokenizer):
    learner = lora_learner(tiny_dir)
    update(learner, 7)
    engine = VLLMEngine(lora_server.url, learner.model(), restart_timeout=600)
    engine.update_weights(learner.model_state(), 1)
    engine.probe_verdict()
    lora_server.restart()
    assert adapter_sync.adapter_name(1) not in served_names(lora_server)
    prompt = tokenizer.encode("<|im_start|>user\nWhat is 5*7?<|im_end|>\n<|im_start|>assistant\n")

    async def after_restart():
        return await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    out = asyncio.run(after_restart())
    assert len(out.token_ids) == 8 and engine.reloads_after_restart == 1
    np.testing.assert_allclose(engine.prompt_logprobs(prompt), jax_logprobs(learner.model(), prompt)[1:], atol=1e-3)
    asyncio.run(engine.close())


def test_two_trainer_processes_train_adapters_and_only_the_first_loads_them(lora_server, tiny_dir, tmp_path):
    """A LoRA run over two jax.distributed trainer processes sampling from one LoRA server: the
    adapters are split over the processes' devices (fsdp=2) and both gather them for each sync in
    the same order; process 0 alone loads each version (one load per version, not one per
    process), and both sample with the adapter of the version they stamp (the sampler's log-probs
    are the learner's, where the base's are not). At the end process 0 unloads what it loaded
    before its files go, and the server stays up."""
    from rstar2_jax.core.checkpoints import load_run_policy
    from tests.rl.launch import launch
    from tests.rl.test_lora_run import checkpoint_state_bytes
    from tests.rl.test_multiprocess import CONFIG, train_args
    from tests.rl.test_training import rl_lines

    config = tmp_path / "moving_tiny_arith.py"
    config.write_text(CONFIG)
    work = tmp_path / "run"
    loads_before = open(lora_server.log_path).read().count("POST /v1/load_lora_adapter")
    results = launch(train_args(str(config), work, 2) + [
        f"--config.model.path={tiny_dir}", "--config.model.lora.rank=4", "--config.model.lora.alpha=8.0",
        "--config.sft.lr=1e-2", "--config.sft.warmup_steps=0", "--config.rl.lr=1e-2", "--config.rollout.engine=vllm",
        f"--config.rollout.vllm.urls={lora_server.url}"], work, n=2)
    assert all(status == 0 for status, _, _ in results), [err[-3000:] for _, _, err in results]
    lines = rl_lines(work)
    assert [l["step"] for l in lines] == [0, 1] and all(l["kept_rollouts"] > 0 for l in lines)
    assert [l["sync/failures"] for l in lines] == [0, 0] and all(l["staleness/max"] == 0 for l in lines)
    loads = open(lora_server.log_path).read().count("POST /v1/load_lora_adapter") - loads_before
    assert loads == 1 + 2  # after SFT, then one per RL step: loaded by process 0 alone
    assert not served_names(lora_server) & {adapter_sync.adapter_name(v) for v in (0, 1, 2)}  # unloaded at the end
    base = models.load_pretrained(tiny_dir)
    probe = list(range(5, 69))
    engine = VLLMEngine(lora_server.url, base)  # and the server still serves the base
    np.testing.assert_allclose(engine.prompt_logprobs(probe), jax_logprobs(base, probe)[1:], atol=1e-3)
    asyncio.run(engine.close())

    # every token of both processes was sampled with the adapters the learner had at its version:
    # the sampler's log-probs equal the learner's to float rounding, while the adapters of every
    # version (as checkpointed: after SFT, after each RL step) move the log-probs well beyond that
    for step in (0, 1):
        moved = np.abs(jax_logprobs(load_run_policy(str(work), step), probe) - jax_logprobs(base, probe)).max()
        assert moved > 1e-2 and lines[step]["logprob_mismatch_max"] < 1e-4, (step, moved)
    assert checkpoint_state_bytes(work, 2) < 0.5 * os.path.getsize(os.path.join(tiny_dir, "model.safetensors"))
