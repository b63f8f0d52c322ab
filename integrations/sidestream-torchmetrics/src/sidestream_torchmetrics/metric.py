"""One torchmetrics ``Metric`` as a sidestream ``Metric``."""

from __future__ import annotations

import enum
import inspect
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric as TorchmetricsBase
from torchmetrics.utilities.data import (
    dim_zero_cat,
    dim_zero_max,
    dim_zero_mean,
    dim_zero_min,
    dim_zero_sum,
)

from sidestream.metric import Metric
from sidestream.state import MetricAccumulator, ReduceOp
from sidestream.sync import stable_hash
from sidestream_torchmetrics._equivalents import suggestion

__all__ = ["TorchmetricsMetric", "UnsupportedStateError"]

_OPS = {dim_zero_sum: ReduceOp.SUM, dim_zero_max: ReduceOp.MAX, dim_zero_min: ReduceOp.MIN}


class UnsupportedStateError(ValueError):
    """A torchmetrics state that is not a fixed-size sum, max or min."""


def _state_op(metric: TorchmetricsBase, name: str) -> ReduceOp:
    """The sidestream op of torchmetrics state ``name``; raises naming the state otherwise."""
    default = metric._defaults[name]
    reduction = metric._reductions[name]
    where = f"{type(metric).__name__}: state {name!r}"
    hint = suggestion(type(metric))
    if "." in name or "/" in name:
        raise UnsupportedStateError(
            f"{where}: a name with '.' or '/' cannot be a sidestream state name (checkpoint "
            "keys of nested metrics are joined with '.')"
        )
    if isinstance(default, list) or reduction is dim_zero_cat:
        raise UnsupportedStateError(
            f"{where} concatenates samples (dist_reduce_fx='cat' or a list state), so it grows "
            f"with the data and cannot be a fixed-size sidestream state; {hint}"
        )
    if isinstance(default, Tensor) and default.numel() == 0:
        raise UnsupportedStateError(
            f"{where} starts empty (shape {tuple(default.shape)}), so it can only grow with the "
            f"data (concatenated samples) and cannot be a fixed-size sidestream state; {hint}"
        )
    if reduction is dim_zero_mean:
        raise UnsupportedStateError(
            f"{where} is averaged across ranks (dist_reduce_fx='mean'), which is not linearly "
            f"reducible (store a sum and a count); {hint}"
        )
    if reduction is None:
        raise UnsupportedStateError(
            f"{where} has dist_reduce_fx=None: torchmetrics reduces it in its own code after a "
            f"gather, which a sidestream sync cannot do; {hint}"
        )
    if reduction not in _OPS:
        raise UnsupportedStateError(
            f"{where} uses a callable reduction ({getattr(reduction, '__name__', reduction)}); "
            f"only 'sum', 'max' and 'min' map to sidestream state; {hint}"
        )
    if reduction is dim_zero_sum and isinstance(default, Tensor) and bool(default.any()):
        raise UnsupportedStateError(
            f"{where} is summed across ranks from a default that is not 0 "
            f"({default.tolist()}): every rank would add it again, so the sum would count it "
            "once per rank; start the state at 0 and add the offset in compute"
        )
    return _OPS[reduction]


def _refuse_inner_metrics(metric: TorchmetricsBase) -> None:
    """Refuse a metric that keeps its state in torchmetrics metrics inside it.

    A wrapper (``Running``, ``MultioutputWrapper``, ``MinMaxMetric``, ``BootStrapper``,
    ``ClasswiseWrapper``...) or a compositional metric (``a + b``) has no state of its own: the
    bridge would sync nothing, checkpoint nothing, and its ``compute`` would run the inner
    metrics' own torchmetrics syncs (counted twice, or collectives from a background thread).
    """
    inner = [
        name
        for name, module in metric.named_modules()
        if module is not metric and isinstance(module, TorchmetricsBase)
    ]
    if inner:
        shown = ", ".join(inner[:4]) + (", ..." if len(inner) > 4 else "")
        raise UnsupportedStateError(
            f"{type(metric).__name__} keeps its state in the torchmetrics metrics inside it "
            f"({shown}): a wrapper or a compositional metric, which the bridge cannot sync or "
            "checkpoint; wrap the inner metrics (in a MetricCollection), or use the sidestream "
            "metric that computes the same value"
        )


