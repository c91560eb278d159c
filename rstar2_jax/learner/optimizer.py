"""AdamW with linear warm-up then constant learning rate, and global-norm clipping (optax)."""

from __future__ import annotations

import optax


def warmup_constant(lr: float, warmup_steps: int):
    """lr * min(1, (step + 1) / warmup_steps): the first update already moves (at lr / warmup)."""
    warmup_steps = max(1, int(warmup_steps))
    return lambda count: lr * optax.safe_int32_increment(count).astype("float32").clip(max=warmup_steps) / warmup_steps


def make_optimizer(lr: float = 1e-6, warmup_steps: int = 20, weight_decay: float = 0.01, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8, grad_clip: float = 1.0) -> optax.GradientTransformation:
    parts = []
    if grad_clip and grad_clip > 0:
        parts.append(optax.clip_by_global_norm(grad_clip))
    parts.append(optax.adamw(warmup_constant(lr, warmup_steps), b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)
