"""The DALI backend's input: trainperf reads the files and hands them to DALI, batch by batch.

DALI can read files itself (``readers.file``), but then it alone knows which file is in which
batch: a decoder error comes back as ``nvImageCodec failure: '#3'``, naming nothing, and a
file name that is not UTF-8 cannot even be passed to it (``Unsupported argument type with
name files``). So the pipeline's input is an ``external_source`` whose callback is a
:class:`FileFeed`. It

- yields each rank's batches in the order of :func:`._source.epoch_batches`
  (``DistributedSampler``'s, as the other backends), epoch after epoch;
- reads each file in a thread pool, one batch ahead of the one it returns, so the reading
  overlaps DALI's decoding and the training step;
- checks the header of the very bytes it hands over (format, image size within
  ``max_pixels``), so a file replaced after the loader was built by a decompression bomb,
  or by anything that is not an image, never reaches DALI's decoder, and the error names it.
  It hands DALI one invalid byte in its place (DALI's decoder then fails on that batch, and
  the loader raises the feed's message): an exception raised into DALI would be kept by the
  pipeline, with the frames it passed through, in a reference cycle only the garbage
  collector frees, and it may free it in a forked DataLoader worker, where destroying a DALI
  pipeline crashes;
- remembers which files went into the batches DALI has not given back yet
  (:attr:`FileFeed.pending`), so that a decoder error is traced to its file
  (:func:`find_culprits`).

File names are never given to DALI, so any name the file system allows works.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainperf.pipelines._source import BadFile, check_one, read_checked, shown

__all__ = ["DALI_REFUSES", "FedBatch", "FileFeed", "find_culprits"]

# The reason given for a file DALI named in its error and PIL reads.
DALI_REFUSES = "DALI's decoder refuses it (PIL reads it)"

# Reading waits on the disk more than on the CPU (np.fromfile releases the GIL).
_MAX_READ_THREADS = 8
_FAILED_SAMPLE = re.compile(r"Failed to decode sample #(\d+)")


# What DALI gets instead of a file that failed the check: no decoder takes one zero byte.
_PLACEHOLDER = np.zeros(1, dtype=np.uint8)


@dataclass(frozen=True)
class FedBatch:
    """A batch handed to DALI: its epoch, its number in the epoch, its file indices, and why
    a file in it was not handed over (None when all were)."""

    epoch: int
    batch: int
    indices: tuple[int, ...]
    problem: str | None = None


class FileFeed:
    """The external source's callback: each call returns the next batch's encoded files.

    Args:
        files: every image path; batches hold indices into it.
        plan: epoch -> this rank's batches of file indices for that epoch.
        max_pixels: the image size limit of the header check; None: no limit.
        threads: reader threads.

    Attributes:
        pending: the batches handed to DALI and not given back yet, oldest first; the loader
            takes one off for every batch DALI returns.
        error: the first problem found by the header check, if any.
    """

    def __init__(
        self,
        files: Sequence[str],
        plan: Callable[[int], list[list[int]]],
        *,
        max_pixels: int | None,
        threads: int,
    ) -> None:
        self._files = files
        self._plan = plan
        self._max_pixels = max_pixels
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(threads, _MAX_READ_THREADS)),
            thread_name_prefix="trainperf-dali-read",
        )
        self._epoch = 0
        self._batches = plan(0)
        self._next = 0
        self._ahead: tuple[int, int, list[Future[np.ndarray[Any, Any]]]] | None = None
        self.pending: deque[FedBatch] = deque()
        self.error: str | None = None

    def start(self, epoch: int) -> None:
        """Make ``epoch`` the next one fed, unless the feed has reached it already.

        An epoch left part-way is abandoned here: the rest of it is never read, and the few
        of its batches already in DALI's queue come out first (the loader drops them, by
        :attr:`FedBatch.epoch`).
        """
        if epoch > self._epoch:
            self._go_to(epoch)

    def _go_to(self, epoch: int) -> None:
        self._epoch, self._batches, self._next = epoch, self._plan(epoch), 0
        if self._ahead is not None:
            for future in self._ahead[2]:
                future.cancel()
            self._ahead = None

    def _read(self, indices: Sequence[int]) -> list[Future[np.ndarray[Any, Any]]]:
        limit = self._max_pixels
        return [self._pool.submit(read_checked, self._files[i], limit) for i in indices]

    def __call__(self) -> tuple[list[np.ndarray[Any, Any]], np.ndarray[Any, Any]]:
        if self._next == len(self._batches):
            self._go_to(self._epoch + 1)
        epoch, number = self._epoch, self._next
        indices = self._batches[number]
        ahead = self._ahead
        if ahead is not None and ahead[:2] == (epoch, number):
            futures = ahead[2]
        else:
            futures = self._read(indices)
        self._next += 1
        following = self._next
        if following < len(self._batches):  # read it while DALI decodes this one
            self._ahead = (epoch, following, self._read(self._batches[following]))
        else:
            self._ahead = None
        datas, problem = [], None
        for i, future in zip(indices, futures, strict=True):
            # Not future.result(): re-raised here, the error's traceback would hold this frame
            # (and the loader's, above it), which holds the future that holds the error: a cycle.
            error = future.exception()
            if error is None:
                datas.append(future.result())
                continue
            datas.append(_PLACEHOLDER)
            if not isinstance(error, RuntimeError):  # not the check's: say what it was
                error = RuntimeError(
                    f"reading '{shown(self._files[i])}' failed ({type(error).__name__}: {error})"
                )
            problem = problem or str(error)
        self.error = self.error or problem
        self.pending.append(FedBatch(epoch, number, tuple(indices), problem))
        return datas, np.asarray(indices, dtype=np.int64)

    def close(self) -> None:
        """Stop the reader threads (reads not started are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def find_culprits(
    message: str,
    pending: Sequence[FedBatch],
    files: Sequence[str],
    max_pixels: int | None,
) -> tuple[list[BadFile], list[str]]:
    """The files behind a DALI decoder error: ``(bad files, suspects)``.

    The failed batch is the oldest one DALI has not returned (``pending[0]``). When DALI
    names a sample (``Failed to decode sample #k``), that file is the culprit; otherwise every
    file of the pending batches is checked again (header, then a PIL decode), and those that
    fail are. Suspects are the files looked at; bad files get PIL's reason, or, for a file
    DALI named and PIL reads, ``"DALI's decoder refuses it"``.

    Example:
        >>> find_culprits("Failed to decode sample #1 : ", [FedBatch(0, 0, (4, 2))],
        ...               ["a", "b", "/no/such.jpg", "d", "e"], None)
        ([BadFile(path='/no/such.jpg', reason='file not found')], ['/no/such.jpg'])
    """
    if not pending:
        return [], []
    named = _FAILED_SAMPLE.search(message)
    first = pending[0].indices
    if named is not None and int(named[1]) < len(first):
        path = files[first[int(named[1])]]
        problem = check_one(path, "decode", max_pixels)[1]
        return [BadFile(path, problem or DALI_REFUSES)], [path]
    suspects = list(dict.fromkeys(files[i] for batch in pending for i in batch.indices))
    bad = []
    for path in suspects:
        problem = check_one(path, "decode", max_pixels)[1]
        if problem is not None:
            bad.append(BadFile(path, problem))
    return bad, suspects