def _refuse_own_distribution(metric: TorchmetricsBase) -> None:
    """Refuse torchmetrics' own process group or gather function: sidestream's group rules."""
    for option in ("process_group", "dist_sync_fn"):
        if getattr(metric, option, None) is not None:
            raise ValueError(
                f"{type(metric).__name__}({option}=...): the bridge reduces over the group of "
                "sidestream's sync (metric.sync(group), or the collector's group=), never "
                f"torchmetrics' own; leave {option} unset and pass the group there"
            )


def _changed_shape(
    metric: TorchmetricsBase, name: str, state: Tensor, value: Tensor
) -> UnsupportedStateError:
    """The refusal of a state that ``update`` gave another shape, saying why it happens."""
    kind = type(metric).__name__
    if state.dim() == 0 and value.dim() > 0:
        # torchmetrics 1.x makes R2Score's and ExplainedVariance's sums scalars and sizes
        # them from the first batch: (N, D) inputs make them (D,).
        why = (
            "torchmetrics made this one a scalar and sized it from the first batch (several "
            "outputs per sample, say)"
        )
    else:
        why = "one that grows with the data is a 'cat' state, which cannot sync in fixed size"
    return UnsupportedStateError(
        f"{kind}.update changed state {name!r} from shape {tuple(state.shape)} to "
        f"{tuple(value.shape)}, but wrapped states keep the shape they had when wrapped: {why}; "
        f"{suggestion(type(metric))}"
    )


