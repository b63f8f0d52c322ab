"""What a custom metric hands its states: inputs that require grad, and bad histogram indices."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import Tensor

from sidestream import Metric, MetricAccumulator, ReduceOp, SumMetric


class _Squares(Metric[Tensor]):
    def __init__(self) -> None:
        self._total = MetricAccumulator(torch.zeros((), dtype=torch.float64))
        self._largest = MetricAccumulator(-torch.inf, ReduceOp.MAX, dtype=torch.float64)
        self._bins = MetricAccumulator(torch.zeros(4, dtype=torch.float64))
        self._moments = MetricAccumulator(torch.zeros(2, dtype=torch.float64))

    def update(self, values: Tensor) -> None:
        squares = values.double() ** 2
        self._total.accumulate(squares.sum())
        self._largest.accumulate(squares.max())
        self._bins.scatter_add(torch.zeros_like(squares, dtype=torch.int64), squares)
        self._moments.add_product(torch.stack([squares, squares]), torch.ones_like(squares))

    def compute(self) -> Tensor:
        return self._total.value


def test_inputs_that_require_grad_leave_the_state_out_of_autograd() -> None:
    weights = torch.tensor([1.0, 2.0], requires_grad=True)
    metric = _Squares()
    for _ in range(2):
        outputs = weights * 3.0  # a model's output: part of the graph
        metric.update(outputs)
        outputs.sum().backward()  # the training step's backward is unaffected
    for name, state in metric.named_accumulators():
        assert not state.local.requires_grad and state.local.grad_fn is None, name
    assert not metric.compute().requires_grad
    assert float(metric.compute()) == 2 * (3.0**2 + 6.0**2)
    metric.reset()
    assert metric.state_dict()["total"].item() == 0.0  # saving works after a reset too


def test_scatter_add_refuses_bad_indices_before_changing_the_state() -> None:
    state = MetricAccumulator(torch.zeros(4))
    state.accumulate(torch.tensor([1.0, 1.0, 0.0, 0.0]))
    for index in (torch.tensor([1, 2, 9]), torch.tensor([1, -1, 2])):
        with pytest.raises(ValueError, match=r"index: expected values in \[0, 4\)"):
            state.scatter_add(index, torch.ones(3))
    with pytest.raises(ValueError, match=r"source: expected index's shape \(3,\)"):
        state.scatter_add(torch.tensor([0, 1, 2]), torch.ones(2))
    assert state.local.tolist() == [1.0, 1.0, 0.0, 0.0]
    state.scatter_add(torch.tensor([3, 3, 0]), torch.tensor([1.0, 2.0, 5.0]))
    assert state.local.tolist() == [6.0, 1.0, 0.0, 3.0]


def test_scatter_add_refuses_what_it_would_truncate_before_changing_the_state() -> None:
    counts = MetricAccumulator(torch.zeros(3, dtype=torch.int64))
    counts.scatter_add(torch.tensor([0, 2]), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match=r"^source: a torch.float32 update .* would be truncated"):
        counts.scatter_add(torch.tensor([0, 1, 1]), torch.tensor([0.7, 2.9, 2.9]))
    with pytest.raises(TypeError, match=r"^source: a torch.float64 update"):
        counts.add_at(torch.tensor([1]), torch.tensor([-0.9], dtype=torch.float64))
    with pytest.raises(
        TypeError, match=r"^scatter_add: index: expected an int64 \(or int32\) tensor"
    ):
        counts.scatter_add(torch.tensor([0.0, 1.0]), torch.tensor([1, 1]))
    assert counts.local.tolist() == [1, 0, 1]
    counts.scatter_add(torch.tensor([1, 1]), torch.tensor([True, True]))  # bool counts: exact
    assert counts.local.tolist() == [1, 2, 1]
    table = MetricAccumulator(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"^scatter_add needs a one-dimensional state, .*\(2, 2\)"):
        table.scatter_add(torch.tensor([0]), torch.tensor([1.0]))
    assert table.local.tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_load_local_refuses_what_it_would_truncate() -> None:
    counts = MetricAccumulator(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"^value: a torch.float32 update .* would be truncated"):
        counts.load_local(torch.tensor([2.7, 1.0]))
    assert counts.local.tolist() == [0, 0]
    counts.load_local(torch.tensor([2, 1], dtype=torch.int32))  # a narrower int: exact
    assert counts.local.tolist() == [2, 1]


def test_load_local_detaches_too() -> None:
    state = MetricAccumulator(torch.zeros(2, dtype=torch.float64))
    state.load_local(torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True) * 2)
    assert not state.local.requires_grad and state.local.tolist() == [2.0, 4.0]


class _Counted(Metric[Tensor]):
    """Counts as d9d's accumulators did: ``update(labels.numel())``, a Python number."""

    def __init__(self) -> None:
        self._count = MetricAccumulator(torch.zeros((), dtype=torch.int64))
        self._largest = MetricAccumulator(-torch.inf, ReduceOp.MAX, dtype=torch.float64)

    def update(self, labels: Tensor, score: float) -> None:
        self._count.accumulate(labels.numel())
        self._largest.accumulate(score)

    def compute(self) -> Tensor:
        return self._count.value


