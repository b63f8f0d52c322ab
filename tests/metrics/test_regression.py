"""Regression metrics against scikit-learn and scipy, in one process and on gloo ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from scipy.stats import pearsonr
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

from sidestream.metrics.regression import (
    MeanAbsoluteErrorMetric,
    MeanSquaredErrorMetric,
    PearsonCorrelationMetric,
    R2ScoreMetric,
    RootMeanSquaredErrorMetric,
)
from sidestream.testing import RankPool, on_rank_device
from tests._checkpoints import states_only

OUTPUTS = 3


def _shard(seed: int, size: int, outputs: int, offset: float = 0.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (size,) if outputs == 1 else (size, outputs)
    target = offset + rng.normal(scale=2.0, size=shape)
    preds = target + rng.normal(scale=1.0, size=shape)
    return {"preds": preds.astype(np.float32), "target": target.astype(np.float32)}


def _shards(seed: int, world_size: int, outputs: int) -> list[dict[str, np.ndarray]]:
    sizes = np.random.default_rng(seed + 500).integers(3, 300, size=world_size)
    if world_size > 1:
        sizes[-1] = 0
    return [_shard(seed * 10 + r, int(s), outputs) for r, s in enumerate(sizes)]


def _metrics(outputs: int) -> dict[str, Any]:
    raw = "raw_values"
    return {
        "mse": MeanSquaredErrorMetric(outputs),
        "rmse": RootMeanSquaredErrorMetric(outputs),
        "mae": MeanAbsoluteErrorMetric(outputs),
        "r2": R2ScoreMetric(outputs),
        "pearson": PearsonCorrelationMetric(outputs),
        "mse_raw": MeanSquaredErrorMetric(outputs, multioutput=raw),
        "r2_raw": R2ScoreMetric(outputs, multioutput=raw),
        "pearson_raw": PearsonCorrelationMetric(outputs, multioutput=raw),
    }


def _feed(metrics: dict[str, Any], data: dict[str, np.ndarray]) -> None:
    n = len(data["preds"])
    for a, b in ((0, n // 3), (n // 3, n // 3), (n // 3, n)):  # includes an empty batch
        preds, target = torch.as_tensor(data["preds"][a:b]), torch.as_tensor(data["target"][a:b])
        for metric in metrics.values():
            metric.update(preds, target)


def _values(metrics: dict[str, Any]) -> dict[str, list[float]]:
    return {name: m.compute().reshape(-1).tolist() for name, m in metrics.items()}


def _references(data: dict[str, np.ndarray]) -> dict[str, list[float]]:
    p, t = data["preds"].astype(np.float64), data["target"].astype(np.float64)
    p2, t2 = p.reshape(len(p), -1), t.reshape(len(t), -1)
    pearson = [pearsonr(p2[:, j], t2[:, j]).statistic for j in range(p2.shape[1])]
    raw = "raw_values"
    mse_raw = mean_squared_error(t2, p2, multioutput=raw)
    return {
        "mse": [mean_squared_error(t, p)],
        "rmse": [float(np.mean(np.sqrt(mse_raw)))],
        "mae": [mean_absolute_error(t, p)],
        "r2": [r2_score(t, p)],
        "pearson": [float(np.mean(pearson))],
        "mse_raw": list(mse_raw),
        "r2_raw": list(r2_score(t2, p2, multioutput=raw)),
        "pearson_raw": pearson,
    }


def _check(values: dict[str, list[float]], data: dict[str, np.ndarray]) -> None:
    for name, expected in _references(data).items():
        assert values[name] == pytest.approx(expected, rel=1e-9, abs=1e-12), name


@pytest.mark.parametrize("outputs", [1, OUTPUTS])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_process_matches_sklearn_and_scipy(seed: int, outputs: int) -> None:
    data = _shard(seed, 50 + 200 * seed, outputs)
    metrics = _metrics(outputs)
    _feed(metrics, data)
    _check(_values(metrics), data)


def test_any_input_shape_with_one_output() -> None:
    data = _shard(4, 60, 1)
    metric = MeanSquaredErrorMetric()
    metric.update(
        torch.as_tensor(data["preds"]).reshape(3, 4, 5),
        torch.as_tensor(data["target"]).reshape(3, 4, 5),
    )
    assert metric.compute().item() == pytest.approx(
        mean_squared_error(data["target"].astype(float), data["preds"].astype(float)), rel=1e-12
    )


def test_shift_keeps_r2_and_pearson_accurate_far_from_zero() -> None:
    data = _shard(6, 2000, 1, offset=1e7)
    p, t = torch.as_tensor(data["preds"]).double(), torch.as_tensor(data["target"]).double()
    r2, pearson = R2ScoreMetric(shift=1e7), PearsonCorrelationMetric(shift=1e7)
    r2.update(p, t)
    pearson.update(p, t)
    p64, t64 = p.numpy(), t.numpy()
    assert r2.compute().item() == pytest.approx(r2_score(t64, p64), rel=1e-9)
    assert pearson.compute().item() == pytest.approx(pearsonr(p64, t64).statistic, rel=1e-9)


@on_rank_device
def _synced(seeds: list[int], outputs: int) -> list[dict[str, list[float]]]:
    out = []
    for seed in seeds:
        shard = _shards(seed, dist.get_world_size(), outputs)[dist.get_rank()]
        metrics = _metrics(outputs)
        _feed(metrics, shard)
        for metric in metrics.values():
            metric.sync()
        out.append(_values(metrics))
    return out


@pytest.mark.parametrize("outputs", [1, OUTPUTS])
def test_distributed_matches_sklearn_on_all_shards(dist_pool: RankPool, outputs: int) -> None:
    seeds = [3, 4, 5]
    per_rank = dist_pool.run(_synced, seeds, outputs)
    for i, seed in enumerate(seeds):
        shards = _shards(seed, dist_pool.world_size, outputs)
        everything = {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}
        for values in per_rank:
            _check(values[i], everything)


def test_bad_input_raises_naming_the_argument_before_state_changes() -> None:
    metric = R2ScoreMetric(num_outputs=2)
    with pytest.raises(ValueError, match=r"preds.*num_outputs=2"):
        metric.update(torch.zeros(4, 3), torch.zeros(4, 3))
    # A preds of the wrong width named itself, not the right target (told to take its shape).
    with pytest.raises(ValueError, match=r"^preds: expected shape \(N, 2\)"):
        metric.update(torch.zeros(4, 3), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="target"):
        metric.update(torch.zeros(4, 2), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="preds"):
        metric.update(torch.tensor([[0.0, float("inf")]]), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="target"):
        metric.update(torch.zeros(1, 2), torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(TypeError, match="preds"):
        metric.update(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="shift"):
        R2ScoreMetric(num_outputs=2, shift=[1.0, 2.0, 3.0])
    assert all(float(t.abs().sum()) == 0 for t in states_only(metric.state_dict()).values())
    assert torch.isnan(metric.compute())


@pytest.mark.parametrize("kind", [R2ScoreMetric, PearsonCorrelationMetric])
def test_checkpoint_keeps_its_shift(kind: Any) -> None:
    # The sums are of values minus the shift: a checkpoint taken with another shift would give
    # wrong numbers (R2 of -1.42 came out as 0.73), so loading it raises naming the shift.
    first, second = _shard(11, 300, 1, offset=3.0), _shard(12, 200, 1, offset=3.0)
    saved_with = kind(shift=2.0)
    saved_with.update(torch.as_tensor(first["preds"]), torch.as_tensor(first["target"]))
    saved = saved_with.state_dict()
    with pytest.raises(
        ValueError, match=r"state_dict\['shift'\]: saved with \[2.0\], this metric has \[5.0\]"
    ):
        kind(shift=5.0).load_state_dict(saved)
    # Another output count is not another shift: the message says the size differs.
    with pytest.raises(ValueError, match=r"shape \(1,\) against this one's \(2,\): a metric of"):
        kind(num_outputs=2, shift=2.0).load_state_dict(saved)
    resumed = kind(shift=2.0)
    resumed.load_state_dict(saved)
    resumed.update(torch.as_tensor(second["preds"]), torch.as_tensor(second["target"]))
    preds = np.concatenate([first["preds"], second["preds"]]).astype(np.float64)
    target = np.concatenate([first["target"], second["target"]]).astype(np.float64)
    expected = r2_score(target, preds) if kind is R2ScoreMetric else pearsonr(preds, target)[0]
    assert resumed.compute().item() == pytest.approx(expected, rel=1e-9)
    # A checkpoint from before the shift was saved loads as one taken with this metric's shift.
    older = {key: value for key, value in saved.items() if "shift" not in key}
    again = kind(shift=2.0)
    again.load_state_dict(older)
    p1, t1 = first["preds"].astype(np.float64), first["target"].astype(np.float64)
    before = r2_score(t1, p1) if kind is R2ScoreMetric else pearsonr(p1, t1)[0]
    assert again.compute().item() == pytest.approx(before, rel=1e-9)


@pytest.mark.parametrize(
    "make",
    [
        lambda: R2ScoreMetric(shift=float("nan")),
        lambda: PearsonCorrelationMetric(shift=float("inf")),
        lambda: PearsonCorrelationMetric(target_shift=[float("nan")]),
    ],
)
def test_a_shift_must_be_finite(make: Any) -> None:
    with pytest.raises(ValueError, match="shift: expected finite values"):
        make()


def test_many_samples_in_large_batches_keep_their_variance() -> None:
    """The NaN guard of the one-pass variance grew with the sample count: 6e6 samples 30000
    standard deviations from 0 (rounding costs about 2e-7 of the variance here) came out NaN.
    It now grows with the updates, which is where the sums' rounding comes from."""
    rng = np.random.default_rng(5)
    target = 30_000.0 + rng.normal(size=1_000_000)
    preds = target + 0.5 * rng.normal(size=1_000_000)
    r2, pearson = R2ScoreMetric(), PearsonCorrelationMetric()
    for _ in range(6):  # the same chunk 6 times: R² and r are the chunk's own
        r2.update(torch.from_numpy(preds), torch.from_numpy(target))
        pearson.update(torch.from_numpy(preds), torch.from_numpy(target))
    assert r2.compute().item() == pytest.approx(r2_score(target, preds), rel=1e-5)
    assert pearson.compute().item() == pytest.approx(pearsonr(preds, target)[0], rel=1e-5)
    assert r2.state_dict()["updates"].item() == 6
    # A constant target is still NaN, however it was fed.
    constant = R2ScoreMetric()
    for _ in range(6):
        constant.update(torch.from_numpy(preds), torch.full((1_000_000,), 30_000.1))
    assert torch.isnan(constant.compute())