class TorchmetricsMetric(Metric[Any]):
    """A torchmetrics ``Metric`` whose states are sidestream accumulators.

    ``update`` and ``compute`` are torchmetrics' own. Before each ``update`` the torchmetrics
    state attributes are pointed at the accumulators' local tensors, and after it whatever the
    update left there is checked and stored back, so in-place updates (``self.tp += tp``) and
    rebinding ones (``self.max_value = torch.max(...)``) both land in sidestream state. Each
    update first copies the states once, to put them back if a check refuses the update (or
    torchmetrics raises half way): a refused update leaves none of its batch. ``compute`` runs
    torchmetrics' ``compute`` on the synchronized state when a ``sync`` is current, with
    torchmetrics' own distributed sync turned off: the reduction over ranks is sidestream's
    coalesced sync, and checkpoints are sidestream's world-size independent ``state_dict``.

    State names are torchmetrics' (``tp``, ``max_value``...), so checkpoints are keyed by them.

    Args:
        metric: A torchmetrics metric whose states are all fixed-size tensors reduced by
            ``"sum"``, ``"max"`` or ``"min"``.

    Raises:
        UnsupportedStateError: (a ``ValueError``) naming the first state that concatenates,
            averages, is not reduced, or uses a callable reduction, with the sidestream metric
            to use instead where there is one; or for a wrapper or compositional metric, whose
            state lives in the torchmetrics metrics inside it.
        TypeError: If ``metric`` is not a torchmetrics ``Metric``.
        ValueError: If ``metric`` was already updated (its state would be dropped), or sets
            torchmetrics' own ``process_group`` or ``dist_sync_fn``.
    """

    def __repr__(self) -> str:
        return f"TorchmetricsMetric({getattr(self, '_torchmetrics', None)!r})"

    def __init__(self, metric: TorchmetricsBase) -> None:
        if not isinstance(metric, TorchmetricsBase):
            raise TypeError(f"metric: expected a torchmetrics Metric, got {type(metric)}")
        _refuse_inner_metrics(metric)
        _refuse_own_distribution(metric)
        if metric._update_count:
            # Its accumulated state would be dropped: the wrapper starts from the defaults.
            raise ValueError(
                f"metric: {type(metric).__name__} was already updated "
                f"({metric._update_count} update(s)); wrap a fresh metric (or call its "
                f"reset() first): the wrapper starts from torchmetrics' default states and "
                f"would silently drop what it accumulated"
            )
        ops = {name: _state_op(metric, name) for name in metric._defaults}
        # torchmetrics must never issue collectives of its own: sidestream syncs the states.
        # A refused wrap gives them back (used as it is then, the metric must sync on its
        # own), and so does a collection that refuses a later member (restore_distribution).
        self._own_distribution = {
            option: getattr(metric, option) for option in _DISTRIBUTION_OPTIONS
        }
        self._torchmetrics = metric
        for option in _DISTRIBUTION_OPTIONS:
            setattr(metric, option, False)
        try:
            self._bridge(metric, ops)
        except BaseException:
            self.restore_distribution()
            raise

    def _bridge(self, metric: TorchmetricsBase, ops: dict[str, ReduceOp]) -> None:
        """Declare ``metric``'s states and take the snapshots the checks compare with."""
        self._torchmetrics_dtype = metric.dtype  # set_dtype later would be lost: refused
        # Declared by their torchmetrics names (add_state, not attributes named after them: a
        # state called "sync_group" would have replaced the metric's own _sync_group).
        states: list[tuple[str, MetricAccumulator]] = []
        for name, op in ops.items():
            default = metric._defaults[name]
            assert isinstance(default, Tensor)  # list states were refused above
            states.append((name, self.add_state(name, default.detach().clone(), op)))
        self._bridged = states
        if "configuration" not in ops:  # that key is the configuration's in checkpoints
            # Ranks of another threshold (or class) then fail their first sync instead of
            # adding counts of two problems, and a checkpoint of another one is refused.
            text = _configuration_text(metric)
            for _, accumulator in states:
                accumulator.set_configuration(text)
        # What the configuration was made of, to refuse a change after wrap(): the sync's
        # fingerprint and the checkpoint's hash would still describe the settings of wrap().
        self._settings = _settings(metric)
        # Public attributes there at wrap(): one that appears later may be a value kept
        # outside the states (a counter update() makes on its first call). Counted, so that a
        # call sees whether any appeared without a pass over them.
        self._attributes = frozenset(key for key, _ in _public_settings(metric))
        self._attribute_count = len(vars(metric))
        # Attributes there at wrap() that may hold data (a tensor, an array, a dict, a list of
        # tensors) and buffers that are not states: an update that changes one in place keeps
        # data outside the states, which no sync or checkpoint carries. Fingerprinted around
        # each update (usually none: no cost).
        self._data_keys = tuple(
            key
            for key, value in _public_settings(metric)
            if _may_carry_data(value) and not _plain(value)
        )
        self._buffer_keys = tuple(
            key for key, buffer in metric._buffers.items() if key not in metric._defaults
        )
        self._updates_seen: int = metric._update_count
        # The state tensors the wrapper last left in the torchmetrics attributes: another
        # tensor there later means torchmetrics rebound them itself (its reset, merge_state,
        # load_state_dict), which the update count alone does not always show.
        self._pointed: tuple[Tensor, ...] | None = None

    def _new_attribute(self) -> str | None:
        """``"'name' was added (value)"`` for a public attribute that may carry data, or None.

        Numbers, tensors, arrays and containers may be a counter or samples kept outside the
        states (refused). Anything else (``None``, a flag, a string, a dtype: FID's
        ``orig_dtype``, TranslationEditRate's ``sentence_ter = None``) is taken into the
        snapshot, so a later change of a plain one is refused as a changed setting.
        """
        metric = self._torchmetrics
        attributes = vars(metric)
        if len(attributes) == self._attribute_count:
            return None  # nothing appeared (the common case: no pass over them)
        for key, value in _public_settings(metric):
            if key in self._attributes:
                continue
            if _may_carry_data(value):
                return f"{key!r} was added ({_shown(value)})"
            self._attributes = self._attributes | {key}
            if _plain(value):
                self._settings[key] = _frozen(value)
        self._attribute_count = len(attributes)
        return None

    def restore_distribution(self) -> None:
        """Give the wrapped metric back torchmetrics' own sync options (a refused collection)."""
        for option, value in self._own_distribution.items():
            setattr(self._torchmetrics, option, value)

    @property
    def torchmetrics(self) -> TorchmetricsBase:
        """The wrapped torchmetrics metric (its states are only current inside calls)."""
        return self._torchmetrics

    def _point_states(self, synced: bool) -> None:
        pointed = []
        for name, accumulator in self._bridged:
            state = accumulator.value if synced else accumulator.local
            setattr(self._torchmetrics, name, state)
            pointed.append(state)
        # Past Metric.__setattr__: its container check would walk the tuple on every update.
        object.__setattr__(self, "_pointed", tuple(pointed))

    def _check_readable(self, call: str) -> None:
        """Raise if the torchmetrics metric was changed outside the wrapper since wrap().

        Raises:
            ValueError: If a setting (a public plain attribute) changed.
            RuntimeError: If torchmetrics' own ``update``, ``forward`` or ``reset`` ran, or
                something else replaced its state tensors (``merge_state``).
        """
        metric = self._torchmetrics
        kind = type(metric).__name__
        rebound = self._states_replaced()
        if rebound and metric._update_count == self._updates_seen:
            self._check_dtype(call)  # set_dtype (or .to(dtype)) rebinds the states too: say so
        if metric._update_count != self._updates_seen or rebound:
            # forward() and reset() rebind the states, so the next call would drop what they
            # did; update() adds to them outside sidestream's bookkeeping.
            seen = (
                "its states were replaced (torchmetrics' own reset, merge_state or load_state_dict)"
                if metric._update_count == self._updates_seen
                else f"torchmetrics counts {metric._update_count} update(s), the wrapper "
                f"{self._updates_seen}"
            )
            raise RuntimeError(
                f"{call}: the wrapped {kind} was updated, called or reset directly "
                f"({seen}): those batches would be lost or counted outside "
                "sidestream's state; call update() and reset() on the wrapper only (reset() "
                "on the wrapper starts both over)"
            )
        changed = _changed_setting(metric, self._settings) or self._new_attribute()
        if changed is not None:
            raise ValueError(
                f"{call}: the wrapped {kind}'s setting {changed} after wrap(), so its state "
                "would mix two settings and its checkpoint name the old one; set it before "
                "wrap() (a fresh wrap of a new metric to change it)"
            )

    def _check_dtype(self, call: str) -> None:
        """Raise if the torchmetrics metric's dtype (or a state's) changed after ``wrap()``."""
        metric = self._torchmetrics
        changed = metric.dtype != self._torchmetrics_dtype or any(
            isinstance(getattr(metric, name, None), Tensor)
            and getattr(metric, name).dtype != accumulator.dtype
            for name, accumulator in self._bridged
        )
        if changed:
            raise RuntimeError(
                f"{call}: the wrapped {type(metric).__name__}'s dtype changed from "
                f"{self._torchmetrics_dtype} to {metric.dtype} after wrap() (set_dtype, "
                ".to(dtype)...): its states are sidestream's now and keep their dtype. "
                "Call set_dtype on the torchmetrics metric before wrap()"
            )

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Run torchmetrics' ``update`` on the local state. No communication.

        Host syncs are torchmetrics': its argument validation reads values on CUDA, so pass
        ``validate_args=False`` to the torchmetrics constructor where it has one.

        An empty batch (every tensor argument with 0 rows: a rank's last batch of an uneven
        split) adds nothing, whatever torchmetrics' own ``update`` does with one (its stat
        scores raise, its ranking loss counts a sample); its shapes are checked all the same.

        Raises:
            ValueError: If a setting of the torchmetrics metric changed after ``wrap()``, or
                torchmetrics refuses an empty batch's shapes (``TypeError`` for a dtype).
            UnsupportedStateError: If this ``update`` changed a setting (a counter kept in a
                plain attribute, which the bridge cannot sync or save) or a state's shape.
            RuntimeError: If torchmetrics' own ``update``, ``forward`` or ``reset`` ran on the
                wrapped metric, or its dtype changed after ``wrap()``.
        """
        self._update(args, kwargs)

    def _update(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
        """``update``; returns the copy of the states it took first, for ``_undo``."""
        self._check_readable("update")
        self._check_dtype("update")
        # torchmetrics adds in place (self.total += ...): a refused update (or one that raised
        # half way) would leave part of its batch in the states. One copy each, put back then.
        snapshot = [accumulator.local.clone() for _, accumulator in self._bridged]
        held = self._held_data()
        # A rank's last batch of an uneven split (DistributedSampler, drop_last=False) may
        # hold no rows. torchmetrics' stat scores raise on one (reshape(0, -1)), which left
        # the other ranks waiting in sync, and its ranking loss counts it as a sample: the
        # value then depended on how the data was split. An empty batch adds nothing.
        empty = _empty_batch(args, kwargs)
        self._point_states(synced=False)
        try:
            try:
                self._torchmetrics.update(*args, **kwargs)
            except Exception:
                if empty is None:
                    raise
                self._check_empty_batch(snapshot, args, kwargs, empty)
            finally:
                # Counted before its update runs: one that raised (a bad target) counts too.
                self._updates_seen = self._torchmetrics._update_count
            if self._store_update(held):
                # States the update rebound (self.max_value = torch.max(...)) were stored into
                # the arena: the attributes alias it again, as the wrapper left them.
                self._point_states(synced=False)
            if empty is not None:
                self._undo(snapshot)  # checked like any batch, kept like none
        except BaseException:
            self._undo(snapshot)
            raise
        return snapshot

    def _check_empty_batch(
        self,
        snapshot: list[Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        shapes: str,
    ) -> None:
        """Check an empty batch torchmetrics refused as one row of zeros of the same shapes.

        torchmetrics' own checks of shapes and dtypes (and their errors, naming the argument)
        then run as for a batch with rows; its state changes are put back by the caller.

        Raises:
            ValueError, TypeError: If torchmetrics refuses the batch with rows too, with its
                message.
        """
        self._undo(snapshot)
        try:
            self._torchmetrics.update(
                *(_one_row(value) for value in args),
                **{key: _one_row(value) for key, value in kwargs.items()},
            )
        except Exception as error:
            kind = TypeError if isinstance(error, TypeError) else ValueError
            raise kind(
                f"{type(self._torchmetrics).__name__}.update: an empty batch ({shapes}), "
                "refused by torchmetrics when checked as one row of each shape: "
                f"{type(error).__name__}: {error}"
            ) from error

    def _undo(self, snapshot: list[Tensor]) -> None:
        """Put back the states ``_update`` copied (its batch refused, here or in a collection)."""
        for (_, accumulator), saved in zip(self._bridged, snapshot, strict=True):
            accumulator.local.copy_(saved)
        self._point_states(synced=False)  # rebinding states left elsewhere come back

    def _held_data(self) -> tuple[object, ...]:
        """Fingerprints of the attributes and buffers that may hold data (``_data_keys``)."""
        if not self._data_keys and not self._buffer_keys:
            return ()
        metric = self._torchmetrics
        return tuple(
            _fingerprint(metric.__dict__.get(key, _MISSING)) for key in self._data_keys
        ) + tuple(_fingerprint(metric._buffers.get(key)) for key in self._buffer_keys)

    def _data_changed(self, held: tuple[object, ...]) -> str | None:
        """``"'name' was changed by the update (value)"`` for the first one ``held`` misses."""
        if not held:
            return None
        now = self._held_data()
        metric = self._torchmetrics
        keys = [(repr(key), metric.__dict__.get(key)) for key in self._data_keys] + [
            (f"{key!r} (a buffer)", metric._buffers.get(key)) for key in self._buffer_keys
        ]
        for (label, value), before, after in zip(keys, held, now, strict=True):
            if before != after:
                return f"{label} was changed ({_shown(value)})"
        return None

    def _store_update(self, held: tuple[object, ...] = ()) -> bool:
        """Check what torchmetrics' update left in its states, then make it the local state.

        Returns:
            Whether the update rebound any state (its attribute holds another tensor now).
        """
        changed = (
            _changed_setting(self._torchmetrics, self._settings)
            or self._new_attribute()
            or self._data_changed(held)
        )
        if changed is not None:
            raise UnsupportedStateError(
                f"{type(self._torchmetrics).__name__}.update: its attribute {changed}: a value "
                "update() keeps outside its states (add_state) is not synced across ranks or "
                "saved in checkpoints, so compute() would use this rank's alone; keep it in a "
                "state"
            )
        results = [
            (name, accumulator, getattr(self._torchmetrics, name))
            for name, accumulator in self._bridged
        ]
        for name, accumulator, value in results:  # every state checked before any is stored
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"{type(self._torchmetrics).__name__}.update left state {name!r} as "
                    f"{type(value)}, not a tensor"
                )
            if value.shape != accumulator.local.shape:
                raise _changed_shape(self._torchmetrics, name, accumulator.local, value)
        for name, accumulator, value in results:
            if torch.promote_types(value.dtype, accumulator.local.dtype) != accumulator.local.dtype:
                # float64 inputs make some updates (R2Score's rebinding sums) float64: stored
                # back into the float32 state they would be rounded, silently.
                raise TypeError(
                    f"{type(self._torchmetrics).__name__}.update turned state {name!r} into "
                    f"{value.dtype} (inputs of that dtype?), wider than its {accumulator.dtype} "
                    "state, which would round it; call set_dtype("
                    f"{value.dtype}) on the torchmetrics metric before wrap()"
                )
        rebound = False
        for _, accumulator, value in results:
            if value is accumulator.local:
                accumulator.mark_changed()  # updated in place: the sync is stale
            else:  # rebound (self.max_value = torch.max(...)): stored into the state
                accumulator.load_local(value.to(accumulator.local.dtype))
                rebound = True
        return rebound

    def compute(self) -> Any:
        """Run torchmetrics' ``compute`` on the synchronized state if current, else the local.

        Raises:
            ValueError: If a setting of the torchmetrics metric changed after ``wrap()``.
            RuntimeError: If torchmetrics' own ``update``, ``forward`` or ``reset`` ran on the
                wrapped metric.
        """
        self._check_readable("compute")
        metric = self._torchmetrics
        self._point_states(synced=True)
        metric._computed = None
        # After a reset or a checkpoint load torchmetrics has seen no update of its own, and
        # its compute would warn that none was called: counted as one for the call (as
        # torchmetrics' ClasswiseWrapper does), not silenced with warnings.catch_warnings(),
        # which swaps the process-wide filters and is not thread-safe. A collector computes
        # on its dispatcher thread: a filter the training thread set meanwhile was lost, and
        # one it set inside its own catch_warnings block stayed for good.
        updates = metric._update_count
        metric._update_count = max(updates, 1)
        # A compute that caches its result in a new attribute (self.last = ...) holds no data
        # an update kept, but the next call's check of settings would take it for one and
        # raise, blaming wrap(); in a collector only once a staging copy is reused, in the
        # dispatcher thread (the fourth window). compute is a function of the states: what it
        # adds is dropped after the call.
        attributes = set(vars(metric))
        try:
            return metric.compute()
        finally:
            metric._update_count = updates
            metric._computed = None
            for key in [key for key in vars(metric) if key not in attributes]:
                if not key.startswith("_"):
                    del metric.__dict__[key]
            self._point_states(synced=False)

    def reset(self) -> None:
        """Reset the sidestream state and torchmetrics' own bookkeeping."""
        super().reset()
        self._torchmetrics.reset()
        self._updates_seen = self._torchmetrics._update_count
        self._point_states(synced=False)  # torchmetrics' reset rebound them to fresh tensors

    def _move_extras(self, device: torch.device) -> None:
        metric = self._torchmetrics
        intact = self._pointed is not None and not self._states_replaced()
        metric.to(device)  # its non-state buffers; the states live in the arena
        if intact:
            # torchmetrics' to() rebinds every state attribute (moved copies): the wrapper's
            # own doing, not a change behind its back. States replaced before it stay
            # refused at the next call.
            pointed = tuple(getattr(metric, name) for name, _ in self._bridged)
            object.__setattr__(self, "_pointed", pointed)

    def _states_replaced(self) -> bool:
        """Whether a state attribute holds another tensor than the wrapper left there."""
        if self._pointed is None:
            return False
        metric = self._torchmetrics
        return any(
            getattr(metric, name) is not pointed
            for (name, _), pointed in zip(self._bridged, self._pointed, strict=True)
        )


