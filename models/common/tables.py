"""Parquet I/O for paper data: dicts of NumPy columns in, dicts of NumPy columns out.

A 2-D array column is stored as a fixed-size list (`list<float32>[64]` for 8x8 pixels) and read back as 2-D.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def _arrow(columns: dict[str, np.ndarray | list]) -> pa.Table:
    arrays = {}
    for name, values in columns.items():
        values = np.asarray(values)
        if values.ndim == 2:
            flat = pa.array(values.reshape(-1))
            arrays[name] = pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
        else:
            arrays[name] = pa.array(values)
    return pa.table(arrays)


def write_table(path: Path, columns: dict[str, np.ndarray | list]) -> None:
    pq.write_table(_arrow(columns), path)


class TableWriter:
    """A table written a part at a time (one row group per `write`), for data too large to hold at once; the
    columns of every part are those of the first. `read_table(path, filters=...)` then reads only matching parts."""

    def __init__(self, path: Path):
        self.path, self._writer = path, None

    def write(self, columns: dict[str, np.ndarray | list]) -> None:
        table = _arrow(columns)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema)
        self._writer.write_table(table)

    def __enter__(self) -> TableWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self._writer is not None:
            self._writer.close()


def read_table(path: Path, filters: list[tuple] | None = None) -> dict[str, np.ndarray]:
    """Every column as NumPy; `filters` (pyarrow's, e.g. [("seed", "==", 0)]) keeps only matching rows."""
    table = pq.read_table(path, filters=filters)
    out: dict[str, np.ndarray] = {}
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(column.type):
            out[name] = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), column.type.list_size)
        else:
            out[name] = column.to_numpy(zero_copy_only=False)
    return out
