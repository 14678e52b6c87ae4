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
- hands over a TIFF that DALI would decode unlike PIL (and so unlike torchvision's
  ImageFolder and the other backends) as PNG, decoded by PIL: one whose Orientation tag
  turns or mirrors it (PIL applies the tag, DALI's TIFF decoder ignores it), a grey one
  with alpha (DALI reads the alpha as green), one with premultiplied alpha (PIL undoes it,
  DALI does not) or a Lab one (:func:`read_for_dali`);
- when training, gives each image its crop box and flip (:func:`._augment.train_params` of
  ``(seed, epoch, index)`` and the image's size, read from the bytes handed over), which DALI
  then cuts and mirrors: DALI's own random operators draw from generators seeded once per
  pipeline, so an epoch run again, or resumed on a new loader, would get other crops, and no
  crop would match the other backends';
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

from trainperf.pipelines._augment import train_params
from trainperf.pipelines._decode import pil_failure, pil_to_rgb
from trainperf.pipelines._header import image_size, sniff_format, tiff_tags
from trainperf.pipelines._source import BadFile, check_one, read_checked, shown

__all__ = [
    "DALI_REFUSES",
    "FedBatch",
    "FileFeed",
    "crop_inputs",
    "find_culprits",
    "read_for_dali",
]

# The reason given for a file DALI named in its error and PIL reads.
DALI_REFUSES = "DALI's decoder refuses it (PIL reads it)"

# Reading waits on the disk more than on the CPU (np.fromfile releases the GIL).
_MAX_READ_THREADS = 8
_FAILED_SAMPLE = re.compile(r"Failed to decode sample #(\d+)")


# What DALI gets instead of a file that failed the check: no decoder takes one zero byte.
_PLACEHOLDER = np.zeros(1, dtype=np.uint8)

# A file's bytes and the (height, width) DALI decodes them to.
_Sized = tuple[np.ndarray[Any, Any], tuple[int, int]]

_TIFF_MAGIC = (b"II*\x00", b"MM\x00*")
_PHOTOMETRIC, _ORIENTATION, _SAMPLES_PER_PIXEL, _EXTRA_SAMPLES = 262, 274, 277, 338
_LAB = (8, 9, 10)  # CIELab, ICCLab, ITULab
_PREMULTIPLIED = 1  # ExtraSamples: associated alpha


def _pil_decodes(data: np.ndarray[Any, Any]) -> bool:
    """Whether DALI would decode these bytes unlike PIL: a TIFF whose Orientation tag (2-8)
    turns or mirrors it, which PIL applies and DALI ignores, a grey TIFF with alpha, whose
    alpha DALI takes for the green channel, a TIFF whose colours are premultiplied by its
    alpha, which PIL undoes and DALI does not, or a Lab TIFF, which DALI reads as RGB."""
    if data[:4].tobytes() not in _TIFF_MAGIC:
        return False
    tags = tiff_tags(data)
    return (
        tags.get(_ORIENTATION, 1) in range(2, 9)
        or tags.get(_SAMPLES_PER_PIXEL) == 2
        or tags.get(_EXTRA_SAMPLES) == _PREMULTIPLIED
        or tags.get(_PHOTOMETRIC) in _LAB
    )


def read_for_dali(path: str, max_pixels: int | None) -> np.ndarray[Any, Any]:
    """The bytes to hand DALI for ``path``: the file's, checked (:func:`read_checked`), or, for
    a TIFF DALI would decode unlike PIL, PIL's 8-bit RGB decode of it as PNG, which DALI
    decodes to exactly those pixels.

    Raises:
        RuntimeError: the file changed since the loader checked it, or PIL cannot decode it.
    """
    import io

    data = read_checked(path, max_pixels)
    if not _pil_decodes(data):
        return data
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data.tobytes())) as im:
            rgb = pil_to_rgb(im)  # applies the orientation (PIL's TIFF reader does)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError...
        raise RuntimeError(f"could not decode image '{shown(path)}' ({pil_failure(e)})") from e
    png = io.BytesIO()
    rgb.save(png, format="PNG", compress_level=1)  # fast: these files are rare, and lossless
    encoded: np.ndarray[Any, Any] = np.frombuffer(png.getbuffer(), dtype=np.uint8).copy()
    return encoded


def _read_sized(path: str, max_pixels: int | None) -> _Sized:
    """:func:`read_for_dali`'s bytes and the ``(height, width)`` their header gives, which is
    what DALI decodes them to (EXIF orientation is ignored; a TIFF's is applied in the PNG).

    Raises:
        RuntimeError: as :func:`read_for_dali`, or its bytes have no image size (it checked
            that very header, so only a fault in it would lead here).
    """
    data = read_for_dali(path, max_pixels)
    fmt = sniff_format(data[:16].tobytes())
    size = "has no image size" if fmt is None else image_size(fmt, data.data.cast("B"))
    if isinstance(size, str):
        raise RuntimeError(f"image '{shown(path)}' {size}, so it is not decoded")
    return data, (size[1], size[0])


