"""numpy <-> Arrow for fixed-width and boolean columns, through their buffers.

pyarrow's own bridges (`pa.array(ndarray)`, `Array.to_numpy`) import pandas on their first call
in a process, to rule out pandas types packshard never writes: ~0.15-0.2 s and ~60 MB, paid by
every pack worker on its first shard and by a reader before its first row. These functions do
the same conversions from the buffers and never touch pandas.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def column_numpy(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A non-null fixed-width or boolean column as numpy: a zero-copy view of a fixed-width
    array of one chunk, a copy for several chunks or booleans (unpacked to ``np.bool_``)."""
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks == 1:
            return column_numpy(col.chunk(0))
        if col.num_chunks == 0:
            return np.zeros(0, dtype=numpy_dtype(col.type))
        return np.concatenate([column_numpy(c) for c in col.chunks])
    if col.null_count:
        raise ValueError(f"a {col.type} column with {col.null_count} nulls has no numpy view")
    data = col.buffers()[1]
    if pa.types.is_boolean(col.type):
        if len(col) == 0:
            return np.zeros(0, np.bool_)
        first, end = col.offset, col.offset + len(col)
        bits = np.frombuffer(data, np.uint8, count=(end + 7) // 8 - first // 8, offset=first // 8)
        return np.unpackbits(bits, bitorder="little")[first % 8 : first % 8 + len(col)].view(
            np.bool_
        )
    dtype = numpy_dtype(col.type)
    if len(col) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(data, dtype=dtype, count=len(col), offset=col.offset * dtype.itemsize)


def numeric_array(values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    """A 1-D numpy array as an Arrow array of the fixed-width or boolean `value_type`
    (zero-copy where the dtype already matches). Values that do not fit the type raise
    OverflowError; floats are never rounded to integers (TypeError)."""
    if pa.types.is_boolean(value_type):
        return bool_array(values)
    values = np.asarray(values)
    dtype = numpy_dtype(value_type)
    if values.ndim != 1:
        raise ValueError(f"numeric_array takes 1-D arrays, not shape {values.shape}")
    if values.size and values.dtype.kind == "f" and dtype.kind in "iu":
        raise TypeError(f"numeric_array does not round {values.dtype} values to {value_type}")
    if values.size and not np.can_cast(values.dtype, dtype, "safe"):
        info = np.iinfo(dtype) if dtype.kind in "iu" else np.finfo(dtype)
        low, high = values.min(), values.max()
        if low < info.min or high > info.max:
            raise OverflowError(f"values in [{low}, {high}] do not fit {value_type}")
    data = np.ascontiguousarray(values, dtype=dtype)
    return pa.Array.from_buffers(value_type, data.size, [None, pa.py_buffer(data)])


def bool_array(values: np.ndarray) -> pa.BooleanArray:
    """numpy bool -> Arrow bitmap via packbits (~10x faster than pa.array on 100M+ values)."""
    bits = np.packbits(np.asarray(values, np.bool_).view(np.uint8), bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), values.size, [None, pa.py_buffer(bits)])


def numpy_dtype(arrow_type: pa.DataType) -> np.dtype:
    """The numpy dtype of a fixed-width Arrow integer or float type, from its width and sign:
    `DataType.to_pandas_dtype` imports pandas in pyarrow < 26, which the core install lacks."""
    if pa.types.is_integer(arrow_type):
        kind = "i" if pa.types.is_signed_integer(arrow_type) else "u"
    elif pa.types.is_floating(arrow_type):
        kind = "f"
    else:
        raise TypeError(f"{arrow_type} is not a fixed-width numeric type")
    return np.dtype(f"{kind}{arrow_type.bit_width // 8}")
