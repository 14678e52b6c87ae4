"""trainperf.checkpoint._files: save_checkpoint and load_checkpoint (devices, missing, empty and
safetensors files, the GPU-saved fixtures, saving under torch.distributed)."""

from __future__ import annotations

import collections
import errno
import io
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainperf._utils.imports
import trainperf.checkpoint._rank_gpu as rank_gpu_module
import trainperf.checkpoint._read as read_module
from tests.checkpoint import _ranks
from tests.checkpoint._common import FIXTURES, GPU_FILES, PEERS, Net, assert_same, temps
from tests.checkpoint._fake_nccl import FakeNccl, map_locations
from tests.ddp._distributed import FORK, spawn
from trainperf.checkpoint import load_checkpoint, load_state_dict, save_checkpoint, unwrap_model
from trainperf.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    DeviceError,
    NotACheckpointError,
    UnsafeCheckpointError,
)

# --------------------------------------------------------------------------- save


def test_save_round_trip_accepts_str_and_pathlike_and_returns_path(tmp_path: Path) -> None:
    obj = {"step": 3, "w": torch.randn(3, 2), "names": ["a", "b"]}
    for target in (str(tmp_path / "a.pt"), tmp_path / "b.pt"):
        out = save_checkpoint(obj, target)
        assert out == Path(target) and isinstance(out, Path)
        loaded = load_checkpoint(out)
        assert loaded["step"] == 3 and loaded["names"] == ["a", "b"]
        assert torch.equal(loaded["w"], obj["w"])
    assert temps(tmp_path) == []


def test_save_replaces_existing_file(old: Path) -> None:
    save_checkpoint({"gen": 1}, old)
    assert load_checkpoint(old) == {"gen": 1}
    assert temps(old.parent) == []


def test_save_creates_missing_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "exp1" / "last.pt"
    save_checkpoint({"x": 1}, path)
    assert load_checkpoint(path) == {"x": 1}


@pytest.mark.slow
def test_save_module_saves_unwrapped_state_dict(tmp_path: Path) -> None:
    net = Net()
    for i, wrapped in enumerate(
        [net, nn.DataParallel(net), torch.compile(net), nn.DataParallel(torch.compile(net))]
    ):
        path = save_checkpoint(wrapped, tmp_path / f"m{i}.pt")
        # weights_only=True loads it: a state dict, not a pickled module.
        loaded = load_checkpoint(path)
        assert_same(loaded, net.state_dict())
        assert loaded._metadata[""] == net.state_dict()._metadata[""]


@pytest.mark.slow
def test_save_dict_of_modules_optimizer_and_prefixed_state_dicts(tmp_path: Path) -> None:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 5, 5)).sum().backward()
    opt.step()
    obj = collections.OrderedDict(
        model=nn.DataParallel(net),
        ema=nn.DataParallel(torch.compile(net)).state_dict(),
        optimizer=opt,
        epoch=7,
    )
    path = save_checkpoint(obj, tmp_path / "all.pt")
    loaded = load_checkpoint(path)
    assert isinstance(loaded, collections.OrderedDict)
    assert list(loaded) == ["model", "ema", "optimizer", "epoch"]
    assert_same(loaded["model"], net.state_dict())
    assert_same(loaded["ema"], net.state_dict())
    assert loaded["ema"]._metadata["bn"] == {"version": 2}
    assert loaded["optimizer"]["param_groups"][0]["momentum"] == 0.9
    assert loaded["epoch"] == 7
    assert isinstance(obj["model"], nn.DataParallel)  # the caller's dict is not modified


