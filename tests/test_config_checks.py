"""Every field of every shipped experiment config is checked before anything runs: a wrong type,
a value out of range or an unknown name is refused by RunConfig's check, named by its path."""

import copy
import dataclasses
import os
import tempfile
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import qwen3_0p6b_math, roc_ablation, rstar2_agent_14b, tiny_arith
from rstar2_jax.core.config_types import ConfigValueError, Section, leaves, setting
from rstar2_jax.core.registry import Registry, UnknownNameError
from rstar2_jax.rl.config import RunConfig, base_config

# Free-form strings, and the setting under which each is read (and so checked): a path that
# does not exist, or a URL of the wrong scheme, is refused there.
PROBLEM_FILE = os.path.join(tempfile.mkdtemp(prefix="config-checks-"), "problems.jsonl")
with open(PROBLEM_FILE, "w") as _f:
    _f.write('{"problem": "1+1", "answer": "2", "id": "a"}\n')
PROBLEM_SETS = {"data.task": "problems", "data.problems.train_path": PROBLEM_FILE, "data.problems.eval_path": PROBLEM_FILE}
FREE_STRINGS = {
    "model.path": ({}, "/no/such/model"),
    "data.problems.train_path": ({"data.task": "problems"}, "/no/such/train.jsonl"),
    "data.problems.eval_path": ({"data.task": "problems"}, "/no/such/eval.jsonl"),
    "data.problems.question_key": (PROBLEM_SETS, "no_such.field"),
    "data.problems.answer_key": (PROBLEM_SETS, "no_such_field"),
    "data.problems.id_key": (PROBLEM_SETS, "problem.id"),
    "sandbox.redis.url": ({"sandbox.backend": "redis"}, "http://not-redis"),
    "sandbox.http.url": ({"sandbox.backend": "http"}, "redis://not-http"),
    "rollout.vllm.sync_dir": ({"rollout.engine": "vllm", "rollout.vllm.urls": ["http://127.0.0.1:1"]}, "/no/such/dir"),
    "rollout.vllm.sync_host": ({}, ""),
    "logging.project": ({}, ""),
    "logging.wandb_entity": ({"logging.backends": ["wandb"]}, "no such team"),
    "logging.mlflow_tracking_uri": ({}, "relative/mlruns"),
    "run_name": ({}, ""),
}
# Lists of strings: the element check, under the setting that reads them.
STRING_LISTS = {"rl.correction.names": ({}, ["no_such_correction"]),
                "model.lora.targets": ({"model.lora.rank": 4}, ["qkv_proj"]),
                "logging.backends": ({}, ["no_such_tracker"]),
                "rollout.vllm.urls": ({"rollout.engine": "vllm"}, ["not-a-url"]),
                "rollout.vllm.fetch_urls": ({"rollout.engine": "vllm", "rollout.vllm.urls": ["http://127.0.0.1:1"],
                                             "rollout.vllm.sync": "pull"}, ["not-a-url"])}


def shipped_configs(tmp_path):
    files = tmp_path / "problems.jsonl"
    files.write_text('{"problem": "1+1", "answer": "2"}\n')
    out = {"tiny_arith": tiny_arith.get_config(), "roc_ablation": roc_ablation.get_config("paper,2,2,0.1")}
    for name, module in (("qwen3_0p6b_math", qwen3_0p6b_math), ("rstar2_agent_14b", rstar2_agent_14b)):
        c = module.get_config(f",{files}")
        c.data.problems.eval_path = str(files)
        out[name] = c
    return {name: c.to_dict() for name, c in out.items()}


def set_path(tree: dict, path: str, value):
    parts = path.replace("[0]", ".0").split(".")
    node = tree
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node[part]
    last = parts[-1]
    node[int(last) if last.isdigit() else last] = value


def problems_of(tree: dict) -> list[str]:
    parsed, problems = RunConfig.parse(tree)
    return [p.path for p in problems]


