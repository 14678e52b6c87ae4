"""Private helpers shared by several trainperf packages; nothing here is public API.

Who uses what:

- :mod:`~trainperf._utils.atomic`: atomic file writes, used by ``checkpoint`` (through its
  ``_write`` module, which names the fix in a ``CheckpointError``) and the ``loader`` cache.
- :mod:`~trainperf._utils.imports`: availability checks for optional packages (DALI, NVML,
  torchvision, safetensors, matplotlib), used by every package that imports one lazily.
- :mod:`~trainperf._utils.format`: byte sizes in words, used by the reports of ``device``,
  ``doctor``, ``loader`` and ``monitor``.
- :mod:`~trainperf._utils.launch_env`: the launcher's environment (RANK, LOCAL_RANK,
  WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_PORT, SLURM_*), read and parsed with one rule each;
  used by ``limits``, ``ddp``, ``doctor`` (through ``limits``) and ``pipelines``.
- :mod:`~trainperf._utils.cgroup`: the readers of the cgroup and PSI files (the cgroups that
  bind this process, CPU quotas and sets, ``memory.stat``, ``cpu.pressure``), used by
  ``limits`` (and through it ``doctor``, ``bench`` and every package that sizes work from
  ``host_limits()``); its ``read_file`` also by ``doctor``'s reads of ``/sys`` and
  ``/proc/cmdline``.
- :mod:`~trainperf._utils.validate`: the argument checks (``positive_int``, ``choice``, ...)
  every package uses, one message per kind of value; ``worker_numbers``, DataLoader's worker
  settings checked once for ``loader``, ``ddp`` and ``batchsize``.
- :mod:`~trainperf._utils.serialize`: ``result_dict``, the ``to_dict()`` of result dataclasses
  in ``bench``, ``checkpoint``, ``device`` and ``limits``.
- :mod:`~trainperf._utils.public`: sets each public object's ``__module__`` to the path users
  import it from, used by every package ``__init__``.
- :mod:`~trainperf._utils.lifetime`: ``DieWithParent`` and ``die_with_parent``, used by the
  ``loader``, ``pipelines``, ``ddp``'s ranks and the ``checkpoint`` writer (its workers ignore
  the signals an active ``Checkpointer.preemption()`` waits for: ``preemption_signals``).
- :mod:`~trainperf._utils.procfs`: ``/proc/<pid>/stat`` fields, used by ``lifetime`` and
  ``ddp``'s run directories.
- :mod:`~trainperf._utils.cache` and :mod:`~trainperf._utils.qualname`: the JSON cache store
  and the qualified names in its keys, used by the ``loader`` and ``batchsize`` caches.
- :mod:`~trainperf._utils.windows`: repeated timed windows until the spread is small, used
  by the ``loader``'s measurements and the ``batchsize`` probe.
- :mod:`~trainperf._utils.progress`: the one-line progress bar of ``tune_loader`` and
  ``tune_batch_size``.
- :mod:`~trainperf._utils.plotting`: ``checked_path`` and ``save_figure``, where a report's
  ``plot(path)`` writes; used by ``monitor``, ``batchsize``, ``loader`` and ``doctor``.
- :mod:`~trainperf._utils.oom`: ``oom_kind``, whether an error means device or host
  memory ran out; used by ``checkpoint``, ``batchsize`` and the ``bench`` command.
- :mod:`~trainperf._utils.batches` and :mod:`~trainperf._utils.rng`: a batch's bytes and
  samples (and the tensors in it: ``tensor_leaves``), and every random generator restored
  after a block; used by the ``loader`` tuner, ``tune_batch_size`` and ``checkpoint``'s
  exact resume.
- :mod:`~trainperf._utils.exiting`: whether the interpreter's exit has begun (Python's
  thread shutdown, which ``import trainperf`` makes sure runs); used by ``checkpoint``.
"""