def test_python_numbers_accumulate_like_tensors_and_wrong_kinds_name_the_argument() -> None:
    metric = _Counted()
    metric.update(torch.zeros(3), 0.25)
    metric.update(torch.zeros(4), -1.0)
    assert int(metric.compute()) == 7
    assert float(metric.state_dict()["largest"]) == 0.25
    count = metric._count
    count.accumulate(True)  # a bool is an int
    assert int(count.value) == 8
    import numpy as np

    count.accumulate(np.int64(2))  # numpy scalars, as run.log takes them
    metric._largest.accumulate(np.float32(0.5))
    assert int(count.value) == 10 and float(metric.state_dict()["largest"]) == 0.5
    with pytest.raises(ValueError, match=r"accumulate: update: .* does not fit a torch\.int64"):
        count.accumulate(2**63)
    # A float too large for a half-precision state became inf without a word.
    half = MetricAccumulator(0.0, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"accumulate: update: 70000.0 does not fit a torch\.f"):
        half.accumulate(70000.0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        with pytest.raises(ValueError, match=r"accumulate: update: 1000+ does not fit"):
            MetricAccumulator(0.0, dtype=dtype).accumulate(10**400)  # was an OverflowError
    half.accumulate(float("inf"))  # an inf is an inf: kept, as in a float64 state
    assert half.value.item() == float("inf")
    count.accumulate(-2)
    for bad, message in ((2.5, "float .*int64 state"), ("3", "got str"), (None, "NoneType")):
        with pytest.raises(TypeError, match=f"accumulate: update: .*{message}"):
            count.accumulate(bad)  # type: ignore[arg-type]
        assert int(count.value) == 8  # nothing changed


@pytest.mark.parametrize("group", [object(), "world", 0])
def test_a_group_of_another_type_is_refused_in_one_process_too(group: object) -> None:
    from sidestream import MeanMetric
    from sidestream.collector import AsyncMetricCollector

    metric = MeanMetric()
    metric.update(torch.ones(2))
    for call in (
        lambda: metric.sync(group),  # type: ignore[arg-type]
        lambda: setattr(metric, "sync_group", group),
        lambda: AsyncMetricCollector(metric, group=group),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match=r"group: expected a torch\.distributed ProcessGroup"):
            call()
    assert float(metric.compute()) == 1.0


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN])
def test_a_float_update_into_an_integer_extremum_is_refused_not_truncated(op: ReduceOp) -> None:
    # 2.7 became a max of 2 and -2.7 a min of -2 (above the true minimum), with no error; a SUM
    # state refuses the same update (add_ will not cast float into int).
    state = MetricAccumulator(torch.tensor([0, 0]), op)
    for update in (torch.tensor(2.7), torch.tensor([-2.7, 1.5], dtype=torch.float64)):
        with pytest.raises(TypeError, match=rf"update: .* into this torch.int64 {op.name} state"):
            state.accumulate(update)
    assert state.local.tolist() == [0, 0]
    state.accumulate(torch.tensor([3, -4], dtype=torch.int32))  # integers still widen
    assert state.local.tolist() == ([3, 0] if op is ReduceOp.MAX else [0, -4])


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN])
def test_a_wider_integer_update_into_an_integer_extremum_is_refused_not_wrapped(
    op: ReduceOp,
) -> None:
    # int32 40000 became an int16 -25536 (and -40000 became 25536): neither a max nor a min
    # was taken, with no error; a Python int of the same value was already refused.
    state = MetricAccumulator(torch.tensor([0, 100], dtype=torch.int16), op)
    update = torch.tensor([40000, -40000], dtype=torch.int32)
    with pytest.raises(
        TypeError, match=rf"torch.int32 update into this torch.int16 {op.name} state could wrap"
    ):
        state.accumulate(update)
    assert state.local.tolist() == [0, 100]
    state.accumulate(torch.tensor([7, 3], dtype=torch.int8))  # narrower: exact
    assert state.local.tolist() == ([7, 100] if op is ReduceOp.MAX else [0, 3])


