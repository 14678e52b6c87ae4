"""Save and load checkpoints safely: atomic writes, cross-device loads, wrapper prefixes.

``save_checkpoint`` never leaves a half-written file under the final name (temp file, fsync,
``os.replace``); ``load_checkpoint`` maps GPU-saved tensors to any device, refuses pickled code
unless told to trust the file, and names the cause when a file is missing, damaged or not a
checkpoint; ``load_state_dict`` fits state dicts with or without the ``module.`` (DataParallel,
DDP) and ``_orig_mod.`` (``torch.compile``) prefixes into wrapped or plain models.

- :mod:`._prefix`: :func:`unwrap_model`, :func:`strip_prefix`, :func:`load_state_dict` and
  :class:`LoadResult` (wrapper layers and key prefixes);
- :mod:`._keys`: the key helpers behind them (removing prefix layers, matching shapes);
- :mod:`._search`: finding the model's state dict inside a whole checkpoint (timm,
  Lightning, Fabric), by keys and shapes;
- :mod:`._files`: :func:`save_checkpoint` and :func:`load_checkpoint`, which reads one file
  or open file object through :mod:`._read`;
- :mod:`._write`: ``write_checkpoint_file``, the temp-file, fsync and ``os.replace`` write
  behind ``save_checkpoint`` (:mod:`trainperf._utils.atomic`), its failures as
  ``CheckpointError``;
- :mod:`._formats`: recognising a file from its first bytes and naming why it does not load;
- :mod:`._allow`: the data-only types (numpy, argparse.Namespace, pathlib, datetime) allowed
  under ``weights_only=True``, and the refusal message listing every other global;
- :mod:`._dirs`: directories (sharded safetensors / ``.bin`` with an index, Accelerate
  ``save_state``, DCP);
- :mod:`._checkpointer`: :class:`Checkpointer`, a directory of step-numbered checkpoints
  (background saves, ``keep``, exact resume, preemption), built from :mod:`._steps` (file
  names, which files are step files (their pickle read by :mod:`._skim`, once per version
  of the file: :mod:`._held`), retention, stale temp files), :mod:`._payload` (what a file
  holds, and restoring it into live objects), :mod:`._writer` (the forked or threaded
  background writer and :class:`SaveHandle`; :mod:`._writer_fork`, :mod:`._writer_snapshot`,
  :mod:`._writer_staging`), :mod:`._checkpointer_wait` (and :mod:`._wait_notice`, the
  "still waiting" lines both it and :class:`SaveHandle` print), :mod:`._checkpointer_warn`,
  :mod:`._checkpointer_ranks`, :mod:`._checkpointer_restore`, :mod:`._preempt`
  (:class:`Preemption`, the signal flag every rank agrees on), :mod:`._loader_state` (a
  DataLoader's position mid-epoch; whether and where it resumes in the loader restored
  into, another batch size included: :mod:`._loader_resume`; the states its sampler draws
  from: :mod:`._sampler_states`; those of the generators its dataset owns:
  :mod:`._dataset_states`) and :mod:`._rng` (the random generators' states).
"""

from __future__ import annotations

from trainperf._utils.public import set_public_module
from trainperf.checkpoint._checkpointer import Checkpointer
from trainperf.checkpoint._files import load_checkpoint, save_checkpoint
from trainperf.checkpoint._keys import DEFAULT_PREFIXES
from trainperf.checkpoint._preempt import Preemption
from trainperf.checkpoint._prefix import (
    LoadResult,
    load_state_dict,
    strip_prefix,
    unwrap_model,
)
from trainperf.checkpoint._writer import SaveHandle

__all__ = [
    "DEFAULT_PREFIXES",
    "Checkpointer",
    "LoadResult",
    "Preemption",
    "SaveHandle",
    "load_checkpoint",
    "load_state_dict",
    "save_checkpoint",
    "strip_prefix",
    "unwrap_model",
]

set_public_module(globals(), __all__, __name__)