# Settings of torchmetrics' Metric and nn.Module that say nothing of what the states mean.
_NOT_CONFIGURATION = frozenset(
    {
        "training",
        "compute_on_cpu",
        "dist_sync_on_step",
        "process_group",
        "dist_sync_fn",
        "distributed_available_fn",
        "sync_on_compute",
        "compute_with_cache",
        "validate_args",
    }
)


def _configuration_text(metric: TorchmetricsBase) -> str:
    """``metric``'s class and settings (threshold, num_classes, average, its buffers) in words.

    Its public attributes of plain values: torchmetrics keeps its constructor's arguments so.
    """
    parts = []
    for key, value in sorted(_public_settings(metric)):
        if _plain(value):
            parts.append(f"{key}={value!r}")
        elif _holds_settings(value):
            parts.append(f"{key}={_settings_text(value)}")
    for key, buffer in sorted(metric._buffers.items()):
        if buffer is not None and key not in metric._defaults:
            values = buffer.detach().cpu().reshape(-1).tolist()
            parts.append(
                f"{key}=<{buffer.dtype} {tuple(buffer.shape)} {stable_hash(repr(values))}>"
            )
    return f"{type(metric).__module__}.{type(metric).__qualname__}({', '.join(parts)})"


def _holds_settings(value: object) -> bool:
    """Whether ``value`` is a torchmetrics helper object that keeps settings (a tokenizer).

    SacreBLEU's ``lowercase`` and ``tokenize`` live in its tokenizer, not in the metric.
    """
    return (
        type(value).__module__.startswith("torchmetrics.")
        and hasattr(value, "__dict__")
        and not isinstance(value, torch.nn.Module | Tensor | type | enum.Enum)
        and not inspect.isroutine(value)
    )