def test_a_checkpoint_without_the_update_count_loads_with_the_strict_bound() -> None:
    metric = R2ScoreMetric()
    metric.update(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1.0, 2.5, 3.5]))
    older = {key: value for key, value in metric.state_dict().items() if key != "updates"}
    resumed = R2ScoreMetric()
    resumed.load_state_dict(older)  # saved before the count was kept: a third of its samples
    assert resumed.state_dict()["updates"].item() == 1  # 3 * (1 + ...) * eps >= count * eps
    assert resumed.compute().item() == pytest.approx(metric.compute().item())
    assert resumed.compute().item() == pytest.approx(r2_score([1.0, 2.5, 3.5], [1.0, 2.0, 4.0]))
    # torch.distributed.checkpoint's partial load leaves the fresh metric's 0 beside the sums.
    partial = R2ScoreMetric()
    partial.load_state_dict({**older, "updates": torch.tensor(0)})
    assert partial.state_dict()["updates"].item() == 1


def test_an_old_checkpoint_of_a_constant_fed_in_small_batches_stays_nan() -> None:
    """The sums of 30000 updates of a constant target, saved without the update count: a
    count of 0 would judge them by one update's bound and report R² = -1e10."""
    target = torch.full((7,), 0.1, dtype=torch.float64)
    preds = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    metric = R2ScoreMetric()
    for _ in range(30_000):
        metric.update(preds, target)
    assert torch.isnan(metric.compute())
    older = {key: value for key, value in metric.state_dict().items() if key != "updates"}
    for saved in (older, {**older, "updates": torch.tensor(0)}):
        resumed = R2ScoreMetric()
        resumed.load_state_dict(saved)
        assert torch.isnan(resumed.compute())


