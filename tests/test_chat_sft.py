"""Chat JSONL SFT data: masks on assistant content only; the sft CLI writes a loadable model."""

import json
import os
import subprocess
import sys

import pytest

from rstar2_jax import models
from rstar2_jax.data.chat_sft import load_conversations, tokenize_conversation
from rstar2_jax.data.problems import DataError
from rstar2_jax.models import tiny
from rstar2_jax.models.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONV = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "<tool_call>x</tool_call>"}, {"role": "tool", "content": "4"},
                     {"role": "assistant", "content": "<answer>\\boxed{4}</answer>"}]}


def test_mask_covers_assistant_content_and_end_of_turn_only(tmp_path):
    d = tiny.build_tiny_model(tmp_path / "m")
    tok = Tokenizer.from_pretrained(d)
    ids, mask = tokenize_conversation(tok, CONV)
    assert tok.decode(ids) == tok.apply_chat_template(CONV["messages"])
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "<tool_call>x</tool_call><|im_end|>\n<answer>\\boxed{4}</answer><|im_end|>\n"


@pytest.mark.parametrize("line,message", [
    ("{oops", "bad.jsonl:1: invalid JSON"),
    ('{"messages": []}', "bad.jsonl:1: expected a non-empty"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "bad.jsonl:1: each message needs a role"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "bad.jsonl:1: no assistant message"),
])
def test_bad_lines(tmp_path, line, message):
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    with pytest.raises(DataError, match=message):
        load_conversations(tmp_path / "bad.jsonl")


def test_sft_cli_trains_and_saves_a_loadable_model(tmp_path):
    d = tiny.build_tiny_model(tmp_path / "m")
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(CONV) for _ in range(4)) + "\n")
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.sft", f"--model={d}", f"--data={tmp_path / 'data.jsonl'}",
                           f"--out={tmp_path / 'out'}", "--steps=3", "--batch_size=2", "--lr=1e-3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = models.load_pretrained(tmp_path / "out")
    assert out.cfg == models.load_pretrained(d).cfg
    assert os.path.exists(tmp_path / "out" / "tokenizer.json")
