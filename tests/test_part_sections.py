"""Every swappable part's settings have one shape (rstar2_jax/core/part_sections.py): a selector, the
common fields, one section per registered part. Settings that moved into a part's section are
refused where they were, naming the new place, and an older run's config.json reads as the
config this version writes."""

import copy
import json
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_jax.core.config_types import Section, moved_to
from rstar2_jax.core.part_sections import PartChoice
from rstar2_jax.rl.config import RunConfig, base_config, validate
from rstar2_jax.rl.run_dir import with_defaults
from tests.rl.test_training import CONFIG_BEFORE_PART_SECTIONS, small_config


def sections(cls=RunConfig, path=""):
    """(path, section type) of every section under `cls`, itself included."""
    yield path, cls
    for name, tp in typing.get_type_hints(cls).items():
        if isinstance(tp, type) and issubclass(tp, Section):
            yield from sections(tp, f"{path}.{name}" if path else name)


def test_every_registry_of_parts_is_one_generated_section():
    choosers = {path: cls for path, cls in sections() if issubclass(cls, PartChoice)}
    assert set(choosers) == {"rollout", "sandbox", "data", "rl.advantage", "rl.roc", "rl.loss", "rl.correction"}
    for path, cls in choosers.items():
        fields = set(typing.get_type_hints(cls))
        assert cls.path == path and cls.selector in fields
        assert set(cls.registry) <= fields, f"{path}: a registered part without its section"


def test_every_moved_setting_is_refused_where_it_was_naming_its_new_place():
    moved = [(f"{path}.{old}" if path else old, cls, old) for path, cls in sections() for old in cls.moved]
    assert len(moved) >= 25
    for dotted, _, _ in moved:
        tree = base_config().to_dict()
        node = tree
        *parents, leaf = dotted.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = node.get(leaf, 1)
        _, problems = RunConfig.parse(tree)
        new = moved_to(RunConfig, dotted)
        assert new and [p.path for p in problems] == [dotted], (dotted, problems)
        assert all(n in problems[0].message for n in new), problems[0].message


def test_the_config_json_e37a544_wrote_reads_as_this_version_writes_it():
    with open(CONFIG_BEFORE_PART_SECTIONS) as f:
        old = json.load(f)
    cfg = small_config(steps=2)
    cfg.eval.before_and_after = False
    assert json.loads(json.dumps(with_defaults(old))) == json.loads(json.dumps(validate(cfg, 1).to_dict()))


def flat(tree: dict) -> dict:
    """A config as versions before the part sections wrote it: each moved setting back in its old
    place (the inverse of Section.upgraded), a chosen sandbox's URL as sandbox.url, the advantage
    a name."""
    old = copy.deepcopy(tree)
    for path, cls in sections():
        node = old
        for name in path.split(".") if path else ():
            node = node[name]
        for key, new in cls.moved.items():
            if isinstance(new, tuple):
                continue
            part, _, leaf = new.rpartition(".")
            node[key] = (node[part] if part else node).pop(leaf)  # a rename in place has no part
    sandbox = old["sandbox"]
    sandbox["url"] = sandbox.get(sandbox["backend"], {}).get("url", "")
    for backend in ("redis", "http"):
        sandbox.pop(backend)
    old["rl"]["advantage"] = old["rl"]["advantage"]["name"]
    return old


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["jax", "vllm"]), st.integers(1, 64), st.sampled_from(["local", "redis", "http"]),
       st.sampled_from(["grpo", "mean_only"]), st.sampled_from(["paper", "release", "off"]),
       st.floats(1e-4, 1.0), st.integers(0, 4))
def test_upgrading_a_flat_config_restores_it(engine, slots, backend, advantage, mode, eps, min_neg):
    """Law: upgraded(flat(c)) reads as c, for configs over every part's choices and settings."""
    tree = base_config().to_dict()
    tree["rollout"]["engine"] = engine
    tree["rollout"]["jax"]["slots"] = slots
    tree["rollout"]["vllm"]["urls"] = ("http://a:1", "http://b:2")
    tree["sandbox"]["backend"] = backend
    if backend != "local":
        tree["sandbox"][backend]["url"] = f"{backend}://host:1"
    tree["rl"]["advantage"]["name"] = advantage
    tree["rl"]["roc"].update(mode=mode, paper={"eps": eps}, release={"min_neg": min_neg, "min_pos": 2})
    def read(t):
        parsed, _ = RunConfig.parse(t)
        return parsed.to_dict()
    assert read(RunConfig.upgraded(flat(tree))) == read(tree)


