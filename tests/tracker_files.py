"""Reading back what the trackers wrote, through each one's own files and client (tests only)."""

from __future__ import annotations

import glob
import json
import os
import re
import struct

# W&B's transaction log (run-<id>.wandb): a 7-byte header (":W&B", 0xBEE1, version), then
# LevelDB-log framing of protobuf Records: 32 KiB blocks, each record a 7-byte header (CRC,
# length, type FULL/FIRST/MIDDLE/LAST) and its bytes; a block's tail shorter than a header is
# zero padding. The framing is W&B's (wandb/sdk/internal/datastore.py before 0.2x, the Go core now).
BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: str):
    """The protobuf Records of a .wandb file."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    ident, magic, _ = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic)
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # padding to the block's end
            pos += left
            continue
        body = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        parts.append(body)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def wandb_history(workdir) -> list[dict]:
    """Every history row (metric name -> value) of every offline W&B run file under workdir/wandb,
    in the order written."""
    rows = []
    for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")), key=_segment_order):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                rows.append({k: v for k, v in row.items() if not k.startswith("_")})  # W&B's own (_step, ...)
    return rows


def _segment_order(path: str) -> tuple[str, int]:
    """A run file's place among the offline segments: their directories are
    offline-run-<YYYYMMDD_HHMMSS>-<run id>, and a segment that starts in the same second as an
    earlier one of the same run gets a "-<n>" suffix. Plain name order would put "...-<id>-1"
    before "...-<id>/" ('-' sorts before '/'), so order by (time, n)."""
    name = os.path.basename(os.path.dirname(path))
    m = re.fullmatch(r"offline-run-(\d{8}_\d{6})-[^-]+(?:-(\d+))?", name)
    return (m.group(1), int(m.group(2) or 0)) if m else (name, 0)


def wandb_run_ids(workdir) -> set[str]:
    return {os.path.basename(p)[len("run-"):-len(".wandb")]
            for p in glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))}


def mlflow_metrics(tracking_uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """metric name -> [(step, value)] of one MLflow run, through MLflow's own client."""
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in run.data.metrics}
