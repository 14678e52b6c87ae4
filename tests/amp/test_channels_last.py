"""trainperf.amp._channels_last: when "auto" converts a model, and converting batches."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, UserDict, namedtuple

import pytest
import torch
from torch import nn

from tests.amp._helpers import TinyViT, small_cnn
from trainperf.amp import MixedPrecision, _channels_last


@pytest.mark.parametrize(
    ("name", "converts", "convs"),
    [
        ("resnet18", True, 20),
        # ~11 % and ~4 % of their parameters are in convolutions (the rest in the classifier's
        # Linear layers), but nearly all of their compute is.
        ("vgg16", True, 13),
        ("alexnet", True, 5),
        # A 4x4/4 stem and 2x2/2 downsampling (patch embeddings), then depthwise 7x7 convolutions.
        ("convnext_tiny", True, 18),
        # Only a patch embedding: 16x16/16 (ViT), 4x4/4 (Swin).
        ("vit_b_16", False, 0),
        ("swin_t", False, 0),
    ],
)
def test_channels_last_rule_on_torchvision_models(name: str, converts: bool, convs: int) -> None:
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):  # no memory, no initialisation cost
        model = getattr(torchvision.models, name)(weights=None)
    use, why = _channels_last.channels_last_decision(
        model, "auto", device=torch.device("cuda", 0), tensor_cores=True
    )
    assert use is converts
    assert _channels_last.feature_map_convs(model)[0] == convs
    if converts:
        assert why.startswith(f"channels_last: yes, {convs} 2-D convolutions over feature maps (")
    else:
        assert why == (
            "channels_last: no, no 2-D convolution over feature maps, only 1 patch embedding: "
            "not a convolutional model"
        )
    if name in ("vgg16", "alexnet"):
        assert _channels_last.conv_share(model) < 0.15  # what the old parameter-share rule missed


def test_channels_last_rule_details() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    cnn, vit = small_cnn(), TinyViT()
    assert _channels_last.conv_share(nn.ReLU()) == 0.0
    decide = _channels_last.channels_last_decision
    assert decide(cnn, "auto", device=cuda, tensor_cores=True) == (
        True,
        f"channels_last: yes, 2 2-D convolutions over feature maps "
        f"({_channels_last.conv_share(cnn):.0%} of parameters in Conv2d/BatchNorm2d)",
    )
    assert not decide(vit, "auto", device=cuda, tensor_cores=True)[0]  # 8x8/8 patch embedding
    assert decide(nn.Linear(2, 2), "auto", device=cuda, tensor_cores=True) == (
        False,
        "channels_last: no, no 2-D convolution over feature maps: not a convolutional model",
    )
    assert not decide(cnn, "auto", device=cuda, tensor_cores=False)[0]  # fp32 on a V100
    assert not decide(cnn, "auto", device=cpu, tensor_cores=True)[0]
    assert decide(vit, True, device=cpu, tensor_cores=False)[0]
    assert not decide(cnn, False, device=cuda, tensor_cores=True)[0]
    shared = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Linear(3, 3))
    shared.append(shared[0])  # a shared module is counted once
    assert _channels_last.conv_share(shared) == pytest.approx(12 / 24)
    assert _channels_last.feature_map_convs(shared) == (1, 0)


@pytest.mark.parametrize(
    ("conv", "patch"),
    [
        (nn.Conv2d(3, 8, 16, stride=16), True),  # ViT
        (nn.Conv2d(3, 8, (1, 4), stride=(1, 4)), True),
        (nn.ConvTranspose2d(8, 8, 2, stride=2), True),
        (nn.Conv2d(8, 8, 1), False),  # pointwise: 1x1 kernel == 1x1 stride, still a conv
        (nn.Conv2d(8, 8, 1, stride=2), False),  # ResNet downsample
        (nn.Conv2d(3, 8, 7, stride=2, padding=3), False),  # ResNet stem
        (nn.Conv2d(3, 8, 11, stride=4), False),  # AlexNet's first layer: overlapping
        (nn.Conv2d(8, 8, 2, stride=2, dilation=2), False),  # dilated: not contiguous patches
        (nn.ConvTranspose2d(8, 8, 4, stride=2, padding=1), False),
    ],
)
def test_patch_embedding_is_kernel_equal_to_stride_above_1x1(conv: nn.Module, patch: bool) -> None:
    assert _channels_last.is_patch_embedding(conv) is patch  # type: ignore[arg-type]
    assert _channels_last.feature_map_convs(nn.Sequential(conv)) == (int(not patch), int(patch))


def test_prepare_batch_converts_only_4d_float_tensors_in_containers() -> None:
    mp = MixedPrecision("cpu", precision="fp32", channels_last=True)
    mp.prepare(small_cnn())
    Pair = namedtuple("Pair", ["image", "label"])
    batch = {
        "pair": Pair(torch.randn(2, 3, 4, 4), torch.tensor([1, 2])),
        "list": [torch.randn(2, 3, 4, 4), torch.randint(0, 9, (2, 3, 4, 4))],
        "od": OrderedDict(v=torch.randn(2, 3, 4)),
        "name": "x",
    }
    out = mp.prepare_batch(batch)
    cl = torch.channels_last
    assert isinstance(out["pair"], Pair) and out["pair"].image.is_contiguous(memory_format=cl)
    assert out["list"][0].is_contiguous(memory_format=cl)
    int_images = out["list"][1]
    assert int_images.is_contiguous() and not int_images.is_contiguous(memory_format=cl)
    assert isinstance(out["od"], OrderedDict) and out["od"]["v"].is_contiguous()
    assert out["name"] == "x"
    assert torch.equal(out["pair"].image, batch["pair"].image)


def channels_last_mp() -> MixedPrecision:
    mp = MixedPrecision("cpu", precision="fp32", channels_last=True)
    mp.prepare(small_cnn())
    return mp


def is_cl(x: torch.Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def test_prepare_batch_takes_a_container_that_holds_itself() -> None:
    # Before: RecursionError, where to_device documents "a container that holds itself is
    # no error".
    mp = channels_last_mp()
    images = [torch.randn(2, 3, 4, 4)]
    images.append(images)  # type: ignore[arg-type]
    batch: dict[str, object] = {"images": images}
    batch["self"] = batch
    out = mp.prepare_batch(batch)
    assert out["self"] is out and out["images"][1] is out["images"]  # type: ignore[index]
    assert is_cl(out["images"][0])  # type: ignore[index]


class TaggedList(list):  # type: ignore[type-arg]
    pass


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int


def test_prepare_batch_keeps_types_and_parameters_as_to_device_does() -> None:
    # Before: a list subclass came back a plain list without its attributes, a Parameter a
    # non-leaf plain tensor, and a dataclass's image kept its layout.
    mp = channels_last_mp()
    image = torch.randn(2, 3, 4, 4)
    tagged = TaggedList([image, torch.ones(2, 3)])
    tagged.tag = "kept"  # type: ignore[attr-defined]
    weight = nn.Parameter(torch.randn(4, 3, 2, 2))
    batch = {"tagged": tagged, "weight": weight, "sample": Sample(image, 1), "again": image}
    out = mp.prepare_batch(batch)
    assert type(out["tagged"]) is TaggedList and out["tagged"].tag == "kept"
    assert is_cl(out["tagged"][0]) and out["tagged"][1] is tagged[1]
    moved = out["weight"]
    assert isinstance(moved, nn.Parameter) and moved.is_leaf and moved.requires_grad
    assert is_cl(moved) and torch.equal(moved, weight)
    assert isinstance(out["sample"], Sample) and is_cl(out["sample"].image)
    assert out["again"] is out["tagged"][0]  # one tensor in two places stays one
    assert not is_cl(image) and type(batch["tagged"]) is TaggedList  # the input is unchanged


class MovesItself(UserDict):  # type: ignore[type-arg]
    """A mapping with its own .to, as Hugging Face's BatchFeature."""

    def to(self, device: torch.device) -> MovesItself:
        self.data = {k: v.to(device) for k, v in self.data.items()}
        return self


