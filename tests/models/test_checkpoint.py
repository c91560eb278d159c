"""HF checkpoint I/O: bit-exact round trips, sharded files, and clear errors for bad directories."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rstar2_jax import models
from rstar2_jax.models.checkpoint import CheckpointError, model_params_host
from rstar2_jax.models.config import ConfigError
from tests.models.conftest import random_model, small_config


def _assert_params_identical(a, b):
    pa, pb = model_params_host(a), model_params_host(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        np.testing.assert_array_equal(pa[name].view(np.uint8), pb[name].view(np.uint8), err_msg=name)


@pytest.mark.parametrize("family,tied", [("qwen3", False), ("qwen3", True), ("qwen2", False), ("llama", False)])
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_save_load_round_trip_is_bit_exact(tmp_path, family, tied, param_dtype):
    model = random_model(small_config(family, tie_word_embeddings=tied), param_dtype=param_dtype)
    models.save_pretrained(model, tmp_path)
    loaded = models.load_pretrained(tmp_path, dtype=param_dtype)
    assert loaded.cfg == model.cfg
    _assert_params_identical(model, loaded)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["torch_dtype"] == jnp.dtype(param_dtype).name


def test_sharded_checkpoint_round_trip(tmp_path):
    model = random_model(small_config("qwen3"))
    models.save_pretrained(model, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    _assert_params_identical(model, models.load_pretrained(tmp_path))


def test_load_with_other_param_dtype_casts(tmp_path):
    model = random_model(small_config("qwen3"))
    models.save_pretrained(model, tmp_path)
    loaded = models.load_pretrained(tmp_path, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    assert loaded.dtype == jnp.bfloat16
    assert loaded.embed.get_value().dtype == jnp.float32


def test_tokenizer_files_are_optional_and_copied(tmp_path):
    model = random_model(small_config("qwen3"))
    models.save_pretrained(model, tmp_path / "a")
    (tmp_path / "a" / "tokenizer.json").write_text("{}")
    loaded = models.load_pretrained(tmp_path / "a")  # no tokenizer_config.json: fine
    models.save_pretrained(loaded, tmp_path / "b")
    assert (tmp_path / "b" / "tokenizer.json").read_text() == "{}"


def _saved(tmp_path, **cfg):
    model = random_model(small_config("qwen3", **cfg))
    models.save_pretrained(model, tmp_path)
    return tmp_path


def _edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    d = _saved(tmp_path)
    _edit_tensors(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        models.load_pretrained(d)


def test_extra_tensor_is_named(tmp_path):
    d = _saved(tmp_path)
    _edit_tensors(d, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.0\.mlp\.extra\.weight"):
        models.load_pretrained(d)


def test_wrong_shape_is_named(tmp_path):
    d = _saved(tmp_path)
    _edit_tensors(d, lambda t: t.update({"model.norm.weight": np.zeros(63, np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \[63\].*\[64\]"):
        models.load_pretrained(d)


def test_missing_shard_file_is_named(tmp_path):
    model = random_model(small_config("qwen3"))
    models.save_pretrained(model, tmp_path, max_shard_bytes=40_000)
    os.remove(tmp_path / "model-00002-of-{:05d}.safetensors".format(
        len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()))))
    with pytest.raises(CheckpointError, match=r"shard 'model-00002-of-\d+\.safetensors'.*missing"):
        models.load_pretrained(tmp_path)


def test_no_weights_and_no_config_are_clear(tmp_path):
    d = _saved(tmp_path)
    os.remove(d / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        models.load_pretrained(d)
    os.remove(d / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.load_pretrained(d)
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        models.load_pretrained(tmp_path / "nope")


def _hf_config(**changes):
    cfg = small_config("qwen3").to_hf_dict()
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("changes,message", [
    (dict(architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
    (dict(architectures=None, model_type="mistral"), "unsupported model_type 'mistral'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "rope type 'yarn'"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(hidden_size=None), "'hidden_size' is missing"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_attention"),
])
def test_unsupported_config_is_a_clear_error(tmp_path, changes, message):
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(**changes)))
    with pytest.raises(ConfigError, match=message) as err:
        models.load_pretrained(tmp_path)
    assert "config.json" in str(err.value)


def test_invalid_json_names_file_and_line(tmp_path):
    (tmp_path / "config.json").write_text('{\n  "vocab_size": 3,\n  oops\n}')
    with pytest.raises(ConfigError, match=r"config\.json: line 3"):
        models.load_pretrained(tmp_path)
