"""The cache: keyed like the loader tuner's, and nothing in it trusted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trainperf.amp import MixedPrecision, Precision
from trainperf.amp._tf32 import tf32
from trainperf.batchsize._cache import cache_misfit, cache_path, entry_key, parsed_candidates
from trainperf.batchsize._search import SizeSpace


def key(**kw: object) -> str:
    fields: dict[str, object] = {
        "step": print,
        "objects": [nn.Linear(4, 4), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)],
        "device": torch.device("cpu"),
        "first_batch": torch.zeros(1, 4),
        "space": SizeSpace(1, 64),
        "world_size": 1,
        "global_batch": None,
        "headroom": 0.1,
    }
    fields.update(kw)
    return entry_key(**fields)  # type: ignore[arg-type]


def frozen(m: nn.Module) -> nn.Module:
    m.weight.requires_grad_(False)
    return m


def test_the_key_changes_with_what_decides_the_answer() -> None:
    base = key()
    assert key() == base
    changed = [
        key(objects=[nn.Linear(4, 8)]),  # another parameter count
        key(objects=[nn.Linear(4, 4).double()]),  # another dtype
        key(objects=[frozen(nn.Linear(4, 4))]),  # as many parameters, fewer trainable
        key(objects=[nn.DataParallel(nn.Linear(4, 4))]),  # wrapped: another speed
        key(objects=[nn.Linear(4, 4), torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1)]),
        key(step=len),
        key(first_batch=torch.zeros(1, 5)),
        key(first_batch=torch.zeros(1, 4, dtype=torch.float16)),
        key(space=SizeSpace(1, 128)),
        key(world_size=2),
        key(global_batch=64),
        key(headroom=0.2),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_the_key_tells_precisions_and_optimizer_implementations_apart() -> None:
    # A size tuned under bf16 autocast would not fit in fp32: its activations take twice
    # the memory, and the entry's peak (the bf16 one) would pass the memory check.
    model = nn.Linear(4, 4)

    def with_(*extra: object) -> str:
        return key(objects=[model, *extra])

    bf16, fp32 = MixedPrecision("cpu", precision="bf16"), MixedPrecision("cpu", precision="fp32")
    assert with_(bf16) != with_(fp32)
    assert with_(bf16) == with_(MixedPrecision("cpu", precision="bf16"))
    foreach = torch.optim.Adam(model.parameters(), foreach=True)
    plain = torch.optim.Adam(model.parameters(), foreach=False)
    assert with_(foreach) != with_(plain)
    assert with_(plain) == with_(torch.optim.Adam(model.parameters(), lr=0.5, foreach=False))
    on = torch.amp.GradScaler("cpu", enabled=True)
    assert with_(on) != with_(torch.amp.GradScaler("cpu", enabled=False))


def test_the_file_sits_beside_the_loaders() -> None:
    assert cache_path().name == "batch_size.json"
    assert cache_path().parent.name == "trainperf"


def entry(**kw: object) -> dict[str, object]:
    return {"batch_size": 16, "accumulation_steps": 4, "peak_memory": 1000, "candidates": [],
            **kw}  # fmt: skip


def test_an_entry_is_used_only_when_it_still_fits() -> None:
    space = SizeSpace(1, None, per_rank=64)
    assert cache_misfit(entry(), space, 2000.0) is None
    assert cache_misfit(entry(peak_memory=None), space, None) is None
    assert "peaked at" in (cache_misfit(entry(), space, 500.0) or "")
    assert "not a size this call allows" in (cache_misfit(entry(batch_size=12), space, None) or "")
    assert "not a size" in (cache_misfit(entry(batch_size="16"), space, None) or "")
    assert "does not make up" in (cache_misfit(entry(accumulation_steps=2), space, None) or "")
    assert "peak_memory=-1" in (cache_misfit(entry(peak_memory=-1), space, None) or "")
    bad = entry(candidates=[{"batch_size": 16, "no such field": 1}])
    assert "do not parse" in (cache_misfit(bad, space, None) or "")
    assert parsed_candidates(bad) is None
    assert parsed_candidates(entry(candidates=[{"batch_size": 8, "status": "ok"}])) is not None


def test_wrappers_are_told_apart_by_the_model_inside() -> None:
    a, b = nn.DataParallel(nn.Linear(4, 4)), nn.DataParallel(nn.Sequential(nn.Linear(4, 4)))
    assert key(objects=[a]) != key(objects=[b])


def test_an_edited_entry_whose_report_fields_are_spoilt_is_not_used() -> None:
    # Before: these passed the check and the hit crashed in str()/to_dict() of the report.
    space = SizeSpace(1, None, per_rank=64)
    for field, value in [("samples_per_s", "fast"), ("memory_limit", "lots"),
                         ("batch_bytes", -3), ("memory_kind", 5)]:  # fmt: skip
        why = cache_misfit(entry(**{field: value}), space, None) or ""
        assert why.startswith(f"{field}={value!r} is not"), why
    assert (
        cache_misfit(entry(samples_per_s=12.5, memory_limit=None, batch_bytes=64), space, None)
        is None
    )


def test_models_of_one_class_and_size_but_other_shapes_have_other_keys() -> None:
    # Before: keyed by class and parameter count only, an MLP 8-64-4-1 answered for an
    # MLP 8-1-277-1 (841 parameters each), whose activations and speed differ.
    def mlp(a: int, b: int) -> nn.Module:
        return nn.Sequential(nn.Linear(8, a), nn.Linear(a, b), nn.Linear(b, 1))

    wide, narrow = mlp(64, 4), mlp(1, 277)
    assert sum(p.numel() for p in wide.parameters()) == sum(p.numel() for p in narrow.parameters())
    assert key(objects=[wide]) != key(objects=[narrow])
    assert key(objects=[mlp(64, 4)]) == key(objects=[wide])  # same shapes: the same key


class Checkpointed(nn.Module):
    """A module with Hugging Face's flag for recomputing activations in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gradient_checkpointing = False