def test_an_unchosen_engine_s_settings_are_kept_with_a_warning_an_unchosen_loss_s_refused(tmp_path):
    cfg = small_config()
    cfg.rollout.engine, cfg.rollout.vllm.urls = "vllm", ("http://127.0.0.1:1",)  # jax.slots=8 stays set
    cfg.rollout.vllm.sync_dir = str(tmp_path)
    run_cfg = validate(cfg, 1)
    assert run_cfg.rollout.jax.slots == 8
    assert "rollout.jax.slots is set but unread: rollout.engine is 'vllm'" in run_cfg.warnings()
    cfg = small_config()
    cfg.rl.roc.mode = "off"
    cfg.rl.roc.paper.eps = 0.5
    with pytest.raises(ValueError, match="rl.roc.paper.eps: belongs to RoC mode 'paper', but rl.roc.mode is 'off'"):
        validate(cfg, 1)


def test_a_redis_run_s_flat_url_moves_to_the_redis_section():
    old = {"backend": "redis", "url": "redis://h:6379/0", "workers": 3}
    tree = base_config().to_dict()
    tree["sandbox"] = old
    new = RunConfig.upgraded(tree)["sandbox"]
    assert new == {"backend": "redis", "redis": {"url": "redis://h:6379/0"}, "local": {"workers": 3}}


def test_a_config_file_that_assigns_a_name_to_a_part_section_is_told_the_selector(tmp_path):
    from rstar2_jax import cli
    config = tmp_path / "old_style.py"
    config.write_text("from experiments import tiny_arith\n\ndef get_config():\n    c = tiny_arith.get_config()\n"
                      "    c.rl.advantage = 'mean_only'  # as before rl.advantage.*\n    return c\n")
    message = cli._load_config_file(str(config), "", RunConfig)
    assert message == (f"{config}:5: rl.advantage is a section now: write `c.rl.advantage.name = 'mean_only'` "
                       "(its own settings under rl.advantage.<name>.*)")


def test_a_part_named_like_a_field_or_method_of_its_section_is_refused():
    from rstar2_jax.core.config_types import setting
    from rstar2_jax.core.part_sections import NoSettings, part_section
    from rstar2_jax.core.registry import Registry
    parts = Registry("widget")
    parts.register("spec", type("Spec", (), {"settings": NoSettings}))
    with pytest.raises(ValueError, match="widget 'spec' is named like a field or method of WidgetConfig"):
        part_section("WidgetConfig", parts, path="widget", module=__name__,
                     selector=("name", str, setting("spec", "the widget", choices=parts)))


def test_a_part_registered_after_its_section_was_built_has_settings_set_checked_and_written():
    """A part module imported after the sections exist (an experiment file's, a user's) still
    gets its `<path>.<part>.*` section: in the defaults, parsed, refused when not chosen (an
    algorithm part), and written to config.json and read back (a resumed run keeps it)."""
    import dataclasses

    from rstar2_jax.core.config_types import ConfigValueError, setting
    from rstar2_jax.core.part_sections import NoSettings, part_section
    from rstar2_jax.core.registry import Registry

    parts = Registry("widget")
    parts.register("plain", type("Spec", (), {"settings": NoSettings})())
    Chooser = part_section("Chooser", parts, path="widgets", module=__name__,
                           selector=("name", str, setting("plain", "the widget", choices=parts)))

    @dataclasses.dataclass(frozen=True)
    class LateSettings(Section):
        size: int = setting(4, "how big", min=1)

    parts.register("late", type("Spec", (), {"settings": LateSettings})())
    assert Chooser.defaults().late.size == 4
    chosen = Chooser.from_mapping({"name": "late", "late": {"size": 7}})
    assert isinstance(chosen, Chooser) and chosen.settings().size == 7
    assert Chooser.from_mapping(chosen.to_dict()) == chosen
    with pytest.raises(ConfigValueError, match="late.size: belongs to widget 'late'"):
        Chooser.from_mapping({"name": "plain", "late": {"size": 7}})
    with pytest.raises(ConfigValueError, match=r"late.size: .*>= 1"):
        Chooser.from_mapping({"name": "late", "late": {"size": 0}})


def test_rollout_vllm_swap_is_now_reload_and_an_older_run_resumes_with_it():
    """Issue 82: `swap` meant two things (rollout.jax.swap: when new weights take over; the vLLM
    servers' staged | streamed reload); the vLLM one is rollout.vllm.reload now."""
    tree = base_config().to_dict()
    tree["rollout"]["vllm"].pop("reload")
    tree["rollout"]["vllm"]["swap"] = "streamed"  # as an older run's config.json has it
    assert RunConfig.from_mapping(RunConfig.upgraded(tree)).rollout.vllm.reload == "streamed"
    with pytest.raises(ValueError, match=r"rollout\.vllm\.swap: moved: set rollout\.vllm\.reload instead"):
        RunConfig.from_mapping(tree)
