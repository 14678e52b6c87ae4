"""trainperf._utils.validate: the float checks every package's options go through."""

from __future__ import annotations

import math

import pytest

from tests._utils._streams import Fresh, Resets, assert_refused_unread
from trainperf._utils.validate import fresh_stream, non_negative_number, positive_number


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, 0, 0.0, True, "1", None])
def test_positive_number_refuses_what_is_not_finite_and_above_zero(value: object) -> None:
    with pytest.raises(ValueError, match=r"^budget_s must be a positive number of seconds, got "):
        positive_number("budget_s", value, unit="seconds")


def test_positive_number_returns_a_float() -> None:
    assert positive_number("budget_s", 3) == 3.0 and isinstance(positive_number("x", 3), float)
    assert positive_number("x", 1e-9) == 1e-9


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, -1e-9, True, "0", None])
def test_non_negative_number_refuses_nan_inf_and_negatives(value: object) -> None:
    match = rf"^timeout must be a finite number of seconds >= 0 \(0: no timeout\), got {value!r}$"
    with pytest.raises(ValueError, match=match):
        non_negative_number("timeout", value, unit="seconds", zero="no timeout")


def test_non_negative_number_takes_zero_and_plain_messages() -> None:
    assert non_negative_number("timeout", 0) == 0.0
    assert non_negative_number("timeout", 2) == 2.0
    with pytest.raises(ValueError, match=r"^wait must be a finite number >= 0, got nan$"):
        non_negative_number("wait", math.nan)


def test_fresh_stream_refuses_only_a_dataset_that_is_its_own_iterator() -> None:
    assert_refused_unread(lambda ds: fresh_stream(ds, "tuning"), "tuning")
    gen = (i for i in range(3))
    with pytest.raises(ValueError, match=r"generator is a one-shot iterator"):
        fresh_stream(gen, "batches_from()")
    assert next(gen) == 0  # not read
    with pytest.raises(ValueError, match=r"list_iterator is a one-shot iterator"):
        fresh_stream(iter([1, 2]), "tuning")
    fresh_stream(Resets(4), "tuning")  # rewinds itself on each iter(): starts afresh
    fresh_stream(Fresh(), "tuning")  # __next__ too, but iter() gives a new generator
    fresh_stream([1, 2, 3], "tuning")  # not an IterableDataset: a map-style list