def test_updates_a_state_cannot_hold_raise_type_error_and_bool_extrema_take_ints() -> None:
    # torch's own RuntimeError ("result type ... can't be cast") came through for a SUM.
    cases = [
        (MetricAccumulator(torch.tensor([False])), torch.tensor([1])),
        (MetricAccumulator(torch.zeros(1)), torch.ones(1, dtype=torch.complex64)),
        (MetricAccumulator(torch.zeros(1), ReduceOp.MAX), torch.ones(1, dtype=torch.complex64)),
    ]
    for state, update in cases:
        with pytest.raises(TypeError, match="cannot be cast without losing values"):
            state.accumulate(update)
        assert not state.local.any()
    # A bool MAX is an "any", a bool MIN an "all": an int update counts as nonzero, as before.
    anything = MetricAccumulator(torch.tensor([False, False]), ReduceOp.MAX)
    anything.accumulate(torch.tensor([0, 7]))
    assert anything.local.tolist() == [False, True]


def test_a_float_tensor_into_an_integer_sum_raises_type_error_as_documented() -> None:
    state = MetricAccumulator(torch.tensor([0, 0]))
    for update in (torch.tensor(2.7), torch.tensor([1.0, 2.0])):
        with pytest.raises(
            TypeError, match=r"update: a torch.float32 update into this torch.int64 SUM state"
        ):
            state.accumulate(update)
    assert state.local.tolist() == [0, 0]
    state.accumulate(torch.tensor([True, False]))  # bools and integers add as before
    state.accumulate(torch.tensor([2, 3], dtype=torch.int32))
    assert state.local.tolist() == [3, 3]


def test_a_non_contiguous_initial_value_makes_a_state() -> None:
    state = MetricAccumulator(torch.zeros(3, 4).t())  # a transposed view crashed in _bind
    state.accumulate(torch.ones(4, 3))
    assert state.local.shape == (4, 3) and float(state.local.sum()) == 12.0


@pytest.mark.parametrize("op", list(ReduceOp))
def test_an_update_of_another_shape_names_the_states_shape(op: ReduceOp) -> None:
    # torch named the 0-dim state's internal view: "output with shape [1] doesn't match".
    for initial, update in ((0.0, torch.ones(3)), (torch.zeros(2, 3), torch.ones(3, 2))):
        state = MetricAccumulator(initial, op)
        shape = tuple(state.local.shape)
        message = (
            f"update: expected a tensor broadcastable to this state's shape {shape}, got shape "
            f"{tuple(update.shape)}"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            state.accumulate(update)
        assert tuple(state.local.shape) == shape and not state.local.any()


def test_an_empty_initial_value_is_refused() -> None:
    # torchmetrics' add_state("preds", [], "cat") made a 0-element float32 state: synced and
    # saved as nothing, with no error.
    for initial in ([], torch.empty(0, 3)):
        with pytest.raises(ValueError, match="initial: a state holds a fixed shape of values"):
            MetricAccumulator(initial)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="override sync"):
        SumMetric().add_state("preds", [], ReduceOp.SUM)  # type: ignore[arg-type]