def _settings_text(value: object) -> str:
    """``Class(setting=value, ...)``: its plain attributes, and its functions by name."""
    parts = []
    for key, item in sorted(vars(value).items()):
        if key.startswith("_"):
            continue
        if _plain(item):
            parts.append(f"{key}={item!r}")
        elif callable(item) and hasattr(item, "__qualname__"):
            parts.append(f"{key}={item.__qualname__}")  # tokenize="13a": _tokenize_13a
    return f"{type(value).__qualname__}({', '.join(parts)})"


_MISSING = object()


def _frozen(value: object) -> object:
    """``value`` with its lists as tuples: a snapshot a later in-place change cannot reach."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(item) for item in value)
    return value


def _public_settings(metric: TorchmetricsBase) -> Iterator[tuple[str, object]]:
    """``metric``'s public attributes that may be settings: not states, not sync options."""
    for key, value in vars(metric).items():
        if key.startswith("_") or key in _NOT_CONFIGURATION or key in metric._defaults:
            continue
        yield key, value


def _settings(metric: TorchmetricsBase) -> dict[str, object]:
    """The plain settings ``_configuration_text`` describes, as a snapshot."""
    return {key: _frozen(value) for key, value in _public_settings(metric) if _plain(value)}


def _changed_setting(metric: TorchmetricsBase, settings: dict[str, object]) -> str | None:
    """``"name changed from a to b"`` for the first setting not as in ``settings``, if any."""
    for key, before in settings.items():
        now = _frozen(metric.__dict__.get(key, _MISSING))
        if not _same(now, before):
            shown = "<deleted>" if now is _MISSING else repr(now)
            return f"{key!r} changed from {before!r} to {shown}"
    return None


