"""Decoder configuration, read from (and written back to) a Hugging Face `config.json`.

One `ModelConfig` covers the three supported families:

| family  | HF architectures        | differences from the common decoder                  |
|---------|-------------------------|------------------------------------------------------|
| qwen3   | Qwen3ForCausalLM        | per-head RMSNorm on q and k before RoPE; no biases     |
| qwen2   | Qwen2ForCausalLM        | biases on q, k and v projections                       |
| llama   | LlamaForCausalLM        | optional llama3 RoPE frequency scaling                 |

Anything the decoder does not implement (another architecture, sliding-window attention, an
unknown RoPE type, another activation) is rejected with an error naming the field, so a model
never loads "almost right".
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
MODEL_TYPES = {family: arch for arch, family in ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json the decoder cannot represent exactly."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # qwen3 | qwen2 | llama
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and for llama also o) projections carry a bias
    qk_norm: bool = False  # per-head RMSNorm on q and k (qwen3)
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.family not in MODEL_TYPES:
            raise ConfigError(f"unsupported model family {self.family!r}; supported: {sorted(MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")

    @property
    def architecture(self) -> str:
        return MODEL_TYPES[self.family]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # ----------------------------------------------------------------------------------------
    # Hugging Face config.json <-> ModelConfig

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        family = _family_of(hf, source)

        def need(key):
            if key not in hf or hf[key] is None:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            return hf[key]

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
        if hf.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported")
        layer_types = hf.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            bad = sorted({t for t in layer_types if t != "full_attention"})
            raise ConfigError(f"{source}: layer_types {bad} are not supported (only full_attention)")
        if hf.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        if int(hf.get("pretraining_tp", 1) or 1) != 1:
            raise ConfigError(f"{source}: pretraining_tp={hf['pretraining_tp']} is not supported")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"{source}: hidden_size {hidden} not divisible by num_attention_heads {heads}")
            head_dim = hidden // heads
        if int(head_dim) % 2:
            raise ConfigError(f"{source}: head_dim must be even for RoPE, got {head_dim}")

        if family == "qwen2":
            attention_bias = True  # Qwen2 always has q/k/v biases; there is no config switch
        else:
            attention_bias = bool(hf.get("attention_bias", False))
        if family == "qwen3" and attention_bias:
            raise ConfigError(f"{source}: attention_bias=true is not supported for qwen3")
        fields = dict(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_of(hf, source),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=family == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )
        try:
            return cls(**fields)
        except ConfigError as e:  # a value check in __post_init__: say which file it came from
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"model config not found: {path}")
        with open(path) as f:
            try:
                hf = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: line {e.lineno}: invalid JSON: {e.msg}") from None
        return cls.from_hf_dict(hf, source=path)

    def to_hf_dict(self) -> dict[str, Any]:
        rope_parameters: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type in ("linear", "llama3"):
            rope_parameters["factor"] = self.rope.factor
        if self.rope.rope_type == "llama3":
            rope_parameters.update(
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings)
        hf = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            # Both spellings: transformers >= 5 reads rope_parameters, older readers (and vLLM
            # versions that predate it) read rope_theta / rope_scaling.
            "rope_parameters": rope_parameters,
            "rope_theta": self.rope.theta,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.rope.rope_type != "default":
            hf["rope_scaling"] = dict(rope_parameters)
        if self.family == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        if self.family == "qwen3":
            hf["attention_bias"] = False
        if self.family in ("qwen2", "qwen3"):
            hf["use_sliding_window"] = False
        return hf


def _family_of(hf: dict[str, Any], source: str) -> str:
    archs = hf.get("architectures") or []
    if archs:
        unknown = [a for a in archs if a not in ARCHITECTURES]
        if unknown:
            raise ConfigError(f"{source}: unsupported architecture {unknown[0]!r}; "
                              f"supported: {sorted(ARCHITECTURES)}")
        return ARCHITECTURES[archs[0]]
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{source}: unsupported model_type {model_type!r}; supported: {sorted(MODEL_TYPES)}")
    return model_type


def _rope_of(hf: dict[str, Any], source: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; released checkpoints use rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported; "
                          f"supported: {list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise ConfigError(f"{source}: rope type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in params:
            raise ConfigError(f"{source}: llama3 rope scaling needs {key!r}")
    return RopeConfig(theta=theta, rope_type="llama3", factor=float(params["factor"]),
                      low_freq_factor=float(params["low_freq_factor"]),
                      high_freq_factor=float(params["high_freq_factor"]),
                      original_max_position_embeddings=int(params["original_max_position_embeddings"]))
