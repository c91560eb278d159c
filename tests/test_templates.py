"""Public sets' instruction templates (data/templates.py): each recognised exactly as its source
writes it, stripped or kept by choice (data.problems.instructions), counted when not recognised,
and a kept template that asks for another answer format than the run grades is a config warning.

Rows are written in each public schema, with the template text of the named source:
- DAPO-Math-17k in verl's RL layout (tests/test_problem_sets.py's fixture: its template as the
  dataset's rows hold it);
- verl examples/data_preprocess/gsm8k.py and math_dataset.py: `question + " " + instruction_following`,
  prompt [{role: user, content}], reward_model{style: rule, ground_truth}, extra_info{split, index};
- open-r1's README distilabel prompt_template around a problem (a plain JSONL row);
- rStar2-Agent's user template (rollout/prompt.py DEFAULT_USER) around a problem.
"""

from __future__ import annotations

import pytest

from rstar2_jax.core.config_types import ConfigValueError
from rstar2_jax.data.tasks import DataConfig, make_task
from rstar2_jax.data.templates import TEMPLATES, TemplateCount, recognise
from rstar2_jax.rewards import Grader
from rstar2_jax.rollout.prompt import DEFAULT_USER
from tests.test_problem_sets import DAPO_TEMPLATE, PROBLEMS, verl_rows, write_jsonl, write_parquet

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
OPEN_R1_PREFIX = "You will be given a problem. Please reason step by step, and put your final answer within \\boxed{}:\n"


