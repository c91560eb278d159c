"""Supervised fine-tuning step: token-mean NLL over the loss mask (model turns only).

Traces are padded rows (each its own row, as wide as the batch's longest), or with a token budget
packed rows (learner/packing.py: several traces per row, each attending within itself): the
demo's traces are 53% real tokens padded and ~90% packed, and the loss is the same token mean
(BENCHMARKS.md, "Packed SFT rows")."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.learner.batching import make_batch
from rstar2_jax.learner.packing import SEGMENTS_PER_ROW, plan_packing
from rstar2_jax.learner.optimizer import make_optimizer
from rstar2_jax.learner.train_step import TrainState, packed_segments, step_key
from rstar2_jax.models import lora
from rstar2_jax.models.logprobs import token_logprobs
from rstar2_jax.core.shared_jit import shared_jit


@dataclasses.dataclass(frozen=True)
class SFTConfig(Section):
    """The run's warm start (`sft.*`): SFT on the task's synthetic traces before RL."""
    steps: int = setting(350, "optimizer steps (0: no warm start; a run resumed past SFT skips it)", min=0)
    batch_size: int = setting(16, "traces per step", min=1)
    lr: float = setting(2e-3, "peak learning rate (AdamW, warm-up then constant)", min=0.0)
    warmup_steps: int = setting(30, "linear warm-up steps", min=0)
    examples: int = setting(4000, "synthetic traces made for SFT", min=1)
    token_budget: int = setting(0, "pack each step's traces into rows of this many tokens (at least the longest "
                                "trace; 0: one padded row per trace)", min=0)
    segments_per_row: int = setting(SEGMENTS_PER_ROW, "packed rows: at most this many traces share a row (cuDNN's "
                                    "packed backward holds memory in proportion to it: rl.segments_per_row)", min=1)


def sft_step(graphdef, tx, state: TrainState, tokens, loss_mask, frozen=None, layout=None):
    """frozen: the base when the state's params are LoRA adapters (models/lora.py). layout: packed
    rows' positions and segment tables (PackingPlan.layout(); None: padded rows). A packed trace's
    first token is masked as a padded row's is, so what precedes it in its row is never read."""
    positions = None if layout is None else layout["positions"]
    segments = None if layout is None else packed_segments(layout)

    def loss(params):
        with lora.dropout_key(step_key(state.step, 0)):  # LoRA dropout, when set
            lp = token_logprobs(lora.merged(graphdef, params, frozen), tokens, positions, segments)
        return -jnp.sum(lp * loss_mask) / jnp.maximum(loss_mask.sum(), 1.0)

    value, grads = jax.value_and_grad(loss)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(state.step + 1, params, opt_state), {"loss": value, "grad_norm": optax.global_norm(grads)}


class SFTTrainer:
    def __init__(self, model: nnx.Module, *, lr: float = SFTConfig.lr, warmup_steps: int = SFTConfig.warmup_steps,
                 weight_decay: float = 0.0, grad_clip: float = 1.0, pad_multiple: int = 64,
                 token_budget: int = SFTConfig.token_budget, segments_per_row: int = SFTConfig.segments_per_row,
                 optimizer: optax.GradientTransformation | None = None):
        """lr, warmup_steps, token_budget, segments_per_row: the `sft.*` settings, whose defaults
        they take (one copy: SFTConfig). token_budget: pack each step's traces into rows of this
        many tokens (0: padded rows), at most segments_per_row traces a row.
        optimizer: in place of AdamW (tests step with plain SGD, as the Learner's do)."""
        self.graphdef, params, self.frozen = lora.split_trained(model)  # with adapters: only they train
        params = jax.tree.map(jnp.copy, params)  # the step donates its state: never the caller's arrays
        self.tx = optimizer or make_optimizer(lr=lr, warmup_steps=warmup_steps, weight_decay=weight_decay,
                                              grad_clip=grad_clip)
        self.state = TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params))
        self.pad_multiple = pad_multiple
        self.token_budget, self.segments_per_row = token_budget, segments_per_row
        self._step = shared_jit(sft_step, self.graphdef, self.tx, donate_argnums=(0,))  # one per process (core/shared_jit.py)

    def step(self, examples) -> dict[str, float]:
        """examples: [(token_ids, loss_mask), ...]"""
        ids = [e[0] for e in examples]
        batch = make_batch(ids, [e[1] for e in examples], [[0.0] * len(t) for t in ids], [0.0] * len(ids),
                           pad_multiple=self.pad_multiple)
        tokens, mask, layout = batch.tokens, batch.loss_mask, None
        if self.token_budget:
            longest = int(batch.lengths.max())
            if longest > self.token_budget:
                raise ValueError(f"an SFT trace has {longest} tokens, more than sft.token_budget "
                                 f"({self.token_budget}): raise it to at least the longest trace")
            plan = plan_packing(batch.lengths, self.token_budget, max_segments=self.segments_per_row)
            tokens, mask, layout = plan.pack(tokens), plan.pack(mask), plan.layout()
        self.state, metrics = self._step(self.state, jax.device_put(tokens), jax.device_put(mask), self.frozen, layout)
        return {k: float(v) for k, v in metrics.items()}

    def train(self, data, steps: int, batch_size: int, seed: int,
              on_step: Callable[[int, dict[str, float]], None] | None = None) -> None:
        """`steps` steps on shuffled batches of `data` (iterate_batches), with a progress bar;
        on_step(i, metrics) after each (the run's metrics log)."""
        from tqdm.auto import tqdm
        if self.token_budget:  # refused before the first step, not at the batch that meets it
            longest = max((len(ids) for ids, _ in data), default=0)
            if longest > self.token_budget:
                raise ValueError(f"sft.token_budget={self.token_budget}: the longest of the {len(data)} SFT traces "
                                 f"has {longest} tokens; set sft.token_budget to at least {longest} (or 0: padded "
                                 "rows)")
        bar = tqdm(zip(range(steps), iterate_batches(data, batch_size, seed)), total=steps, desc="SFT",
                   dynamic_ncols=True)
        for i, batch in bar:
            metrics = self.step(batch)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}")
            if on_step is not None:
                on_step(i, metrics)

    def model(self) -> nnx.Module:
        return lora.merged(self.graphdef, self.state.params, self.frozen)

    def params(self):
        """Every parameter of the model (with LoRA: the base and the trained adapters)."""
        return lora.whole(self.state.params, self.frozen)


def iterate_batches(data, batch_size: int, seed: int):
    """Endless shuffled batches over `data`."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(data))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield [data[j] for j in order[i:i + batch_size]]
