"""Tokenizer (encode/decode, special tokens, chat template) and the tiny model directory."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from hypothesis import given, settings, strategies as st

from rstar2_jax import models
from rstar2_jax.models import tiny
from rstar2_jax.models.tokenizer import Tokenizer, TokenizerError
from tests.models import hf_reference as ref


@pytest.fixture(scope="module")
def tok(tokenizer):
    return tokenizer


@pytest.fixture(scope="module")
def hf_tok(tiny_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


TEXT = st.text(st.characters(codec="utf-8"), max_size=60) | st.lists(
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                     "12+7", " ", "\n", "print(x)", "é", "∑"]), max_size=12).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_encode_decode_round_trip_and_ids_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]


def test_special_and_tool_tokens(tok):
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    for t in tiny.TOOL_TOKENS + tiny.SPECIAL_TOKENS:
        assert len(tok.encode(t)) == 1, t
    ids = tok.encode("<|im_start|>a<tool_call>b</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "a<tool_call>b</tool_call>"
    assert tok.token_to_id("<tool_call>") not in tok.special_token_ids
    assert tok.eos_token_id in tok.special_token_ids


def test_chat_template_matches_transformers(tok, hf_tok):
    messages = [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": "What is 12 * 34? <b>&</b>"},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"type": "function", "function": {"name": "execute_python_code_with_standard_io",
                                              "arguments": {"code": "print(12*34)", "input": ""}}}]},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "<answer>\\boxed{408}</answer>"},
    ]
    tools = [{"type": "function", "function": {
        "name": "execute_python_code_with_standard_io", "description": "Run Python <code>.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}, "input": {"type": "string"}},
                       "required": ["code", "input"]}}}]
    for kwargs in (dict(tools=tools), dict()):
        ours = tok.apply_chat_template(messages[:4], add_generation_prompt=True, **kwargs)
        theirs = hf_tok.apply_chat_template(messages[:4], add_generation_prompt=True, tokenize=False, **kwargs)
        assert ours == theirs
    ours_ids = tok.apply_chat_template(messages, tools=tools, tokenize=True)
    theirs_ids = hf_tok(hf_tok.apply_chat_template(messages, tools=tools, tokenize=False),
                        add_special_tokens=False)["input_ids"]
    assert ours_ids == theirs_ids


def test_missing_files_and_template_are_clear_errors(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(open(f"{tiny_dir}/tokenizer.json").read())
    bare = Tokenizer.from_pretrained(tmp_path)
    assert bare.eos_token_id is None
    with pytest.raises(TokenizerError, match="no chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|nope|>"}')
    with pytest.raises(TokenizerError, match="eos_token '<\\|nope\\|>' is not in the vocabulary"):
        _ = Tokenizer.from_pretrained(tmp_path).eos_token_id


def test_tiny_model_directory_is_servable_and_loads_in_transformers(tiny_dir, tok):
    cfg = json.load(open(f"{tiny_dir}/config.json"))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] >= 32 and cfg["tie_word_embeddings"] is False  # vLLM CPU constraints
    assert cfg["vocab_size"] >= tok.vocab_size and cfg["eos_token_id"] == tok.eos_token_id

    model = models.load_pretrained(tiny_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype="float32").eval()
    hf_model.config._attn_implementation = "eager"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                  tokenize=True)
    tokens = np.asarray([ids], np.int32)
    diff = np.abs(np.asarray(model(jnp.asarray(tokens))) - ref.hf_logits(hf_model, tokens, np.array([len(ids)]))).max()
    assert diff <= 1e-4