def test_prepare_batch_converts_the_images_of_a_mapping_that_moves_itself() -> None:
    mp = channels_last_mp()
    features = MovesItself(pixel_values=torch.randn(2, 3, 4, 4), ids=torch.tensor([1, 2]))
    out = mp.prepare_batch(features)
    assert isinstance(out, MovesItself) and is_cl(out["pixel_values"])
    assert torch.equal(out["ids"], features["ids"])


class TwoAndThreeD(nn.Module):
    """A 2-D stem, then a 3-D convolution over a stack of its feature maps (5-D weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.temporal = nn.Conv3d(8, 8, (3, 3, 3), padding=1)
        self.register_buffer("mask", torch.ones(1, 1, 2, 4, 4))  # a 5-D buffer too

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, time, 3, H, W)
        b, t = x.shape[:2]
        maps = self.stem(x.flatten(0, 1)).unflatten(0, (b, t)).transpose(1, 2)
        return self.temporal(maps)


def test_model_to_channels_last_converts_4d_tensors_and_leaves_5d_ones_alone() -> None:
    model = TwoAndThreeD()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    assert _channels_last.model_to_channels_last(model) is model
    assert model.stem.weight.is_contiguous(memory_format=torch.channels_last)
    assert model.temporal.weight.is_contiguous()  # NCDHW, as before
    assert model.mask.is_contiguous()
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name])
    out = model(torch.randn(2, 2, 3, 4, 4))  # still runs
    assert out.shape == (2, 8, 2, 4, 4)


@pytest.mark.parametrize(
    ("model", "kinds"),
    [
        (nn.Sequential(nn.Conv3d(3, 8, 3), nn.ReLU(), nn.Conv3d(8, 8, 3)), "2 Conv3d"),
        (
            nn.Sequential(nn.Conv1d(3, 8, 3), nn.ConvTranspose1d(8, 3, 3)),
            "1 Conv1d, 1 ConvTranspose1d",
        ),
    ],
)
def test_auto_names_the_convolutions_channels_last_does_not_cover(
    model: nn.Module, kinds: str
) -> None:
    # A video or audio network was called "not a convolutional model".
    use, why = _channels_last.channels_last_decision(
        model, "auto", device=torch.device("cuda", 0), tensor_cores=True
    )
    assert not use
    assert why == (
        f"channels_last: no, no 2-D convolution over feature maps, only {kinds}: "
        "channels_last is a layout of 4-D tensors"
    )
