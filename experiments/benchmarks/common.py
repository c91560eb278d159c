"""Shared pieces of the GPU benchmarks: model shapes, the two hardware ceilings, recording.

Every benchmark measures the ceilings it divides by in the same run (a large device copy and a
large bf16 matmul), because these machines are shared and datasheet figures are only leads.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from rstar2_jax.models import ModelConfig, shapes

H100_DENSE_BF16 = 989e12  # FLOP/s, datasheet (SXM, dense)
# BENCHMARKS.md's subsystems (`# ...` headings): a benchmark records its new subjects into its own
SANDBOX = "Sandbox"
ENGINES = "Rollout engines"
WEIGHT_SYNC = "Weight sync"
LEARNER = "Learner"
MEMORY_PLAN = "Memory plan"
PIPELINE = "Scheduling and the RL pipeline"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def vllm_python() -> str:
    """The repository's vLLM venv interpreter (.venv-vllm), wherever a benchmark is run from."""
    return os.path.join(ROOT, ".venv-vllm", "bin", "python")


def shape(name: str) -> ModelConfig:
    """A public checkpoint's architecture (rstar2_jax.models.shapes), with random weights."""
    try:
        return shapes.shape(name)
    except KeyError as e:
        raise SystemExit(e.args[0]) from None


def enable_compile_cache(path: str = ".jax_cache"):
    """Reuse compiled programs across runs on a warm machine (the directory is gitignored)."""
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def device_line() -> str:
    d = jax.devices()[0]
    return f"{d.device_kind} ({d.platform}), jax {jax.__version__}, {platform.python_version()}"


def median_seconds(fn, *, repeats: int, warmup: int = 1) -> float:
    """Median wall time of fn() (which must block until its device work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device memory bandwidth in bytes/s: x + 1 over a large float32 array (read + write)."""
    n = int(gib * 2 ** 30 / 4)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    add = jax.jit(lambda a: a + 1.0)
    t = median_seconds(lambda: add(x).block_until_ready(), repeats=10, warmup=2)
    return 2 * 4 * n / t


def matmul_rate(n: int = 8192) -> float:
    """bf16 matmul FLOP/s on random data (the measured compute ceiling)."""
    k1, k2 = jax.random.split(jax.random.key(1))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    t = median_seconds(lambda: mm(a, b).block_until_ready(), repeats=20, warmup=3)
    return 2 * n ** 3 / t


