"""What limits a training loop: the machinery behind :func:`trainperf.watch`.

::

    with trainperf.watch() as w:
        for batch in w.iter(loader):   # times the wait for each batch
            loss = step(batch)
            w.step()                   # marks the end of a training step
    print(w.report())

:class:`Watch` records a timeline (one :class:`StepRecord` per step) while a background
sampler reads GPU and CPU use; :func:`analyse` turns the timeline into a
:class:`WatchReport` whose :class:`Verdict` says whether the loop is input-bound,
compute-bound, host-bound, not using the GPU, or stalling periodically; each of those rules
is a pure function of the measured figures (``_rules``). Each verdict and "also" finding
carries its :class:`Fix` es with the speed-up each is predicted to give and the basis of
that prediction (``_predict``, pure functions as well); ``report.what_if()`` returns the
:class:`WhatIf` table that ranks them. The package is called ``monitor`` so that
``trainperf.watch`` is only ever the function.

Example:
    >>> from trainperf.monitor import Watch, analyse
    >>> Watch.__module__
    'trainperf'
"""

from __future__ import annotations

from trainperf._utils.public import set_public_module
from trainperf.monitor._analysis import analyse
from trainperf.monitor._records import LoaderChange, Sample, StepRecord
from trainperf.monitor._report import WatchReport
from trainperf.monitor._setup import LoopSetup
from trainperf.monitor._verdict import Fix, Verdict, VerdictKind, WhatIf
from trainperf.monitor._watch import Watch, watch

__all__ = [
    "Fix",
    "LoaderChange",
    "LoopSetup",
    "Sample",
    "StepRecord",
    "Verdict",
    "VerdictKind",
    "Watch",
    "WatchReport",
    "WhatIf",
    "analyse",
    "watch",
]

set_public_module(globals(), __all__, __name__)