def stepping(model: object, mp: object = None) -> object:
    """A step whose body is always the same, reading ``model`` and ``mp`` from its closure."""

    def step(batch: object) -> object:
        return model, mp, batch

    return step


def test_the_key_changes_with_modes_and_layouts_the_shapes_do_not_show() -> None:
    # Before: a model tuned in eval mode, with gradient checkpointing, or with
    # channels_last weights answered for the same model without: the cached size of a
    # checkpointed model runs out of memory once checkpointing is off.
    base = key(objects=[Checkpointed()])
    evaluating, checkpointing = Checkpointed().eval(), Checkpointed()
    checkpointing.gradient_checkpointing = True
    conv = nn.Conv2d(3, 8, 3)
    changed = [
        key(objects=[evaluating]),
        key(objects=[checkpointing]),
        key(objects=[conv]),
        key(objects=[conv.to(memory_format=torch.channels_last)]),
    ]
    assert base not in changed and len(set(changed)) == len(changed)
    assert key(objects=[Checkpointed()]) == base


def _model_class(forward: str) -> type[nn.Module]:
    """A ``Net(nn.Linear)`` whose forward returns ``forward``, as a user's module defines it
    (one module name, file and line, whatever the body)."""
    source = f"class Net(nn.Linear):\n    def forward(self, x):\n        return {forward}\n"
    namespace: dict[str, object] = {"nn": nn, "__name__": "user_model"}
    exec(compile(source, "user_model.py", "exec"), namespace)
    return namespace["Net"]  # type: ignore[return-value]


def test_the_key_changes_when_the_model_s_code_is_edited() -> None:
    # Before: only the model's class name, sizes and shapes counted: after an edit of its
    # forward (another attention, an upsampling), same parameters, the size tuned for the
    # old code was reused, its peak from the old code taken as still fitting.
    base = key(objects=[_model_class("super().forward(x)")(4, 4)])
    assert key(objects=[_model_class("super().forward(x)")(4, 4)]) == base
    edited = _model_class("super().forward(x).relu()")
    assert key(objects=[edited(4, 4)]) != base
    inside = nn.Sequential(_model_class("super().forward(x)")(4, 4))
    assert key(objects=[nn.Sequential(edited(4, 4))]) != key(objects=[inside])


def test_the_key_changes_with_what_the_step_reads_unpassed() -> None:
    # Before: only the step's own body counted: a step using a MixedPrecision or a
    # torch.compile'd model it was not passed got a size tuned for another precision.
    model = nn.Linear(4, 4)
    base = key(step=stepping(model))
    assert key(step=stepping(model)) == base  # another step object, the same code and reads
    changed = [
        key(step=stepping(torch.compile(model))),
        key(step=stepping(model, MixedPrecision("cpu", precision="bf16"))),
        key(step=stepping(model, MixedPrecision("cpu", precision="fp32"))),
        key(step=stepping(model.eval())),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_the_key_reads_a_trainer_s_attributes_and_the_functions_a_step_calls() -> None:
    class Trainer:
        def __init__(self, precision: Precision) -> None:
            self.mp = MixedPrecision("cpu", precision=precision)

        def step(self, batch: object) -> object:
            return self.mp, batch

    assert key(step=Trainer("bf16").step) != key(step=Trainer("fp32").step)

    def with_helper(mp: MixedPrecision) -> object:
        helper = stepping(None, mp)
        return stepping(helper)  # the step calls a helper that reads mp

    bf16, fp32 = MixedPrecision("cpu", precision="bf16"), MixedPrecision("cpu", precision="fp32")
    assert key(step=with_helper(bf16)) != key(step=with_helper(fp32))


def test_the_key_of_a_gpu_changes_with_tf32_and_cudnn_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # TF32 matmuls, cuDNN's autotuner and deterministic algorithms change the speed (and
    # cuDNN's workspace) of every size: a size cached with them off was not measured so.
    card = SimpleNamespace(name="Fake GPU", total_memory=2**34)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: card)
    gpu = torch.device("cuda", 0)
    with tf32(False):
        off = key(device=gpu)
        assert key(device=gpu) == off
    with tf32(True):
        on = key(device=gpu)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", not torch.backends.cudnn.benchmark)
    with tf32(False):
        benchmarked = key(device=gpu)
    assert len({off, on, benchmarked}) == 3


def test_a_lazy_module_the_step_reads_keys_by_its_class() -> None:
    # Its parameters have no size yet: describing it must not fail the key.
    assert key(step=stepping(nn.LazyLinear(3))) == key(step=stepping(nn.LazyLinear(3)))
    assert key(step=stepping(nn.LazyLinear(3))) != key(step=stepping(nn.Linear(2, 3)))