def markdown_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line(module: str, argv) -> str:
    """How a benchmark was invoked, for its record: `python -m MODULE ARGS`."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python -m", module, *args])


def record(path: str | None, title: str, command: str, config: str, table: str, notes: str = "",
           group: str | None = None):
    """Write one result block (device, date, config, command, table) into a BENCHMARKS.md: it
    replaces the section of the same title (one section per subject, always the current figures;
    the section's commentary goes with it and is rewritten for the new figures), and the section
    it replaces moves to the top of "History", titled with its date, the new one saying where.
    A new subject goes last in its subsystem, `group` (a `# Group` heading, made before History
    when the page has none), or before "History" without one (at the end when there is none).
    The page's "Contents:" list is rewritten from its headings."""
    block = (f"## {title}\n\n- Device: {device_line()}. Date: {datetime.date.today().isoformat()}.\n"
             f"- Config: {config}\n- Command: `{command}`\n\n{table}\n" + (f"\n{notes}\n" if notes else ""))
    print(block)
    if not path:
        return
    text = open(path).read() if os.path.exists(path) else ""
    heading = f"## {title}\n"
    if heading in text and text.index(heading) < _history_at(text):
        start = text.index(heading)
        nxt = _section_end(text, start + len(heading))
        old = text[start:nxt].strip("\n")
        dated = f"{title} ({_date_of(old)})"
        block += f"\nEarlier figures: History, \"{dated}\".\n"
        text = text[:start] + block + text[nxt:]
        text = _into_history(text, old.replace(heading, f"## {dated}\n", 1))
    else:
        if group and f"\n# {group}\n" not in text:  # a new subsystem, last before History
            at = _history_at(text)
            text = text[:at].rstrip("\n") + f"\n\n# {group}\n" + text[at:]
        at = _group_end(text, group) if group else _history_at(text)
        text = text[:at].rstrip("\n") + "\n\n" + block + ("\n" + text[at:].lstrip("\n") if at < len(text) else "")
    with open(path, "w") as f:
        f.write(with_contents(text))


def _section_end(text: str, after: int) -> int:
    """Where the section whose heading ends at `after` ends: the next section or subsystem heading."""
    ends = [i for i in (text.find("\n## ", after), text.find("\n# ", after)) if i >= 0]
    return min(ends) if ends else len(text)


def _group_end(text: str, group: str) -> int:
    """Where a new section of `group` (a heading the page has) goes: after its last section."""
    start = text.index(f"\n# {group}\n") + len(f"\n# {group}\n")
    nxt = text.find("\n# ", start)
    return nxt + 1 if nxt >= 0 else len(text)


def with_contents(text: str) -> str:
    """`text` with its "Contents:" list (between "Contents:" and the first subsystem heading)
    listing each subsystem's sections in page order; a page without that line is left as it is."""
    import re
    if "\nContents:\n" not in text:
        return text
    current = text[:_history_at(text)]
    lines = []
    for part in re.split(r"\n(?=# )", current)[1:]:
        name = part.split("\n", 1)[0][2:].strip()
        titles = re.findall(r"^## (.+)$", part, flags=re.M)
        lines.append(f"- **{name}**: " + "; ".join(titles))
    if "\n# History\n" in text:
        lines.append("- **History**: superseded figures and the sections' longer notes, newest first")
    start = text.index("\nContents:\n") + len("\nContents:\n")
    end = text.find("\n# ", start)
    end = end + 1 if end >= 0 else len(text)
    return text[:start] + "\n".join(lines) + "\n\n" + text[end:]


def _history_at(text: str) -> int:
    return text.index("\n# History\n") if "\n# History\n" in text else len(text)


def _date_of(section: str) -> str:
    """The date a section's figures were recorded ("Date: YYYY-MM-DD"), else "undated"."""
    import re
    found = re.search(r"Date: (\d{4}-\d{2}-\d{2})", section)
    return found.group(1) if found else "undated"


def _into_history(text: str, section: str) -> str:
    """`section` first under "# History" (created at the end when missing): newest history first."""
    if "\n# History\n" not in text:
        text = text.rstrip("\n") + "\n\n# History\n"
    at = text.index("\n# History\n") + len("\n# History\n")
    nxt = text.find("\n## ", at - 1)
    intro_end = nxt + 1 if nxt >= 0 else len(text)  # after History's own lines, before its first section
    return text[:intro_end].rstrip("\n") + "\n\n" + section + "\n\n" + text[intro_end:].lstrip("\n")


def weight_export_rate(model, dtype, bucket_bytes: int, root: str, repeats: int = 3) -> tuple[int, float, int]:
    """The vLLM sync's bucket writer alone (rollout/engines/vllm_engine/sync/export.py), with both of its
    slots warm (the first use of each allocates its pages): (bytes written, GB/s median, buckets)."""
    from rstar2_jax.rollout.engines.vllm_engine.sync import export as weight_export

    plan = weight_export.model_plan(model, dtype, bucket_bytes)
    slots = weight_export.ExportSlots(root)
    arrays = weight_export.param_arrays(model)
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        slot = slots.begin(plan)
        for b in plan.buckets:
            slots.write(slot, b, arrays)
        slots.commit(slot)
        if i >= 2:
            times.append(time.perf_counter() - start)
    slots.close()
    return plan.nbytes, plan.nbytes / statistics.median(times) / 1e9, len(plan.buckets)
