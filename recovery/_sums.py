"""Checksums of the bytes a store keeps: 64-bit XXH3 per chunk, taken at once or in a thread.

A holder checks the copies it received once the commit made them current; above
``INLINE_BYTES`` it does so in a thread (xxhash lets go of the GIL), so the commit and the steps
after it go on meanwhile. Anything that reads the sums or reuses the buffers waits for that
thread first (``settle``). Local, no communication.
"""
from __future__ import annotations

import threading
from typing import Mapping

import numpy as np
import xxhash

from ._versions import Held

INLINE_BYTES = 1 << 20  # copies up to this size are checksummed at once (XXH3: ~0.2 ms), not in a thread


def checksum(data: np.ndarray) -> int:
    """A chunk's checksum: 64-bit XXH3 (several GB/s per rank, docs/measurements.md; zlib's CRC32
    was a third of a commit's time)."""
    return xxhash.xxh3_64_intdigest(data.data)


class Checksums:
    """The checksums of one store's chunks (``chunk_bytes``) and its one background thread."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._thread: threading.Thread | None = None  # the checksums of the last commit's copies

    def of(self, data: np.ndarray) -> list[int]:
        return [checksum(data[i:i + self.chunk_bytes]) for i in range(0, data.nbytes, self.chunk_bytes)]

    def take(self, held: Mapping[tuple[int, int, int], Held], later: bool) -> None:
        """Each held piece's sums, now or (``later``) in a thread."""
        def run() -> None:
            for h in held.values():
                h.sums = self.of(h.data)
        if not later:
            run()
            return
        self._thread = threading.Thread(target=run, name="elastic-store-checksums", daemon=True)
        self._thread.start()

    def settle(self) -> None:
        """Wait for the thread's checksums, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def intact(self, held: Held) -> bool:
        """``held``'s bytes still match their checksums."""
        self.settle()
        return self.of(held.data) == held.sums
