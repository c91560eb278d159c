"""VLLMEngine against real vLLM CPU servers (.venv-vllm, installed by `make test`) serving the
tiny model: parity with the JAX model, weight sync after a learner update, prefix-cache hits
counted in /metrics, the tied-embedding trap, a multi-turn rollout with real sandbox calls, a server
killed mid-batch, the scheduler over a vLLM server and a JaxEngine, a short training run, and the evaluate CLI on a server.

Each server takes about half a minute to start on two cores (eager); the module shares one where it can.
"""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sandbox
from rstar2_jax import models
from rstar2_jax.data import arith
from rstar2_jax.learner import Learner, LearnerSettings, make_batch
from rstar2_jax.learner.sft import SFTTrainer
from rstar2_jax.models import tiny
from rstar2_jax.rewards import answer_reward
from rstar2_jax.rollout import AgentConfig, run_agent, tiny_format
from rstar2_jax.rollout.engines import JaxEngine
from rstar2_jax.rollout.engines.vllm_engine.sync import background as background_sync
from rstar2_jax.rollout.engines.vllm_engine.sync import probe as vllm_probe
from rstar2_jax.rollout.engines.base import PromptTooLong, WeightSyncFailed
from rstar2_jax.rollout.engines.vllm_engine.client import ServerRequestError
from rstar2_jax.rollout.engines.vllm_engine.engine import VLLMEngine
from rstar2_jax.rollout.engines.vllm_engine.sync.probe import WeightSyncError
from rstar2_jax.rollout.engines.vllm_engine.server import ServerOptions, VLLMServer, free_port
from rstar2_jax.rollout.engines.sampling import SamplingParams
from rstar2_jax.rollout.engines.scheduler import Scheduler
from rstar2_jax.traces import read_traces

pytestmark = pytest.mark.slow  # real vLLM CPU servers (~60 s to start each)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")


def start_server(model_dir, log_dir, name="server", extra_args=()) -> VLLMServer:
    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(f"{VLLM_PYTHON} is missing: `make test` installs it (make venv-vllm)")
    server = VLLMServer(str(model_dir), ServerOptions(port=free_port(), dtype="float32", max_model_len=1024,
                                                      cpu_kv_cache_gib=1, eager=True, extra_args=extra_args),
                        python=VLLM_PYTHON, log_path=os.path.join(str(log_dir), f"{name}.log"))
    return server.start().wait_ready(timeout=600)


# The module's server also takes NCCL weight-transfer requests (as a GPU job's would be started),
# so the NCCL protocol test needs no server of its own (a start is ~40 s here); the files and
# pull syncs every other test uses work on it all the same.
NCCL_BACKEND = ("--weight-transfer-config", '{"backend":"nccl"}')


@pytest.fixture(scope="module")  # stopped when the module is done: an idle server holds ~1.7 GB and some CPU
def shared_vllm_server(tiny_dir, tmp_path_factory):
    server = start_server(tiny_dir, tmp_path_factory.mktemp("vllm"), extra_args=NCCL_BACKEND)
    yield server
    server.stop()


ENGINE_DIED = "EngineCore encountered a fatal error"  # vLLM's log line when its engine process fails


def restarted_if_it_died(server: VLLMServer):
    """A per-test fixture's body over a module's server: a test that kills the server's engine
    prints why (the log's traceback from then: CI shows only the clients' 500s), and the next
    test gets a restarted server, so one death fails one test, not the rest of the module."""
    with open(server.log_path, "rb") as f:
        start = f.seek(0, os.SEEK_END)
    yield server
    with open(server.log_path, errors="replace") as f:
        f.seek(start)
        during = f.read()
    if ENGINE_DIED in during or server.proc.poll() is not None:
        why = during[during.find(ENGINE_DIED):][:6000] if ENGINE_DIED in during else during[-6000:]
        print(f"the vLLM server died during this test; its log from then:\n{why}")
        server.restart()


@pytest.fixture
def vllm_server(shared_vllm_server):
    yield from restarted_if_it_died(shared_vllm_server)