def _may_carry_data(value: object) -> bool:
    """Whether an attribute's value may be data an update keeps (a count, samples)."""
    if isinstance(value, bool):
        return False
    return isinstance(
        value, int | float | complex | Tensor | np.ndarray | list | tuple | dict | set | deque
    )


def _fingerprint(value: object) -> object:
    """What tells a later in-place change of ``value`` (a tensor by identity and version)."""
    if isinstance(value, Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, np.ndarray):
        return ("array", id(value), value.shape, value.tobytes())
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _fingerprint(v)) for k, v in value.items()))
    if isinstance(value, list | tuple | deque):
        return (type(value).__name__, tuple(_fingerprint(item) for item in value))
    if isinstance(value, set):
        return ("set", frozenset(value))
    if isinstance(value, float) and value != value:
        return ("nan",)
    return ("value", id(value)) if value is _MISSING else ("value", value)


def _empty_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The shapes of a batch of no rows, in words, or None for one with rows.

    Empty: every tensor argument of one dimension or more has 0 rows, and there is one
    (scalar tensors, such as a weight, and non-tensor arguments do not count).
    """
    batched = [
        value
        for value in (*args, *kwargs.values())
        if isinstance(value, Tensor) and value.dim() > 0
    ]
    if not batched or any(value.shape[0] for value in batched):
        return None
    return "shapes " + ", ".join(str(tuple(value.shape)) for value in batched)


def _one_row(value: object) -> object:
    """A tensor of 0 rows as one row of zeros (same dtype and device); anything else as is."""
    if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == 0:
        return torch.zeros((1, *value.shape[1:]), dtype=value.dtype, device=value.device)
    return value


def _shown(value: object) -> str:
    """A short description of an attribute's value for an error message."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_DISTRIBUTION_OPTIONS = ("sync_on_compute", "dist_sync_on_step", "_to_sync")
"""torchmetrics' own sync options: all False while wrapped (sidestream syncs the states)."""


def _same(now: object, before: object) -> bool:
    """Equal, with NaN equal to NaN (a pickled copy holds another NaN object)."""
    if now is before or now == before:
        return True
    if isinstance(now, float) and isinstance(before, float):
        return now != now and before != before  # both NaN
    if isinstance(now, tuple) and isinstance(before, tuple) and len(now) == len(before):
        return all(_same(a, b) for a, b in zip(now, before, strict=True))
    return False


def _plain(value: object) -> bool:
    if isinstance(value, bool | int | float | str | None):
        return True
    return isinstance(value, tuple | list) and all(_plain(item) for item in value)
