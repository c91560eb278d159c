"""The GRPO-RoC training loop and its parts."""