def perturbed(model, scale=0.05, seed=0):
    """The model with every matrix nudged: a stand-in for 'weights the server has not seen'."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 2 else x for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def served_version(url: str) -> str:
    """The weight version a server reports (what /update_weight_version last set)."""
    return json.load(urllib.request.urlopen(url + "/weight_info"))["weight_version"]


def jax_logprobs(model, ids, temperature=1.0):
    return np.asarray(models.token_logprobs(model, jnp.asarray([ids], jnp.int32), temperature=temperature))[0]


def test_generation_matches_the_jax_model(vllm_server, tiny_model, tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nWhat is 12+34?<|im_end|>\n<|im_start|>assistant\n")

    async def main():
        engine = VLLMEngine(vllm_server.url, tiny_model)
        engine.update_weights(tiny_model)  # whatever an earlier test synced, serve the fixture's model
        greedy = await engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0))
        sampled = await engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0.7, seed=11))
        with pytest.raises(PromptTooLong, match="1025 tokens"):  # the server's max_model_len is 1024
            await engine.generate([5] * 1025, SamplingParams(max_tokens=4))
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=256) as jax_engine:
            reference = await jax_engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0))
        await engine.close()
        return greedy, sampled, reference

    greedy, sampled, reference = asyncio.run(main())
    assert greedy.token_ids == reference.token_ids and len(greedy.token_ids) == 40
    np.testing.assert_allclose(greedy.logprobs, reference.logprobs, atol=1e-3)
    # sampled tokens: vLLM's log-probs are the learner's at the sampling temperature
    recomputed = jax_logprobs(tiny_model, prompt + sampled.token_ids, temperature=0.7)[len(prompt):]
    np.testing.assert_allclose(sampled.logprobs, recomputed, atol=1e-3)
    assert sampled.finish_reason in ("length", "eos", "stop")


def test_sync_after_a_learner_update_matches_the_updated_model(vllm_server, tiny_model, tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nWhat is 5*7?<|im_end|>\n<|im_start|>assistant\n35")
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 256, 48).tolist() for _ in range(4)]
    batch = make_batch(rows, [[0] * 8 + [1] * 40] * 4, [[-5.0] * 48] * 4, [1.0, -1.0, 0.5, -0.5], pad_multiple=16)
    learner = Learner(tiny_model, LearnerSettings(lr=1e-2, warmup_steps=0))
    engine = VLLMEngine(vllm_server.url, tiny_model)
    engine.update_weights(learner.model_state(), learner.version)
    before = np.asarray(engine.prompt_logprobs(ids))
    learner.update(batch)
    engine.update_weights(learner.model_state(), learner.version)
    after = np.asarray(engine.prompt_logprobs(ids))
    updated = jax_logprobs(learner.model(), ids)[1:]
    np.testing.assert_allclose(after, updated, atol=1e-3)
    assert np.max(np.abs(after - before)) > 1e-2  # the update moved the served model
    assert served_version(vllm_server.url) == str(learner.version) == str(engine.version)
    asyncio.run(engine.close())


# A trainer's engine, synced once, then waiting: what `scancel` finds.
SYNCED_AND_WAITING = """
import sys, time
from rstar2_jax import models
from rstar2_jax.rollout.engines.vllm_engine.engine import VLLMEngine
url, model_dir, sync_dir, previous = sys.argv[1:]
if previous == "handler":  # a handler that was there first (absl, serve.py) still runs
    import signal
    signal.signal(signal.SIGTERM, lambda *_: (print("previous handler", flush=True), sys.exit(3)))
model = models.load_pretrained(model_dir)
engine = VLLMEngine(url, model, sync_dir=sync_dir)
engine.update_weights(model, 1)
print(engine.sync_root, flush=True)
if previous == "exit":  # told to, the process ends without closing the engine
    sys.stdin.readline()
else:  # short sleeps, as a trainer's main thread runs Python between calls: a SIGTERM the kernel
    # gives another thread (JAX's, the file server's) only runs its Python handler when the main
    # thread next runs bytecode, and one sleep(600) would hold it that long
    while True:
        time.sleep(0.1)
