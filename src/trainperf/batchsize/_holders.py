"""Which objects hold the training state a probe changes, beyond those passed in.

``step`` trains what it closes over, not only what the caller handed to the tuner: the
optimizers stepping the passed parameters (:func:`holding_optimizers`), the LR schedulers
driving those (:func:`attached_schedulers`, held still while probing by
:func:`schedulers_held`), every live MixedPrecision and ``GradScaler``
(:func:`with_live_amp_state`), the model whose parameters only its optimizer was passed
for (:func:`owning_modules`), the EMA or SWA copies of the model (:func:`model_copies`) and
the random generators its layers own (:func:`module_generators`) are found here;
:func:`state_holder` says whose ``state_dict()`` holds an object's state in this process.
:class:`trainperf.batchsize._state.SavedState` saves and restores them.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from trainperf._utils.rng import dataset_generators
from trainperf.amp import MixedPrecision
from trainperf.amp._mixed import LIVE

__all__ = [
    "attached_schedulers",
    "holding_optimizers",
    "is_scheduler",
    "model_copies",
    "module_generators",
    "owning_modules",
    "parameters_of",
    "schedulers_held",
    "state_holder",
    "stateful_objects",
    "with_live_amp_state",
]


def stateful_objects(*groups: object) -> list[Any]:
    """The objects whose state is saved: each argument, or each item of a tuple or list;
    then the optimizers that step their parameters and the LR schedulers of every optimizer
    among them, found without being passed.

    Raises:
        TypeError: one of them has no ``state_dict``/``load_state_dict``.

    Example:
        >>> m = nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> [type(o).__name__ for o in stateful_objects(m, (opt,), None)]
        ['Linear', 'SGD']
    """
    found: list[Any] = []
    for group in groups:
        items = group if isinstance(group, (tuple, list)) else (group,)
        for obj in items:
            if obj is None:
                continue
            if not (callable(getattr(obj, "state_dict", None))) or not callable(
                getattr(obj, "load_state_dict", None)
            ):
                raise TypeError(
                    f"{type(obj).__name__} has no state_dict()/load_state_dict(), so "
                    f"tune_batch_size cannot put it back after probing; pass modules, "
                    f"optimizers, schedulers, GradScalers (anything with both methods)"
                )
            if all(obj is not seen for seen in found):
                found.append(obj)
    found += holding_optimizers(found)
    for scheduler in attached_schedulers([o for o in found if isinstance(o, Optimizer)]):
        if all(scheduler is not seen for seen in found):
            found.append(scheduler)
    return found


def holding_optimizers(objects: list[Any]) -> list[Optimizer]:
    """The optimizers alive in this process, not among ``objects``, that step a parameter of
    the modules or optimizers among them.

    ``model=`` passed without its optimizer (or a GAN's second optimizer left out): each
    probe step fills the optimizer's moments and step count, which would stay so. Found by
    a scan of the objects the garbage collector tracks (one pass, however many parameters;
    ``gc.get_referrers`` of every parameter would scan once per parameter).

    Example:
        >>> m = nn.Linear(2, 2)
        >>> opt = torch.optim.Adam(m.parameters())
        >>> holding_optimizers([m]) == [opt], holding_optimizers([m, opt])
        (True, [])
    """
    ours = {id(p) for p in parameters_of(objects)}
    if not ours:
        return []
    # type(), not isinstance(): isinstance reads __class__, which some module proxies
    # answer with a deprecation warning or an import.
    return [
        o
        for o in gc.get_objects()
        if issubclass(type(o), Optimizer)
        and all(o is not seen for seen in objects)
        and any(id(p) in ours for p in _stepped(o))
    ]


def _stepped(optimizer: Any) -> Iterator[Any]:
    """The parameters an optimizer steps; none for a subclass that never set its groups."""
    for group in getattr(optimizer, "param_groups", None) or ():
        yield from group.get("params", ()) if isinstance(group, dict) else ()


def with_live_amp_state(objects: Iterable[Any]) -> list[Any]:
    """``objects``, then every live :class:`~trainperf.MixedPrecision` and every live
    ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` included) not among them.

    A ``step`` that uses one moves its loss scale and growth tracker (each probe step that
    does not overflow counts towards a doubling: a default scaler's scale grew 1024 times
    over a tuning run) and a MixedPrecision's record of its backward, passed or not. A
    MixedPrecision registers itself when made; a plain scaler is found by a scan of the
    objects the garbage collector tracks. They are kept out of :func:`stateful_objects`
    (the cache key): one alive for another model says nothing about this step (the key
    counts those the step reads).

    Example:
        >>> mp = MixedPrecision("cpu", precision="fp32")
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> found = with_live_amp_state([])
        >>> any(o is mp for o in found), any(o is scaler for o in found)
        (True, True)
    """
    out = list(objects)
    out += [mp for mp in list(LIVE) if all(mp is not o for o in out)]
    held = [getattr(o, "scaler", None) for o in out if isinstance(o, MixedPrecision)]
    out += [
        s
        for s in gc.get_objects()
        if issubclass(type(s), torch.amp.GradScaler) and all(s is not o for o in out + held)
    ]
    return out


def owning_modules(objects: Iterable[Any]) -> list[nn.Module]:
    """The outermost live modules, not among ``objects``, that hold a parameter one of the
    optimizers among ``objects`` steps but no module among them owns.

    ``optimizer=`` passed without its model (or a GAN's ``model=G, optimizer=(optG,
    optD)``): an optimizer's ``state_dict()`` holds no parameter values, nor the model's
    BatchNorm statistics, ``num_batches_tracked`` or train/eval modes. Found by one scan of
    the objects the garbage collector tracks: a module's own ``_parameters`` holds the
    parameter and its parent's ``_modules`` the module, up to the model that no module
    holds (whose buffers include those of submodules without parameters, a BatchNorm with
    ``affine=False``). A parameter no module holds stays loose (saved by value).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> owning_modules([opt]) == [model], owning_modules([model, opt])
        (True, [])
    """
    objects = list(objects)
    passed = [o for o in objects if isinstance(o, nn.Module)]
    owned = {id(p) for m in passed for p in m.parameters()}
    loose = {id(p) for p in parameters_of(objects)} - owned
    if not loose:
        return []
    modules = [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]
    parents: dict[int, list[nn.Module]] = {}
    for m in modules:
        for child in _own(m, "_modules").values():
            parents.setdefault(id(child), []).append(m)
    todo = [m for m in modules if any(id(p) in loose for p in _own(m, "_parameters").values())]
    seen: set[int] = set()
    roots: list[nn.Module] = []
    while todo:
        m = todo.pop()
        if id(m) not in seen:
            seen.add(id(m))
            todo += parents.get(id(m), [])
            if id(m) not in parents and all(m is not o for o in objects):
                roots.append(m)
    return roots


_WRAPPED = ("module", "_orig_mod")
"""Where a wrapper keeps the model: DDP's and an EMA's ``module``, ``torch.compile``'s."""


def _unwrapped(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and the models it wraps (DDP, ``torch.compile``), outermost first."""
    inner: Any = module
    while isinstance(inner, nn.Module):
        yield inner
        children = _own(inner, "_modules")
        inner = next((children[k] for k in _WRAPPED if k in children), None)


def _layout(module: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    """Each parameter's name and shape; None where one has no values (lazy, meta)."""
    params = list(module.named_parameters())
    if any(is_lazy(p) or p.is_meta for _, p in params):
        return None
    return tuple((n, tuple(p.shape)) for n, p in params)


_NOT_AVERAGES = (nn.parallel.DistributedDataParallel, nn.DataParallel)
"""Wrappers that keep the model they train as ``module``, not a copy of it."""


def model_copies(objects: Iterable[Any]) -> list[nn.Module]:
    """The live EMA or SWA averages of a model among ``objects``, not among them: the
    modules that keep a copy of it as ``module`` (``torch.optim.swa_utils.AveragedModel``,
    timm's ``ModelEmaV2``/``ModelEmaV3``). ``step`` updates one after each optimizer step;
    unless it is put back, it comes back averaged over every probe step (and an
    ``AveragedModel``'s ``n_averaged`` counts them).

    A copy is a module of the model's class (under a DDP or ``torch.compile`` wrapper, the
    class inside it) with the same parameter names and shapes, none of them shared with the
    model. Found by one scan of the objects the garbage collector tracks. A copy of the
    model kept otherwise (a distillation teacher made by ``deepcopy``) is not found: pass
    it in ``model=(model, teacher)``.

    Example:
        >>> from torch.optim.swa_utils import AveragedModel
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> swa = AveragedModel(model)
        >>> model_copies([model]) == [swa], model_copies([model, swa])
        (True, [])
    """
    objects = list(objects)
    passed = [m for o in objects if isinstance(o, nn.Module) for m in _unwrapped(o)]
    models = {(type(m), layout) for m in passed if (layout := _layout(m)) is not None}
    if not models:
        return []
    classes = {cls for cls, _ in models}
    ours = {id(m) for o in objects if isinstance(o, nn.Module) for m in o.modules()}
    params = {id(p) for o in objects if isinstance(o, nn.Module) for p in o.parameters()}
    found: list[nn.Module] = []
    for holder in gc.get_objects():
        if not issubclass(type(holder), nn.Module) or issubclass(type(holder), _NOT_AVERAGES):
            continue
        inner = _own(holder, "_modules").get("module")
        if (
            isinstance(inner, nn.Module)
            and type(inner) in classes
            and id(holder) not in ours
            and id(inner) not in ours
            and (type(inner), _layout(inner)) in models
            and not any(id(p) in params for p in inner.parameters())
        ):
            found.append(holder)
    return found


def module_generators(
    objects: Iterable[Any], owners: list[nn.Module] | None = None
) -> list[object]:
    """The random generators (torch, numpy, ``random.Random``) that the submodules of the
    modules among ``objects`` hold as attributes (a seeded noise or augmentation layer),
    and those of the model an optimizer among them steps (``owners``: the
    :func:`owning_modules` of ``objects``, found here when None): a probe step draws from
    them, and training would go on from other draws than an untuned run.

    Example:
        >>> class Noise(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.gen = torch.Generator()
        >>> model = nn.Sequential(nn.Linear(2, 2), Noise())
        >>> [g is model[1].gen for g in module_generators([model])]
        [True]
    """
    objects = list(objects)
    if owners is None:
        owners = owning_modules(objects)
    modules = [o for o in objects if isinstance(o, nn.Module)] + owners
    found: list[object] = []
    seen: set[int] = set()
    for m in (sub for module in modules for sub in module.modules()):
        for g in dataset_generators(m):
            if id(g) not in seen:
                seen.add(id(g))
                found.append(g)
    return found


def _own(module: nn.Module, name: str) -> dict[str, Any]:
    """``module``'s own ``_parameters`` or ``_modules`` dict (empty while ``__init__`` has
    not set it yet, or where a module keeps something else there)."""
    value = vars(module).get(name)
    return value if isinstance(value, dict) else {}


def is_scheduler(obj: object) -> bool:
    """``obj`` is an LR scheduler (``ReduceLROnPlateau`` included)."""
    return isinstance(obj, (LRScheduler, ReduceLROnPlateau))


_NOT_SET = object()


@contextlib.contextmanager
def schedulers_held(objects: Iterable[Any]) -> Iterator[None]:
    """Every LR scheduler among ``objects`` stands still meanwhile: its ``step()`` does
    nothing. Probing runs thousands of steps; a scheduler stepped by each would run out
    (OneCycleLR raises past its ``total_steps``) and its learning rates are no part of what
    a step costs.

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> with schedulers_held([sched]):
        ...     sched.step()
        >>> sched.last_epoch, sched.step.__name__
        (0, 'step')
    """
    held = [o for o in objects if is_scheduler(o)]
    own = [o.__dict__.get("step", _NOT_SET) for o in held]
    for scheduler in held:
        scheduler.step = _standing_still
    try:
        yield
    finally:
        for scheduler, step in zip(held, own, strict=True):
            if step is _NOT_SET:
                del scheduler.step
            else:
                scheduler.step = step


def _standing_still(*args: Any, **kwargs: Any) -> None:
    """A held scheduler's ``step``: nothing."""


def attached_schedulers(optimizers: list[Optimizer]) -> list[Any]:
    """The LR schedulers alive in this process that drive one of ``optimizers``.

    A ``step`` that also steps its scheduler advances it on every probe step: unless its
    state is put back too, training resumes further along its schedule than it was (a
    OneCycleLR's warm-up spent on probes, or run past its ``total_steps``). The schedulers
    are found by who refers to each optimizer (``gc.get_referrers``), so the caller need
    not pass them.

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
        >>> attached_schedulers([opt]) == [sched]
        True
    """
    if not optimizers:
        return []
    # An instance's attributes refer to it from the instance itself (inline values) or
    # from its __dict__, whose referrer is the instance: one more scan for all the dicts.
    refs = gc.get_referrers(*optimizers)
    dicts = [r for r in refs if isinstance(r, dict)]
    owners = [r for r in refs if not isinstance(r, dict)]
    owners += gc.get_referrers(*dicts) if dicts else []
    found: list[Any] = []
    for owner in owners:
        opt = getattr(owner, "optimizer", None) if is_scheduler(owner) else None
        if any(opt is o for o in optimizers) and all(owner is not f for f in found):
            found.append(owner)
    return found


def state_holder(obj: Any) -> Any:
    """The object whose ``state_dict()`` holds ``obj``'s state in this process: a
    ``ZeroRedundancyOptimizer``'s local optimizer (the moments of this rank's shard), since
    its own ``state_dict()`` refuses until ``consolidate_state_dict()``, a collective, ran
    on every rank; ``obj`` itself for anything else.

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        >>> state_holder(opt) is opt
        True
    """
    inner = getattr(obj, "optim", None)
    if callable(getattr(obj, "consolidate_state_dict", None)) and isinstance(inner, Optimizer):
        return inner
    return obj


def parameters_of(objects: Iterable[Any]) -> list[nn.Parameter]:
    """Every parameter of the modules and optimizers among ``objects``, once."""
    params: list[nn.Parameter] = []
    seen: set[int] = set()

    def add(ps: Iterable[Any]) -> None:
        for p in ps:
            if isinstance(p, torch.Tensor) and id(p) not in seen:
                seen.add(id(p))
                params.append(p)  # type: ignore[arg-type]

    for obj in objects:
        if isinstance(obj, nn.Module):
            add(obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                add(group["params"])
    return params
