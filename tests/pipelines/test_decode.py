"""trainperf.pipelines._decode: 16-bit images scaled to 8 bits, the same in every backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.pipelines._images import CPU_BACKENDS, _loader, _pixels
from trainperf.pipelines._decode import pil_to_rgb, to_uint8

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")

# 30000 / 65535 * 255 = 116.73: 117 when scaled and rounded; PIL's own convert("RGB") clips
# the 16-bit value to 255 (white).
GREY16, GREY8 = 30000, 117


def write_grey16(path: Path, value: int = GREY16, size: tuple[int, int] = (40, 30)) -> Path:
    """A uniform 16-bit greyscale PNG, written by PIL from mode ``"I;16"``."""
    data = np.full(size[::-1], value, dtype="<u2")
    PIL.frombytes("I;16", size, data.tobytes()).save(path)
    with PIL.open(path) as im:
        assert im.mode == "I;16"  # really 16-bit on disk, not converted on the way
    return path


def test_to_uint8_rounds_the_16_bit_scale() -> None:
    values = torch.tensor([0, 128, 129, GREY16, 65407, 65535], dtype=torch.uint16)
    expected = [round(v * 255 / 65535) for v in values.tolist()]
    assert to_uint8(values).tolist() == expected
    assert to_uint8(values).dtype == torch.uint8
    eight = torch.tensor([0, 7, 255], dtype=torch.uint8)
    assert to_uint8(eight) is eight


def test_pil_to_rgb_scales_16_bit_grey(tmp_path: Path) -> None:
    path = write_grey16(tmp_path / "g16.png")
    with PIL.open(path) as im:
        rgb = pil_to_rgb(im)
    assert rgb.mode == "RGB"
    assert set(np.asarray(rgb).ravel().tolist()) == {GREY8}


def test_pil_to_rgb_takes_float_grey_as_0_to_1_as_dali_does() -> None:
    values = np.array([[0.0, 0.25, 0.5, 1.0], [2.0, -1.0, 0.002, 0.998]], dtype=np.float32)
    rgb = pil_to_rgb(PIL.fromarray(values, mode="F"))
    # DALI's CPU decoder gives these levels for this float TIFF (round(v * 255), clipped).
    assert np.asarray(rgb)[..., 0].tolist() == [[0, 64, 128, 255], [255, 0, 1, 254]]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_float_tiff_decodes_to_the_same_level_in_every_backend(
    tmp_path: Path, backend: str
) -> None:
    (tmp_path / "grey").mkdir()
    PIL.fromarray(np.full((40, 40), 0.5, dtype=np.float32), mode="F").save(
        tmp_path / "grey" / "f.tiff"
    )
    loader = _loader(tmp_path, backend, batch_size=1, train=False, last_batch="keep")
    [(images, _)] = list(loader)
    levels = (_pixels(images) * 255).round()
    assert levels.min().item() == levels.max().item() == 128  # it was black (0) with PIL


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("train", [False, True])
def test_16_bit_grey_png_decodes_to_the_scaled_value(
    tmp_path: Path, backend: str, train: bool
) -> None:
    (tmp_path / "grey").mkdir()
    write_grey16(tmp_path / "grey" / "g16.png")
    loader = _loader(tmp_path, backend, batch_size=1, train=train, last_batch="keep")
    [(images, _)] = list(loader)
    levels = (_pixels(images) * 255).round()
    # A uniform image stays uniform through any crop, resize and flip.
    assert levels.min().item() == levels.max().item() == GREY8
