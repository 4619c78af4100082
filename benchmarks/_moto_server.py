"""moto's standalone S3 server for bench_stream.py, with one cost that real S3 does not have
taken out: moto answers a ranged GET by materialising the whole object and slicing it
(`FakeKey.value` reads every byte; a 32 KiB range of a 50 MiB object cost 90 ms here, the
same range of a 1 MiB object 15 ms). Here a ranged GET reads only its range from the object's
buffer. Both benchmark sides gain: Mosaic's downloads are ranged GETs of 8 MiB parts, ours
ranged reads of rows or shard parts. Everything else is moto as shipped.

    python benchmarks/_moto_server.py -H 127.0.0.1 -p PORT      (moto.server's arguments)
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from moto.s3 import models, responses
from moto.server import main

_ranged = threading.local()
_value = models.FakeKey.value


class _RangeReader:
    """What moto's range handling needs of a body: its length and a slice of it."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __len__(self) -> int:
        return self.key.size

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(self.key.size)
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))


def _value_or_range(key: Any) -> Any:
    return _RangeReader(key) if getattr(_ranged, "on", False) else _value.fget(key)


_get_object = responses.S3Response.get_object


def _get_object_ranged(self: Any) -> Any:
    _ranged.on = bool(self.headers.get("range"))
    try:
        return _get_object(self)
    finally:
        _ranged.on = False


models.FakeKey.value = property(_value_or_range, _value.fset)
responses.S3Response.get_object = _get_object_ranged

if __name__ == "__main__":
    main(sys.argv[1:])
