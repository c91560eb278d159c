"""The bucketed weight export (rollout/engines/vllm_engine/sync/export.py): what it writes is what
save_pretrained writes (read back by the safetensors library), buckets hold whole decoder layers
within their size, and a slot is rewritten in place. Against real vLLM servers:
tests/rollout/test_vllm_engine.py."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from rstar2_jax import models
from rstar2_jax.models import checkpoint, tiny
from rstar2_jax.models.weight_map import LAYER_WEIGHTS
from rstar2_jax.rollout.engines.vllm_engine.sync import export as we


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny.build_tiny_model(tmp_path_factory.mktemp("m") / "m", num_layers=3, hidden_size=64,
                                 intermediate_size=192)
    return models.load_pretrained(path)


def read_slot(slot: str, plan: we.ExportPlan) -> dict[str, np.ndarray]:
    out = {}
    for name in plan.file_names:
        out.update(load_file(os.path.join(slot, name)))
    return out


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_the_export_is_what_save_pretrained_writes(model, tmp_path, dtype):
    plan = we.model_plan(model, dtype, bucket_bytes=40_000)  # several buckets
    assert len(plan.buckets) == 4  # the top tensors, then one per layer
    slots = we.ExportSlots(str(tmp_path / "sync"))
    slot = slots.begin(plan)
    parts = [slots.write(slot, b, we.param_arrays(model)) for b in plan.buckets]
    ours, reference = read_slot(slot, plan), checkpoint.model_params_host(model, dtype)
    assert set(ours) == set(reference)
    for name, x in reference.items():
        assert ours[name].dtype == x.dtype and ours[name].shape == x.shape, name
        np.testing.assert_array_equal(ours[name], x, err_msg=name)
    # each bucket's own directory reads as that bucket alone (what a partial reload loads)
    for b, part in zip(plan.buckets, parts):
        assert set(load_file(os.path.join(part, "model.safetensors"))) == {t.spec.hf for t in b.tensors}


def test_a_square_linear_weight_is_transposed(tmp_path):
    """A [n, n] projection looks the same in both layouts: only the values say it was transposed
    (n = 100: whole strips of the host transpose and a shorter last one)."""
    n = 100
    assert n > we.STRIP_ROWS and n % we.STRIP_ROWS
    ours = np.arange(n * n, dtype=np.float32).reshape(n, n)
    plan = we.export_plan({"layers.0.mlp.up_proj": (n, n)}, np.float32, 1 << 20)
    slots = we.ExportSlots(str(tmp_path))
    slot = slots.begin(plan)
    slots.write(slot, plan.buckets[0], {"layers.0.mlp.up_proj": jnp.asarray(ours)})
    np.testing.assert_array_equal(read_slot(slot, plan)["model.layers.0.mlp.up_proj.weight"], ours.T)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 150), cols=st.integers(1, 150), threads=st.integers(1, 5), transpose=st.booleans(),
       bf16=st.booleans())
def test_a_copy_split_over_threads_is_the_whole_copy(rows, cols, threads, transpose, bf16):
    """copy_to_hf, split over threads by rows of the destination (every part, even of a few
    bytes): the destination is x.T (a linear weight) or x, every element written once."""
    bits = np.arange(1, rows * cols + 1, dtype=np.uint16 if bf16 else np.uint32).reshape(rows, cols)  # all distinct
    x = bits.view(jnp.bfloat16 if bf16 else np.float32)
    dst = np.zeros((cols, rows) if transpose else (rows, cols), x.dtype)
    we.copy_to_hf(dst, x, transpose, threads=threads, min_part_bytes=1)
    np.testing.assert_array_equal(dst.view(bits.dtype), bits.T if transpose else bits)


def test_slots_alternate_and_are_rewritten_in_place(model, tmp_path):
    plan = we.model_plan(model, None, bucket_bytes=1 << 30)
    slots = we.ExportSlots(str(tmp_path))
    arrays = we.param_arrays(model)
    written = []
    for _ in range(3):
        slot = slots.begin(plan)
        slots.write(slot, plan.buckets[0], arrays)
        written.append((slot, os.stat(os.path.join(slot, plan.file_names[0])).st_ino))
        slots.commit(slot)
    assert written[0][0] != written[1][0] and written[2] == written[0]  # the same file, not a new one
    # the previous export is never the one being written
    assert slots.begin(plan) != slots.latest
    # a smaller bucket size, then the large one again: the small plan's leftovers go
    small = we.model_plan(model, None, bucket_bytes=1)
    slot = slots.begin(small)
    for b in small.buckets:
        slots.write(slot, b, arrays)
    assert len(os.listdir(slot)) == 2 * len(small.buckets) == 8  # a file and a directory each
    assert sorted(os.listdir(slots.begin(plan))) == ["b00000", "model-b00000.safetensors"]


def fake_model_shapes(layers: int, hidden: int) -> dict[str, tuple[int, ...]]:
    shapes = {"embed": (32, hidden), "final_norm.scale": (hidden,), "lm_head": (hidden, 32)}
    for i in range(layers):
        for w in LAYER_WEIGHTS:
            if "bias" in w.ours:
                continue
            shape = {"input_norm.scale": (hidden,), "post_attn_norm.scale": (hidden,), "attn.q_norm.scale": (8,),
                     "attn.k_norm.scale": (8,), "attn.o_proj": (2, 8, hidden)}.get(w.ours, (hidden, 16))
            shapes[f"layers.{i}.{w.ours}"] = shape
    return shapes


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 12), hidden=st.sampled_from([8, 16, 64]), bucket=st.integers(1, 200_000),
       bf16=st.booleans())
def test_buckets_hold_whole_layers_every_tensor_once_within_their_size(layers, hidden, bucket, bf16):
    shapes = fake_model_shapes(layers, hidden)
    plan = we.export_plan(shapes, jnp.bfloat16 if bf16 else np.float32, bucket)
    paths = [t.path for b in plan.buckets for t in b.tensors]
    assert sorted(paths) == sorted(shapes)  # every tensor, once
    homes = {}
    for b in plan.buckets:
        keys = {we.layer_key(t.spec.hf) for t in b.tensors}
        for k in keys:
            assert homes.setdefault(k, b.index) == b.index  # a layer is never split
        # over the size only as one layer alone
        assert b.nbytes <= bucket or len(keys) == 1
    # in the model's order: the top tensors, then layer 0, 1, ...
    order = [we.layer_key(t.spec.hf) for b in plan.buckets for t in b.tensors]
    firsts = list(dict.fromkeys(order))
    assert firsts == ["top"] + [str(i) for i in range(layers)]
    assert plan.nbytes == sum(int(np.prod(s)) for s in shapes.values()) * (2 if bf16 else 4)


def test_a_bad_bucket_size_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes"):
        we.export_plan({"embed": (4, 4)}, np.float32, 0)


def test_no_room_for_a_bucket_is_a_clear_error_not_a_crash(tmp_path):
    """A full /dev/shm would kill an mmap writer with SIGBUS; the writer reserves a bucket's pages
    first and says where to write instead. (The file-size limit stands in for a full tmpfs.)"""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import resource, signal
        import numpy as np
        from rstar2_jax.rollout.engines.vllm_engine.sync import export as we
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        plan = we.export_plan({{"embed": (1024, 1024)}}, np.float32, 1 << 30)  # 4 MiB
        try:
            we.write_bucket({str(tmp_path / "b.safetensors")!r}, plan.buckets[0], [np.ones((1024, 1024), np.float32)],
                            [True])
        except OSError as e:
            print("REFUSED", e)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED" in out.stdout and "rollout.vllm.sync_dir" in out.stdout and "4 MiB" in out.stdout, out.stdout


def test_exports_of_trainers_that_are_gone_are_freed(tmp_path):
    """A trainer killed before close() leaves its two export slots in /dev/shm (memory); the next
    engine on the host deletes those whose process is gone, and nothing else."""
    import subprocess
    import sys

    from rstar2_jax.rollout.engines.vllm_engine.sync.export_roots import SYNC_ROOT_PREFIX, remove_orphaned_exports

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid whose process has exited
    for name in (f"{SYNC_ROOT_PREFIX}{gone}_7f00", f"{SYNC_ROOT_PREFIX}{os.getpid()}_7f01", "rstar2_sync_x_1", "other"):
        (tmp_path / name / "slot-a").mkdir(parents=True)
    assert remove_orphaned_exports(str(tmp_path)) == [f"{SYNC_ROOT_PREFIX}{gone}_7f00"]
    assert sorted(os.listdir(tmp_path)) == sorted([f"{SYNC_ROOT_PREFIX}{os.getpid()}_7f01", "rstar2_sync_x_1", "other"])
