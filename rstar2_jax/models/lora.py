"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv 2106.09685) on the decoder's projections.

A targeted projection W (ours: [in..., out...]) computes x W + scale * (x A) B, with A [in..., r]
and B [r, out...], scale = alpha / r (PEFT's `lora_alpha / r`), A drawn as PEFT draws it
(uniform in +-1/sqrt(fan_in)) and B zero, so a fresh adapter leaves the model unchanged.

    model = load_pretrained(path, dtype=jnp.bfloat16)       # the base, in its serving dtype
    attach(model, LoRAConfig(rank=8), seed=0)                # adapters on every target
    graphdef, trained, frozen = split_trained(model)         # adapters | the base

The adapters are `LoRAParam`s (a kind of nnx.Param), so everything that handles a model's
Params (engines, the weight sync, `model_with`) handles them too, and `split_trained` tells the
learner what it trains: only the adapters when a model has them, else every parameter.
Their names follow PEFT (`adapter_files` writes them), so an adapter loads in PEFT and vLLM.

Dropout (`LoRAConfig.dropout`, PEFT's `lora_dropout`: on the adapter's input, B A dropout(x))
applies only inside `with dropout_key(key):`, which the learner's and SFT's gradient passes open
(a key per optimizer step and micro-batch); every other pass (old and reference log-probs,
engines, evaluation) runs without it. With dropout the recomputed policy of the loss is not the
one that sampled or the old one: PPO's ratio departs from 1 from the first step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from rstar2_jax.core.config_types import Section, changed_fields, setting


class LoRAParam(nnx.Param):
    """An adapter matrix (A or B): what the learner trains when a model has adapters."""


# target name -> (the layer's submodule, the HF module path, input dims of our kernel)
TARGETS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("attn", "self_attn.q_proj", 1),
    "k_proj": ("attn", "self_attn.k_proj", 1),
    "v_proj": ("attn", "self_attn.v_proj", 1),
    "o_proj": ("attn", "self_attn.o_proj", 2),
    "gate_proj": ("mlp", "mlp.gate_proj", 1),
    "up_proj": ("mlp", "mlp.up_proj", 1),
    "down_proj": ("mlp", "mlp.down_proj", 1),
}
ADAPTER_SUFFIX = "_lora"  # the adapter of `q_proj` is the attribute `q_proj_lora` beside it


@dataclasses.dataclass(frozen=True)
class LoRAConfig(Section):
    """`model.lora.*`: low-rank adapters trained in place of the full weights (rank 0: off)."""
    rank: int = setting(0, "adapter rank r (0: full fine-tuning, every parameter trained)", min=0)
    alpha: float = setting(16.0, "scale alpha / r of the adapters' product (PEFT's lora_alpha)", min=0.0)
    targets: tuple[str, ...] = setting(tuple(TARGETS), "projections that get an adapter, by name: "
                                       + " | ".join(TARGETS))
    dropout: float = setting(0.0, "dropout on each adapter's input in the gradient passes (PEFT's lora_dropout; "
                             "0: none)", min=0.0)

    def rules(self):
        if not self.enabled:  # LoRA off: its settings would be kept and never read, as an unselected part's
            for name in changed_fields(self):
                if name != "rank":
                    yield name, (f"is set but LoRA is off (model.lora.rank=0): set model.lora.rank > 0, or leave "
                                 f"model.lora.{name} at its default")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            yield "targets", f"{unknown} are not projections of the decoder; choose from {list(TARGETS)}"
        if self.rank and not self.targets:
            yield "targets", "rank > 0 needs at least one target projection"
        if self.dropout >= 1.0:
            yield "dropout", f"must be below 1 (the share of inputs dropped), got {self.dropout}"
        if len(set(self.targets)) != len(self.targets):
            yield "targets", f"{list(self.targets)} names a projection twice"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def widths(model_cfg) -> dict[str, tuple[int, int]]:
    """Each target projection's (in, out) features in a model of `model_cfg` (a ModelConfig)."""
    return {"q_proj": (model_cfg.hidden_size, model_cfg.num_heads * model_cfg.head_dim),
            "k_proj": (model_cfg.hidden_size, model_cfg.num_kv_heads * model_cfg.head_dim),
            "v_proj": (model_cfg.hidden_size, model_cfg.num_kv_heads * model_cfg.head_dim),
            "o_proj": (model_cfg.num_heads * model_cfg.head_dim, model_cfg.hidden_size),
            "gate_proj": (model_cfg.hidden_size, model_cfg.intermediate_size),
            "up_proj": (model_cfg.hidden_size, model_cfg.intermediate_size),
            "down_proj": (model_cfg.intermediate_size, model_cfg.hidden_size)}


def adapter_parameters(cfg: LoRAConfig, model_cfg) -> int:
    """How many numbers the adapters hold: r x (in + out) per target and layer."""
    if not cfg.enabled:
        return 0
    w = widths(model_cfg)
    return model_cfg.num_layers * sum(cfg.rank * sum(w[t]) for t in cfg.targets if t in w)


def rank_problems(cfg: LoRAConfig, model_cfg) -> list[str]:
    """Why `cfg` cannot adapt a model of `model_cfg` (a rank above a target's smaller width)."""
    widths_of = widths(model_cfg)
    return [f"rank {cfg.rank} is above {t}'s width {min(widths_of[t])} (in {widths_of[t][0]}, out {widths_of[t][1]}): "
            f"lower model.lora.rank to at most {min(widths_of[t])}"
            for t in cfg.targets if t in widths_of and cfg.rank > min(widths_of[t])]