def verl_preprocessed_rows(instruction: str, source: str):
    return [{"data_source": source, "prompt": [{"role": "user", "content": q + " " + instruction}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": "train", "index": i}}
            for i, (q, a, _) in enumerate(PROBLEMS)]


SCHEMAS = {  # template name -> (rows in its source's schema, the answer format its instructions ask for)
    "dapo_math_17k": (verl_rows, "dapo"),
    "verl_gsm8k": (lambda: verl_preprocessed_rows(GSM8K_INSTRUCTION, "openai/gsm8k"), "gsm8k"),
    "verl_math": (lambda: verl_preprocessed_rows(MATH_INSTRUCTION, "DigitalLearningGmbH/MATH-lighteval"), "boxed"),
    "open_r1": (lambda: [{"problem": OPEN_R1_PREFIX + q, "answer": a} for q, a, _ in PROBLEMS], "boxed"),
    "rstar2_agent": (lambda: [{"problem": DEFAULT_USER.format(problem=q), "answer": a} for q, a, _ in PROBLEMS],
                     "answer_boxed"),
}


def data_config(path, **problems):
    return DataConfig.from_mapping({"task": "problems", "problems": {"train_path": path, "eval_path": path, **problems}})


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_each_public_template_is_stripped_or_kept_by_choice(tmp_path, name):
    rows, asks = SCHEMAS[name]
    path = write_parquet(tmp_path / "train.parquet", rows())
    stripped = make_task(data_config(path), seed=0)
    assert [p.question for p in stripped.train_problems] == [q for q, _, _ in PROBLEMS]
    kept = make_task(data_config(path, instructions="keep"), seed=0)
    assert all(recognise(p.question)[0] == name for p in kept.train_problems)
    assert TEMPLATES[name].answer_format == asks


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_response_in_the_set_s_format_scores_1_and_one_in_ours_is_a_format_failure(name):
    """With `keep` the run grades the set's format: a correct response written as the template asks
    scores 1; the same answer in our <answer>\\boxed{}</answer> form is a format failure there (except
    where the set's format reads ours: a bare \\boxed{} format reads the box inside our tags)."""
    asks = SCHEMAS[name][1]
    theirs = {"dapo": "work\nAnswer: 84", "gsm8k": "work\n#### 84", "boxed": "work so \\boxed{84}",
              "answer_boxed": "<answer>\\boxed{84}</answer>"}[asks]
    ours = "<reason>work</reason><answer>\\boxed{84}</answer>"
    assert Grader(asks)(theirs, "84").reward == 1.0
    in_ours = Grader(asks)(ours, "84")
    assert in_ours.reward == (1.0 if asks in ("boxed", "answer_boxed") else 0.0)
    assert in_ours.format_failure == (asks not in ("boxed", "answer_boxed"))
    if asks != "answer_boxed":  # and a response in the set's format, graded in ours, fails the format
        assert Grader()(theirs, "84").format_failure


def test_templates_match_exactly_and_an_unrecognised_text_is_left_and_counted():
    near = DAPO_TEMPLATE.format("Find x.").replace("step by step", "step-by-step")
    texts = [DAPO_TEMPLATE.format("Find x."), near, "Find y.", "Find z. " + MATH_INSTRUCTION]
    assert recognise(near) == (None, near)
    count = TemplateCount.of(texts)
    assert count.templates == {"dapo_math_17k": 1, "verl_math": 1} and count.unrecognised == 2
    assert "2 rows with none recognised" in count.describe()
    assert recognise(DAPO_TEMPLATE.format("")) == (None, DAPO_TEMPLATE.format(""))  # a template with no problem


def test_the_rstar2_agent_template_is_our_prompt_s_user_template():
    assert DEFAULT_USER.format(problem="P") == TEMPLATES["rstar2_agent"].prefix + "P"


def test_a_kept_template_graded_in_another_format_is_a_warning_naming_the_fix(tmp_path):
    from rstar2_jax.rl.config import RunConfig, base_config

    path = write_parquet(tmp_path / "train.parquet", verl_rows())

    def warnings(**data):
        c = base_config()
        c.data.task, c.data.problems.train_path, c.data.problems.eval_path = "problems", path, path
        c.sft.steps = 0
        for k, v in data.items():
            if k == "instructions":
                c.data.problems.instructions = v
            else:
                setattr(c.data, k, v)
        return [w for w in RunConfig.from_config(c).warnings() if "template" in w]

    [conflict] = [w for w in warnings(instructions="keep") if "train.parquet" in w][:1]
    assert "dapo_math_17k" in conflict and "data.answer_format='answer_boxed'" in conflict
    assert "--config.data.answer_format=dapo" in conflict and "instructions=strip" in conflict
    assert warnings(instructions="keep", answer_format="dapo") == []
    assert warnings() == []  # strip (the default): our format instructs, ours is graded


def test_a_kept_template_inside_a_prompt_format_that_instructs_too_is_two_conflicting_instructions(tmp_path):
    """Issue 69: DAPO's instruction kept under the rstar2 or compact format (both ask for
    <answer>\\boxed{}</answer>) gave the model two answer instructions, with no warning."""
    from rstar2_jax.rl.config import RunConfig, base_config

    path = write_parquet(tmp_path / "train.parquet", verl_rows())

    def warnings(fmt):
        c = base_config()
        c.data.task, c.data.problems.train_path, c.data.problems.eval_path = "problems", path, path
        c.data.problems.instructions, c.data.answer_format, c.format, c.sft.steps = "keep", "dapo", fmt, 0
        return [w for w in RunConfig.from_config(c).warnings() if "template" in w]

    for fmt in ("rstar2", "compact"):
        [conflict] = warnings(fmt)
        assert "two conflicting answer instructions" in conflict and f"prompt format {fmt!r}" in conflict
        assert "instructions=strip" in conflict and "--config.format=tiny" in conflict
    assert warnings("tiny") == []  # its prompt gives no answer instruction: the set's instructs alone


def test_an_unknown_answer_format_is_a_config_error_listing_the_known_ones():
    from rstar2_jax.rl.config import RunConfig, base_config

    c = base_config()
    c.data.answer_format = "Answer:"
    with pytest.raises(ConfigValueError, match="data.answer_format: .*answer_boxed, boxed, choice_letter, dapo, gsm8k"):
        RunConfig.from_config(c)


def test_a_config_written_before_templates_keeps_its_texts(tmp_path):
    """Its rows were trained as stored: a resumed run reads them so (resuming it with the default
    `strip` is then a config mismatch naming data.problems.instructions, not a silent change)."""
    path = write_jsonl(tmp_path / "train.jsonl", verl_rows())
    older = {"task": "problems", "problems": {"train_path": path, "eval_path": path}}
    assert DataConfig.from_mapping(DataConfig.upgraded(older)).problems.instructions == "keep"
    arith = {"task": "arith", "problems": {}}  # the setting is unread there: the default
    assert DataConfig.from_mapping(DataConfig.upgraded(arith)).problems.instructions == "strip"