def test_save_schedulers_scalers_and_mixed_precision_as_state_dicts(tmp_path: Path) -> None:
    from trainperf import MixedPrecision

    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    obj = {
        "model": net,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": scaler,
        "mp": MixedPrecision("cpu", precision="fp32"),
        "more": {"schedulers": [sched], "pair": (opt, 1)},
    }
    state = load_checkpoint(save_checkpoint(obj, tmp_path / "all.pt"))  # weights_only=True
    opt2 = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    sched2.load_state_dict(state["scheduler"])
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr() == [0.05]
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.load_state_dict(state["scaler"])
    assert scaler2.get_scale() == 1024.0
    assert state["mp"] == {"precision": "fp32", "scaler": None}
    assert state["more"]["schedulers"] == [sched.state_dict()]
    assert state["more"]["pair"][1] == 1 and isinstance(state["more"]["pair"], tuple)
    assert state["more"]["pair"][0]["param_groups"][0]["lr"] == 0.05
    assert obj["scheduler"] is sched and obj["more"]["schedulers"][0] is sched  # not modified
    # A class has a state_dict attribute too, but is no stateful object: saved as given.
    with pytest.warns(UserWarning, match=r"cls.pt, but load_checkpoint \(weights_only=True\) will"):
        path = save_checkpoint({"cls": nn.Linear}, tmp_path / "cls.pt")
    assert load_checkpoint(path, weights_only=False)["cls"] is nn.Linear


def test_save_warns_of_a_file_the_default_load_will_refuse(tmp_path: Path) -> None:
    history = collections.defaultdict(list, {"val_acc": [0.9]})
    with pytest.warns(UserWarning, match=r"collections.defaultdict.*Save plain data instead"):
        path = save_checkpoint({"model": nn.Linear(2, 2), "history": history}, tmp_path / "h.pt")
    assert load_checkpoint(path, weights_only=False)["history"] == history  # written all the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plain data: no warning
        save_checkpoint({"model": nn.Linear(2, 2), "history": dict(history)}, tmp_path / "p.pt")


def test_save_strips_prefixes_of_a_top_level_state_dict(tmp_path: Path) -> None:
    sd = nn.DataParallel(Net()).state_dict()
    loaded = load_checkpoint(save_checkpoint(sd, tmp_path / "s.pt"))
    assert list(loaded) == [k.removeprefix("module.") for k in sd]


def _averaged() -> torch.optim.swa_utils.AveragedModel:
    torch.manual_seed(0)
    swa = torch.optim.swa_utils.AveragedModel(Net())
    for _ in range(2):
        swa.update_parameters(Net())
    return swa


@pytest.mark.parametrize("form", ["module", "state dict", "dict of module", "dict of state dict"])
def test_an_averaged_models_real_module_prefix_is_kept(tmp_path: Path, form: str) -> None:
    # AveragedModel holds the network as a real submodule named `module`, beside its own
    # n_averaged: only wrappers' prefixes (on every key) go, so the file loads back into an
    # AveragedModel with torch alone, strictly.
    swa = _averaged()
    obj: Any = {
        "module": swa,
        "state dict": swa.state_dict(),
        "dict of module": {"swa": swa},
        "dict of state dict": {"swa": swa.state_dict()},
    }[form]
    path = save_checkpoint(obj, tmp_path / "swa.pt")
    saved = torch.load(path, weights_only=True)
    saved = saved.get("swa", saved)
    assert list(saved) == list(swa.state_dict())  # n_averaged, module.conv.weight, ...
    plain = torch.optim.swa_utils.AveragedModel(Net())
    plain.load_state_dict(saved, strict=True)
    assert int(plain.n_averaged) == 2
    assert_same(plain.state_dict(), swa.state_dict())
    ours = torch.optim.swa_utils.AveragedModel(Net())
    assert load_state_dict(ours, load_checkpoint(path)).complete
    assert_same(ours.state_dict(), swa.state_dict())


def test_wrapper_layers_go_even_around_an_averaged_model(tmp_path: Path) -> None:
    # DataParallel around an AveragedModel: its layer is on every key and goes; the
    # AveragedModel's own `module.` stays.
    swa = _averaged()
    sd = nn.DataParallel(swa).state_dict()
    assert all(k.startswith("module.") for k in sd)
    loaded = load_checkpoint(save_checkpoint({"swa": sd}, tmp_path / "dp.pt"))["swa"]
    assert list(loaded) == list(swa.state_dict())


# ---------------------------------------------------------------------- distributed