def bad_values(path: str, f: dataclasses.Field, tp) -> list[tuple[dict, object]]:
    """(settings that make the field read, a bad value) pairs for one leaf."""
    meta, out = f.metadata, []
    inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    base = inner[0]
    wrong_type = {bool: "yes", int: "three", float: "x", str: 3}.get(base, 5)
    out.append(({}, wrong_type))
    if meta.get("min") is not None:
        out.append(({}, meta["min"] - (1 if base is int else 0.5)))
    if meta.get("max") is not None:
        out.append(({}, meta["max"] + 1))
    if meta.get("choices") is not None:
        out.append(({}, "no_such_name"))
    if path in FREE_STRINGS:
        out.append(FREE_STRINGS[path])
    if path in STRING_LISTS:
        out.append(STRING_LISTS[path])
    return out


def test_every_leaf_has_a_check_beyond_its_type():
    """A numeric field has bounds, a name field its registry, a free string the setting that reads
    it: a new field without a check fails here."""
    for path, f, tp in leaves(RunConfig):
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if typing.get_origin(tp) is tuple:
            assert path in STRING_LISTS, f"{path}: a list needs an element check"
        elif inner[0] in (int, float):
            assert f.metadata["min"] is not None, f"{path}: a number needs bounds"
        elif inner[0] is str:
            assert f.metadata["choices"] is not None or path in FREE_STRINGS, f"{path}: a string needs a check"
        assert f.metadata["doc"], f"{path}: undocumented"


def test_every_bad_leaf_of_every_shipped_config_is_refused_by_the_check(tmp_path):
    configs = shipped_configs(tmp_path)
    for name, tree in configs.items():
        assert problems_of(tree) == [], (name, problems_of(tree))
        for path, f, tp in leaves(RunConfig):
            for context, bad in bad_values(path, f, tp):
                mutated = copy.deepcopy(tree)
                for key, value in context.items():
                    set_path(mutated, key, value)
                set_path(mutated, path, bad)
                refused = problems_of(mutated)
                assert any(p == path or p.startswith(path + "[") for p in refused), \
                    f"{name}: {path}={bad!r} ({context}) was not refused; problems: {refused}"


def test_unknown_keys_are_refused_with_did_you_mean():
    tree = base_config().to_dict()
    tree["rl"]["roc"]["mod"] = "paper"
    tree["sandbox"]["local"]["wrokers"] = 2
    with pytest.raises(ConfigValueError) as e:
        RunConfig.from_config(tree)
    text = str(e.value)
    assert "rl.roc.mod: unknown field; did you mean 'mode'?" in text
    assert "sandbox.local.wrokers: unknown field; did you mean 'workers'?" in text


def test_the_base_config_round_trips_through_its_typed_form():
    typed = RunConfig.from_config(base_config())
    assert RunConfig.from_config(typed.to_dict()) == typed
    assert typed == RunConfig()


def test_the_paper_recipe_validates_for_its_process_counts(tmp_path):
    """64 devices (fsdp 16 x tensor 4) on hosts of 8 GPUs (mesh.devices_per_process): 8 processes
    (or one, before launch) pass; 16 processes contradict the declared hosts; without hosts declared,
    any count that divides the devices passes, and one that does not is refused."""
    tree = shipped_configs(tmp_path)["rstar2_agent_14b"]
    for processes in (1, 8):
        RunConfig.from_config(tree, processes=processes)
    with pytest.raises(ConfigValueError, match="16 processes x 8 devices is not the mesh's 64 devices"):
        RunConfig.from_config(tree, processes=16)
    undeclared = {**tree, "mesh": {**tree["mesh"], "devices_per_process": 0}}
    for processes in (16, 64):
        RunConfig.from_config(undeclared, processes=processes)
    with pytest.raises(ConfigValueError, match="64 devices cannot be split evenly over 3 processes"):
        RunConfig.from_config(tree, processes=3)


