"""Device-resident metric state: a local tensor and the synchronized copy a sync fills."""

from __future__ import annotations

import copy
import copyreg
import itertools
import math
import numbers
from typing import Any

import torch
from torch import Tensor
from torch.compiler import is_compiling

from sidestream._distributed import Group
from sidestream._reduce_op import ReduceOp
from sidestream._shapes import broadcasts_to
from sidestream.sync import SyncBatch, stable_hash

__all__ = ["Freshness", "MetricAccumulator", "ReduceOp"]


_SHARED_BUFFER_MAX = 256
"""The largest arena buffer (elements) compiled updates add into as a whole; see ``_bind``."""


_RAISES = itertools.count(1)


class Freshness:
    """Whether a metric's synchronized state is current: one flag, cleared by any update.

    Every state of a metric shares its metric's flag, so a metric that updates only some of its
    states after a sync computes from local state throughout, never from a mix.
    """

    pending = False
    """A sync started with ``async_op`` makes the flag current when waited on, unless cleared."""

    raised = 0
    """Changes, to a value it never had, whenever any flag of the process is set (current or
    pending): ``Arena.mark(False)`` skips its loop over a tree's flags when this is what it read
    before it last cleared them all, so the collector's reset per window does no work per
    metric. Written after the flag it announces, so a flag set while such a loop runs changes
    it after the loop read it, and the next reset looks again."""

    def __init__(self) -> None:
        self.current = False
        self.pending = False  # an instance attribute from the start: one guard shape compiled

    def stale(self) -> None:
        """Clear the flag, and a pending sync's claim to set it (an update happened).

        Eager, written only when set. Compiling, written without being read: a read is a guard
        on the flag's value, so each combination of set flags among the metrics a compiled step
        updates was a graph of its own (three metrics synced every 2, 3 and 5 steps reached the
        recompile limit of 8 at step 28, failing a ``fullgraph=True`` step). The write-back after
        each call costs no measurable time (CPU, 64 values: within 0.5 µs of 15 µs).
        """
        if is_compiling():
            self.current = False
            self.pending = False
            return
        if self.current:
            self.current = False
        if self.pending:
            self.pending = False

    def mark(self, current: bool) -> None:
        """Set the flag (a sync ended, or a reset or load); a pending sync's claim is dropped."""
        self.current = current
        self.pending = False
        if current:
            Freshness.announce()

    def expect(self) -> None:
        """Stale until ``settle``: a sync started now, and its results are not written yet."""
        self.current = False
        self.pending = True
        Freshness.announce()

    @staticmethod
    def announce() -> None:
        """Record that a flag was just set (see ``raised``); call it after setting the flag."""
        # next() on a count is atomic under the GIL: two threads never write the same value.
        Freshness.raised = next(_RAISES)

    def settle(self) -> None:
        """Current, if nothing made it stale since ``expect`` (the sync sent that state)."""
        if self.pending:
            self.mark(True)


_FILL_LIMITS = {dtype: torch.finfo(dtype).max for dtype in (torch.float16, torch.bfloat16)}
"""Past these, torch's fill into a state of the dtype gives inf without a word; a float32 fill
past its range raises by itself, as an int64 one does (so they cost the hot path nothing)."""