def test_save_under_one_rank_gloo_group_unwraps_ddp(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        net = Net()
        ddp = nn.parallel.DistributedDataParallel(net)
        path = save_checkpoint({"model": ddp}, tmp_path / "ddp.pt")
        assert_same(load_checkpoint(path)["model"], net.state_dict())
        fresh = nn.parallel.DistributedDataParallel(Net())
        assert load_state_dict(fresh, ddp.state_dict()).complete
        assert_same(unwrap_model(fresh).state_dict(), net.state_dict())
    finally:
        dist.destroy_process_group()


def test_distributed_must_be_none_true_or_false(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"distributed must be one of \(None, True, False\), got 'yes'"
    ):
        save_checkpoint({"x": 1}, tmp_path / "c.pt", distributed="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "c.pt").exists()


# Two gloo ranks, forked where that is safe. The process-group timeout is short so that a
# save that waits for a rank which never joins fails the test in seconds instead of hanging it.
def _two_ranks(fn: Any, tmp_path: Path, timeout_s: float = 10.0) -> dict[int, Any]:
    return spawn(fn, 2, "gloo", args=(tmp_path,), start_method=FORK, timeout_s=timeout_s)


def test_save_inside_if_rank_0_returns_and_writes_once(tmp_path: Path) -> None:
    results = _two_ranks(_ranks.save_on_rank0_only, tmp_path)
    assert results[0]["written"] == ["r0.pt"] and results[1]["written"] == []
    assert results[0]["w"] == results[1]["w"] == [7.0, 7.0, 7.0]
    assert results[0]["step"] == 5
    assert temps(tmp_path) == []


def test_save_on_every_rank_writes_on_rank_0_only(tmp_path: Path) -> None:
    results = _two_ranks(_ranks.save_on_every_rank, tmp_path)
    assert results[0]["written"] == ["all.pt"] and results[1]["written"] == []
    assert results[0]["returned"] == results[1]["returned"] == "all.pt"
    assert results[1]["w"] == [7.0, 7.0, 7.0]


@pytest.mark.slow
def test_distributed_true_waits_for_rank_0_and_shares_its_failure(tmp_path: Path) -> None:
    r0, r1 = _two_ranks(_ranks.save_collectively, tmp_path).values()
    # Rank 0 took 0.5 s to write; rank 1 returned only once the file was there.
    assert r0["exists_on_return"] and r1["exists_on_return"]
    assert r0["loaded"] == r1["loaded"] == [7.0, 7.0, 7.0]
    assert not r0["bad_exists"] and not r1["bad_exists"]
    assert r0["written"] == ["dist.pt", "bad.pt", "own0.pt"] and r1["written"] == ["own1.pt"]
    assert load_checkpoint(tmp_path / "own1.pt") == {"rank": 1}
    assert temps(tmp_path) == []


@pytest.mark.slow
def test_distributed_true_on_one_rank_names_the_fix(tmp_path: Path) -> None:
    results = _two_ranks(_ranks.collective_on_rank0_only, tmp_path, timeout_s=3.0)
    assert "rank 0 waited" in results[0] and "was written" in results[0], results[0]
    assert load_checkpoint(tmp_path / "lone.pt")["w"].tolist() == [1.0]


# ---------------------------------------------------------------------------- load


@pytest.mark.parametrize("name", GPU_FILES)
@pytest.mark.parametrize(
    "device", ["cpu", "auto", torch.device("cpu"), "cpu:0", torch.device("cpu", 0)]
)
def test_gpu_saved_fixtures_load_on_cpu(name: str, device: Any) -> None:
    from trainperf.device import best_device

    # "auto" is the CPU on a machine without a GPU, which is where these tests run in CI.
    want = best_device().type if device == "auto" else "cpu"
    sd = load_checkpoint(FIXTURES / name, device)
    assert len(sd) == 9
    assert all(t.device.type == want for t in sd.values())


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name", GPU_FILES)
def test_gpu_saved_fixtures_load_on_cuda(name: str) -> None:
    sd = load_checkpoint(FIXTURES / name, "cuda:0")
    assert all(t.device == torch.device("cuda", 0) for t in sd.values())


@pytest.mark.requires_cuda
def test_cuda_round_trips(tmp_path: Path) -> None:
    net = Net().cuda()
    path = save_checkpoint({"model": nn.DataParallel(net)}, tmp_path / "gpu.pt")
    on_cpu = load_checkpoint(path, "cpu")["model"]
    assert all(t.device.type == "cpu" for t in on_cpu.values())
    on_gpu = load_checkpoint(path, "auto")["model"]
    assert all(t.device.type == "cuda" for t in on_gpu.values())
    assert load_state_dict(torch.compile(Net()), on_gpu).complete
    n = torch.cuda.device_count()
    with pytest.raises(DeviceError, match=rf"only {n} GPU\(s\)"):
        load_checkpoint(path, f"cuda:{n}")
    if trainperf._utils.imports.is_available("safetensors"):
        st = save_checkpoint(net, tmp_path / "gpu.safetensors")
        for device in ("cuda", "cuda:0", torch.device("cuda", 0)):
            loaded = load_checkpoint(st, device)
            assert all(t.device.type == "cuda" for t in loaded.values())


def test_auto_uses_best_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainperf.device

    calls = []

    def fake_best() -> torch.device:
        calls.append(1)
        return torch.device("cpu")

    monkeypatch.setattr(trainperf.device, "best_device", fake_best)
    load_checkpoint(FIXTURES / GPU_FILES[0], "auto")
    assert calls == [1]


def test_cuda_without_cuda_fails_before_reading(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for device in ("cuda", "cuda:1", torch.device("cuda", 0), 0):
        with pytest.raises(DeviceError, match=r"needs CUDA.*device='cpu'"):
            load_checkpoint(tmp_path / "does-not-exist.pt", device)


def test_cuda_index_beyond_visible_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceError, match=r"'cuda:3'.*only 2 GPU\(s\).*cuda:0 to cuda:1"):
        load_checkpoint(tmp_path / "does-not-exist.pt", "cuda:3")


@pytest.mark.parametrize("device", ["gpu", "CPU", "cuda:x", "cuda:", ""])
def test_bad_device_string(device: Any) -> None:
    with pytest.raises(ValueError, match=r"invalid device .*expected 'auto', 'cpu', 'cuda'"):
        load_checkpoint(FIXTURES / GPU_FILES[0], device)


def test_meta_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"device 'meta' is not supported here.*'mps'"):
        load_checkpoint(FIXTURES / GPU_FILES[0], "meta")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"nope\.pt does not exist") as info:
        load_checkpoint(tmp_path / "nope.pt")
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.path == tmp_path / "nope.pt"