def crop_inputs(
    seed: int, epoch: int, indices: Sequence[int], sizes: Sequence[tuple[int, int]]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The training crops of a batch as the DALI graph takes them: int32 ``(top, left)``
    ``[N, 2]``, ``(height, width)`` ``[N, 2]`` and flips ``[N]``, each image's
    :func:`._augment.train_params` for ``(seed, epoch, index)`` and its ``(height, width)``.

    Example:
        >>> anchors, shapes, flips = crop_inputs(0, 0, [3], [(375, 500)])
        >>> (anchors + shapes <= [375, 500]).all(), flips.dtype.name
        (np.True_, 'int32')
    """
    params = [train_params(seed, epoch, i, h, w) for i, (h, w) in zip(indices, sizes, strict=True)]
    boxes = np.array([box for box, _ in params], dtype=np.int32).reshape(-1, 4)
    flips = np.array([flip for _, flip in params], dtype=np.int32)
    return np.ascontiguousarray(boxes[:, :2]), np.ascontiguousarray(boxes[:, 2:]), flips


@dataclass(frozen=True)
class FedBatch:
    """A batch handed to DALI: its epoch, its number in the epoch, its file indices, why a
    file in it was not handed over (None when all were), and the feed's generation (how many
    times :meth:`FileFeed.start` had started an epoch afresh) when it was fed."""

    epoch: int
    batch: int
    indices: tuple[int, ...]
    problem: str | None = None
    generation: int = 0


class FileFeed:
    """The external source's callback: each call returns the next batch's encoded files.

    Args:
        files: every image path; batches hold indices into it.
        plan: epoch -> this rank's batches of file indices for that epoch.
        max_pixels: the image size limit of the header check; None: no limit.
        threads: reader threads.
        augment_seed: when training, the ``seed`` of the crops and flips: each batch then
            also holds every image's crop ``(top, left)``, ``(height, width)`` and flip
            (0/1), int32, for ``(augment_seed, epoch, index)``; None (eval): files and
            indices only.

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
        augment_seed: int | None = None,
    ) -> None:
        self._files = files
        self._augment_seed = augment_seed
        self._plan = plan
        self._max_pixels = max_pixels
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(threads, _MAX_READ_THREADS)),
            thread_name_prefix="trainperf-dali-read",
        )
        self._epoch = 0
        self._generation = 0
        self._batches = plan(0)
        self._next = 0
        self._ahead: tuple[int, int, list[Future[_Sized]]] | None = None
        self.pending: deque[FedBatch] = deque()
        self.error: str | None = None

    def start(self, epoch: int) -> int:
        """Make ``epoch`` the next one fed, from its first batch; return the generation
        whose batches of ``epoch`` are this pass's.

        The feed goes on as it is when it is about to begin ``epoch``, or has read ahead into
        it, or past it (DALI asks for two batches ahead, so when an epoch is a single batch
        the feed is already one or two epochs on), and ``epoch``'s first batch is still in
        :attr:`pending` (the loader drops the batches queued before it). Otherwise (the
        epoch before left part-way, a later epoch, or one begun or run already, as when
        ``loader.epoch`` is set back) ``epoch`` starts afresh, in a new generation: the rest
        of what was being fed is never read, and the few of its batches already in DALI's
        queue come out first (the loader drops them, by :attr:`FedBatch.generation`).
        """
        if not self._reaches(epoch):
            self._go_to(epoch)
            self._generation += 1
        return self._generation

    def _reaches(self, epoch: int) -> bool:
        """Whether the feed goes on into, or has fed, ``epoch``'s first batch, none of
        ``epoch`` taken yet."""
        if self._epoch == epoch - 1:
            return self._next == len(self._batches)
        if self._epoch == epoch and self._next == 0:
            return True
        # DALI reads ahead (two batches): the feed may be a batch or two into epoch, or, when
        # an epoch is one batch, already past it; it goes on while epoch's first batch is queued.
        first = (self._generation, epoch, 0)
        return self._epoch >= epoch and any(
            (b.generation, b.epoch, b.batch) == first for b in self.pending
        )

    def _go_to(self, epoch: int) -> None:
        self._epoch, self._batches, self._next = epoch, self._plan(epoch), 0
        if self._ahead is not None:
            for future in self._ahead[2]:
                future.cancel()
            self._ahead = None

    def _read(self, indices: Sequence[int]) -> list[Future[_Sized]]:
        limit = self._max_pixels
        return [self._pool.submit(_read_sized, self._files[i], limit) for i in indices]

    def __call__(self) -> tuple[Any, ...]:
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
        datas, sizes, problem = [], [], None
        for i, future in zip(indices, futures, strict=True):
            # Not future.result(): re-raised here, the error's traceback would hold this frame
            # (and the loader's, above it), which holds the future that holds the error: a cycle.
            error = future.exception()
            if error is None:
                data, size = future.result()
                datas.append(data)
                sizes.append(size)
                continue
            datas.append(_PLACEHOLDER)
            sizes.append((1, 1))  # the placeholder fails to decode: its crop is never cut
            if not isinstance(error, RuntimeError):  # not the check's: say what it was
                error = RuntimeError(
                    f"reading '{shown(self._files[i])}' failed ({type(error).__name__}: {error})"
                )
            problem = problem or str(error)
        self.error = self.error or problem
        self.pending.append(FedBatch(epoch, number, tuple(indices), problem, self._generation))
        fed = (datas, np.asarray(indices, dtype=np.int64))
        if self._augment_seed is None:
            return fed
        return (*fed, *crop_inputs(self._augment_seed, epoch, indices, sizes))

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
