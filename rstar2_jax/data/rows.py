"""Rows of a data set, whatever it is stored in: JSONL, Parquet (one file, or a folder of shards as
the Hugging Face hub keeps them), or a folder written by Hugging Face `datasets`' `save_to_disk`.

Each row comes with where it is, so that any error about it can name the file and the row:
(file, row number counted from 1, row). The format is told from the file's first bytes, not its
name (a Parquet file called train.jsonl is still read as Parquet).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

from rstar2_jax.data.jsonl import DataError, iter_jsonl

PARQUET_MAGIC = b"PAR1"
ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"  # an Arrow IPC stream's first message (datasets' .arrow files)
ARROW_FILE_MAGIC = b"ARROW1"
FORMATS = "JSONL, Parquet, a folder of Parquet shards, or a Hugging Face datasets folder (save_to_disk)"

Row = tuple[str, int, Any]


def iter_rows(path: str | os.PathLike, what: str = "data file") -> Iterator[Row]:
    """(file, row number, row) of every row of the data set at `path`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    if os.path.isdir(path):
        yield from _iter_folder(path, what)
        return
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(PARQUET_MAGIC):
        yield from _iter_parquet(path)
    elif head.startswith(ARROW_STREAM_MAGIC) or head.startswith(ARROW_FILE_MAGIC):
        yield from _iter_arrow(path)
    else:
        yield from iter_jsonl(path, what)


def _iter_parquet(path: str) -> Iterator[Row]:
    import pyarrow.parquet as pq
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    yield from _numbered(path, parquet.iter_batches(batch_size=1024))


def _iter_arrow(path: str) -> Iterator[Row]:
    import pyarrow as pa
    try:
        source = pa.memory_map(path)
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: not a readable Arrow file ({type(e).__name__}: {e})") from None
    yield from _numbered(path, batches)


def _numbered(path: str, batches) -> Iterator[Row]:
    """The rows of Arrow record batches, numbered from 1 across them."""
    n = 0
    for batch in batches:
        for row in batch.to_pylist():
            n += 1
            yield path, n, row


def _iter_folder(path: str, what: str) -> Iterator[Row]:
    """A `save_to_disk` Dataset (state.json lists its .arrow files), or a folder of Parquet shards
    (read in name order, rows numbered per file). A DatasetDict's root is refused, naming its splits."""
    names = set(os.listdir(path))
    if "dataset_dict.json" in names:
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        raise DataError(f"{path}: a Hugging Face DatasetDict with splits {splits}: point the path at one split's "
                        f"folder, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
    if "state.json" in names:
        with open(os.path.join(path, "state.json")) as f:
            files = [entry["filename"] for entry in json.load(f).get("_data_files", [])]
        if not files:
            raise DataError(f"{path}/state.json: lists no data files (_data_files)")
        for name in files:
            yield from _iter_arrow(os.path.join(path, name))
        return
    shards = sorted(n for n in names if n.endswith(".parquet"))
    if not shards and os.path.isdir(os.path.join(path, "data")):  # a hub data set's own folder
        yield from _iter_folder(os.path.join(path, "data"), what)
        return
    if not shards:
        raise DataError(f"{path}: a folder with neither a datasets state.json nor .parquet files ({what}: {FORMATS})")
    for name in shards:
        yield from _iter_parquet(os.path.join(path, name))