def test_a_path_through_a_file_is_a_missing_checkpoint_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "f.pt").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match=r"f\.pt is a file, not a directory"):
        load_checkpoint(tmp_path / "f.pt" / "x.pt")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(NotACheckpointError, match=r"is a directory.*give the checkpoint file"):
        load_checkpoint(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"x")
    with pytest.raises(NotACheckpointError, match=r"torch\.distributed\.checkpoint"):
        load_checkpoint(tmp_path)


def test_a_file_that_cannot_be_opened_is_an_os_error_not_a_damaged_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_checkpoint({"w": torch.ones(2)}, tmp_path / "c.pt")

    def no_permission(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(read_module, "open", no_permission, raising=False)
    with pytest.raises(
        PermissionError, match=r"cannot read checkpoint .*c\.pt: Permission denied.*ls -l"
    ) as info:
        load_checkpoint(path)
    assert not isinstance(info.value, CheckpointError)


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "e.pt").write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match=r"e\.pt is empty \(0 bytes\)"):
        load_checkpoint(tmp_path / "e.pt")


# -------------------------------------------------------------------- file objects


class _Marker:
    """Unpickling this would create the marker file: what a malicious checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("zip_format", [True, False])
def test_an_open_binary_file_object_loads_as_its_file_does(
    tmp_path: Path, zip_format: bool
) -> None:
    # It was a bare TypeError from path handling; torch.load takes file objects.
    path = tmp_path / "c.pt"
    torch.save({"w": torch.arange(4.0)}, path, _use_new_zipfile_serialization=zip_format)
    with open(path, "rb") as f:
        assert torch.equal(load_checkpoint(f)["w"], torch.arange(4.0))
    data = b"junk" + path.read_bytes()
    buffer = io.BytesIO(data)
    buffer.seek(4)  # read from where it stands, as torch.load does
    assert torch.equal(load_checkpoint(buffer)["w"], torch.arange(4.0))


def test_a_file_object_gets_the_same_safe_load_and_checks(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = io.BytesIO()
    torch.save({"w": torch.ones(2), "x": _Marker(marker)}, evil)
    evil.seek(0)
    with pytest.raises(UnsafeCheckpointError, match=r"BytesIO object given contains .*system"):
        load_checkpoint(evil)
    assert not marker.exists()
    good = io.BytesIO()
    torch.save({"w": torch.full((1000,), 2.0)}, good)
    with pytest.raises(CheckpointCorruptError, match=r"BytesIO object given is truncated"):
        load_checkpoint(io.BytesIO(good.getvalue()[:500]))
    flipped = bytearray(good.getvalue())
    flipped[bytes(flipped).index(torch.full((8,), 2.0).numpy().tobytes())] ^= 0xFF
    with pytest.raises(CheckpointCorruptError, match=r"damaged"):
        load_checkpoint(io.BytesIO(bytes(flipped)))
    with pytest.raises(CheckpointCorruptError, match=r"empty \(0 bytes\)"):
        load_checkpoint(io.BytesIO())
    with pytest.raises(NotACheckpointError, match=r"looks like JSON text"):
        load_checkpoint(io.BytesIO(b'{"a": 1}'))


def test_a_safetensors_file_object_loads_onto_the_device(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    path = save_checkpoint({"a": torch.arange(3.0)}, tmp_path / "w.safetensors")
    with open(path, "rb") as f:
        assert torch.equal(load_checkpoint(f, "cpu")["a"], torch.arange(3.0))


def test_what_is_not_a_readable_binary_file_object_is_refused_with_the_fix(
    tmp_path: Path,
) -> None:
    path = save_checkpoint({"w": torch.ones(1)}, tmp_path / "c.pt")
    with pytest.raises(TypeError, match=r"got bytes \(\d+ bytes\).*io\.BytesIO\(data\)"):
        load_checkpoint(path.read_bytes())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got int: pass the checkpoint's path"):
        load_checkpoint(3)  # type: ignore[arg-type]
    with open(path) as text, pytest.raises(TypeError, match=r"text one .*open\(path, 'rb'\)"):
        load_checkpoint(text)  # type: ignore[arg-type]
    with open(path, "rb") as closed:
        pass
    with pytest.raises(ValueError, match=r"closed file .*c\.pt"):
        load_checkpoint(closed)
    with open(tmp_path / "w.pt", "wb") as written, pytest.raises(ValueError, match=r"not open"):
        load_checkpoint(written)
    r, w = os.pipe()
    os.close(w)
    with open(r, "rb") as pipe, pytest.raises(ValueError, match=r"io\.BytesIO\(f\.read\(\)\)"):
        load_checkpoint(pipe)


def test_a_buffer_left_at_its_end_is_refused_with_seek_0() -> None:
    # torch.save(obj, buf) leaves buf at its end; it was reported as an interrupted save.
    buf = io.BytesIO()
    torch.save({"w": torch.ones(1)}, buf)
    with pytest.raises(ValueError, match=r"at its end .*position \d+.*f\.seek\(0\)"):
        load_checkpoint(buf)
    buf.seek(0)
    assert torch.equal(load_checkpoint(buf)["w"], torch.ones(1))


class _BareStream:
    """A file-like object with read/seek/tell only, which torch.load reads."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)
        self.read, self.seek, self.tell = self._f.read, self._f.seek, self._f.tell
        self.readline = self._f.readline


