"""Parquet I/O for paper data: dicts of NumPy columns in, dicts of NumPy columns out.

A 2-D array column is stored as a fixed-size list (`list<float32>[64]` for 8x8 pixels) and read back as 2-D.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write_table(path: Path, columns: dict[str, np.ndarray | list]) -> None:
    arrays = {}
    for name, values in columns.items():
        values = np.asarray(values)
        if values.ndim == 2:
            flat = pa.array(values.reshape(-1))
            arrays[name] = pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
        else:
            arrays[name] = pa.array(values)
    pq.write_table(pa.table(arrays), path)


def read_table(path: Path) -> dict[str, np.ndarray]:
    table = pq.read_table(path)
    out: dict[str, np.ndarray] = {}
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(column.type):
            out[name] = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), column.type.list_size)
        else:
            out[name] = column.to_numpy(zero_copy_only=False)
    return out