# ---- the registry -------------------------------------------------------------------------------
def test_a_registry_refuses_duplicates_and_lists_its_names_in_errors():
    r = Registry("widget")
    r.register("alpha", 1)

    @r.register("beta")
    def beta():
        return 2

    assert r["beta"] is beta and sorted(r) == ["alpha", "beta"] and "alpha" in r
    with pytest.raises(ValueError, match="widget 'alpha' is registered twice"):
        r.register("alpha", 3)
    with pytest.raises(UnknownNameError, match="unknown widget 'alpah'; did you mean 'alpha'\\? registered: alpha, beta"):
        r["alpah"]
    assert r.problem("gamma") == "unknown widget 'gamma'; registered: alpha, beta" and r.problem("beta") is None
    del r["alpha"]
    assert list(r) == ["beta"]


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8), st.integers(), max_size=6))
def test_registry_lookup_round_trips(entries):
    r = Registry("thing")
    for k, v in entries.items():
        r[k] = v
    assert dict(r.items()) == entries and all(r.problem(k) is None for k in entries)


def test_sections_refuse_wrong_types_and_widen_ints_to_floats():
    @dataclasses.dataclass(frozen=True)
    class Demo(Section):
        rate: float = setting(1.0, "a rate", min=0.0)
        count: int = setting(1, "a count", min=1)
        flag: bool = setting(False, "a flag")

    assert Demo.from_mapping({"rate": 2}).rate == 2.0
    _, problems = Demo.parse({"count": True, "flag": 1, "rate": "fast"})
    assert sorted(p.path for p in problems) == ["count", "flag", "rate"]


@pytest.mark.parametrize("path, value", [
    ("model.remat", "ful"), ("checkpoint.every", 0), ("rollout.jax.slots", 0), ("sandbox.local.workers", 0),
    ("rl.tis_cap", 0.5), ("mesh.fsdp", 0), ("stages[0].max_turns", 0),
])
def test_the_values_validate_once_let_through_are_refused(path, value):
    """The review's list: each once passed validation and failed later (or divided by zero)."""
    tree = tiny_arith.get_config().to_dict()
    set_path(tree, path, value)
    assert path in problems_of(tree)


def test_session_tool_state_is_accepted_with_every_sandbox_backend(tmp_path):
    """Sessions exist on every backend (local; http and redis keep each on one remote host)."""
    tree = shipped_configs(tmp_path)["tiny_arith"]
    for backend, url in (("local", ""), ("http", "http://127.0.0.1:8088"), ("redis", "redis://127.0.0.1:6379/0")):
        t = copy.deepcopy(tree)
        t["sandbox"].update(backend=backend, tool_state="session")
        if url:
            t["sandbox"][backend]["url"] = url
        assert problems_of(t) == [], backend


def test_a_token_budget_below_the_longest_rollout_names_both_numbers_and_micro_batches_follow_from_it():
    tree = tiny_arith.get_config().to_dict()
    max_len = tree["rollout"]["max_len"]
    tree["rl"]["token_budget"] = max_len - 1
    parsed, problems = RunConfig.parse(tree)
    [p] = [p for p in problems if p.path == "rl.token_budget"]
    assert f"{max_len - 1} tokens is below rollout.max_len ({max_len})" in str(p), p
    tree["rl"].update(token_budget=max_len, micro_batches=2)
    assert problems_of(tree) == ["rl.micro_batches"]
    tree["rl"]["micro_batches"] = 1
    assert problems_of(tree) == []


def test_segments_per_row_must_be_a_power_of_two_and_the_error_names_the_two_nearest():
    tree = tiny_arith.get_config().to_dict()
    tree["rl"].update(token_budget=tree["rollout"]["max_len"], segments_per_row=24)
    _, problems = RunConfig.parse(tree)
    [p] = [p for p in problems if p.path == "rl.segments_per_row"]
    assert "is 24; it must be a power of two" in str(p) and "32 or 16" in str(p), p
    tree["rl"]["segments_per_row"] = 16
    assert problems_of(tree) == []