@pytest.mark.parametrize("scale", [1e-150, 1e-120, 1e120, 1e152])
def test_pearson_holds_wherever_its_sums_are_normal_floats(scale: float) -> None:
    """At 1e152 with a mean of 5 (squares finite, their sum too) ``sum(x)**2`` overflowed."""
    rng = np.random.default_rng(3)
    x = 5.0 + rng.normal(size=100)
    y = 0.6 * x + 0.8 * rng.normal(size=100)
    metric = PearsonCorrelationMetric()
    metric.update(torch.from_numpy(x * scale), torch.from_numpy(y * scale))
    assert metric.compute().item() == pytest.approx(pearsonr(x, y)[0], rel=1e-9)


@pytest.mark.parametrize("scale", [1e-162, 8e-162, 1e-160])
def test_pearson_below_the_normal_range_is_nan_not_a_wrong_value(scale: float) -> None:
    """The squares underflow (to 0 or subnormals): r came out 0.6154 at 1e-162 and 0.5597 at
    8e-162 where scipy gives 0.5867 and 0.5768. A variance within a million times what the
    underflow may have taken is NaN."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=200)
    y = 0.6 * x + 0.8 * rng.normal(size=200)
    metric = PearsonCorrelationMetric()
    metric.update(torch.from_numpy(x * scale), torch.from_numpy(y * scale))
    assert np.isnan(metric.compute().item())


@pytest.mark.parametrize(("batch", "updates"), [(1, 4000), (7, 1000), (2_000_000, 3)])
def test_a_constant_target_is_nan_however_it_is_fed(batch: int, updates: int) -> None:
    """The rounding bound must still call a constant target's leftover noise what it is."""
    for constant in (0.1, 1 / 3, 30_000 + 1 / 7):
        r2, pearson = R2ScoreMetric(), PearsonCorrelationMetric()
        target = torch.full((batch,), constant, dtype=torch.float64)
        preds = torch.randn(batch, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for _ in range(updates):
            r2.update(preds, target)
            pearson.update(preds, target)
        assert torch.isnan(r2.compute()) and torch.isnan(pearson.compute()), constant


def test_variance_weighted_r2_does_not_drop_an_output_whose_variance_is_lost() -> None:
    """An output 1e8 from 0 with std 1 has its one-pass variance lost to rounding (NaN), but it
    is not constant: it holds nearly all the weight. variance_weighted left it out as constant
    and gave 0.026, the other output's R², where scikit-learn gives 0.180."""
    rng = np.random.default_rng(0)
    target = np.stack([1e8 + rng.normal(size=1000), 1e-3 * rng.normal(size=1000)], axis=1)
    preds = target + np.stack([0.9 * rng.normal(size=1000), 1e-3 * rng.normal(size=1000)], 1)
    weighted = R2ScoreMetric(2, "variance_weighted")
    weighted.update(torch.from_numpy(preds), torch.from_numpy(target))
    assert torch.isnan(weighted.compute())
    # With a shift the variance is kept, and the value is scikit-learn's.
    shifted = R2ScoreMetric(2, "variance_weighted", shift=[1e8, 0.0])
    shifted.update(torch.from_numpy(preds), torch.from_numpy(target))
    expected = r2_score(target, preds, multioutput="variance_weighted")
    assert shifted.compute().item() == pytest.approx(expected, rel=1e-6)
    # A constant output still weighs nothing, as in scikit-learn, even when it is not exact in
    # float64 (its sums leave rounding noise) or sits a thousand standard deviations out. The
    # reference is the other output's R²: scikit-learn's own float64 mean of 0.1s leaves a
    # variance of 1e-30 that it weighs in, with all of that output's squared error.
    expected = r2_score(target[:, 0], preds[:, 0])
    for constant in (5.0, 0.1, 1000.0 + 1 / 3):
        target[:, 1] = constant
        metric = R2ScoreMetric(2, "variance_weighted", shift=[1e8, 0.0])
        metric.update(torch.from_numpy(preds), torch.from_numpy(target))
        assert metric.compute().item() == pytest.approx(expected, rel=1e-6), constant
