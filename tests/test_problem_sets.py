"""Problem sets in the formats and layouts public math-RL sets come in (issue 39).

Each fixture is written in the exact schema of its source, field names as there:
- verl RL Parquet, as DAPO-Math-17k stores it: verl docs/preparation/prepare_data.rst and
  verl/utils/dataset/rl_dataset.py (data_source, prompt as chat messages, ability,
  reward_model{style, ground_truth}, extra_info{index});
- open-r1/DAPO-Math-17k-Processed: prompt (a string), solution, data_source, source_prompt, ability,
  reward_model, extra_info;
- the rStar2-Agent release's rows: verl examples/data_preprocess/dapo_rstar2_agent_loop.py (microsoft's
  fork): data_source "rstar_open-r1/DAPO-Math-17k-Processed", agent_name, prompt [{role: user}],
  reward_model{style: rule, ground_truth}, extra_info{split, index, answer, question,
  need_tools_kwargs, interaction_kwargs}; the map keeps open-r1's solution and source_prompt;
- verl's GSM8K and MATH preprocessing (verl examples/data_preprocess/gsm8k.py, math_dataset.py):
  the question with verl's instruction in the user turn, the final answer in
  reward_model.ground_truth, and (GSM8K) the worked solution and bare question in extra_info;
- openai/gsm8k as published: question, answer "<worked solution>\n#### N";
- a Hugging Face `datasets` folder written by datasets' own save_to_disk.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rstar2_jax.core.config_types import ConfigValueError
from rstar2_jax.data.jsonl import DataError
from rstar2_jax.data.problems import Columns, layout_of, load_problems
from rstar2_jax.data.tasks import DataConfig, make_task

PROBLEMS = [("In triangle ABC, AB = 13, BC = 14, CA = 15. Find the area.", "84", "9a9b6eb4-a1cb"),
            ("Find the number of positive divisors of 360.", "24", "0c1f7d2e-77aa")]
DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the form "
                 "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put "
                 "your answer on its own line after \"Answer:\".")


def verl_rows():
    return [{"data_source": "math_dapo", "prompt": [{"content": DAPO_TEMPLATE.format(q), "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": i}} for q, a, i in PROBLEMS]


def open_r1_rows():
    return [{"prompt": q, "solution": a, "data_source": "https://artofproblemsolving.com/wiki",
             "source_prompt": [{"content": DAPO_TEMPLATE.format(q), "role": "user"}], "ability": "MATH",
             "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": i}}
            for q, a, i in PROBLEMS]


def rstar2_agent_rows():
    rows = []
    for idx, ((q, a, _), base) in enumerate(zip(PROBLEMS, open_r1_rows())):
        rows.append({**base, "data_source": "rstar_open-r1/DAPO-Math-17k-Processed", "agent_name": "rstar2_agent",
                     "prompt": [{"role": "user", "content": q}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": a},
                     "extra_info": {"split": "train", "index": idx, "answer": a, "question": q,
                                    "need_tools_kwargs": False,
                                    "interaction_kwargs": {"query": q, "ground_truth": a}}})
    return rows


GSM8K = [("Tom has 3 apples and buys 4 more. How many apples does he have?",
          "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "7"),
         ("A school buys 40 boxes of 30 pens. How many pens is that?",
          "40 boxes hold 40 * 30 = <<40*30=1200>>1,200 pens.\nThat is all of them.\n#### 1,200", "1200")]
VERL_GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
VERL_MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def verl_gsm8k_rows():
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q + " " + VERL_GSM8K_INSTRUCTION}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": gold},
             "extra_info": {"split": "train", "index": i, "answer": worked, "question": q}}
            for i, (q, worked, gold) in enumerate(GSM8K)]


def gsm8k_rows():
    return [{"question": q, "answer": worked} for q, worked, _ in GSM8K]


def verl_math_rows():
    return [{"data_source": "DigitalLearningGmbH/MATH-lighteval",
             "prompt": [{"role": "user", "content": q + " " + VERL_MATH_INSTRUCTION}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": "train", "index": i}}
            for q, a, i in PROBLEMS]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("layout,rows,question_of", [
    ("dapo_math_17k", verl_rows, lambda q: DAPO_TEMPLATE.format(q)),  # the user turn, as verl trains on it
    ("open_r1", open_r1_rows, lambda q: q),
    ("rstar2_agent", rstar2_agent_rows, lambda q: q),
    ("verl_math", verl_math_rows, lambda q: q + " " + VERL_MATH_INSTRUCTION),
])
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_each_public_layout_loads_from_parquet_and_jsonl(tmp_path, layout, rows, question_of, fmt):
    path = (write_parquet if fmt == "parquet" else write_jsonl)(tmp_path / f"train.{fmt}", rows())
    assert layout_of(path) == layout
    problems = load_problems(path)
    assert [(p.question, p.answer) for p in problems] == [(question_of(q), a) for q, a, _ in PROBLEMS]
    ids = [p.id for p in problems]
    assert ids == ([i for _, _, i in PROBLEMS] if layout != "rstar2_agent" else ["0", "1"])


@pytest.mark.parametrize("layout,rows,question_of,evidence", [
    ("verl_gsm8k", verl_gsm8k_rows, lambda q: q + " " + VERL_GSM8K_INSTRUCTION, "data_source 'openai/gsm8k'"),
    ("gsm8k", gsm8k_rows, lambda q: q, "ending in '#### N'"),
])
def test_gsm8k_layouts_give_the_final_answer_as_gold_never_the_worked_solution(tmp_path, layout, rows, question_of,
                                                                               evidence, caplog):
    """Issue 69: verl's GSM8K rows carry extra_info.question/answer and were read as the rStar2-Agent
    layout, with the whole worked solution as gold (every response scored 0); raw openai/gsm8k too."""
    path = write_parquet(tmp_path / "gsm8k.parquet", rows())
    with caplog.at_level("INFO"):
        problems = load_problems(path)
    assert layout_of(path) == layout
    assert [(p.question, p.answer) for p in problems] == [(question_of(q), gold) for q, _, gold in GSM8K]
    decided = [r.getMessage() for r in caplog.records if "read as layout" in r.getMessage()]
    assert decided and f"read as layout {layout} (" in decided[0] and evidence in decided[0]


def test_verl_gsm8k_is_told_by_its_worked_solution_without_a_data_source(tmp_path):
    rows = [{k: v for k, v in row.items() if k != "data_source"} for row in verl_gsm8k_rows()]
    path = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    assert layout_of(path) == "verl_gsm8k" and [p.answer for p in load_problems(path)] == ["7", "1200"]


def test_verl_gsm8k_kept_instructions_are_verl_s_own_and_warn_under_another_format(tmp_path):
    from rstar2_jax.data.tasks import kept_template_conflicts
    path = write_parquet(tmp_path / "gsm8k.parquet", verl_gsm8k_rows())
    cfg = DataConfig.from_mapping({"task": "problems", "answer_format": "answer_boxed",
                                   "problems": {"train_path": path, "eval_path": path, "instructions": "keep"}})
    [warning] = kept_template_conflicts(cfg)
    assert "verl_gsm8k" in warning and "--config.data.answer_format=gsm8k" in warning
    assert make_task(cfg, 0).train_problems[0].question.endswith(VERL_GSM8K_INSTRUCTION)


def test_a_gold_that_is_a_worked_solution_is_refused_naming_file_row_and_key(tmp_path):
    path = write_parquet(tmp_path / "gsm8k.parquet", verl_gsm8k_rows())
    with pytest.raises(DataError, match=r"gsm8k.parquet:1: the gold \(field 'extra_info.answer'\) looks like a worked "
                                        r"solution.*'####'.*data.problems.answer_key"):
        load_problems(path, columns=Columns("extra_info.question", "extra_info.answer"))
    rows = [{"problem": "Add 2 and 3.", "answer": "5"},
            {"problem": "Add 1 and 1.", "answer": "First, 1 + 1.\nThat makes\n\\boxed{2}"}]
    with pytest.raises(DataError, match=r"plain.jsonl:2: the gold .* worked solution.*boxed"):
        load_problems(write_jsonl(tmp_path / "plain.jsonl", rows))


def test_a_row_whose_two_golds_disagree_is_ambiguous_and_names_the_keys(tmp_path):
    row = {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "reward_model": {"ground_truth": "4"},
           "extra_info": {"question": "What is 2 + 2?", "answer": "5", "index": 0}}
    path = write_jsonl(tmp_path / "odd.jsonl", [row])
    with pytest.raises(DataError, match=r"odd.jsonl:1: ambiguous layout: two golds .*'4'.*'5'.*"
                                        r"data.problems.answer_key=reward_model.ground_truth"):
        load_problems(path)
    assert [p.answer for p in load_problems(path, columns=Columns("prompt", "reward_model.ground_truth"))] == ["4"]


def test_a_parquet_file_named_jsonl_is_read_as_parquet(tmp_path):
    path = write_parquet(tmp_path / "train.jsonl", verl_rows())  # the UnicodeDecodeError case
    assert [p.answer for p in load_problems(path)] == ["84", "24"]


def test_a_folder_of_parquet_shards_as_the_hub_keeps_them(tmp_path):
    (tmp_path / "data").mkdir()
    rows = open_r1_rows()
    write_parquet(tmp_path / "data" / "train-00000-of-00002.parquet", rows[:1])
    write_parquet(tmp_path / "data" / "train-00001-of-00002.parquet", rows[1:])
    assert [p.answer for p in load_problems(tmp_path)] == ["84", "24"]


def test_datasets_save_to_disk_folders_load_and_a_dataset_dict_names_its_splits(tmp_path):
    import datasets  # requirements-dev.txt: the writer is datasets' own
    ds = datasets.Dataset.from_list(verl_rows())
    ds.save_to_disk(str(tmp_path / "ds"))
    assert [p.answer for p in load_problems(tmp_path / "ds")] == ["84", "24"]
    datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list(open_r1_rows())}).save_to_disk(
        str(tmp_path / "dd"))
    assert [p.question for p in load_problems(tmp_path / "dd" / "test")] == [q for q, _, _ in PROBLEMS]
    with pytest.raises(DataError, match=r"DatasetDict with splits \['train', 'test'\].*dd/train"):
        load_problems(tmp_path / "dd")


def test_a_column_mapping_reads_any_other_layout(tmp_path):
    rows = [{"input": {"text": q}, "target": a, "uid": i} for q, a, i in PROBLEMS]  # slime-style keys, nested
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    with pytest.raises(DataError, match=r"unknown problem-set layout.*input\{text \(str\)\}.*target \(str\).*"
                                        r"data.problems.question_key"):
        load_problems(path)
    problems = load_problems(path, columns=Columns("input.text", "target", "uid"))
    assert [(p.id, p.question, p.answer) for p in problems] == [(i, q, a) for q, a, i in PROBLEMS]


def test_the_mapping_overrides_a_detected_layout(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows())
    problems = load_problems(path, columns=Columns(question="extra_info.index"))
    assert [p.question for p in problems] == [i for _, _, i in PROBLEMS]
    assert [p.answer for p in problems] == ["84", "24"]  # the layout's answer still


@pytest.mark.parametrize("bad,message", [
    ({"reward_model": {"style": "rule"}}, r"train.parquet:2: no answer \(field 'reward_model.ground_truth'\)"),
    ({"prompt": [{"role": "system", "content": "x"}]}, r"train.parquet:2: no problem text: field 'prompt' is a list"),
    ({"reward_model": {"ground_truth": None, "style": "rule"}}, r"train.parquet:2: no answer"),
])
def test_malformed_rows_name_file_and_row(tmp_path, bad, message):
    rows = verl_rows()
    rows[1] = {**rows[1], **bad}
    path = write_jsonl(tmp_path / "train.parquet.jsonl", rows)
    os.rename(path, tmp_path / "train.parquet")  # JSONL under a Parquet name: told by content too
    with pytest.raises(DataError, match=message):
        load_problems(tmp_path / "train.parquet")
    write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError, match=message):
        load_problems(tmp_path / "train.parquet")


def test_bytes_that_are_not_utf8_name_their_line(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"problem": "x", "answer": 1}\n{"problem": "\xff\xfe", "answer": 2}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not UTF-8"):
        load_problems(tmp_path / "bad.jsonl")


def test_the_problems_task_refuses_an_unloadable_set_at_config_time_naming_the_keys(tmp_path):
    good = write_parquet(tmp_path / "train.parquet", rstar2_agent_rows())
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"input": "1+1", "target": "2"}])
    with pytest.raises(ConfigValueError) as e:
        DataConfig.from_mapping({"task": "problems", "problems": {"train_path": good, "eval_path": odd}})
    assert "eval_path: " in str(e.value) and "data.problems.answer_key" in str(e.value) and "train_path" not in str(e.value)
    # the mapping is the run's, for both sets
    odd_train = write_jsonl(tmp_path / "odd_train.jsonl", [{"input": q, "target": a} for q, a, _ in PROBLEMS])
    cfg = DataConfig.from_mapping({"task": "problems", "problems": {"train_path": odd_train, "eval_path": odd,
                                                                   "question_key": "input", "answer_key": "target"}})
    task = make_task(cfg, seed=0)
    assert [p.answer for p in task.train_problems] == ["84", "24"]
    assert [(p.question, p.answer) for p in task.eval_problems] == [("1+1", "2")]
    with pytest.raises(ConfigValueError, match="train_path: .*train.parquet:1: no problem text: field 'input'"):
        DataConfig.from_mapping({"task": "problems", "problems": {"train_path": good, "eval_path": odd,
                                                                 "question_key": "input", "answer_key": "target"}})
