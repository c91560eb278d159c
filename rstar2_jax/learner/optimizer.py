"""AdamW with linear warm-up then constant learning rate, and global-norm clipping (optax)."""

from __future__ import annotations

import functools

import optax


def warmup_constant(lr: float, warmup_steps: int):
    """lr * min(1, (step + 1) / warmup_steps): the first update already moves (at lr / warmup)."""
    warmup_steps = max(1, int(warmup_steps))
    return lambda count: lr * optax.safe_int32_increment(count).astype("float32").clip(max=warmup_steps) / warmup_steps


@functools.lru_cache(maxsize=64)  # equal settings, the same transformation: the key of core/shared_jit.py's programs
def make_optimizer(*, lr: float, warmup_steps: int, weight_decay: float, grad_clip: float, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """AdamW after a global-norm clip; the settings come from the caller's section (rl.* through
    LearnerSettings, sft.*), never from defaults here. b1, b2, eps: AdamW's usual constants."""
    parts = []
    if grad_clip and grad_clip > 0:
        parts.append(optax.clip_by_global_norm(grad_clip))
    parts.append(optax.adamw(warmup_constant(lr, warmup_steps), b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)
