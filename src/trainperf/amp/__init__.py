"""Mixed precision that picks the fast path for the GPU it runs on.

Older GPUs follow different rules: on Pascal fp16 is slower than fp32, on Volta/Turing fp16
with loss scaling is the fast path, and from Ampere on bf16 needs no scaler.
:class:`MixedPrecision` makes those choices (precision, loss scaling, channels_last, TF32)
from the device, and says which it made and why. What each choice is worth, measured, is in
the project's ``docs/benchmarks.md``.

The "auto" policy (:func:`choose_precision`):

========================================  ============  ==============
device                                    precision     loss scaler
========================================  ============  ==============
CUDA, compute capability >= 8.0           bf16          no
CUDA, compute capability 7.x              fp16          yes
CUDA, compute capability < 7.0            fp32          no
CPU with native bf16 (AVX512-BF16/AMX)    bf16          no
CPU without                               fp32          no
MPS                                       fp16          yes
anything else                             fp32          no
========================================  ============  ==============

On x86-64 "native bf16" means AVX512-BF16 or AMX (an AVX-512 CPU without them, such as
Skylake or Cascade Lake, emulates bf16 and gets fp32); on other CPUs (Arm) it is oneDNN's
own bf16 check.

Example:
    >>> from trainperf.amp import MixedPrecision
    >>> MixedPrecision(device="cpu", precision="fp32").dtype
    torch.float32
"""

from __future__ import annotations

from trainperf._utils.public import set_public_module
from trainperf.amp._mixed import MixedPrecision, Precision, choose_precision

__all__ = ["MixedPrecision", "Precision", "choose_precision"]

set_public_module(globals(), __all__, __name__)