def test_a_file_like_object_without_seekable_loads() -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    loaded = load_checkpoint(_BareStream(buf.getvalue()))  # type: ignore[arg-type]
    assert torch.equal(loaded["w"], torch.ones(2))


# --------------------------------------------------------------------- safetensors


def test_safetensors_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    sd = {"a": torch.randn(3, 4), "b": torch.arange(5), "t": torch.randn(4, 3).t()}
    path = save_checkpoint(sd, tmp_path / "w.safetensors")
    assert path.read_bytes()[8:9] == b"{"
    loaded = load_checkpoint(path)
    assert_same(dict(sorted(loaded.items())), sd)  # safetensors stores keys sorted
    net = Net()
    loaded = load_checkpoint(save_checkpoint(nn.DataParallel(net), tmp_path / "m.safetensors"))
    assert load_state_dict(Net(), loaded).complete
    assert set(loaded) == set(net.state_dict())
    # The content decides the reader, not the name.
    (tmp_path / "m.safetensors").rename(tmp_path / "m.bin")
    assert set(load_checkpoint(tmp_path / "m.bin")) == set(net.state_dict())
    assert temps(tmp_path) == []


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ({"model": {"w": torch.ones(1)}}, r"key 'model' \(dict\) is not a tensor"),
        ({"w": torch.ones(1), "epoch": 3}, r"key 'epoch' \(int\) is not a tensor"),
        ([torch.ones(1)], r"the whole object is not a tensor \(list given\)"),
    ],
)
def test_safetensors_needs_a_flat_tensor_dict(tmp_path: Path, obj: Any, match: str) -> None:
    pytest.importorskip("safetensors")
    with pytest.raises(ValueError, match=match + r".*everything else .* to a \.pt file"):
        save_checkpoint(obj, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_safetensors_with_tied_weights_names_them_and_the_fix(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    net = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    net[1].weight = net[0].weight  # tied input and output embeddings
    with pytest.raises(
        ValueError, match=r"share memory .*\['0\.weight', '1\.weight'\].*save to a \.pt file"
    ):
        save_checkpoint(net.state_dict(), tmp_path / "tied.safetensors")
    assert list(tmp_path.iterdir()) == []
    untied = {k: v.clone() for k, v in net.state_dict().items()}
    assert save_checkpoint(untied, tmp_path / "tied.safetensors").exists()


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantize_per_tensor
        return torch.quantize_per_tensor(torch.rand(3), 0.1, 0, torch.quint8)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: torch.empty(2, device="meta"), r"a meta tensor, which holds no data"),
        (lambda: torch.eye(3).to_sparse(), r"layout torch\.sparse_coo: save tensor\.to_dense"),
        (_quantized, r"a quantized tensor \(torch\.quint8\): save tensor\.dequantize\(\)"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), r"tensor\.unbind"),
    ],
    ids=["meta", "sparse", "quantized", "nested"],
)
def test_safetensors_refuses_tensors_without_plain_data_by_key(
    tmp_path: Path, make: Any, why: str
) -> None:
    pytest.importorskip("safetensors")
    with pytest.raises(ValueError, match=rf"cannot hold key 'w': it is .*{why}"):
        save_checkpoint({"ok": torch.ones(1), "w": make()}, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_truncated_safetensors(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    path = save_checkpoint({"w": torch.randn(1000)}, tmp_path / "w.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointCorruptError, match=r"safetensors checkpoint .* truncated"):
        load_checkpoint(path)


def test_missing_safetensors_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("safetensors")
    path = save_checkpoint({"w": torch.ones(1)}, tmp_path / "w.safetensors")
    monkeypatch.setattr(trainperf._utils.imports, "is_available", lambda name: False)
    with pytest.raises(ModuleNotFoundError, match=r"save_checkpoint.*trainperf\[safetensors\]"):
        save_checkpoint({"w": torch.ones(1)}, tmp_path / "v.safetensors")
    with pytest.raises(ModuleNotFoundError, match=r"load_checkpoint.*trainperf\[safetensors\]"):
        load_checkpoint(path)


def test_distributed_given_as_a_falsy_number_means_false(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainperf.checkpoint import _files

    # As if this were rank 1 of a process group: only distributed=False writes here.
    monkeypatch.setattr(_files, "_group_rank", lambda: 1)
    assert not save_checkpoint({"x": torch.ones(1)}, tmp_path / "none.pt").exists()
    assert save_checkpoint({"x": torch.ones(1)}, tmp_path / "zero.pt", distributed=0).exists()


# ------------------------------------------------------------------------ paths


def test_a_path_under_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    out = save_checkpoint({"x": 1}, "~/runs/x.pt")
    assert out == tmp_path / "home" / "runs" / "x.pt" and out.is_file()
    assert not (tmp_path / "~").exists()
    assert load_checkpoint("~/runs/x.pt") == {"x": 1}


@pytest.mark.parametrize("exists", [False, True])
def test_a_path_ending_in_a_separator_names_the_fix(tmp_path: Path, exists: bool) -> None:
    if exists:
        (tmp_path / "ckpts").mkdir()
    with pytest.raises(
        ValueError, match=r"ckpts/' ends with '/'.*give a file name: .*ckpts/checkpoint\.pt"
    ):
        save_checkpoint({"x": 1}, f"{tmp_path / 'ckpts'}/")
    assert [p.name for p in tmp_path.iterdir()] == (["ckpts"] if exists else [])
    assert not (tmp_path / "ckpts").is_file()


# ------------------------------------------------------------------ out of memory


def test_running_out_of_memory_reading_safetensors_is_not_called_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = save_checkpoint({"w": torch.ones(1000)}, tmp_path / "c.safetensors")
    size = f"{path.stat().st_size / 1024:.0f} KiB"

    def no_memory(*args: Any, **kwargs: Any) -> None:
        raise MemoryError("Cannot allocate memory (os error 12)")

    monkeypatch.setattr(safetensors_torch, "load_file", no_memory)
    with pytest.raises(MemoryError, match=rf"c\.safetensors \({size}\).*not damaged.*free memory"):
        load_checkpoint(path)


_CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB "
    "memory in use."
)


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (torch.OutOfMemoryError(_CUDA_OOM), r"allocating 2\.00 GiB for a tensor failed "
         r"\(1\.06 GiB was free\)"),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB "
                      "total capacity)"), r"allocating 20\.00 MiB for a tensor failed"),
    ],
)  # fmt: skip
def test_running_out_of_gpu_memory_reading_safetensors_is_not_called_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, said: str
) -> None:
    # It read "safetensors checkpoint ... is truncated or damaged": the user re-copied a
    # good file, or deleted it, when a load onto the CPU would have worked.
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = save_checkpoint({"w": torch.ones(1000)}, tmp_path / "c.safetensors")
    size = f"{path.stat().st_size / 1024:.0f} KiB"

    def no_gpu_memory(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(safetensors_torch, "load_file", no_gpu_memory)
    monkeypatch.setattr(rank_gpu_module, "resolve_device", lambda *a, **k: torch.device("cuda:0"))
    with pytest.raises(
        torch.OutOfMemoryError,
        match=rf"out of GPU memory loading checkpoint .*c\.safetensors \({size}\) onto cuda:0: "
        rf"{said}\. The file is not damaged: load it with device='cpu'.*free GPU memory",
    ) as info:
        load_checkpoint(path, "cuda")
    assert not isinstance(info.value, CheckpointError) and info.value.__cause__ is error


def test_a_distributed_save_broadcasts_on_the_ranks_own_gpu_under_nccl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNccl(monkeypatch, rank=1, gpus=2)  # set_device never called: cuda:0 current
    monkeypatch.setenv("LOCAL_RANK", "1")
    save_checkpoint({"w": torch.ones(1)}, tmp_path / "c.pt", distributed=True)
    assert fake.used == [1] and fake.current == 0


@pytest.mark.parametrize(
    ("device", "backend", "expected"),
    [
        ("cuda", "nccl", "cuda:1"),  # set_device never called: LOCAL_RANK's GPU, not cuda:0
        (torch.device("cuda"), "nccl", "cuda:1"),
        ("cuda", "gloo", "cuda:1"),  # a gloo group training on GPUs: the same convention
        ("auto", "nccl", "cuda:1"),  # not the GPU with most free memory, the same on every rank
        ("cuda:0", "nccl", "cuda:0"),  # an explicit index is kept
        (0, "nccl", "cuda:0"),
    ],
)
def test_cuda_without_an_index_under_a_group_loads_onto_the_ranks_own_gpu(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    device: str | int | torch.device,
    backend: str,
    expected: str,
) -> None:
    # Before: torch.load(map_location="cuda") put every rank's tensors on the current
    # device, cuda:0 on each rank of a script that never calls torch.cuda.set_device.
    path = save_checkpoint({"w": torch.ones(2)}, tmp_path / "c.pt")
    FakeNccl(monkeypatch, rank=1, gpus=2, backend=backend)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr("trainperf.device.best_device", lambda: torch.device("cuda", 0))
    asked = map_locations(monkeypatch)
    assert load_checkpoint(path, device)["w"].tolist() == [1.0, 1.0]
    assert asked == [("c.pt", torch.device(expected))]


def test_cuda_without_an_index_and_without_a_group_is_left_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_checkpoint({"w": torch.ones(2)}, tmp_path / "c.pt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    asked = map_locations(monkeypatch)
    load_checkpoint(path, "cuda")
    assert asked == [("c.pt", torch.device("cuda"))]  # the current device, as torch.load's


# ------------------------------------------------------------- probes from other tools' files


@pytest.mark.parametrize(
    "index",
    [
        "accelerate/save_model_safetensors/model.safetensors.index.json",
        "accelerate/save_model_bin/pytorch_model.bin.index.json",
        "transformers/bert_tiny/model.safetensors.index.json",
    ],
)
def test_a_shard_index_file_loads_as_its_directory_does(index: str) -> None:
    by_file = load_checkpoint(PEERS / index)
    by_dir = load_checkpoint((PEERS / index).parent)
    assert sorted(by_file) == sorted(by_dir)
    assert all(torch.equal(by_file[k], by_dir[k]) for k in by_dir)


def test_a_shard_index_file_naming_a_missing_shard_is_not_found(tmp_path: Path) -> None:
    shutil.copytree(PEERS / "accelerate/save_model_safetensors", tmp_path / "m")
    (tmp_path / "m/model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointNotFoundError, match=r"model-00002-of-00002\.safetensors listed in .*copy every"
    ):
        load_checkpoint(tmp_path / "m/model.safetensors.index.json")


@pytest.mark.parametrize(
    "map_location", [{"cuda:0": "cpu"}, lambda storage, location: storage], ids=["dict", "callable"]
)
def test_a_torch_load_map_location_as_device_says_what_to_pass(
    tmp_path: Path, map_location: Any
) -> None:
    save_checkpoint({"w": torch.ones(1)}, tmp_path / "c.pt")
    with pytest.raises(TypeError, match=r"one device.*map_location.*device='cpu'"):
        load_checkpoint(tmp_path / "c.pt", map_location)


def test_two_indexes_error_advice_loads_the_index_it_names(tmp_path: Path) -> None:
    shutil.copytree(PEERS / "accelerate/save_model_bin", tmp_path, dirs_exist_ok=True)
    index = tmp_path / "pytorch_model.bin.index.json"
    shutil.copy(index, tmp_path / "other.bin.index.json")
    with pytest.raises(NotACheckpointError, match=r"load_checkpoint\('([^']+)'\)") as info:
        load_checkpoint(tmp_path)
    advised = re.search(r"load_checkpoint\('([^']+)'\)", str(info.value))
    assert advised is not None
    assert sorted(load_checkpoint(advised[1])) == sorted(load_checkpoint(index))