"""


@pytest.mark.parametrize("previous", ["default", "handler", "exit"])
def test_sigterm_or_exit_frees_the_trainer_s_exports(vllm_server, tiny_dir, tmp_path, previous):
    """SIGTERM (scancel, a job's time limit) ends Python without its `finally` blocks: the
    engine's two export slots (memory, in /dev/shm) used to stay behind. Now they are deleted,
    and the process still ends as SIGTERM (or the handler it had before) would end it; a process
    that exits without closing its engine deletes them too ("exit")."""
    import signal
    proc = subprocess.Popen([sys.executable, "-c", SYNCED_AND_WAITING, vllm_server.url, str(tiny_dir),
                             str(tmp_path / "sync"), previous], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        root = proc.stdout.readline().strip()
        assert root and os.listdir(root), proc.stderr.read()[-2000:] if proc.poll() is not None else root
        if previous != "exit":
            proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate("\n", timeout=60)
    finally:
        proc.kill()
    assert not os.path.exists(root)
    if previous == "exit":
        assert proc.returncode == 0
    elif previous == "default":
        assert proc.returncode == -signal.SIGTERM
    else:
        assert proc.returncode == 3 and "previous handler" in rest


@pytest.mark.parametrize("swap", ["staged", "streamed"])
def test_a_sync_in_buckets_lands_and_one_that_fails_part_way_leaves_the_old_weights(vllm_server, tiny_model,
                                                                                      tokenizer, monkeypatch, swap):
    """One bucket per decoder layer, either all written before the server stops for one reload
    of the whole export (staged: it generated through the export) or each reloaded while the
    next is written (streamed): the sync lands (the log-prob probe passes). A sync whose third
    bucket the server cannot read (its file cut short after it is written: vLLM's own reload
    fails) is undone: the server answers with the previous weights and version, the failure is
    counted, and the next sync lands."""
    ids = tokenizer.encode("<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n42")
    engine = VLLMEngine(vllm_server.url, tiny_model, bucket_bytes=1, reload=swap, probe="wait")
    first, second = perturbed(tiny_model, seed=11), perturbed(tiny_model, seed=12)
    engine.update_weights(first, 21)
    assert engine.last_sync.ok and engine.last_sync.buckets == len(tiny_model.layers) + 1 >= 3
    if swap == "staged":  # the server stopped only once every bucket was written
        assert engine.last_sync.paused_from_s >= engine.last_sync.export_s > 0
    served_first = np.asarray(engine.prompt_logprobs(ids))
    np.testing.assert_allclose(served_first, jax_logprobs(first, ids)[1:], atol=1e-3)

    write = engine.slots.write

    def write_then_cut(slot, bucket, arrays):
        part = write(slot, bucket, arrays)
        if bucket.index == 2:
            os.truncate(os.path.join(slot, bucket.file_name), 64)
        return part

    monkeypatch.setattr(engine.slots, "write", write_then_cut)
    engine.update_weights(second, 22)
    assert not engine.last_sync.ok and engine.sync_failures == 1 and engine.version == 21, engine.last_sync
    served = served_version(vllm_server.url)
    assert served == "21"
    np.testing.assert_allclose(engine.prompt_logprobs(ids), served_first, atol=1e-6)  # buckets 0 and 1 undone
    monkeypatch.undo()
    engine.update_weights(second, 22)
    assert engine.last_sync.ok and engine.version == 22
    np.testing.assert_allclose(engine.prompt_logprobs(ids), jax_logprobs(second, ids)[1:], atol=1e-3)
    asyncio.run(engine.close())


def test_a_background_sync_returns_at_the_export_and_lands_behind_the_caller_one_at_a_time(
        vllm_server, tiny_model, tokenizer, monkeypatch):
    """sync_wait=export: update_weights returns once the export is written, while the server's
    reload is held back and before the probe's reference (the learner's log-probs of the probe
    tokens) has a value: it is dispatched, and only the probe behind the sync reads it. The
    learner's arrays are deleted right then (as the next update donates them) and the sync still
    lands: the server then serves those weights and the engine's version moves only when it
    does. A second sync started meanwhile waits for the first to land before it exports (one sync
    at a time), then lands in turn."""
    ids = tokenizer.encode("<|im_start|>user\nWhat is 3*9?<|im_end|>\n<|im_start|>assistant\n27")
    engine = VLLMEngine(vllm_server.url, tiny_model, sync_wait="export")
    assert engine.lands_in_background
    release = threading.Event()
    reloads: list[str] = []
    reload_part = engine.reload_part

    def held_reload(bucket_dir):
        release.wait(60)
        reloads.append(bucket_dir)
        reload_part(bucket_dir)

    monkeypatch.setattr(engine, "reload_part", held_reload)
    reads: list[str] = []  # the threads that read a probe reference's value
    probe_jit = vllm_probe._probe_jit

    class Pending:  # a result still being computed, as JAX's asynchronous dispatch hands it back
        def __init__(self, array):
            self.array = array

        def __getattr__(self, name):  # its sharding, its devices: the array's
            return getattr(self.array, name)

        def __getitem__(self, index):
            return Pending(self.array[index])

        def __array__(self, dtype=None, copy=None):  # reading its value waits for it: until release
            reads.append(threading.current_thread().name)
            if reads[-1].startswith("vllm-probe"):  # (elsewhere: recorded, not held, to fail at once)
                release.wait(60)
            return np.asarray(self.array, dtype)

    monkeypatch.setattr(vllm_probe, "_probe_jit", lambda *args: Pending(probe_jit(*args)))
    graphdef, state = nnx.split(perturbed(tiny_model, seed=31))
    first = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))  # arrays of its own (perturbed shares the vectors)
    second = perturbed(tiny_model, seed=32)
    expected = [jax_logprobs(m, ids)[1:] for m in (first, second)]
    engine.update_weights(first, 41)
    assert engine.version == 0 and reloads == [] and served_version(vllm_server.url) != "41"  # still landing
    assert reads == []  # nor did the sync wait for the probe's reference
    for leaf in jax.tree.leaves(nnx.state(first)):
        leaf.delete()  # the next update donates them: the landing must not read them again
    started = threading.Thread(target=engine.update_weights, args=(second, 42))
    started.start()
    started.join(1.0)
    assert started.is_alive() and engine.landing.version == 41 and not engine.landing.future.done()  # v42 waits
    release.set()
    started.join(60)
    assert not started.is_alive() and len(reloads) >= 1
    asyncio.run(engine.weights_at_least(42))
    assert engine.version == 42 and served_version(vllm_server.url) == "42" and engine.last_sync.ok
    assert [r.version for r in background_sync.settle([engine])] == [42]
    assert engine.probe_verdict() < 1e-3  # v42's probe, on its reference
    assert reads and all(name.startswith("vllm-probe") for name in reads)  # only the probes read them
    np.testing.assert_allclose(engine.prompt_logprobs(ids), expected[1], atol=1e-3)
    asyncio.run(engine.close())


def test_a_failed_background_sync_is_made_again_from_its_export_and_a_second_failure_stops_the_run(
        vllm_server, tiny_model, tokenizer, monkeypatch):
    """A background sync whose reload fails is rolled back and made once more from the export it
    already wrote (the arrays may be gone): it lands, and the next sync counts the failure. A
    sync whose reload fails twice leaves the server on its previous weights, the wait for its
    version raises WeightSyncFailed, and so does the next sync (two failures in a row)."""
    ids = tokenizer.encode("<|im_start|>user\nWhat is 4*8?<|im_end|>\n<|im_start|>assistant\n32")
    engine = VLLMEngine(vllm_server.url, tiny_model, sync_wait="export")
    failures = {"left": 0}
    reload_part = engine.reload_part

    def failing_reload(bucket_dir):
        if failures["left"] and bucket_dir != engine._synced_dir:  # the new export's reload; roll-backs go through
            failures["left"] -= 1
            raise ServerRequestError("reload refused by the test")
        reload_part(bucket_dir)

    monkeypatch.setattr(engine, "reload_part", failing_reload)
    first, second, third = (perturbed(tiny_model, seed=s) for s in (51, 52, 53))
    asyncio.run(engine.sync_weights(first, 1))
    asyncio.run(engine.weights_at_least(1))
    failures["left"] = 1
    asyncio.run(engine.sync_weights(second, 2))
    asyncio.run(engine.weights_at_least(2))  # the second attempt landed
    assert engine.version == 2 and served_version(vllm_server.url) == "2"
    np.testing.assert_allclose(engine.prompt_logprobs(ids), jax_logprobs(second, ids)[1:], atol=1e-3)
    assert [r.ok for r in background_sync.settle([engine])] == [False, True] and engine.failed_syncs == 0
    failures["left"] = 2
    asyncio.run(engine.sync_weights(third, 3))
    assert engine.failed_syncs == 1  # counted by the sync after it
    with pytest.raises(WeightSyncFailed, match="could not reach"):
        asyncio.run(engine.weights_at_least(3))
    assert engine.version == 2 and served_version(vllm_server.url) == "2"
    np.testing.assert_allclose(engine.prompt_logprobs(ids), jax_logprobs(second, ids)[1:], atol=1e-3)
    with pytest.raises(WeightSyncFailed, match="twice in a row"):
        asyncio.run(engine.sync_weights(first, 4))
    asyncio.run(engine.close())


def memorized_tool_model(tiny_model, tokenizer, fmt):
    """The tiny model fine-tuned on one clean trace until greedy decoding replays it: a tool call
    printing 123+456, then the answer from the tool's output."""
    problem = arith.Problem("p", "What is 123+456?", "579", "123+456")
    example = arith.tokenize_trace(tokenizer, fmt, problem, arith.sft_trace(problem, "clean", None))
    trainer = SFTTrainer(tiny_model, lr=3e-3, warmup_steps=5, pad_multiple=64)
    for _ in range(150):
        loss = trainer.step([example] * 4)["loss"]
    assert loss < 0.01, f"SFT did not memorize the trace (loss {loss:.3f})"
    return trainer.model(), problem


