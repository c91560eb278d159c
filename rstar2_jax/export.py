"""Write a training run's policy for other tools: the LoRA adapter as PEFT files, or the merged
model as a HF directory.

    python -m rstar2_jax.export --checkpoint=runs/lora --out=runs/lora/adapter          # PEFT (LoRA runs)
    python -m rstar2_jax.export --checkpoint=runs/lora --out=runs/lora/merged --merged  # HF model

The adapter loads in PEFT (`PeftModel.from_pretrained(base, out)`), in vLLM (`--enable-lora`,
`--lora-modules name=out`), and here (`evaluate --model=out`, `chat --model=out`: its
adapter_config.json names the base). The merged directory is a plain HF checkpoint: W + (alpha/r)
A B in every adapted projection, with the base's tokenizer. A run without adapters exports its
whole model (--merged is then implied).
"""

from __future__ import annotations

from absl import flags

from rstar2_jax import cli

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a training run directory: its latest checkpoint", required=True)
_OUT = flags.DEFINE_string("out", None, "the directory to write", required=True)
_MERGED = flags.DEFINE_bool("merged", False, "write the base with the adapters merged in (a HF model), not the adapter")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "dtype of the merged model's tensors")


def main(argv):
    del argv
    import jax.numpy as jnp

    from rstar2_jax.core.checkpoints import load_run_policy, run_info
    from rstar2_jax.models import lora
    from rstar2_jax.models.adapter_files import write_adapter
    from rstar2_jax.models.checkpoint import save_pretrained
    from flax import nnx

    model, base = load_run_policy(_CHECKPOINT.value), run_info(_CHECKPOINT.value)["model_dir"]
    adapters = lora.config_of(model)
    if adapters is not None and not _MERGED.value:
        out = write_adapter(nnx.state(model, nnx.Param), adapters, _OUT.value, base_model=base)
        print(f"wrote the rank-{adapters.rank} adapter of {_CHECKPOINT.value} (base {base}) to {out}")
        return
    plain = lora.merged_into_base(model) if adapters is not None else model
    out = save_pretrained(plain, _OUT.value, dtype=jnp.dtype(_DTYPE.value), tokenizer_dir=base)
    print(f"wrote the {'merged ' if adapters is not None else ''}model of {_CHECKPOINT.value} to {out}")


if __name__ == "__main__":
    cli.run(main)