_DROPOUT_KEY: contextvars.ContextVar = contextvars.ContextVar("lora_dropout_key", default=None)


@contextlib.contextmanager
def dropout_key(key):
    """Adapters with dropout drop inputs while tracing inside this block (key: a jax PRNG key; each
    adapter folds in its own index). None: no dropout."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


class Adapter(nnx.Module):
    """scale * (dropout(x) A) B for one projection whose kernel has `in_ndim` input dims."""

    def __init__(self, kernel_shape: tuple[int, ...], kernel_axes: tuple, in_ndim: int, rank: int, scale: float,
                 *, rngs: nnx.Rngs, dropout: float = 0.0, index: int = 0):
        in_shape, out_shape = kernel_shape[:in_ndim], kernel_shape[in_ndim:]
        bound = 1.0 / math.sqrt(math.prod(in_shape))  # PEFT: kaiming_uniform(a=sqrt(5)) on A
        self.in_ndim, self.scale, self.dropout, self.index = in_ndim, scale, dropout, index
        self.a = LoRAParam(jax.random.uniform(rngs.params(), (*in_shape, rank), jnp.float32, -bound, bound),
                           axes=(*kernel_axes[:in_ndim], None))
        self.b = LoRAParam(jnp.zeros((rank, *out_shape), jnp.float32), axes=(None, *kernel_axes[in_ndim:]))

    def __call__(self, x: jax.Array) -> jax.Array:
        key = _DROPOUT_KEY.get()
        if key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.index), 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        low = jnp.tensordot(x, self.a[...].astype(x.dtype), axes=self.in_ndim)
        return jnp.tensordot(low, self.b[...].astype(x.dtype), axes=1) * jnp.asarray(self.scale, x.dtype)


def adapted(module: nnx.Module, name: str, x: jax.Array, out: jax.Array) -> jax.Array:
    """`out` (= x @ module.<name>) plus its adapter's term when the projection has one."""
    adapter = getattr(module, name + ADAPTER_SUFFIX, None)
    return out if adapter is None else out + adapter(x).astype(out.dtype)


def attach(model: nnx.Module, cfg: LoRAConfig, seed: int) -> nnx.Module:
    """Give every targeted projection of every layer a fresh adapter (in place; returns `model`)."""
    if not cfg.enabled:
        return model
    problems = rank_problems(cfg, model.cfg)
    if problems:
        raise ValueError("; ".join(problems))
    rngs = nnx.Rngs(seed)
    for i, layer in enumerate(model.layers):
        for j, name in enumerate(cfg.targets):
            part, _, in_ndim = TARGETS[name]
            module = getattr(layer, part)
            kernel = getattr(module, name)
            setattr(module, name + ADAPTER_SUFFIX,
                    Adapter(tuple(kernel.shape), tuple(kernel.axes), in_ndim, cfg.rank, cfg.scale, rngs=rngs,
                            dropout=cfg.dropout, index=i * len(TARGETS) + j))
    return model


def config_of(model: nnx.Module) -> LoRAConfig | None:
    """The LoRAConfig `model`'s adapters were attached with (None: it has none)."""
    found = [(name, getattr(getattr(model.layers[0], part), name + ADAPTER_SUFFIX, None))
             for name, (part, _, _) in TARGETS.items()]
    found = [(name, a) for name, a in found if a is not None]
    if not found:
        return None
    first = found[0][1]
    rank = first.a.shape[-1]
    return LoRAConfig(rank=rank, alpha=first.scale * rank, targets=tuple(name for name, _ in found),
                      dropout=first.dropout)


def has_adapters(model: nnx.Module) -> bool:
    return bool(jax.tree.leaves(nnx.state(model, LoRAParam)))


def split_trained(model: nnx.Module):
    """(graphdef, trained, frozen): the adapters and the base when `model` has adapters, else
    every parameter and None. `merged(graphdef, trained, frozen)` puts them back together."""
    if has_adapters(model):
        return nnx.split(model, LoRAParam, nnx.Param)
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params, None


def merged(graphdef, trained, frozen=None) -> nnx.Module:
    return nnx.merge(graphdef, trained) if frozen is None else nnx.merge(graphdef, trained, frozen)


def whole(trained, frozen=None):
    """Every parameter as one nnx.State (what engines and exports take): `trained` alone, or the
    frozen base with the adapters."""
    return trained if frozen is None else nnx.merge_state(frozen, trained)


def merged_into_base(model: nnx.Module) -> nnx.Module:
    """A plain decoder (no adapters) whose targeted kernels are W + scale * A B: what a HF
    checkpoint of the adapted policy holds. `model` is left as it is."""
    plain = nnx.clone(model)  # new Variables (the arrays, immutable, are shared until replaced)
    for layer in plain.layers:
        for name, (part, _, _) in TARGETS.items():
            module = getattr(layer, part)
            adapter = getattr(module, name + ADAPTER_SUFFIX, None)
            if adapter is None:
                continue
            kernel = getattr(module, name)
            delta = jnp.tensordot(adapter.a[...], adapter.b[...], axes=1) * adapter.scale
            kernel.set_value((kernel[...].astype(jnp.float32) + delta).astype(kernel.dtype))
            delattr(module, name + ADAPTER_SUFFIX)
    return plain