def test_multi_turn_rollout_with_real_sandbox_calls(vllm_server, tiny_model, tokenizer):
    fmt = tiny_format()
    model, problem = memorized_tool_model(tiny_model, tokenizer, fmt)
    cfg = AgentConfig(format=fmt, max_turns=4, max_response_tokens=300, temperature=0.0)

    async def main():
        async with sandbox.LocalSandbox(workers=2) as sb:
            engine = VLLMEngine(vllm_server.url, model)
            engine.update_weights(model)
            traj = await run_agent(engine, sb, tokenizer, problem.question, cfg)
            await engine.close()
            async with JaxEngine(model, tokenizer, slots=2, max_len=512) as jax_engine:
                reference = await run_agent(jax_engine, sb, tokenizer, problem.question, cfg)
        return traj, reference

    traj, reference = asyncio.run(main())
    assert len(traj.turns) == 2 and traj.finish_reason == "eos"
    tool = traj.turns[0].tools[0]
    assert tool.status == "ok" and tool.output.strip() == "579"  # executed in the sandbox
    assert answer_reward(traj.response_text, problem.answer) == 1.0
    assert traj.token_ids == reference.token_ids
    mask = np.asarray(traj.loss_mask, bool)
    np.testing.assert_allclose(np.asarray(traj.logprobs)[mask], np.asarray(reference.logprobs)[mask], atol=1e-3)


def test_a_trajectory_s_next_turn_hits_the_server_s_prefix_cache(vllm_server, tiny_model, tokenizer):
    """The hit rate the scheduler reports (`engine/prefix_cache_hit_rate`) is vLLM's own count:
    a turn whose prompt extends the previous turn's finds that prefix cached; a fresh prompt
    does not. Each request's own count (usage.prompt_tokens_details, charged to its owner: one RL
    step's share under asynchronous rollouts) is the same figure."""
    from rstar2_jax.rollout.engines.accounting import owned_by
    prompt = tokenizer.encode("<|im_start|>user\nAdd " + " + ".join(str(i) for i in range(60))
                              + "<|im_end|>\n<|im_start|>assistant\n")
    greedy = SamplingParams(max_tokens=16, temperature=0.0)

    async def main():
        engine = VLLMEngine(vllm_server.url, tiny_model)
        engine.update_weights(tiny_model)  # a sync also resets the server's prefix cache
        loads = [engine.load()]
        with owned_by("turn 1"):
            first = await engine.generate(prompt, greedy)
        loads.append(engine.load())
        extended = prompt + first.token_ids + tokenizer.encode("<tool_response>1830</tool_response>")
        with owned_by("turn 2"):
            await engine.generate(extended, greedy)
        loads.append(engine.load())
        owned = [engine.take_owned("turn 1"), engine.take_owned("turn 2")]
        await engine.close()
        return extended, loads, owned

    extended, loads, owned = asyncio.run(main())
    hits = [b.prefix_cache_hits - a.prefix_cache_hits for a, b in zip(loads, loads[1:])]
    queries = [b.prefix_cache_queries - a.prefix_cache_queries for a, b in zip(loads, loads[1:])]
    assert len(prompt) > 200 and hits[0] == 0 and queries[0] >= len(prompt) - 1
    # the second turn finds (nearly) all of the first prompt; what it misses is at most the
    # partly filled last block and the tokens sampled after it
    assert len(prompt) - 128 <= hits[1] <= queries[1] <= len(extended)
    assert [w.prefix_cache_hits for w in owned] == hits
    assert [w.prefix_cache_queries for w in owned] == [len(prompt), len(extended)]
    assert all(len(w.busy) == 1 for w in owned)


