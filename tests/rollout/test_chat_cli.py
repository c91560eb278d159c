"""`python -m rstar2_jax.chat` runs end to end on the tiny model with the real sandbox."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_chat_prints_turns_and_a_summary(tiny_dir):
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.chat", "--model", tiny_dir, "--format", "compact",
                           "--max_tokens", "40", "--prompt", "What is 2+2?", "--temperature", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in proc.stdout
    assert "--- assistant (" in proc.stdout
    assert "\n=== " in proc.stdout and "turns" in proc.stdout and "answer (answer_boxed):" in proc.stdout
