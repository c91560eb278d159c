"""Hugging Face checkpoint directories <-> `Decoder`.

Loading builds the model abstractly (`nnx.eval_shape`: shapes, no memory), then reads one
tensor at a time from the safetensors files (single file, or sharded with
`model.safetensors.index.json`) and places it straight onto its sharding, so peak host memory
is one tensor and no full-precision copy of the model is ever made on device. Only config.json
and the safetensors are needed; tokenizer files are optional.

Everything that does not match exactly is an error naming the tensor or file: a missing
tensor, an unexpected tensor, a wrong shape, a shard named in the index but absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from rstar2_jax.core import sharding as sharding_lib
from rstar2_jax.models import weight_map
from rstar2_jax.models.config import ModelConfig
from rstar2_jax.models.decoder import Decoder

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt",
                   "added_tokens.json")


class CheckpointError(ValueError):
    """A checkpoint directory that does not match the model its config describes."""


def _dtype_name(dtype) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[jnp.dtype(dtype).name]


def _param_paths(state: nnx.State) -> dict[str, Any]:
    """'layers.3.attn.q_proj' -> the Param (abstract or concrete) in an nnx state."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        out[".".join(str(p) for p in path)] = var
    return out


def abstract_model(cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32) -> Decoder:
    """The model with ShapeDtypeStruct parameters: costs no memory."""
    return nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))


def tensor_index(model_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, for a single-file or sharded checkpoint."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    single_path = os.path.join(model_dir, SINGLE_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            try:
                weight_file = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: not a safetensors index ({e})") from None
        for fname in sorted(set(weight_file.values())):
            if not os.path.exists(os.path.join(model_dir, fname)):
                raise CheckpointError(f"{index_path} names shard {fname!r}, which is missing from {model_dir}")
        return {name: os.path.join(model_dir, fname) for name, fname in weight_file.items()}
    if os.path.exists(single_path):
        with safe_open(single_path, "np") as f:
            return {name: single_path for name in f.keys()}
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def load_pretrained(model_dir: str | os.PathLike, dtype=jnp.float32, *, param_dtype=None,
                    mesh: Mesh | None = None, rules=sharding_lib.DEFAULT_RULES,
                    progress: bool | None = None) -> Decoder:
    """Load a HF directory (config.json + *.safetensors) into a `Decoder`.

    dtype: compute dtype. param_dtype: storage dtype of the parameters (default: dtype).
    mesh: when given, every parameter is placed directly onto its NamedSharding.
    """
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    cfg = ModelConfig.from_json_file(os.path.join(model_dir, "config.json"))
    param_dtype = dtype if param_dtype is None else param_dtype
    graphdef, abstract_state = nnx.split(abstract_model(cfg, dtype=dtype, param_dtype=param_dtype))
    params = _param_paths(abstract_state)
    specs = weight_map.weight_specs(list(params))
    files = tensor_index(model_dir)

    expected = {spec.hf for spec in specs.values()}
    missing = sorted(expected - files.keys())
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}"
                              f" ({len(missing)} of {len(expected)})")
    extra = sorted(n for n in files.keys() - expected if not weight_map.unused_hf_name(n, cfg))
    if extra:
        raise CheckpointError(f"{model_dir}: unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''}"
                              f" not used by {cfg.architecture}")

    shardings = (sharding_lib.param_shardings(abstract_state, mesh, rules) if mesh is not None else None)
    flat_shardings = _param_paths(shardings) if shardings is not None else {}
    loaded = {}
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(path, "np")) for path in sorted(set(files.values()))}
        for path, var in tqdm(params.items(), desc=f"loading {os.path.basename(model_dir)}",
                              disable=(not progress) if progress is not None else None, leave=False):
            spec = specs[path]
            our_shape = tuple(var.shape if hasattr(var, "shape") else var.value.shape)
            handle = handles[files[spec.hf]]
            want = weight_map.hf_shape(spec, our_shape)
            got = tuple(handle.get_slice(spec.hf).get_shape())
            if got != want:
                raise CheckpointError(f"{files[spec.hf]}: tensor {spec.hf!r} has shape {list(got)}, "
                                      f"config.json implies {list(want)}")
            if path in flat_shardings:  # each device takes its own slice of the host tensor
                host = weight_map.from_hf(spec, handle.get_tensor(spec.hf), our_shape).astype(param_dtype, copy=False)
                target = flat_shardings[path].get_value()
                loaded[path] = jax.make_array_from_callback(host.shape, target, lambda idx, a=host: a[idx])
            else:  # contiguous bytes to the device; the layout change happens there
                loaded[path] = weight_map.from_hf_on_device(spec, jax.device_put(handle.get_tensor(spec.hf)),
                                                            our_shape, jnp.dtype(param_dtype))
    state = nnx.from_flat_state([(tuple(int(p) if p.isdigit() else p for p in path.split(".")),
                                 params[path].replace(loaded[path])) for path in params])
    model = nnx.merge(graphdef, state)
    model.source_dir = model_dir
    return model


def model_params_hf(model: Decoder, dtype=None) -> dict[str, jax.Array]:
    """HF tensor name -> device array in HF layout, in `dtype` (default: the parameters' own)."""
    params = _param_paths(nnx.state(model, nnx.Param))
    specs = weight_map.weight_specs(list(params))
    out = {}
    for path, var in params.items():
        value = var.get_value()
        out[specs[path].hf] = weight_map.to_hf_on_device(specs[path], value, jnp.dtype(dtype or value.dtype))
    return out


def model_params_host(model: Decoder, dtype=None) -> dict[str, np.ndarray]:
    """HF tensor name -> host numpy array, in `dtype` (default: the parameters' own).

    Cast and layout change happen on the device, so only the written bytes cross to the host."""
    return {name: np.asarray(jax.device_get(x)) for name, x in model_params_hf(model, dtype).items()}


def save_pretrained(model: Decoder, out_dir: str | os.PathLike, *, dtype=None,
                    max_shard_bytes: int = 4 << 30, tokenizer_dir: str | None = None) -> str:
    """Write a HF directory (config.json, safetensors, tokenizer files) that transformers and vLLM load.

    dtype: dtype of the written tensors (default: the parameters' own). More than
    `max_shard_bytes` of tensors are split into model-0000k-of-0000n.safetensors plus an index.
    Tokenizer files are copied from `tokenizer_dir` (default: the directory the model came from).
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tensors = model_params_host(model, dtype)
    written_dtype = next(iter(tensors.values())).dtype

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for stale in (SINGLE_FILE, INDEX_FILE):
        if os.path.exists(os.path.join(out_dir, stale)):
            os.remove(os.path.join(out_dir, stale))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_file = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_file.update({name: fname for name in shard})
        index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                 "weight_map": dict(sorted(weight_file.items()))}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)

    hf_config = model.cfg.to_hf_dict()
    hf_config["torch_dtype"] = hf_config["dtype"] = _dtype_name(written_dtype)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)

    source = tokenizer_dir or getattr(model, "source_dir", None)
    if source and os.path.abspath(source) != os.path.abspath(out_dir):
        for fname in TOKENIZER_FILES:
            if os.path.exists(os.path.join(source, fname)):
                shutil.copy2(os.path.join(source, fname), os.path.join(out_dir, fname))
    return out_dir
