"""LoRA adapters as PEFT writes them: `adapter_model.safetensors` and `adapter_config.json`.

The files load unchanged in PEFT (`PeftModel.from_pretrained`) and in vLLM (`--enable-lora`,
`POST /v1/load_lora_adapter`). PEFT's names and layout, against ours (models/lora.py):

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in_features]  = A.reshape(in, r).T
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out_features, r] = B.reshape(r, out).T

with in/out flattened as the HF Linear flattens them (heads major, head_dim minor: weight_map.py),
and the product scaled by lora_alpha / r, as ours.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from rstar2_jax.models.lora import ADAPTER_SUFFIX, TARGETS, LoRAConfig, LoRAParam

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_PREFIX = "base_model.model.model.layers."


def _peft_name(path: str) -> str:
    """'layers.3.attn.q_proj_lora.a' -> PEFT's name of that matrix."""
    _, layer, _, adapter, matrix = path.split(".")
    target = adapter[:-len(ADAPTER_SUFFIX)]
    return f"{_PREFIX}{layer}.{TARGETS[target][1]}.lora_{matrix.upper()}.weight"


def adapter_tensors(params, dtype=np.float32) -> dict[str, np.ndarray]:
    """PEFT name -> array (in `dtype`) of every adapter matrix in `params` (an nnx.State of a
    model's Params, or of its LoRAParams alone), in PEFT's layout."""
    out = {}
    for path, var in nnx.to_flat_state(params):
        if not isinstance(var, LoRAParam):
            continue
        name, x = ".".join(map(str, path)), np.asarray(var.get_value()).astype(dtype)
        if name.endswith(".a"):  # [in..., r] -> [r, in]
            out[_peft_name(name)] = np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)
        else:                    # [r, out...] -> [out, r]
            out[_peft_name(name)] = np.ascontiguousarray(x.reshape(x.shape[0], -1).T)
    return out


def write_adapter(params, cfg: LoRAConfig, out_dir: str, base_model: str = "", dtype=np.float32) -> str:
    """The adapters of `params` as a PEFT adapter directory, tensors in `dtype` (float32, as
    trained; a sync writes the servers' dtype: rollout/engines/vllm_engine/sync/adapters.py); returns
    `out_dir`. Written to a temporary name and renamed, so a reader never sees half a file."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = adapter_tensors(params, dtype)
    if not tensors:
        raise ValueError("these parameters hold no LoRA adapters (model.lora.rank is 0?)")
    tmp = os.path.join(out_dir, f".{WEIGHTS_FILE}.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, WEIGHTS_FILE))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
              "target_modules": list(cfg.targets), "lora_dropout": cfg.dropout, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "base_model_name_or_path": base_model}
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE)) and os.path.isfile(os.path.join(path, WEIGHTS_FILE))


def read_adapter_config(path: str) -> LoRAConfig:
    """The LoRAConfig a PEFT adapter directory was written with (a clear error for what we do not run)."""
    with open(os.path.join(path, CONFIG_FILE)) as f:
        c = json.load(f)
    if c.get("peft_type", "LORA") != "LORA" or c.get("use_dora") or c.get("use_rslora"):
        raise ValueError(f"{path}/{CONFIG_FILE}: only plain LoRA adapters are read (no DoRA, no rsLoRA)")
    targets = c["target_modules"]
    targets = [targets] if isinstance(targets, str) else targets
    return LoRAConfig(rank=int(c["r"]), alpha=float(c["lora_alpha"]), targets=tuple(t for t in TARGETS if t in targets),
                      dropout=float(c.get("lora_dropout", 0.0)))


def load_adapter(model: nnx.Module, path: str) -> nnx.Module:
    """Set `model`'s adapters (attached with the directory's LoRAConfig) to the files' values, in place."""
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    state = nnx.state(model, LoRAParam)
    for key, var in nnx.to_flat_state(state):
        name = ".".join(map(str, key))
        peft = _peft_name(name)
        if peft not in tensors:
            raise ValueError(f"{path}/{WEIGHTS_FILE} has no tensor {peft} (the adapter of {name})")
        x, shape = tensors[peft], var.get_value().shape
        is_a = name.endswith(".a")
        rank, file_rank = (shape[-1], x.shape[0]) if is_a else (shape[0], x.shape[-1])
        if math.prod(shape) != x.size or rank != file_rank:
            raise ValueError(f"{path}: {peft} has shape {list(x.shape)}, the model's adapter {list(shape)}")
        var.set_value(x.T.reshape(shape).astype(var.get_value().dtype))  # PEFT [r, in] / [out, r] -> ours
    nnx.update(model, state)
    return model


def base_identity(model_dir: str, sample_bytes: int = 1 << 20) -> dict[str, str]:
    """What names the base an adapter was trained on: sha256 of its config.json, and per weights
    file its size and sha256 of its safetensors header and first `sample_bytes` of data. Read in
    milliseconds (a 14B base is 30 GB: hashing it whole would take minutes every resume); any
    other base differs in its config, its tensor list, its sizes, or its first weights."""
    import hashlib
    out = {}
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if name == "config.json":
            with open(path, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
        elif name.endswith(".safetensors"):
            with open(path, "rb") as f:
                header = int.from_bytes(f.read(8), "little")
                digest = hashlib.sha256(f.read(header + sample_bytes)).hexdigest()
            out[name] = f"{os.path.getsize(path)}:{digest}"
    return out


def load_model_dir(path: str, dtype=None) -> nnx.Module:
    """A HF model directory, or a PEFT adapter directory on the base its adapter_config.json
    names (`base_model_name_or_path`): what evaluate and chat take as --model."""
    import jax.numpy as jnp

    from rstar2_jax.models.checkpoint import load_pretrained
    from rstar2_jax.models.lora import attach
    dtype = dtype or jnp.float32
    if not is_adapter_dir(path):
        return load_pretrained(path, dtype)
    base = _named_base(path)
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise ValueError(f"{path}/{CONFIG_FILE} names base model {base!r}, which is not a model directory here: "
                         "set base_model_name_or_path to the base's directory")
    return load_adapter(attach(load_pretrained(base, dtype), read_adapter_config(path), seed=0), path)


def _named_base(adapter_dir: str) -> str:
    """The base an adapter directory's adapter_config.json names ('' when none)."""
    with open(os.path.join(adapter_dir, CONFIG_FILE)) as f:
        return json.load(f).get("base_model_name_or_path") or ""


def base_dir_of(path: str) -> str:
    """The model directory holding the tokenizer and config of `path` (an adapter's base)."""
    if not is_adapter_dir(path):
        return path
    return _named_base(path) or path
