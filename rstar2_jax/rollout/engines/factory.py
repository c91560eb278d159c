"""One way to build the rollout engine, shared by train and evaluate (and anything else)."""

from __future__ import annotations

from typing import Sequence

from rstar2_jax.rollout.engines.base import Engine

ENGINE_KINDS = ("jax", "vllm")


def make_engine(kind: str, model, tokenizer, *, max_len: int, slots: int, seed: int, urls: Sequence[str] = (),
                scheduler: str = "kv_aware", export_dtype=None, probe_tolerance: float = 1e-3,
                reuse_kv: bool = False, page_size: int = 0, kv_pages: int = 0) -> Engine:
    """kind "jax": the embedded JaxEngine over `model` (slots x max_len of KV, or `kv_pages` pages
    of `page_size` positions when page_size > 0 (kv_pages 0: the rows' memory); `reuse_kv` keeps
    a trajectory's KV between turns).
    kind "vllm": clients of the servers at `urls` (several: behind the Scheduler with policy
    `scheduler`); `model` is the served architecture, used to export and probe synced weights
    (None: generation only, no weight sync)."""
    if kind == "jax":
        from rstar2_jax.rollout.engines.jax_engine import JaxEngine
        return JaxEngine(model, tokenizer, slots=slots, max_len=max_len, seed=seed, reuse_kv=reuse_kv,
                         page_size=page_size or None, kv_pages=kv_pages or None)
    if kind == "vllm":
        from rstar2_jax.rollout.engines.vllm_engine import VLLMEngine
        from rstar2_jax.rollout.scheduler import Scheduler
        if not urls:
            raise ValueError("the vllm engine needs server URLs (start one: python -m rstar2_jax.rollout.serve --model DIR)")
        engines = [VLLMEngine(url, model, export_dtype=export_dtype, probe_tolerance=probe_tolerance) for url in urls]
        return engines[0] if len(engines) == 1 else Scheduler(engines, scheduler)
    raise ValueError(f"unknown engine {kind!r}; known: {ENGINE_KINDS}")