def test_sync_wait_export_is_refused_where_its_landing_cannot_be_awaited_and_warned_where_nothing_overlaps():
    """rollout.vllm.sync_wait=export (rollout/engines/vllm_engine/sync/background.py): a sync through files,
    whole weights, any number of trainer processes; with rl.max_staleness=0 it runs but overlaps
    nothing."""
    tree = tiny_arith.get_config().to_dict()
    tree["rollout"].update(engine="vllm")
    tree["rollout"]["vllm"].update(urls=("http://127.0.0.1:8100",), sync_wait="export")
    tree["rl"]["max_staleness"] = 1
    run_cfg, problems = RunConfig.parse(tree)
    assert problems == [] and run_cfg.topology_problems(1) == []
    assert not any("sync_wait" in w for w in run_cfg.warnings())
    assert run_cfg.topology_problems(2) == []  # the others learn of each landing from the primary
    tree["rollout"]["vllm"]["sync"] = "nccl"
    assert problems_of(tree) == ["rollout.vllm.sync_wait"]
    tree["rollout"]["vllm"]["sync"] = "pull"
    tree["rollout"]["vllm"]["fetch_urls"] = ("http://127.0.0.1:8200",)
    assert problems_of(tree) == []
    tree["model"]["lora"]["rank"] = 8
    assert problems_of(tree) == ["model.lora.rank"]
    tree["model"]["lora"]["rank"], tree["rl"]["max_staleness"] = 0, 0
    run_cfg, problems = RunConfig.parse(tree)
    assert problems == [] and any("sync_wait=export with rl.max_staleness=0" in w for w in run_cfg.warnings())


def test_an_unknown_engine_is_refused_by_name_while_the_checks_that_ask_an_engine_s_kind_skip_it():
    """The LoRA refusal asks the engine's kind: with a name the registry lacks it must not raise
    past the config check, which lists the name's problem."""
    tree = tiny_arith.get_config().to_dict()
    tree["rollout"]["engine"] = "sglang"
    tree["model"]["lora"]["rank"] = 8
    run_cfg, problems = RunConfig.parse(tree)
    assert [p.path for p in problems] == ["rollout.engine"] and "unknown engine 'sglang'" in str(problems[0])
    assert run_cfg.topology_problems(2) == []


@pytest.mark.parametrize("given, leaf, message, fixed", [
    # each replica takes an equal group of the engine's devices (issue 70 item 2)
    ({"devices": 4, "replicas": 3}, "jax.replicas", "3 does not divide rollout.jax.devices=4", {"replicas": 2}),
    # a chunk checks for a live slot between equal blocks of steps (issue 70)
    ({"decode_steps": 16, "exit_check_steps": 5}, "jax.exit_check_steps",
     "5 does not divide rollout.jax.decode_steps=16", {"exit_check_steps": 16}),
    # one step per dispatch too (issue 80: exit_check_steps=4 with decode_steps=1 was accepted)
    ({"decode_steps": 1, "exit_check_steps": 4}, "jax.exit_check_steps",
     "4 does not divide rollout.jax.decode_steps=1", {"exit_check_steps": 1}),
], ids=["replicas_over_devices", "exit_check_over_decode_steps", "exit_check_over_one_step"])
def test_an_engine_setting_that_must_divide_another_is_refused_naming_both(given, leaf, message, fixed):
    tree = tiny_arith.get_config().to_dict()
    tree["rollout"]["jax"].update(given)
    _, problems = RunConfig.parse(tree)
    [p] = [p for p in problems if p.path.endswith(leaf)]
    assert message in str(p), p
    tree["rollout"]["jax"].update(fixed)
    assert problems_of(tree) == []


def test_an_engine_asking_for_every_device_of_a_process_is_refused_by_the_config_check():
    """Issue 80: rollout.jax.devices equal to a host's devices was refused only once the run started."""
    tree = tiny_arith.get_config().to_dict()
    tree["mesh"]["devices_per_process"] = 4
    tree["rollout"]["jax"]["devices"] = 4
    run_cfg, problems = RunConfig.parse(tree)
    assert problems == []
    [p] = run_cfg.topology_problems(1)
    assert p.path == "rollout.jax.devices" and "leaves the learner 0: set it to at most 3" in str(p), p
    tree["rollout"]["jax"]["devices"] = 3
    run_cfg, _ = RunConfig.parse(tree)
    assert run_cfg.topology_problems(1) == []
