"""trainperf._utils.validate: the float checks every package's options go through."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests._utils._streams import Fresh, Resets, assert_refused_unread
from trainperf._utils.validate import (
    as_real_number,
    fresh_stream,
    int_like,
    non_negative_int,
    non_negative_number,
    positive_int,
    positive_number,
    worker_numbers,
)


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


@pytest.mark.parametrize("value", [torch.tensor(5), 5.0, np.float32(5.0), np.float64(5.0)])
def test_an_int_check_names_the_fix_for_a_whole_number_of_another_type(value: object) -> None:
    with pytest.raises(ValueError, match=r"^step must be an int >= 0, got .*\(pass int\(step\)\)$"):
        non_negative_int("step", value)


@pytest.mark.parametrize(
    "value",
    [True, np.bool_(True), torch.tensor(True), "5", 2.5, -1.0, np.int64(0), np.timedelta64(5, "s")],
)
def test_an_int_check_offers_no_cast_where_int_would_not_make_it_right(value: object) -> None:
    with pytest.raises(ValueError, match=r"^batch_size must be an int >= 1, got ") as refused:
        positive_int("batch_size", value)
    assert "pass int" not in str(refused.value)


@pytest.mark.parametrize("value", [True, 0, "2", 2.0, None])
def test_an_int_check_ends_with_the_fix_its_caller_gives(value: object) -> None:
    # "nprocs must be an int >= 1, got True" said what was wrong, not what to pass instead.
    fix = "pass the number of processes as an int, e.g. nprocs=2"
    with pytest.raises(ValueError, match=rf"^nprocs must be an int >= 1, got .*; {fix}$"):
        positive_int("nprocs", value, fix=fix)
    with pytest.raises(ValueError, match=r"^seed must be None or an int >= 0, got -1; pass 0$"):
        non_negative_int("seed", -1, none_ok=True, fix="pass 0")


def test_an_int_check_returns_a_python_int() -> None:
    assert non_negative_int("step", 0) == 0 and positive_int("batch_size", 32) == 32


@pytest.mark.parametrize("value", [np.int64(5), np.int32(5), np.uint8(5), np.int16(5)])
def test_an_int_check_takes_numpy_integers_as_python_ints(value: object) -> None:
    # Before: refused ("got np.int64(5) (pass int(step))"), as if the value were wrong.
    for check in (positive_int, non_negative_int):
        checked = check("step", value)
        assert checked == 5 and type(checked) is int
    assert type(positive_int("every", np.int64(3), none_ok=True)) is int


@pytest.mark.parametrize("value", [np.float32(0.5), np.float16(0.5), np.float64(0.5), np.int64(2)])
def test_a_number_check_takes_numpy_scalars_as_python_floats(value: object) -> None:
    # Before: np.float32(0.5) was refused ("budget_s must be a positive number, got ...").
    for check in (positive_number, non_negative_number):
        checked = check("budget_s", value)
        assert checked == float(value) and type(checked) is float
    assert type(non_negative_number("timeout", np.float32(0))) is float


@pytest.mark.parametrize(
    "value",
    [np.bool_(True), np.float32("nan"), np.float32("inf"), np.timedelta64(5, "ms"), np.int8(-1)],
)
def test_a_number_check_refuses_numpy_bools_timedeltas_and_non_finite_values(
    value: object,
) -> None:
    with pytest.raises(ValueError, match=r"^budget_s must be a positive number of seconds, got "):
        positive_number("budget_s", value, unit="seconds")
    with pytest.raises(ValueError, match=r"^timeout must be a finite number >= 0, got "):
        non_negative_number("timeout", value)


def test_as_real_number_converts_numpy_scalars_and_refuses_the_rest() -> None:
    assert type(as_real_number(np.int64(3))) is int and type(as_real_number(np.float32(1))) is float
    assert as_real_number(2) == 2 and as_real_number(0.25) == 0.25
    refused = [True, np.bool_(False), np.timedelta64(1), torch.tensor(1.0), "1", None, 1j]
    assert [as_real_number(v) for v in refused] == [None] * len(refused)


def test_worker_numbers_converts_those_given_and_leaves_the_rest_out() -> None:
    given = {"num_workers": np.int64(2), "prefetch_factor": np.uint8(3), "timeout": np.int64(5)}
    checked = worker_numbers({**given, "shuffle": True})
    assert checked == {"num_workers": 2, "prefetch_factor": 3, "timeout": 5}
    assert [type(v) for v in checked.values()] == [int, int, int]
    assert worker_numbers({"timeout": np.float64(5)}) == {"timeout": 5.0}
    assert worker_numbers({"prefetch_factor": None}) == {"prefetch_factor": None}
    assert worker_numbers({}) == {}


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"prefetch_factor": 2}, r"^prefetch_factor=2 needs num_workers > 0 \(DataLoader refuses"),
        ({"num_workers": 0, "prefetch_factor": np.int64(4)}, r"^prefetch_factor=4 needs num_"),
        ({"num_workers": "2"}, r"^num_workers must be an int >= 0, got '2'$"),
        ({"num_workers": 1, "prefetch_factor": 0}, r"^prefetch_factor must be None or an int >= 1"),
        ({"timeout": math.inf}, r"^timeout must be a finite number of seconds >= 0 .*, got inf$"),
    ],
)
def test_worker_numbers_names_the_bad_value_and_prefetch_factor_without_workers(
    given: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        worker_numbers(given)


@pytest.mark.parametrize("value", [float("inf"), np.float64("inf")])
def test_an_infinite_positive_number_is_told_to_be_finite(value: object) -> None:
    # "budget_s must be a positive number of seconds, got inf" did not say what was wrong.
    with pytest.raises(ValueError, match=r"got (np\.float64\()?inf\)?; pass a finite number$"):
        positive_number("budget_s", value, unit="seconds")


def test_a_number_past_float_range_is_no_int_like_value() -> None:
    import fractions

    assert int_like(fractions.Fraction(10**400), 0) is False  # OverflowError escaped