class MetricAccumulator:
    """One tensor of metric state, updated in place on its device.

    Updates touch only the local tensor: no communication and no host sync. A metric's ``sync``
    fills a separate synchronized copy with the reduction over all ranks, and ``value`` returns
    that copy until the next update or reset of the metric, and the local tensor otherwise.

    Inside a metric (``self._total = MetricAccumulator(...)`` or ``Metric.add_state``), the
    tensors are views into the metric tree's state arena once it is built (when the metric's
    ``__init__`` ends, and on ``to``): one flat buffer per dtype (all in one block per device),
    so reset and staging cost one copy, and the sync one pack per dtype, not one per state.

    Args:
        initial: Where every rank starts: 0 for a sum (a non-zero start would be added once
            per rank), the identity or a floor for a max or min (-inf, ...). Its shape and
            dtype are the state's shape and dtype; a Python float gives a float64 state, an
            int an int64 one.
        op: How updates and ranks are combined.
        dtype: Optional dtype to convert ``initial`` to.

    Raises:
        TypeError: If ``op``, ``initial`` or ``dtype`` is of the wrong type, or complex.
        ValueError: If ``initial`` is empty, a SUM state's is not 0, or ``dtype`` cannot hold
            it (-1 in uint8, 0.7 or -inf in int64, 1e5 in float16).

    Example:
        >>> acc = MetricAccumulator(torch.zeros(3))
        >>> acc.accumulate(torch.tensor([1.0, 2.0, 3.0]))
        >>> acc.value
        tensor([1., 2., 3.])
    """

    def __init__(
        self,
        initial: Tensor | float | int | bool,
        op: ReduceOp = ReduceOp.SUM,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(op, ReduceOp):
            raise TypeError(f"op: expected a sidestream.state.ReduceOp, got {op!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype or None, got {dtype!r}")
        floats = _python_floats(initial)
        if dtype is None and floats:
            dtype = torch.float64  # a sum kept in float32 drifts
        try:
            # Python floats as float64, so a check below sees the number given.
            source = torch.as_tensor(initial, dtype=torch.float64 if floats else None).detach()
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(
                f"initial: expected a tensor or a number (the state's starting value), got "
                f"{initial!r}"
            ) from error
        initial_tensor = source
        if dtype is not None and source.dtype != dtype and not source.is_complex():
            # A conversion that wraps (-1 into uint8 is 255) or truncates (0.7 into int64 is 0)
            # would start the state somewhere else, silently, as an update must not either.
            _check_representable(source, dtype)
            initial_tensor = source.to(dtype)
        if initial_tensor.numel() == 0:
            # torchmetrics' list states (add_state("preds", [], "cat")) have no counterpart: a
            # state has a fixed shape. An empty one would be synced and saved as nothing.
            raise ValueError(
                f"initial: a state holds a fixed shape of values, got an empty {initial!r}; to "
                "keep samples, override sync (see 'A metric whose state cannot be reduced' in "
                "docs/metrics.md)"
            )
        if initial_tensor.is_complex():
            raise TypeError(
                f"initial: complex states are not supported, got {initial_tensor.dtype}"
            )
        if op is ReduceOp.SUM and bool(initial_tensor.ne(0).any()):
            # Every rank starts from it, so a sync (and a resharded load) would add it once per
            # rank: the world size would change the result.
            raise ValueError(
                "initial: a SUM state starts at 0 (every rank adds its initial value into the "
                f"sum, so it would count once per rank); got {initial_tensor.tolist()}"
            )
        self._op = op
        # A bool, not the enum: under torch.compile the same ReduceOp member reached through two
        # states costs an identity guard (evaluated in Python) on every call.
        self._sums = op is ReduceOp.SUM
        self._maxes = op is ReduceOp.MAX  # as _sums, for accumulate
        self._freshness = Freshness()
        self._owned = False
        self._arena: Any = None  # the state arena holding this state's views (or None)
        # What this state's values mean something only with, in words ("" for nothing): a
        # constant's value (see ``constant``), a classification problem. The structure check
        # compares it across ranks.
        self._configuration = ""
        # The dtype a constant is compared in (see ``constant``); None for a state that counts.
        self._compared_as: torch.dtype | None = None
        # Contiguous copies whatever the layout given (a transposed initial value): the state's
        # flat views need one.
        with torch.inference_mode(False):  # normal tensors, wherever made: see normal_tensor
            initial_tensor = initial_tensor.clone(memory_format=torch.contiguous_format)
            self._bind(
                initial_tensor.clone(),
                initial_tensor.clone(),
                torch.empty_like(initial_tensor),
            )

    @classmethod
    def constant(
        cls,
        value: Tensor | float | int,
        *,
        dtype: torch.dtype | None = None,
        compared_as: torch.dtype | None = None,
    ) -> MetricAccumulator:
        """A configuration value kept with a metric's state and checked to agree on every rank.

        For what the other states mean something only with: histogram bins, a shift subtracted
        before summing. It is saved in ``state_dict`` with them (a metric can refuse a
        checkpoint of another value in ``_upgrade_state_dict``), reduced as the MAX of equal
        values, and the first sync of its structure over a group (a blocking check that runs
        anyway) raises ``RankMismatchError`` on every rank if ranks hold different values,
        instead of reducing counts of different bins into one.

        Args:
            value: The constant; its shape and dtype are the state's.
            dtype: Optional dtype to convert ``value`` to.
            compared_as: The dtype ranks compare it in, if coarser than the state's (bin edges
                that float32 scores are binned by: float32).

        Example:
            >>> edges = MetricAccumulator.constant(torch.tensor([0.0, 0.5, 1.0]))
            >>> edges.op
            <ReduceOp.MAX: 'max'>
        """
        state = cls(value, ReduceOp.MAX, dtype=dtype)
        state._compared_as = state.dtype if compared_as is None else compared_as
        state._configuration = _describe_constant(state._initial.to(state._compared_as))
        return state

    def set_configuration(self, text: str) -> None:
        """Say, in words, what this state's values mean something only with.

        A classification problem (threshold, top-k...), a wrapped metric's settings. The
        structure check compares it across ranks (``RankMismatchError`` naming both), and the
        metric's ``state_dict`` saves a hash of it as ``configuration``, which
        ``load_state_dict`` compares. Not for constants, whose value says it already.
        """
        if self._compared_as is not None:
            raise ValueError("set_configuration: a constant's configuration is its value")
        self._configuration = text

    def _check_saved_constant(self, key: str, saved: Tensor) -> None:
        """Raise ``ValueError`` if ``saved`` is not this constant's value (or shape).

        Compared in the constant's ``compared_as`` dtype, as ranks compare it.
        """
        assert self._compared_as is not None  # called for constants only
        own = self._initial.detach().cpu().to(self._compared_as)
        theirs = saved.detach().cpu().to(self._compared_as)
        if not torch.equal(theirs, own):
            # Another shape is not a value that changed: the metric that saved it has another
            # size (outputs, classes, bins), which is what the user changed.
            why = (
                f"; shape {tuple(theirs.shape)} against this one's {tuple(own.shape)}: a "
                "metric of another size (outputs, classes, bins) saved it"
                if theirs.shape != own.shape
                else "; the other states mean something only with their own value"
            )
            raise ValueError(
                f"state_dict[{key!r}]: saved with {_describe_constant(theirs)}, this metric has "
                f"{_describe_constant(own)}{why}, so load the checkpoint into a metric "
                "configured the same"
            )

    def _bind(self, local: Tensor, initial: Tensor, synced: Tensor) -> None:
        """Point the state at new tensors (its own, or views into an arena)."""
        self._local = local
        self._initial = initial
        self._synced = synced
        # Groups this stand-alone state's structure was checked over (by id): its first sync
        # over a group checks, later ones do not (every rank makes the same calls).
        self._checked_groups: frozenset[int] = frozenset()
        # Updates write through a 1-D view: torch 2.13 loses in-place updates of 0-dim tensors
        # (and 0-dim views) inside compiled graphs on CPU; shape (1,) is safe.
        self._target = local.view(1) if local.dim() == 0 else local
        # add_product's flat view, made once: a view per update costs as much as a small op.
        self._flat = self._target.view(-1)
        # Metadata an update reads, kept off the tensors: torch.compile guards every tensor an
        # update touches, and a 0-dim float one costs a host read per call (a NaN guard).
        self._dtype = local.dtype
        self._device = local.device
        self._kind = _kind(local.dtype)
        # Compiled SUM updates add into a slice of the whole buffer (the arena's, shared by the
        # metric's states of this dtype): one graph input for all those states instead of one
        # each (every input costs a guard, an aliasing check and a size assert per call). Only
        # a small buffer: the compiled graph writes the whole of it back on every call.
        base: Tensor | None = local._base
        self._buffer: Tensor = self._flat
        if (
            base is not None
            and base.dim() == 1
            and base.is_contiguous()
            and base.numel() <= _SHARED_BUFFER_MAX
        ):
            self._buffer = base
        # Compared, where an identity check of the buffers would be a guard run in Python on
        # every compiled call (accumulate_sums).
        self._buffer_key = id(self._buffer)
        self._start = local.storage_offset() - self._buffer.storage_offset()
        self._stop = self._start + local.numel()
        # None for a 1-D state (the slice has its shape already): guarding a shape costs more.
        self._shape = None if self._target.dim() == 1 else tuple(self._target.shape)
        self._local_shape = tuple(local.shape)

    def __getstate__(self) -> dict[str, Any]:
        # Pickle copies each tensor on its own, so the views into one buffer (the arena's, and
        # the state's own 1-D view) would come back as unrelated copies that updates, compute
        # and checkpoints no longer share. Keep the three tensors whole; __setstate__ makes
        # the views again. (deepcopy keeps views as views: see __deepcopy__.)
        state = {key: value for key, value in self.__dict__.items() if key not in _VIEWS}
        state.update(
            _local=self._local.clone(),
            _initial=self._initial.clone(),
            _synced=self._synced.clone(),
            _arena=None,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickled by an earlier version, without these.
        state.setdefault("_configuration", "")
        # A constant of an earlier version: the MAX state with a configuration text.
        constant = state["_op"] is ReduceOp.MAX and bool(state["_configuration"])
        state.setdefault("_compared_as", state["_initial"].dtype if constant else None)
        state.setdefault("_maxes", state["_op"] is ReduceOp.MAX)
        self.__dict__.update(state)
        # Unpickled inside torch.inference_mode(): inference tensors, which updates outside it
        # could not write in place.
        self._bind(*(normal_tensor(state[key]) for key in ("_local", "_initial", "_synced")))

    def __deepcopy__(self, memo: dict[int, Any]) -> MetricAccumulator:
        copied: MetricAccumulator = copy_keeping_views(self, memo)
        return copied

    def __copy__(self) -> MetricAccumulator:
        copied: MetricAccumulator = copy_sharing(self)  # the same tensors, as before pickling
        return copied

    @property
    def op(self) -> ReduceOp:
        """The reduction this state uses."""
        return self._op

    @property
    def initial(self) -> Tensor:
        """The identity value the state starts from and returns to on ``reset``."""
        return self._initial

    @property
    def local(self) -> Tensor:
        """This rank's accumulated state (not reduced)."""
        if is_compiling():  # a view made in the graph, as for writes: see _span
            return self._span().view(self._local_shape)
        return self._local

    @property
    def synced(self) -> Tensor | None:
        """The state reduced over all ranks by the last sync, or ``None`` when stale."""
        return self._synced if self._freshness.current else None

    @property
    def value(self) -> Tensor:
        """The synchronized state if the metric's last sync is current, else the local state."""
        return self._synced if self._freshness.current else self._local

    @property
    def device(self) -> torch.device:
        """The device the state lives on."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The state's dtype."""
        return self._dtype

    def accumulate(self, update: Tensor | float) -> None:
        """Combine ``update`` into the local state with this accumulator's op, in place.

        Args:
            update: A tensor broadcastable to the state's shape, on the state's device, or a
                number (Python or numpy; a float only for a floating-point state). A tensor
                that requires grad is detached: metric state never joins the autograd graph.

        Raises:
            TypeError: If ``update`` is neither, of a dtype the state cannot take without
                losing values (a float for an integer state, a complex one), or (MAX and MIN)
                an integer tensor of a wider dtype than the state's (a SUM adds it as torch's
                ``add_`` does, wrapping where the sum does not fit).
            ValueError: If a Python int does not fit the state's dtype.
        """
        if not isinstance(update, Tensor):
            update = self._number(update)
        if update.requires_grad:
            update = update.detach()
        if self._sums:
            # _refuse_lossy inlined (the hot path); add_'s own error is a RuntimeError.
            if update.dtype != self._dtype and _kind(update.dtype) > self._kind:
                raise self._cast_error(update)
            if is_compiling():  # _span inlined: the hot path of small compiled updates
                span = self._buffer[self._start : self._stop]
                span = span if self._shape is None else span.view(self._shape)
                span.add_(update)
            else:
                try:
                    self._target.add_(update)
                except RuntimeError as error:
                    raise self._update_error(update, error) from error
        elif (
            update.dtype != self._dtype
            and torch.promote_types(update.dtype, self._dtype) != self._dtype
        ):
            kind = _kind(update.dtype)
            # A bool max or min takes integers too: any nonzero is true.
            if kind > max(self._kind, _INTEGER):
                raise self._cast_error(update)
            if kind == self._kind == _INTEGER:
                # .to() would wrap: an int32 40000 becomes an int16 -25536, a max never taken.
                raise TypeError(
                    f"update: a {update.dtype} update into this {self._dtype} "
                    f"{self._op.name} state could wrap around; convert it first where its "
                    "values fit, or declare a wider state"
                )
            # out= may not narrow a type. A narrower update (float32 into a float64 state, an
            # int into a bool one: any nonzero is true) needs no copy: maximum/minimum promote
            # it exactly as .to() would.
            self.accumulate(update.to(self._dtype))
            return
        else:
            extremum = torch.maximum if self._maxes else torch.minimum  # NaN propagates
            if is_compiling():
                target = self._span()
                extremum(target, update, out=target)
            else:
                try:
                    extremum(self._target, update, out=self._target)
                except RuntimeError as error:
                    raise self._update_error(update, error) from error
        self._freshness.stale()

    def _refuse_lossy(self, value: Tensor, argument: str) -> None:
        """Raise ``TypeError`` naming ``argument`` if the state's dtype would lose its values."""
        if value.dtype != self._dtype and _kind(value.dtype) > self._kind:
            raise self._cast_error(value, argument)

    def _cast_error(self, update: Tensor, argument: str = "update") -> TypeError:
        """An update whose dtype this state cannot take without losing values."""
        if update.is_floating_point() and self._kind < _FLOATING:
            # 2.7 would become a sum or max of 2, -2.7 a min of -2.
            how = "round it (ceil for a max, floor for a min) and convert it first"
            loss = "would be truncated"
        else:
            how, loss = "convert it first", "cannot be cast without losing values"
        return TypeError(
            f"{argument}: a {update.dtype} update into this {self._dtype} {self._op.name} state "
            f"{loss}; {how}, or declare a state of a dtype that holds it"
        )

    def _update_error(self, update: Tensor, error: RuntimeError) -> Exception:
        """What an update torch refused raises: ``ValueError`` naming shapes where they differ.

        torch names the state's internal 1-D view (``output with shape [1]``) for a 0-dim one.
        """
        shape, given = tuple(self._local.shape), tuple(update.shape)
        if broadcasts_to(given, shape):
            return error
        return ValueError(
            f"update: expected a tensor broadcastable to this state's shape {shape}, got shape "
            f"{given}"
        )

    def _add_unflagged(self, update: Tensor) -> None:
        """Add ``update`` into this SUM state, compiling, and leave the freshness flag alone.

        For a metric's counter whose own state adds come right after and clear the metric's
        one flag: clearing it through this state as well makes every compiled call check, in
        Python, that both states hold the same flag.
        """
        self._span().add_(update)

    def _span(self) -> Tensor:
        """The state as a slice of its buffer, shaped: where a compiled update writes.

        Not ``_target``: a view made outside the graph becomes a graph input of its own, and
        on a recompile with dynamic sizes (a second metric of another class count) torch gives
        its base's size a symbol it cannot trace back to any input, and fails. Reads of
        ``local`` in a compiled update (a shift) take the same view for the same reason.
        """
        span = self._buffer[self._start : self._stop]
        return span if self._shape is None else span.view(self._shape)

    def _number(self, update: object) -> Tensor:
        # d9d's accumulator took Python numbers too (``update(labels.numel())``). A fill, not a
        # copy from host memory, so a CUDA state gets no host-to-device transfer.
        state = self._target
        if type(update) is float and self._dtype == torch.float64 and is_compiling():
            # torch.full would make the float a constant of the graph, compiled again for every
            # value (a learning rate) up to the recompile limit; added to a tensor it stays a
            # graph input (see _validation.compiled_number). Exact in float64.
            return torch.zeros((), dtype=torch.float64, device=self._device) + update
        if type(update) is int or type(update) is float:  # the common case: no ABC checks
            integral_value = type(update) is int
        elif isinstance(update, numbers.Real):  # bool and numpy's scalars
            integral_value = isinstance(update, numbers.Integral)
        else:
            raise TypeError(
                "accumulate: update: expected a tensor or a Python number, got "
                f"{type(update).__name__}"
            )
        integral = not (state.is_floating_point() or state.is_complex())
        if integral and not integral_value:
            raise TypeError(
                f"accumulate: update: a float ({update}) for a {state.dtype} state; pass an int "
                "or a tensor"
            )
        value = int(update) if integral_value else float(update)  # type: ignore[arg-type]
        limit = _FILL_LIMITS.get(state.dtype)
        if limit is not None and limit < abs(value) < math.inf:  # an inf stays an inf
            # The fill would make it inf without a word (float32 and ints raise below).
            raise ValueError(f"accumulate: update: {update} does not fit a {state.dtype} state")
        try:
            return torch.full((), value, dtype=state.dtype, device=state.device)
        except (RuntimeError, OverflowError) as error:  # too large for the state's dtype
            raise ValueError(
                f"accumulate: update: {update} does not fit a {state.dtype} state"
            ) from error

    def scatter_add(self, index: Tensor, source: Tensor) -> None:
        """Add ``source`` into a one-dimensional SUM state at ``index`` (histograms, counts).

        Fixed-size and host-sync free, unlike ``bincount`` on CUDA.

        Args:
            index: int64 indices into the state, same shape as ``source``, each in
                ``[0, numel)``.
            source: The amounts to add.

        Raises:
            TypeError: If ``index`` is not an integer tensor, or ``source`` of a dtype the state
                cannot take without losing values (a float for an integer state).
            ValueError: If the state is not one-dimensional, ``source``'s shape differs from
                ``index``'s, or (CPU, not compiling:
                read on the host) an index is outside ``[0, numel)``, before the state changes.
                On CUDA indices are not read back (that would stall the host): keep them in
                range.
        """
        if not self._sums:
            raise ValueError(f"scatter_add needs a SUM accumulator, this one is {self._op.name}")
        if self._local.dim() != 1:
            raise ValueError(
                "scatter_add needs a one-dimensional state, this one has shape "
                f"{tuple(self._local.shape)}"
            )
        if tuple(index.shape) != tuple(source.shape):
            raise ValueError(
                f"scatter_add: source: expected index's shape {tuple(index.shape)}, "
                f"got {tuple(source.shape)}"
            )
        if index.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"scatter_add: index: expected an int64 (or int32) tensor, got {index.dtype}"
            )
        flat = index.reshape(-1)
        size = self._target.shape[0]
        if flat.numel() and flat.device.type == "cpu" and not is_compiling():
            low, high = (bound.item() for bound in torch.aminmax(flat))
            if low < 0 or high >= size:
                raise ValueError(
                    f"scatter_add: index: expected values in [0, {size}), got values in "
                    f"[{low}, {high}]"
                )
        self.add_at(flat, source.reshape(-1))

    def add_at(self, index: Tensor, source: Tensor) -> None:
        """``scatter_add`` of flat, trusted indices (the built-in metrics make them in range).

        Args:
            index: 1-D int64 indices, each in ``[0, numel)``: not checked.
            source: 1-D amounts, ``index``'s length.

        Raises:
            TypeError: If ``source`` has a dtype the state cannot take without losing values.
        """
        if source.requires_grad:
            source = source.detach()
        self._refuse_lossy(source, "source")  # .to() would truncate 2.7 to 2
        target = self._span() if is_compiling() else self._target
        target.index_add_(0, index, source.to(self._dtype))
        self._freshness.stale()

    def mark_changed(self) -> None:
        """Record that ``local`` was changed in place by other means (a numpy view of it).

        As every update does: the synchronized value is no longer current.
        """
        self._freshness.stale()

    def add_product(self, matrix: Tensor, vector: Tensor) -> None:
        """Add ``matrix @ vector`` into a SUM state, flattened (row-major), in place.

        One ``addmv_`` instead of a product and an ``add_`` (small CPU updates are dominated by
        per-op dispatch). Integer dtypes are fine on CPU; CUDA has no integer ``addmv``.

        Args:
            matrix: ``(state numel, K)``, the state's dtype.
            vector: ``(K,)``, the state's dtype.
        """
        if not self._sums:
            raise ValueError(f"add_product needs a SUM accumulator, this one is {self._op.name}")
        if matrix.requires_grad or vector.requires_grad:
            matrix, vector = matrix.detach(), vector.detach()
        flat = self._buffer[self._start : self._stop] if is_compiling() else self._flat
        flat.addmv_(matrix, vector)
        self._freshness.stale()

    def sync(self, group: Group = None) -> None:
        """Reduce a stand-alone accumulator over ``group`` into its synchronized copy.

        For accumulators used on their own. A metric's states are synced by ``Metric.sync``,
        all together (one flag says whether they are current), so this raises for them.

        Args:
            group: A process group, a 1-D device mesh, or ``None`` for the default group.

        Raises:
            RuntimeError: If the accumulator belongs to a metric.
        """
        if self._owned:
            raise RuntimeError(
                "MetricAccumulator.sync: this state belongs to a metric; call the metric's sync"
            )
        batch = SyncBatch()
        part = ("state", tuple(self._local.shape), self._configuration)
        batch.add(self, group, self._synced, name="state", parts=(part,))
        checked = id(group) in self._checked_groups
        batch.program(check=not checked).start()
        if not checked:
            self._checked_groups |= {id(group)}
        self._freshness.mark(True)

    def reset(self) -> None:
        """Return the local state to its initial value (the metric's sync becomes stale)."""
        self._local.copy_(self._initial)
        self._freshness.stale()

    def to(self, device: torch.device | str) -> MetricAccumulator:
        """Move a stand-alone accumulator to ``device`` and return ``self``.

        A metric's states move with ``Metric.to`` (which rebuilds the arena).
        """
        with torch.inference_mode(False):  # moved inside inference mode: see normal_tensor
            self._bind(self._local.to(device), self._initial.to(device), self._synced.to(device))
        if self._arena is not None:
            self._arena.alive = False  # this state is no longer a view into it
        return self

    def load_local(self, value: Tensor) -> None:
        """Overwrite the local state with ``value`` (same shape) and mark the sync stale.

        Raises:
            ValueError: If ``value`` does not have the state's shape.
            TypeError: If ``value``'s dtype would lose values in the state's (a float for an
                integer state).
        """
        if tuple(value.shape) != tuple(self._local.shape):
            raise ValueError(
                f"state_dict: expected a tensor of shape {tuple(self._local.shape)}, "
                f"got {tuple(value.shape)}"
            )
        self._refuse_lossy(value, "value")  # copy_ would truncate 2.7 to 2
        self._local.copy_(value.detach())
        self._freshness.stale()

    def __repr__(self) -> str:
        return (
            f"MetricAccumulator(op={self._op.name}, shape={tuple(self._local.shape)}, "
            f"dtype={self._local.dtype}, device={self._local.device})"
        )


_VIEWS = frozenset(
    {
        "_local",
        "_initial",
        "_synced",
        "_target",
        "_flat",
        "_buffer",
        "_start",
        "_stop",
        "_shape",
        "_local_shape",
        "_checked_groups",
    }
)
"""What ``MetricAccumulator._bind`` derives: left out of a pickle and made again on load."""


def normal_tensor(tensor: Tensor) -> Tensor:
    """``tensor``, or a normal copy of it if it is an inference tensor.

    State made under ``torch.inference_mode()`` (a metric built or first used in an evaluation
    function decorated with it) would be inference tensors, which no in-place op may write
    outside inference mode: the first training update after validation would fail. So every
    state, arena and sync buffer is made with ``torch.inference_mode(False)``, which makes
    normal tensors; those may be written in place in either mode, so updates pay nothing.
    """
    if not tensor.is_inference():
        return tensor
    with torch.inference_mode(False):
        return tensor.clone()


def accumulate_sums(
    states: tuple[MetricAccumulator, ...], sums: Tensor | tuple[Tensor, ...]
) -> None:
    """``states[i].accumulate(sums[i])`` for scalar SUM states, in one add where it can be.

    States declared one after another with the same dtype lie next to each other in the
    arena, so a 1-D ``sums`` of their dtype is added into that range at once: on CUDA each
    ``add_`` is a kernel launch, the host cost of a small update. Otherwise (states elsewhere,
    another dtype) each state accumulates its element as usual.

    A tuple of 0-dim sums (``stacked_sums`` when compiling) is added one by one: the compiler
    fuses those adds, while a stacked tensor would cost a compiled call a buffer and an alias
    of it per state.
    """
    if isinstance(sums, tuple):
        first = states[0]
        if _one_run(states):
            # Every sum into the first state's buffer, and the metric's one flag cleared once:
            # read through each state, the buffer and the flag would each cost every compiled
            # call a guard run in Python that they are the same objects.
            buffer, start = first._buffer, first._start
            for index, value in enumerate(sums):
                if value.dtype != first._dtype and _kind(value.dtype) > first._kind:
                    raise first._cast_error(value)
                value = value.detach() if value.requires_grad else value
                buffer[start + index : start + index + 1].add_(value)
            first._freshness.stale()
            return
        for state, value in zip(states, sums, strict=True):
            state.accumulate(value)
        return
    first, last = states[0], states[-1]
    if (
        sums.dtype == first._dtype
        and not sums.requires_grad
        and len(states) == sums.numel()
        # Offsets, not the tensors: a compiled update guards every tensor it reads.
        and all(
            state._sums
            and state._buffer is first._buffer
            and state._start == first._start + index == state._stop - 1
            for index, state in enumerate(states)
        )
    ):
        first._buffer[first._start : last._stop].add_(sums)
        for state in states:
            state._freshness.stale()
        return
    for index, state in enumerate(states):
        state.accumulate(sums[index])


def _one_run(states: tuple[MetricAccumulator, ...]) -> bool:
    """Whether ``states`` are scalar SUM states one after another in one buffer.

    States of one metric, so they share its freshness flag. By keys and offsets (ints, which a
    compiled call guards in C++), not by the tensors themselves.
    """
    first = states[0]
    return all(
        state._sums
        and state._buffer_key == first._buffer_key
        and state._start == first._start + index == state._stop - 1
        for index, state in enumerate(states)
    )


def stacked_sums(*sums: Tensor) -> Tensor | tuple[Tensor, ...]:
    """0-dim sums as ``accumulate_sums`` and ``drop_invalid`` take them best.

    Eager, one 1-D tensor: one fill and one add for all of them (each a kernel launch on CUDA).
    Compiling, the tuple itself: the compiler fuses the per-state work, and a stack would be
    one more buffer, with an alias of it per state, in every compiled call (about 1 µs on CPU).
    """
    return sums if is_compiling() else torch.stack(sums)


def _describe_constant(value: Tensor) -> str:
    """A constant's value in words: short ones whole, long ones by ends, count and hash."""
    flat = value.detach().cpu().reshape(-1)
    values = flat.tolist()
    if len(values) <= 6:
        return repr([_shortest(v, flat.dtype) for v in values])
    first, second, last = (_shortest(values[i], flat.dtype) for i in (0, 1, -1))
    digest = stable_hash(repr(values)) & (2**64 - 1)
    return f"{len(values)} values [{first}, {second}, ..., {last}] (hash {digest:016x})"


def _shortest(value: object, dtype: torch.dtype) -> object:
    """A float32 value as the shortest decimal that is the same float32 (0.2, not 0.2000000029)."""
    if dtype != torch.float32 or not isinstance(value, float):
        return value
    for digits in range(6, 10):
        short = float(f"{value:.{digits}g}")
        if torch.tensor(short, dtype=torch.float32).item() == value:
            return short
    return value


def _check_representable(values: Tensor, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless every one of ``values`` converts to ``dtype`` unchanged.

    Floating-point targets only refuse a finite value that overflows (rounding is a float's
    nature); integer and bool targets refuse anything that would wrap, truncate or clip.
    """
    shown = values.tolist() if values.numel() <= 6 else f"{values.numel()} values"
    if dtype.is_floating_point:
        finite = (
            torch.isfinite(values)
            if values.is_floating_point()
            else torch.ones_like(values, dtype=torch.bool)
        )
        if bool((finite & ~torch.isfinite(values.to(dtype))).any()):
            raise ValueError(
                f"initial: {shown} overflows {dtype} (largest finite "
                f"{torch.finfo(dtype).max:g}); pass a wider dtype"
            )
        return
    if dtype == torch.bool:
        if not bool(((values == 0) | (values == 1)).all()):
            raise ValueError(f"initial: {shown} is not representable as bool (0 or 1 only)")
        return
    info = torch.iinfo(dtype)
    if values.is_floating_point():
        wide = values.double()  # info.max + 1 is exact in float64 where info.max is not
        fits = (wide >= info.min) & (wide < float(info.max + 1)) & (wide == wide.round())
    else:
        wide = values.to(torch.int64)
        fits = (wide >= info.min) & (wide <= min(info.max, 2**63 - 1))
    if not bool(fits.all()):
        hint = ""
        if values.is_floating_point() and not bool(torch.isfinite(wide).all()):
            hint = (
                f"; an integer MAX state starts at torch.iinfo({dtype}).min ({info.min}), a MIN "
                f"state at torch.iinfo({dtype}).max ({info.max})"
            )
        raise ValueError(
            f"initial: {shown} is not representable in {dtype} (integers in "
            f"[{info.min}, {info.max}]): converting would wrap, truncate or fail{hint}"
        )


def _python_floats(initial: object) -> bool:
    """Whether ``initial`` is a Python float, or (nested) lists or tuples with one among numbers."""
    leaves = _leaves(initial)
    numbers = all(isinstance(leaf, int | float) and not isinstance(leaf, bool) for leaf in leaves)
    return numbers and any(isinstance(leaf, float) for leaf in leaves)


def _leaves(value: object) -> list[object]:
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def copy_sharing(obj: Any) -> Any:
    """``copy.copy``'s own copy of ``obj``: a new object sharing every attribute's value."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    for key in _slot_names(obj):
        object.__setattr__(new, key, getattr(obj, key))
    return new


def _slot_names(obj: Any) -> list[str]:
    """The ``__slots__`` of ``obj``'s class (and bases) that ``obj`` has a value in."""
    names = copyreg._slotnames(type(obj))  # type: ignore[attr-defined]
    return [n for n in names if n not in ("__dict__", "__weakref__") and hasattr(obj, n)]


def copy_keeping_views(obj: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy``'s own copy of ``obj`` (attribute by attribute, views kept as views).

    For classes whose ``__getstate__`` serves pickling only: deepcopy shares tensor storages
    through its memo, so it need not give up the views that pickling must.
    """
    new = object.__new__(type(obj))
    memo[id(obj)] = new
    # Over a snapshot of the attributes: a close run inside the copy on this thread (a signal
    # handler's, during schedule_collection's copy into a new slot) takes a key out of a
    # metric's __dict__, and a checkpoint on another thread adds one; iterated live, the copy
    # failed with "dictionary changed size during iteration".
    for key, value in list(obj.__dict__.items()):
        object.__setattr__(new, key, copy.deepcopy(value, memo))
    for key in _slot_names(obj):
        object.__setattr__(new, key, copy.deepcopy(getattr(obj, key), memo))
    return new


_BOOL, _INTEGER, _FLOATING, _COMPLEX = range(4)


def _kind(dtype: torch.dtype) -> int:
    """The kind of ``dtype``, in order: bool, integer, floating, complex.

    An update of a higher kind loses values in a state of a lower one: ``torch.can_cast``'s
    rule, which torch.compile cannot trace.
    """
    if dtype == torch.bool:
        return _BOOL
    if dtype.is_complex:
        return _COMPLEX
    return _FLOATING if dtype.is_floating_point else _INTEGER