def test_a_sum_state_must_start_at_zero() -> None:
    # Every rank adds its initial value into the sum: a sync counted it once per rank.
    with pytest.raises(ValueError, match="initial: a SUM state starts at 0"):
        MetricAccumulator(torch.tensor([0.0, 1.0]))
    MetricAccumulator(torch.tensor(-torch.inf), ReduceOp.MAX)  # any start for a max or min


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial": None}, "initial: expected a tensor or a number"),
        ({"initial": "zero"}, "initial: expected a tensor or a number"),
        ({"initial": 0.0, "dtype": "float32"}, "dtype: expected a torch.dtype or None"),
    ],
)
def test_bad_declarations_name_their_argument(kwargs: dict[str, object], message: str) -> None:
    metric = _Squares()
    with pytest.raises(TypeError, match=message):
        metric.add_state("extra", **kwargs)  # type: ignore[arg-type]


def test_a_metric_cannot_hold_itself() -> None:
    outer, inner = _Squares(), _Squares()
    outer.inner = inner
    with pytest.raises(ValueError, match="a metric tree cannot hold itself"):
        inner.outer = outer  # a cycle: RecursionError in every walk of the tree
    with pytest.raises(ValueError, match="a metric tree cannot hold itself"):
        outer.again = outer


@pytest.mark.parametrize("value", [None, "0.0"])
def test_a_saved_value_that_is_not_a_tensor_is_named(value: object) -> None:
    metric = _Squares()
    saved = {**metric.state_dict(), "total": value}
    with pytest.raises(TypeError, match=r"state_dict\['total'\]: expected a tensor"):
        metric.load_state_dict(saved)


@pytest.mark.parametrize(
    ("initial", "dtype", "says"),
    [
        (-1, torch.uint8, "not representable in torch.uint8"),  # was 255: a MAX stuck there
        (0.7, torch.int64, "not representable in torch.int64"),  # was 0
        (300, torch.uint8, "not representable in torch.uint8"),  # was 44
        (float(2**63), torch.int64, "not representable in torch.int64"),
        (2, torch.bool, "not representable as bool"),
        (1e5, torch.float16, "overflows torch.float16"),
        # The docs' RangeMetric starts at -inf; for an int64 max that said "not a number".
        (-math.inf, torch.int64, r"MAX state starts at torch.iinfo\(torch.int64\).min"),
    ],
)
def test_an_initial_value_the_dtype_cannot_hold_is_refused_naming_both(
    initial: float, dtype: torch.dtype, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        MetricAccumulator(initial, ReduceOp.MAX, dtype=dtype)


@pytest.mark.parametrize(
    ("initial", "dtype", "expected"),
    [
        (torch.iinfo(torch.int64).min, torch.int64, torch.iinfo(torch.int64).min),
        (255, torch.uint8, 255),
        (True, torch.int64, 1),
        (-math.inf, torch.float32, -math.inf),
        (0.1, torch.float32, float(torch.tensor(0.1, dtype=torch.float32))),  # rounding is fine
        (-2.0, torch.int32, -2),
    ],
)
def test_an_initial_value_the_dtype_holds_converts(
    initial: float, dtype: torch.dtype, expected: float
) -> None:
    state = MetricAccumulator(initial, ReduceOp.MAX, dtype=dtype)
    assert state.local.dtype == dtype and state.local.item() == expected