def test_tied_embedding_reload_is_detected(tmp_path):
    """The probe catches vLLM's reload keeping a tied model's old output layer: at once with
    probe="wait"; deferred (the default), the sync returns and the verdict stops the next request
    or the next sync."""
    model_dir = tiny.build_tiny_model(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    model = models.load_pretrained(model_dir)
    server = start_server(model_dir, tmp_path, "tied")
    try:
        engine = VLLMEngine(server.url, model, probe="wait")
        assert engine.check_sync(model) < 1e-3  # as launched: consistent
        with pytest.raises(WeightSyncError, match="ties its embeddings"):
            engine.update_weights(perturbed(model))
        deferred = VLLMEngine(server.url, model)
        deferred.update_weights(perturbed(model, seed=5), 7)  # returns before the probe's verdict
        assert deferred.last_sync.ok and deferred.pending_probe is not None
        deferred.pending_probe.exception(timeout=120)  # the verdict is in ...
        with pytest.raises(WeightSyncError, match="ties its embeddings"):  # ... and stops the next request
            asyncio.run(deferred.generate([1, 2, 3], SamplingParams(max_tokens=4)))
        deferred.update_weights(perturbed(model, seed=6), 8)
        with pytest.raises(WeightSyncError, match="ties its embeddings"):  # or the next sync, before its export
            deferred.update_weights(perturbed(model, seed=7), 9)
        assert deferred.version == 8
    finally:
        server.stop()


def test_server_killed_mid_batch_then_restarted_every_trajectory_completes_once(vllm_server, tiny_model, tokenizer):
    """Eight trajectories are in flight when the module's server is SIGKILLed; it is restarted
    from its launch directory (the fixture's model, not the synced weights). Each trajectory
    completes exactly once, whole, and equals what the healthy server with the synced weights
    produced: the engine put them back first. (The module's server, killed and restarted: a server
    of its own cost the suite a start.)

    The kill comes as the batch's fourth generation request is about to be sent, so at least that
    request meets a dead server whatever the timing (waiting for the server to report 4 running
    requests raced with short turns: some runs never saw 4 at once)."""
    server = vllm_server
    synced = perturbed(tiny_model, seed=1)
    fmt = tiny_format()
    cfg = AgentConfig(format=fmt, max_turns=2, max_response_tokens=500, temperature=0.0)
    questions = [f"What is {i}+{i}?" for i in range(8)]

    async def batch(engine, sb):
        return await asyncio.gather(*(run_agent(engine, sb, tokenizer, q, cfg) for q in questions))

    async def main():
        async with sandbox.LocalSandbox(workers=2) as sb:
            engine = VLLMEngine(server.url, tiny_model, restart_timeout=600)
            engine.update_weights(synced)
            healthy = await batch(engine, sb)

            sent = 0
            generate = engine.generate

            async def generate_then_kill_at_the_fourth(*args, **kwargs):
                nonlocal sent
                sent += 1
                if sent == 4:
                    server.kill()  # returns once the server is dead
                    threading.Thread(target=server.restart, daemon=True).start()
                return await generate(*args, **kwargs)

            engine.generate = generate_then_kill_at_the_fourth
            recovered = await batch(engine, sb)
            await engine.close()
            return engine, healthy, recovered, sent

    engine, healthy, recovered, sent = asyncio.run(main())
    assert sent >= 4 and engine.retries >= 1 and engine.reloads_after_restart >= 1
    assert len(recovered) == len(questions)
    for a, b in zip(healthy, recovered):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        assert len(b.logprobs) == len(b.token_ids)


def launch_dir(tmp_path, model):
    """A launch directory holding `model` (the server's starting weights)."""
    out = tmp_path / "launch"
    models.save_pretrained(model, out)
    return out


def test_scheduler_over_a_vllm_server_and_a_jax_engine(vllm_server, tiny_model, tokenizer):
    """Both policies return what one engine would; kv_aware sends everything to the server, whose
    KV cache (1 GiB: ~1M tokens) dwarfs the JaxEngine's 4 x 256 slots; least_requests uses both."""
    prompts = [tokenizer.encode(f"<|im_start|>user\n{i}*{i}=") for i in range(12)]
    sampling = SamplingParams(max_tokens=24, temperature=0.0)

    async def main():
        vllm_engine = VLLMEngine(vllm_server.url, tiny_model)
        vllm_engine.update_weights(tiny_model)
        out = {}
        async with JaxEngine(tiny_model, tokenizer, slots=4, max_len=256) as jax_engine:
            reference = [await jax_engine.generate(p, sampling) for p in prompts]
            for policy in ("kv_aware", "least_requests"):
                scheduler = Scheduler([vllm_engine, jax_engine], policy, refresh_s=0.2)
                out[policy] = scheduler, await asyncio.gather(*(scheduler.generate(p, sampling) for p in prompts))
        await vllm_engine.close()
        return reference, out

    reference, out = asyncio.run(main())
    for policy, (scheduler, completions) in out.items():
        assert [c.token_ids for c in completions] == [c.token_ids for c in reference], policy
        assert sum(scheduler.dispatched) == len(prompts)
        assert all(l.in_flight == 0 and l.reserved_tokens == 0 for l in scheduler.loads)
    assert out["kv_aware"][0].dispatched == [len(prompts), 0]
    assert min(out["least_requests"][0].dispatched) > 0


@pytest.mark.parametrize("sync_wait", ["reload", "export"])
def test_short_training_run_with_the_vllm_engine(vllm_server, tmp_path, monkeypatch, sync_wait):
    """The trainer over a vLLM server, each reload held back 1 s. reload: the trainer's sync holds
    it. export (one step of staleness, three steps): the trainer's first sync returns before its
    reload, the rollouts of step 2 wait for v1 to land, not started under v0 (two versions
    behind: the run would stop on the staleness bound), and the evaluations before and after RL
    wait for the weights they evaluate."""
    from rstar2_jax.rl.trainer import run
    from rstar2_jax.traces import read_traces
    from tests.rl.test_training import small_config

    held_s = 1.0
    reload_part = VLLMEngine.reload_part

    def held_reload(self, bucket_dir):
        time.sleep(held_s)
        reload_part(self, bucket_dir)

    monkeypatch.setattr(VLLMEngine, "reload_part", held_reload)
    landed_at_request = []  # whether the engine's last sync had landed when each request went out
    generate = VLLMEngine.generate

    def recording_generate(self, *args, **kwargs):
        landed_at_request.append(self.landing is None or self.landing.future.done())
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(VLLMEngine, "generate", recording_generate)
    export = sync_wait == "export"
    cfg = small_config(steps=3, max_staleness=1) if export else small_config(steps=2)
    cfg.rollout.engine = "vllm"
    cfg.rollout.vllm.urls = [vllm_server.url]
    cfg.rollout.vllm.sync_wait = sync_wait
    cfg.rl.roc.reject_uniform_groups = False  # every step updates (and syncs), whatever the rewards
    results = run(cfg, str(tmp_path))
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    rl = [l for l in lines if l["phase"] == "rl"]
    assert [l["step"] for l in rl] == list(range(cfg.rl.steps)) and all(l["kept_rollouts"] > 0 for l in rl)
    if export:  # step 0's sync: the export alone (v0 had landed before its rollouts)
        assert rl[0]["time/sync_s"] < held_s, rl[0]
        assert all(l["staleness/max"] <= 1 for l in rl), rl
    else:  # the server stood only for its reloads, inside the trainer's sync
        assert all(held_s <= l["sync/servers_paused_s"] <= l["time/sync_s"] for l in rl), rl
    assert "before" in results and "after" in results
    assert landed_at_request[0] and landed_at_request[-1]  # both evaluations sample the weights last sent
    assert served_version(vllm_server.url) == str(cfg.rl.steps)  # SFT start = version 0, then one sync per RL step
    assert set(read_traces(tmp_path / "traces")["engine"]) == {"vllm"}  # the traces name the engine that sampled


def test_nccl_sync_falls_back_to_safetensors_where_it_cannot_run(vllm_server, tiny_model, caplog):
    """No GPU (or no libnccl) here: sync="nccl" logs why and syncs through safetensors instead;
    the probe still checks the result."""
    engine = VLLMEngine(vllm_server.url, tiny_model, sync="nccl")
    target = perturbed(tiny_model, seed=4)
    with caplog.at_level("WARNING"):
        engine.update_weights(target, 5)
    assert engine.way.name == "files" and "NCCL weight sync unavailable" in caplog.text
    assert engine.check_sync(target) < 1e-3 and engine.version == 5
    asyncio.run(engine.close())


class RecordingNccl:
    """A stand-in for CuPy's NCCL binding beside the real server (sync/nccl_group.CupyNccl's interface):
    it records the collectives the sender issues, which need GPUs to run."""

    def __init__(self):
        self.calls = []

    def unique_id(self):
        raw = bytes(range(128))
        return raw, raw

    def communicator(self, world_size, uid, rank):
        self.calls.append(("join", world_size, rank))
        return "communicator"

    def all_reduce(self, comm, ptr, count, dtype):
        self.calls.append(("all_reduce", count, dtype))

    def broadcast(self, comm, ptr, count, dtype, root=0):
        self.calls.append(("broadcast", count, dtype, root))

    def synchronize(self):
        pass


def test_the_nccl_protocol_reaches_a_real_vllm_server_up_to_where_a_gpu_is_needed(vllm_server, tiny_model):
    """A real vLLM CPU server started with the NCCL weight-transfer backend takes the sender's
    join request (our unique id, rank offset, world size) and fails only at its missing
    accelerator; it takes the description of an export (HF names, dtypes, shapes) and fails only
    because no NCCL group exists; the tensors go out one at a time in that order; and the server
    answers afterwards. The collectives themselves need GPUs and have not run (vllm_engine/sync/nccl_group.py)."""
    from rstar2_jax.rollout.engines.vllm_engine.sync.nccl_group import (
        NCCL_TYPES, NcclUnavailable, NcclWeightSender, sending_device_tensors)
    from rstar2_jax.rollout.engines.vllm_engine.client import ServerUnavailable, VLLMClient
    from rstar2_jax.rollout.engines.vllm_engine.sync.export import model_plan, param_arrays

    server = vllm_server  # started with the NCCL backend (NCCL_BACKEND)
    client, fake = VLLMClient(server.url, timeout=120), RecordingNccl()
    with pytest.raises(NcclUnavailable, match="Cannot access accelerator device"):
        NcclWeightSender(client, server_ranks=1, nccl=fake)
    assert fake.calls == [("join", 2, 0), ("all_reduce", 1, NCCL_TYPES["float32"])]  # rank 0, then the handshake
    # what the check above stands on: the same validation refuses a malformed id
    with pytest.raises(ServerUnavailable, match="not valid standard base64"):
        client.request("POST", "/init_weight_transfer_engine",
                       {"init_info": {"nccl_unique_id_b64": "-_-_", "rank_offset": 1, "world_size": 2}})

    sender = object.__new__(NcclWeightSender)  # as if the group had formed
    sender.nccl, sender.client, sender.world_size, sender.comm = fake, client, 2, "communicator"
    fake.calls.clear()
    plan = model_plan(tiny_model, jnp.bfloat16, 1 << 30)
    with pytest.raises(NcclUnavailable, match="NCCL weight transfer not initialized"):
        sender.send(plan, sending_device_tensors(plan, param_arrays(tiny_model)), version=3)
    assert fake.calls == [("broadcast", int(np.prod(t.hf_shape)), NCCL_TYPES["bfloat16"], 0)
                          for b in plan.buckets for t in b.tensors]
    # vLLM leaves its layers mid-reload after a failed update: the files sync the engine falls
    # back to reloads every tensor, and the server generates with them (the probe passes)
    engine = VLLMEngine(server.url, tiny_model)
    engine.update_weights(tiny_model, 4)
    out = client.request("POST", "/v1/completions", {"model": server.model_name, "prompt": [1, 2, 3, 4],
                                                     "max_tokens": 4, "temperature": 0.0})
    assert engine.version == 4 and out["choices"][0]["finish_reason"] in ("length", "stop")
    asyncio.run(engine.close())


def test_evaluate_cli_on_a_vllm_server_matches_the_embedded_engine(vllm_server, tiny_dir, tiny_model, tmp_path,
                                                                  benchmark_dir):
    async def serve_the_fixture_model():  # whatever an earlier test synced
        async with VLLMEngine(vllm_server.url, tiny_model) as engine:
            engine.update_weights(tiny_model)
    asyncio.run(serve_the_fixture_model())
    results, tokens = {}, {}
    for engine in ("jax", "vllm"):
        out = tmp_path / engine
        args = [f"--model={tiny_dir}", "--benchmarks=aime24,gpqa_diamond", f"--data_dir={benchmark_dir}", "--limit=2",
                "--samples=2", "--temperature=0", "--max_tokens=40", "--max_turns=2", "--format=tiny",
                f"--engine={engine}", f"--out={out}"] + ([f"--url={vllm_server.url}"] if engine == "vllm" else [])
        proc = subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads((out / "results.json").read_text())
        assert report["protocol"]["engine"] == engine
        results[engine] = report["results"]
        tokens[engine] = {name: [list(t) for t in read_traces(out / "traces" / name)["token_ids"]]
                          for name in ("aime24", "gpqa_diamond")}
    assert results["vllm"] == results["jax"]  # greedy: the same rollouts, so the same table
    assert tokens["vllm"] == tokens["jax"]
    assert all(len(v) == 4 for v in tokens["jax"].values())


def test_two_servers_share_one_export_and_a_killed_one_hands_its_trajectories_to_the_other(
        vllm_server, tiny_model, tokenizer, tmp_path):
    """A sync writes the weights once and both servers reload them in parallel (each then passes
    its log-prob probe); so does a pull sync, each server reloading the copy its own fetcher made.
    Then one server is SIGKILLed mid-batch and stays down: its trajectories finish on the other
    server, each exactly once, the same tokens as with both up (greedy)."""
    from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import WeightFetcher

    second = start_server(launch_dir(tmp_path, tiny_model), tmp_path, "second")
    synced = perturbed(tiny_model, seed=2)
    cfg = AgentConfig(format=tiny_format(), max_turns=2, max_response_tokens=300, temperature=0.0)
    questions = [f"What is {i}*{i}?" for i in range(8)]

    async def main():
        async with sandbox.LocalSandbox(workers=2) as sb:
            engines = [VLLMEngine(vllm_server.url, tiny_model), VLLMEngine(second.url, tiny_model, restart_timeout=5)]
            # pull: neither server reads the trainer's export; each fetcher copies it into its own directory
            fetchers = [WeightFetcher(str(tmp_path / f"pulled{i}")) for i in range(2)]
            pulling = [VLLMEngine(e.url, tiny_model, sync="pull", fetch_url=f.url, sync_dir=str(tmp_path / "trainer"))
                       for e, f in zip(engines, fetchers)]
            Scheduler(pulling, "round_robin").update_weights(perturbed(tiny_model, seed=5), 6)
            pulled = [e._synced_dir for e in pulling]
            left_behind = [f for _, _, files in os.walk(tmp_path / "trainer") for f in files if f.endswith(".safetensors")]
            for f in fetchers:
                f.close()
            for e in pulling:
                await e.close()
            # files: one export both servers read
            scheduler = Scheduler(engines, "round_robin", refresh_s=0.2)
            scheduler.update_weights(synced, 7)
            exports = {e._synced_dir for e in engines}
            versions = [served_version(e.url) for e in engines]
            both_up = await asyncio.gather(*(run_agent(scheduler, sb, tokenizer, q, cfg, seed=i)
                                             for i, q in enumerate(questions)))
            sent = {"n": 0}
            generate = engines[1].generate

            async def generate_then_kill(*args, **kwargs):
                sent["n"] += 1
                if sent["n"] == 2:
                    second.kill()  # and never restarted
                return await generate(*args, **kwargs)

            engines[1].generate = generate_then_kill
            one_down = await asyncio.gather(*(run_agent(scheduler, sb, tokenizer, q, cfg, seed=i)
                                              for i, q in enumerate(questions)))
            await scheduler.close()
            return exports, versions, both_up, one_down, scheduler.rerouted, sent["n"], pulled, left_behind

    try:
        exports, versions, both_up, one_down, rerouted, sent, pulled, left_behind = asyncio.run(main())
    finally:
        second.stop()
    assert pulled == [str(tmp_path / f"pulled{i}" / "v6") for i in range(2)] and left_behind == []
    assert len(exports) == 1 and versions == ["7", "7"]  # one export, reloaded by both servers
    assert sent >= 2 and rerouted >= 1
    assert len(one_down) == len(questions)
    for a, b in zip(both_up, one_down):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason


def test_two_trainer_processes_share_a_vllm_server_and_only_the_first_pushes_weights(vllm_server, tmp_path):
    """Several trainer processes sample from the same servers: process 0 pushes each update (one
    reload per version, not one per process) while both gather the weights, which are split over
    the two processes, tensor by tensor in the same order; the other stamps its tokens with the
    version once it is on the server. The sync goes through a weight fetcher (sync=pull), one
    bucket per decoder layer, whose copy of step 0's second bucket fails once: the server has
    reloaded the first bucket by then, the first process stops writing while the second still
    gathers every tensor, the server goes back to its previous weights, and both processes sync
    again at once, in step."""
    from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import WeightFetcher
    from tests.rl.launch import launch
    from tests.rl.test_multiprocess import CONFIG, train_args
    from tests.rl.test_training import rl_lines

    class FailingOnce(WeightFetcher):
        """A real fetcher whose copy of the second bucket of the second sync (step 0's) fails, as
        a full disk would."""
        copies: list[tuple[int, str]] = []  # (version, bucket) of every copy asked for

        def fetch_part(self, base_url, file, bucket, version):
            FailingOnce.copies.append((version, bucket))
            versions = sorted({v for v, _ in FailingOnce.copies})
            if len(versions) == 2 and bucket == "b00001" and FailingOnce.copies.count((version, bucket)) == 1:
                raise OSError("injected: the copy failed")
            return super().fetch_part(base_url, file, bucket, version)

    config = tmp_path / "moving_tiny_arith.py"
    config.write_text(CONFIG)
    work = tmp_path / "run"
    fetcher = FailingOnce(str(tmp_path / "pulled"))
    reloads_before = open(vllm_server.log_path).read().count("POST /update_weight_version")
    try:
        results = launch(train_args(str(config), work, 2) + [
            "--config.rollout.engine=vllm", f"--config.rollout.vllm.urls={vllm_server.url}",
            "--config.rollout.vllm.sync=pull", f"--config.rollout.vllm.fetch_urls={fetcher.url}",
            "--config.rollout.vllm.sync_bucket_mb=1e-6"], work, n=2)  # a bucket per layer
    finally:
        fetcher.close()
    assert all(status == 0 for status, _, _ in results), [err[-3000:] for _, _, err in results]
    reloads = open(vllm_server.log_path).read().count("POST /update_weight_version") - reloads_before
    assert reloads == 1 + 2  # the start (after SFT), then one per RL step: pushed by one process
    syncs = [v for v, b in FailingOnce.copies if b == "b00000"]
    assert len(syncs) == 1 + 2 + 1 and syncs[1] == syncs[2]  # step 0's sync was made twice
    # the first try stopped at the failed copy, after the server had reloaded a bucket; the retry copied all
    assert [b for v, b in FailingOnce.copies if v == syncs[1]] == ["b00000", "b00001", "b00000", "b00001", "b00002"]
    assert len({b for _, b in FailingOnce.copies}) == 3  # a bucket a sync for each of the 2 layers, with the rest
    served = served_version(vllm_server.url)
    lines = rl_lines(work)
    assert [l["step"] for l in lines] == [0, 1] and served == "2"
    assert [l["sync/failures"] for l in lines] == [1, 1]
    assert all(l["staleness/max"] == 0 for l in lines)  # on-policy: no token stamped before its weights arrived
    assert "did not reach the servers" in results[1][2]  # process 1 learned of the failure from process 0


@pytest.mark.parametrize("swap", ["staged", "streamed"])
def test_pull_sync_reaches_a_server_that_cannot_see_the_trainer_s_files(vllm_server, tiny_model, tmp_path, swap):
    """sync="pull": the trainer exports into a directory of its own and serves it over HTTP; the
    fetcher beside the server copies each bucket into the server's directory as soon as it is
    written, and the server reloads the whole copy once committed (staged) or each bucket's copy
    as it arrives (streamed). The trainer's export is deleted before the probe, so the server
    cannot have read it."""
    from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import WeightFetcher

    fetcher = WeightFetcher(str(tmp_path / "server_side"))
    engine = VLLMEngine(vllm_server.url, tiny_model, sync="pull", fetch_url=fetcher.url,
                        sync_dir=str(tmp_path / "trainer_side"), bucket_bytes=1, reload=swap)  # a bucket per layer
    buckets = len(engine.export_plan(tiny_model).buckets)
    assert buckets > 1
    try:
        for version, seed in ((11, 3), (12, 4)):
            engine.update_weights(perturbed(tiny_model, seed=seed), version)  # reload, then the log-prob probe
            assert os.path.dirname(engine._synced_dir) == str(tmp_path / "server_side")
            copied = [f for f in os.listdir(engine._synced_dir) if f.endswith(".safetensors")]
            assert len(copied) == buckets  # every bucket fetched (and reloaded) on its own, then committed
            assert not any(f.endswith(".safetensors") for _, _, files in os.walk(tmp_path / "trainer_side")
                           for f in files)
            served = served_version(vllm_server.url)
            assert served == str(version)
        assert engine.probe_verdict() < 1e-3  # the deferred probe of the last sync
        assert sorted(os.listdir(tmp_path / "server_side")) == ["v11", "v12"]
    finally:
        fetcher.close()
        asyncio.run(engine.close())
