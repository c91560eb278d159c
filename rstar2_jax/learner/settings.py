"""LearnerSettings: every setting the learner reads, defined once.

They are `rl.*` settings: the run's RLConfig (rl/config.py) extends this section, so `rl.lr`,
`rl.loss`, `rl.micro_batches`... have one definition and one default, here, and the trainer hands
`cfg.rl` to the Learner as it is. Tests and benchmarks build a LearnerSettings directly.
"""

from __future__ import annotations

import dataclasses

from rstar2_jax.algo import KLConfig, PolicyLossConfig
from rstar2_jax.algo.corrections import CorrectionConfig
from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.learner.packing import SEGMENTS_PER_ROW

AUTO_TOKEN_BUDGET = -1  # rl.token_budget's default: chosen by the memory plan (see the setting)

# rl.old_logprobs: where an update's old (proximal) log-probs come from (Learner.update).
OLD_LOGPROB_SOURCES = ("auto", "one_pass", "separate")


@dataclasses.dataclass(frozen=True)
class LearnerSettings(Section):
    """The optimizer, the update's shape, and the loss with its corrections and KL term."""
    lr: float = setting(2e-4, "peak learning rate (AdamW; warm-up then constant)", min=0.0)
    warmup_steps: int = setting(2, "linear warm-up steps", min=0)
    weight_decay: float = setting(0.0, "AdamW weight decay", min=0.0)
    grad_clip: float = setting(1.0, "global-norm gradient clip (0: off)", min=0.0)
    micro_batches: int = setting(1, "micro-batches per optimizer step (gradients accumulated; memory)", min=1)
    # -1 is resolved once by the trainer (rl/memory_plan.resolve_token_budget): packed rows at the
    # largest budget the memory plan fits on an accelerator, padded rows on the CPU or when
    # rl.micro_batches > 1 asks for padded micro-batches. A Learner given -1 directly pads.
    token_budget: int = setting(AUTO_TOKEN_BUDGET, "pack rollouts into rows of this many tokens for every learner pass "
                                "(verl's ppo_max_token_len_per_gpu): micro-batches follow from the tokens; 0: padded "
                                "rows split in rl.micro_batches; -1 (auto): packed on an accelerator at the largest "
                                "budget the memory plan fits (train --plan names it), padded on the CPU", min=-1)
    # cuDNN's packed attention holds a float32 accumulator of rows x (this bound, rounded up to a
    # power of two) x heads x budget x head_dim in its backward pass, whatever the rows hold: on an
    # H200, Qwen3-1.7B rows of 32,768 peaked 8 GiB higher with up to 32 rollouts than with 16 (BENCHMARKS.md,
    # "Packed rows on an H200: MFU on real tokens..."). Bounded, the memory plan counts it; rows of
    # short rollouts fill less (a row closes at the bound: the simulation's mix in rows of 73,728
    # computes 1.14-1.21x its tokens at 32, 1.00-1.02x unbounded; rows of 32,768: 1.00-1.02x).
    segments_per_row: int = setting(SEGMENTS_PER_ROW, "packed rows: at most this many rollouts share a row (a power of two; "
                                    "cuDNN's packed backward holds memory in proportion to it)", min=1)
    # A padded update compiles the learner's programs once per (rows, width) it meets: ~9 s for the
    # CPU demo's model, minutes for a large one. The longest rollout sets the width and the groups
    # RoC and the filters keep set the rows, so both can move every step; coarser multiples mean
    # fewer compiles but more padding, and padding is not free (the demo's 52 rows: 5.1 s an update
    # at width 480, 6.9 s at 512 on this CPU). The defaults suit the demo (64-row updates, compute
    # dominates); short runs of small updates (an ablation grid's cells) compile less with 128 and
    # 16 (BENCHMARKS.md, "Padded updates: shapes and recompiles"). Packed rows (rl.token_budget)
    # compile one shape per micro-batch length, on a grid of 32 lengths per octave (packing.py).
    pad_width_multiple: int = setting(32, "padded rows: each update's rows padded to a multiple of this many tokens "
                                      "(capped at rollout.max_len): coarser, fewer shapes to compile, more padding",
                                      min=1)
    pad_rows_multiple: int = setting(1, "padded rows: each update padded with masked rows to a multiple of this many "
                                     "rows (capped at the most a step keeps, rl.batch_problems x rl.group_size): "
                                     "coarser, fewer shapes to compile, more padding", min=1)
    mini_batches: int = setting(1, "optimizer steps per epoch of an update: the kept rollouts split in this many "
                                "row slices (1: the paper; verl's ppo_mini_batch_size)", min=1)
    epochs: int = setting(1, "passes over the kept rollouts per update (1: the paper; verl's ppo_epochs)", min=1)
    # update() also returns per-token entropies from its old-log-prob pass, for the forking /
    # reflection analysis; one more reduction over the logits: +15-22% on that pass on CPU
    # (BENCHMARKS.md, "Entropy in the old-log-prob pass").
    token_entropy: bool = setting(True, "per-token entropies of kept rollouts into the traces (learner pass)")
    # One optimizer step per update (the paper's 1 x 1) takes its step from the weights the old
    # log-probs are of, so they are the update's own forward pass, stop-gradient (tunix, verl's
    # on-policy bypass, slime): the separate pass is a whole forward over every row for nothing
    # (BENCHMARKS.md, "Learner: one pass where one is exact"). Several steps move the weights
    # between them; a KL term reads a reference pass anyway; LoRA dropout makes the update's
    # forward another policy than the old one. There the separate pass stays.
    old_logprobs: str = setting("auto", "the update's old (proximal) log-probs: auto (one_pass where it is exact: "
                                "rl.mini_batches x rl.epochs = 1, no KL term, no LoRA dropout; else separate) | "
                                "one_pass (the update's own forward pass with a stop-gradient; refused where not "
                                "exact) | separate (a forward pass of its own before the update)",
                                choices=OLD_LOGPROB_SOURCES)
    correction: CorrectionConfig = setting(CorrectionConfig, "off-policy corrections sampler -> learner (none: the "
                                           "paper)")
    loss: PolicyLossConfig = setting(PolicyLossConfig, "the policy loss")
    kl: KLConfig = setting(KLConfig, "KL term to the frozen reference (off: the paper)")

    def rules(self):
        if why := self.one_pass_refusal():
            yield "old_logprobs", why

    def one_pass_refusal(self, lora_dropout: float = 0.0) -> str | None:
        """Why rl.old_logprobs=one_pass is refused here (None: it is not asked for, or exact)."""
        if self.old_logprobs == "one_pass" and (why := self.one_pass_problem(lora_dropout)):
            return f"one_pass is not exact here: {why} (use auto or separate)"
        return None

    def one_pass_problem(self, lora_dropout: float = 0.0) -> str | None:
        """Why the old log-probs cannot be the update's own forward pass exactly (None: they can)."""
        if self.mini_batches * self.epochs > 1:
            return (f"rl.mini_batches x rl.epochs = {self.mini_batches} x {self.epochs} optimizer steps, and "
                    "the weights move between them")
        if self.kl.enabled:
            return "a KL term (rl.kl.coef > 0) reads the current log-probs from a pass before the update"
        if lora_dropout > 0:
            return f"LoRA dropout ({lora_dropout}) makes the update's forward pass another policy than the old one"
        return None

    def old_logprobs_in_update(self, lora_dropout: float = 0.0) -> bool:
        """Whether updates take the old log-probs from their own forward pass (rl.old_logprobs)."""
        if self.old_logprobs == "separate":
            return False
        if why := self.one_pass_refusal(lora_dropout):
            raise ValueError(f"rl.old_logprobs: {why}")
        return self.one_pass_problem(lora_dropout) is None
