"""The ``Metric`` interface every sidestream metric implements."""

from __future__ import annotations

import abc
import collections
import contextlib
import contextvars
import functools
import inspect
import json
import math
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import FunctionType, MappingProxyType, MemberDescriptorType
from typing import Any, Generic, Self, TypeVar

import torch
import torch.distributed as dist

from sidestream._arena import Arena
from sidestream._dcp_guard import refuse_dcp_pickle, under_dcp
from sidestream._digest import checkpoint_digest
from sidestream._distributed import (
    Group,
    check_cuda_available,
    check_device,
    check_process_group,
    default_group,
    group_rank,
    group_ranks,
    resolve_device,
    resolve_group,
)
from sidestream._eager import host_call
from sidestream._reduce_op import ReduceOp
from sidestream._samples import SampleStore, SavedRows, gather_rows
from sidestream._step import training_step
from sidestream.state import Freshness, MetricAccumulator, copy_keeping_views, copy_sharing
from sidestream.sync import (
    CallFingerprint,
    RankMismatchError,
    StatePart,
    SyncBatch,
    SyncHandle,
    SyncProgram,
    check_same_call,
    settings_part,
    stable_hash,
)

__all__ = ["CallCounter", "Metric", "has_own_sync"]

# Covariant: T is only what compute() returns, so a MeanMetric (a Metric[Tensor]) is also a
# Metric[Tensor | dict[str, Tensor]] or a Metric[object] to a function that takes any metric.
T = TypeVar("T", covariant=True)

_Child = MetricAccumulator | Any  # a state or a child Metric


class CallCounter:
    """Numbers a metric's collective calls; shared with its copies (``clone_metric``).

    Every rank makes the same calls in the same order, so the numbers agree across ranks and go
    into each call's fingerprint: a rank that skipped or added a call is caught.
    """

    def __init__(self) -> None:
        self.count = 0

    def next(self) -> int:
        """The next call's number."""
        self.count += 1
        return self.count


@dataclass
class _Prepared:
    """A metric's laid-out sync over one group, valid while the arena of its states lives."""

    group: Group
    arena: Arena | None
    every_state: SyncProgram
    batched: SyncProgram
    own_sync: list[Metric[Any]] = field(default_factory=list)
    #: No metric of the tree has its own ``sync`` or sample stores: ``start_sync`` covers it.
    arena_only: bool = True
    #: For ``group=None``: the default group the layout was made for (one made again, say with
    #: another world size, is another group). Weak: a reference kept past
    #: ``destroy_process_group`` runs gloo's destructor at exit, which aborts the process.
    default_at_layout: weakref.ref[dist.ProcessGroup] | None = None
    #: The last ``start_sync(async_op=True)`` of this layout: until it is waited on, its
    #: results are still in the layout's buffers, which a checkpoint's reduction reuses.
    in_flight: SyncHandle | None = None


def _finish_in_flight(prepared: _Prepared) -> None:
    """Wait on the layout's last ``start_sync`` if nobody has yet, before its buffers are reused.

    Its results are unpacked from the layout's buffers at its wait, and another start (a second
    ``start_sync``, a checkpoint's reduction) writes those buffers: that wait would unpack the
    later reduction instead, and on gloo the first collective could send the later payload
    (reported as a rank mismatch, though the ranks called alike). A local step on every rank
    (the collectives were issued); the handle's own ``wait`` is then a no-op.
    """
    in_flight, prepared.in_flight = prepared.in_flight, None
    if in_flight is not None and in_flight.pending:
        in_flight.wait()


class Metric(Generic[T], abc.ABC):
    """A metric whose state lives on the device and reduces linearly across ranks.

    Lifecycle: ``update`` any number of times (device ops only, no communication, no host
    sync), ``sync`` to reduce the state over the ranks of a group, ``compute`` to get the value
    (a tensor or a pytree of tensors), ``reset`` to start a new window.

    State is declared by name: ``self.add_state("total", 0.0)``, or by assigning a
    ``MetricAccumulator`` to an attribute (``self._total = MetricAccumulator(0.0)`` declares
    ``"total"``: the attribute name without its leading underscore). Child metrics assigned to
    attributes are part of the tree. A duplicate name raises, and so does a state or metric
    hidden in a list, tuple, set, dict or deque attribute, or in a ``collections`` wrapper
    (``UserList``, ``UserDict``, ``ChainMap``; it would be left out of sync, reset and
    checkpoints), when assigned, when ``__init__`` ends, and on ``to`` and ``state_dict``.
    The default ``sync``, ``reset``, ``to``, ``state_dict`` and ``load_state_dict`` work on the
    declared states, so a subclass usually implements only ``update`` and ``compute``.

    When ``__init__`` ends (and again on ``to``) every state of the tree becomes a view into the
    state arena: one flat buffer per dtype, all in one block of memory per device, so reset and
    collector staging cost one copy, and the sync's packing one per dtype, whatever the number
    of metrics.

    Checkpoints are world-size independent: on a multi-rank job ``state_dict`` is a collective
    that returns the globally reduced state (identical on every rank), and ``load_state_dict``
    puts that state on the group's first rank and the initial value on the others. Saving with
    4 ranks and loading with 2 (or 1) continues the same numbers.
    """

    _sync_group: Group = None

    @abc.abstractmethod
    def update(self, *args: Any, **kwargs: Any) -> None:
        """Add a batch to the local state. No communication and no host sync."""

    @abc.abstractmethod
    def compute(self) -> T:
        """Compute the value from the synchronized state if current, else the local state."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Only an __init__ of the class's own: one written into a class it merely inherits
        # would stop @dataclass (and the like) from generating one.
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _building_the_arena(init)  # type: ignore[method-assign]

    def __getstate__(self) -> Any:
        # Pickled (multiprocessing, Ray, a file) the arena's buffers would come back apart
        # from the states' views (see MetricAccumulator.__getstate__): leave the arena and the
        # sync layouts built on it out, and build them again on load. A process group cannot
        # be pickled (nor used in another process): the copy syncs over the default group.
        refuse_dcp_pickle(self, _DCP_NESTED_METRIC)
        state = super().__getstate__()  # the __dict__, with a subclass's __slots__ if any
        attributes, slots = state if isinstance(state, tuple) else (state, None)
        kept = {key: value for key, value in attributes.items() if key not in _NOT_PICKLED}
        return kept if slots is None else (kept, slots)

    def __setstate__(self, state: Any) -> None:
        # A checkpoint written before the check above (or by hand) holds one rank's pickle.
        refuse_dcp_pickle(self, _DCP_NESTED_METRIC)
        attributes, slots = state if isinstance(state, tuple) else (state, None)
        for key, value in (slots or {}).items():
            object.__setattr__(self, key, value)
        self.__dict__.update(attributes)
        # As at the end of __init__ (children come back first, then each parent's arena
        # replaces theirs): a compiled update never sees the states move later.
        self._own_arena()

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        group = self.__dict__.get("_sync_group")
        if group is not None:
            memo.setdefault(id(group), group)  # shared: a process group cannot be copied
        arena: Arena | None = self.__dict__.get("_state_arena")
        alone = arena is not None and arena.root is not self and id(arena.root) not in memo
        if alone:
            # A child copied without its tree: not a copy of the whole tree's arena (and
            # through its root, the tree), but a metric with an arena of its own.
            memo[id(arena)] = None
        for inner in self._walk_metrics():
            # Not copied: a laid-out sync writes its fingerprints through a NumPy view of its
            # send buffer, which a copy would make a separate array (the copy then sent its
            # first call's fingerprint forever), and pending syncs are the original's. The
            # copy lays out its own at its first sync.
            # Nor the container scan (the copy makes its own).
            pairs: tuple[tuple[str, Any], ...] = (
                ("_sync_layouts", {}),
                ("_unverified_syncs", []),
                ("_container_scan", None),
                ("_dcp_template", None),  # weak references to the original's DCP template
            )
            for private, empty in pairs:
                value = inner.__dict__.get(private)
                if value is not None:
                    memo.setdefault(id(value), empty)
        # Normal tensors even under torch.inference_mode() (a collector's slots made as it binds
        # in an evaluation function): inference ones could not be written in place outside it.
        with torch.inference_mode(False):
            copied: Self = copy_keeping_views(self, memo)
        copied.__dict__.pop("_bound_prefix", None)  # a copy belongs to no collector
        if alone:
            copied._own_arena()
        return copied

    def __copy__(self) -> Self:
        # Shares everything, as a shallow copy does: not __getstate__'s pickling copy, which
        # leaves the process group out and builds an arena of its own.
        copied: Self = copy_sharing(self)
        # Not the container scan: it names this metric's attributes, not the copy's.
        copied.__dict__.pop("_container_scan", None)
        return copied

    # ------------------------------------------------------------------ declaration

    def add_state(
        self,
        name: str,
        initial: torch.Tensor | float | int | bool,
        op: ReduceOp = ReduceOp.SUM,
        *,
        dtype: torch.dtype | None = None,
    ) -> MetricAccumulator:
        """Declare a state named ``name`` and return it (keep it in an attribute to update it).

        Args:
            name: The state's key in ``state_dict`` and sync error messages: unique in this
                metric, without ``.`` or ``/``.
            initial: Where every rank starts (0 for sums, -inf for a max); its shape is the
                state's, and its dtype unless ``dtype`` is given (a Python float gives float64,
                an int int64).
            op: How updates and ranks combine.
            dtype: Optional dtype for ``initial``.

        Raises:
            ValueError: If ``name`` is empty, has ``.`` or ``/``, or is already declared; if
                ``initial`` is empty, or a SUM state's is not 0 (each rank would add it into
                the sum).
            TypeError: If ``initial`` is not a tensor or a number, or ``dtype`` not a dtype.
        """
        try:
            state = MetricAccumulator(initial, op, dtype=dtype)
        except (TypeError, ValueError) as error:  # the message names the state and its metric
            raise type(error)(f"{type(self).__name__}.add_state({name!r}): {error}") from None
        self._declare(name, state, None)
        return state

    def __setattr__(self, attribute: str, value: Any) -> None:
        if attribute in _RESERVED:
            # The base class keeps its bookkeeping there: a subclass's own value (a state
            # named "_sync_group", a counter "_call_counter") broke it later, blaming another
            # cause.
            raise TypeError(
                f"{attribute}: a name the Metric base class keeps its own bookkeeping in; give "
                f"the {type(value).__name__} an attribute of another name"
            )
        if isinstance(value, _TREE_TYPES):
            if not self._holds_declared(value):
                self._refuse_shadowing(attribute, value)
                self._declare(attribute.lstrip("_"), value, attribute)
        else:
            self._refuse_replacing(attribute, value)
            if isinstance(value, _CONTAINERS):
                self._refuse_hidden(attribute, value)
                if not isinstance(self.__dict__.get(attribute), _CONTAINERS):
                    # A new container attribute: the tree's container scan is made again.
                    # Counted after the assignment (a scan made in between would keep the
                    # old attributes under the new count), and not for a container replacing
                    # one, which the scan finds by name already: a compiled update that
                    # assigns a list every call would guard on the count and recompile every
                    # call (fullgraph=True failed at the recompile limit).
                    object.__setattr__(self, attribute, value)
                    _count_tree_assignment()
                    return
        object.__setattr__(self, attribute, value)

    def __delattr__(self, attribute: str) -> None:
        current = self.__dict__.get(attribute)
        if isinstance(current, _TREE_TYPES) and self._holds_declared(current):
            # It would stay declared (synced, reset, in checkpoints) out of the code's reach.
            what = "state" if isinstance(current, MetricAccumulator) else "child metric"
            raise TypeError(
                f"{attribute}: holds a declared {what}; a deleted one would stay in sync, reset "
                "and checkpoints while update and compute could not reach it"
            )
        # super(), not object.__delattr__: dynamo traces the one and refuses the other
        # (a fullgraph-compiled update that deletes an attribute of its own).
        super().__delattr__(attribute)

    def _refuse_shadowing(self, attribute: str, value: _Child) -> None:
        """Raise ``TypeError`` for a state or child on a method's or property's name.

        Checked before anything is declared: the assignment would fail (a property without a
        setter) or hide the method after the state was already part of sync and checkpoints.
        """
        found = inspect.getattr_static(type(self), attribute, None)
        # A __slots__ member is a data descriptor too, but an attribute of the instance.
        if isinstance(found, FunctionType | staticmethod | classmethod) or (
            hasattr(type(found), "__set__") and not isinstance(found, MemberDescriptorType)
        ):
            raise TypeError(
                f"{attribute}: {type(self).__name__}.{attribute} is a method or property of "
                f"the metric; give the {type(value).__name__} an attribute of another name"
            )

    def _refuse_replacing(self, attribute: str, value: object) -> None:
        """Raise ``TypeError`` when ``value`` would replace a declared state or child metric.

        The declared one would stay in sync, reset and checkpoints while ``compute`` read the
        new value: ``self._total = self._total.value + x`` (torchmetrics' style) would log
        zeros through a collector and never reset.
        """
        registry: dict[str, tuple[str | None, _Child]] | None = self.__dict__.get("_declarations")
        if not registry:
            return
        name = attribute.lstrip("_")
        declared = registry.get(name)
        if declared is None or declared[0] != attribute:
            # A state from add_state kept in an attribute (``self._high = self.add_state(
            # "high", ...)``) is declared without one: look at what the attribute holds.
            # A loop, not next() over a generator: torch 2.8's dynamo cannot trace that (a
            # compiled update assigning an attribute).
            current = self.__dict__.get(attribute)
            for key, item in registry.items():
                if item[1] is current:
                    name, declared = key, item
                    break
            else:
                return
        what = "state" if isinstance(declared[1], MetricAccumulator) else "child metric"
        raise TypeError(
            f"{attribute}: holds the declared {what} {name!r}; assigning a "
            f"{type(value).__name__} would leave it out of sync, reset and checkpoints. Update "
            "a state in place (accumulate, scatter_add, ...) and read it with .value"
        )

    def _tree_ids(self) -> set[int]:
        """The ids of every metric and state of this tree.

        Any of them may be listed again elsewhere in it (a list of a child's states, say): only
        others are hidden.
        """
        ids = {id(metric) for metric in self._walk_metrics()}
        ids.update(id(state) for _, state in self.named_accumulators())
        return ids

    def _refuse_hidden_in_tree(self) -> None:
        """Raise ``TypeError`` if a container attribute holds an undeclared state or metric.

        Checked again when the arena is built, on ``to``, on every sync and on
        ``state_dict``, not only when an attribute is assigned: a container filled later
        (``self.sums = []``, then ``append``; an item replaced; a list inside a dict) would
        otherwise leave its states out of sync, reset and checkpoints.
        """
        scan: tuple[int, tuple[tuple[Metric[Any], str], ...]] | None = self.__dict__.get(
            "_container_scan"
        )
        if scan is None or scan[0] != _tree_assignments:
            # Which attributes of the tree hold containers changes only through an assignment
            # (__setattr__ counts those): a walk over every attribute of a composition of 256
            # metrics on every sync cost it about 300 µs.
            scan = (_tree_assignments, tuple(self._container_attributes()))
            object.__setattr__(self, "_container_scan", scan)
        for metric, attribute in scan[1]:
            value = metric.__dict__.get(attribute)  # its items are looked at every time
            if value is not None and _is_container_type(type(value)):
                self._refuse_hidden(attribute, value, metric)

    def _container_attributes(self) -> Iterator[tuple[Metric[Any], str]]:
        """``(metric, attribute)`` of each container attribute of the tree (not bookkeeping)."""
        for metric in self._walk_metrics():
            for attribute, value in vars(metric).items():
                if _is_container_type(type(value)) and attribute not in _BOOKKEEPING:
                    yield metric, attribute

    def _refuse_hidden(self, attribute: str, container: Any, holder: Any = None) -> None:
        """Raise ``TypeError`` for a state or metric in ``container`` that is not of this tree.

        ``holder``: the metric whose attribute it is; what that metric declared itself (a
        composition's dict of children) is found without a walk over the whole tree.
        """
        if not _may_hold_tree_objects(container):
            # Plain data (floats, strings, tensors): its item types, gathered in C, say so
            # without a walk in Python (a metric keeping 100k values in a list paid 76 ms per
            # sync). Not a cache of ids and lengths: a replaced item or a list inside a dict
            # changes neither.
            return
        declared = None if holder is None else holder._declared_ids()
        if declared is not None and declared.issuperset(map(id, _items(container))):
            return  # what the holder declared itself (a composition's dict of its children)
        found = list(_tree_objects(container))
        if declared is not None:
            # One set of ids, not a scan of the declarations per item: a composition of n
            # children otherwise paid n * n comparisons on every sync (1.6 ms at n = 256).
            found = [(item, box) for item, box in found if id(item) not in declared]
        if not found:  # plain data: no walk over the tree
            return
        ours = self._tree_ids()
        for item, holder in found:
            if id(item) not in ours:
                raise TypeError(
                    f"{attribute}: a {type(item).__name__} inside a {type(holder).__name__} "
                    "would be left out of sync, reset and checkpoints; declare each state with "
                    "add_state or its own attribute (child metrics: their own attribute, or a "
                    "ComposeMetric)"
                )

    def _holds_declared(self, value: Any) -> bool:
        registry: dict[str, tuple[str | None, _Child]] | None = self.__dict__.get("_declarations")
        if not registry:
            return False
        if isinstance(value, MetricAccumulator) and not getattr(value, "_owned", True):
            return False  # declared by no metric yet (``self._x = MetricAccumulator(...)``)
        # The state add_state just declared (``self._x = self.add_state(...)``) is the newest:
        # found without a set of every declaration, which made building a metric of k states
        # O(k * k) (1024 states: 0.5 M id() calls).
        if next(reversed(registry.values()))[1] is value:
            return True
        return id(value) in self._declared_ids()

    def _declared_ids(self) -> set[int]:
        registry: dict[str, tuple[str | None, _Child]] = self.__dict__.get("_declarations", {})
        return {id(item) for _, item in registry.values()}

    def _declare(self, name: str, value: _Child, attribute: str | None) -> None:
        if not isinstance(name, str) or not name or "." in name or "/" in name:
            # Named by its attribute (``self._ = ...`` gives the name ''), if it has one.
            holder = "" if attribute is None else f"{type(self).__name__}.{attribute}: "
            raise ValueError(
                f"{holder}state name: expected a non-empty str without '.' or '/', got {name!r}"
            )
        _count_tree_assignment()
        registry: dict[str, tuple[str | None, _Child]] = self.__dict__.setdefault(
            "_declarations", {}
        )
        existing = registry.get(name)
        if existing is not None and (attribute is None or existing[0] != attribute):

            def where(declared_by: str | None) -> str:
                return f"attribute {declared_by!r}" if declared_by else "add_state"

            raise ValueError(
                f"{type(self).__name__}: the state name {name!r} is declared twice "
                f"({where(existing[0])}, then {where(attribute)})"
            )
        if existing is not None and existing[1] is not value and self.__dict__.get("_init_depth"):
            # The same attribute given a new state or metric while the metric is built: most
            # often a subclass reusing its base class's attribute name (``self._count`` in a
            # MeanMetric subclass), whose new state the base's update then feeds, silently
            # changing what the base computes. (Replacing a state after __init__ stays allowed.)
            what = "state" if isinstance(existing[1], MetricAccumulator) else "child metric"
            raise ValueError(
                f"{type(self).__name__}.{attribute}: already holds the declared {what} "
                f"{name!r} (declared by a base class's __init__, or earlier in this one); "
                f"assigning a new {type(value).__name__} would replace it, and the base class's "
                "code would update the new one. Give the new one an attribute of another name"
            )
        if isinstance(value, Metric):
            if any(inner is self for inner in value._walk_metrics()):
                raise ValueError(
                    f"{name}: this {type(value).__name__} holds this "
                    f"{type(self).__name__} already (itself or as a child); a metric tree "
                    "cannot hold itself"
                )
            home: Arena | None = value.__dict__.get("_state_arena")
            if home is not None and home.alive and home.root not in (value, self):
                raise ValueError(
                    f"{name}: this {type(value).__name__} is already part of the metric tree of "
                    f"a {type(home.root).__name__}; a metric belongs to one tree (its states "
                    "live in that tree's arena): make a new metric, or use the whole tree"
                )
        if isinstance(value, MetricAccumulator):
            if value._owned:
                # Declared twice, it would be saved under two keys (and synced twice, or moved
                # between two metrics' arenas on every layout).
                raise ValueError(
                    f"{name}: this MetricAccumulator is already a state of a metric (another "
                    "one, or a child of this one); a state belongs to one metric: declare a "
                    "new MetricAccumulator, or read the other metric's state through it"
                )
            value._owned = True
            value._freshness = self._metric_freshness
            # A new state has no synchronized value: the metric computes from local state
            # until its next sync, never from a synced buffer this state was not part of.
            value._freshness.stale()
        registry[name] = (attribute, value)
        arena = self.__dict__.get("_state_arena")
        if arena is not None:
            arena.alive = False  # the tree changed: the next reset or sync lays it out anew

    @property
    def _metric_freshness(self) -> Freshness:
        flag = self.__dict__.get("_freshness_flag")
        if flag is None:
            flag = Freshness()
            object.__setattr__(self, "_freshness_flag", flag)
        return flag

    def _declared_items(self) -> Iterator[tuple[str, _Child]]:
        registry: dict[str, tuple[str | None, _Child]] = self.__dict__.get("_declarations", {})
        for name, (_, value) in registry.items():
            yield name, value

    def named_accumulators(self, prefix: str = "") -> Iterator[tuple[str, MetricAccumulator]]:
        """Yield ``(dotted name, state)`` for this metric's states, children included."""
        for name, value in self._declared_items():
            if isinstance(value, MetricAccumulator):
                yield prefix + name, value
            else:
                yield from value.named_accumulators(f"{prefix}{name}.")

    def _named_metrics(self, prefix: str = "") -> Iterator[tuple[str, Metric[Any]]]:
        """Yield ``(dotted prefix of its states, metric)`` for this metric and its children."""
        yield prefix, self
        for name, value in self._declared_items():
            if isinstance(value, Metric):
                yield from value._named_metrics(f"{prefix}{name}.")

    def _key_hints(self, keys: list[str]) -> str:
        """What the metrics of the tree say of checkpoint ``keys`` they miss or do not know."""
        hints = []
        for prefix, metric in self._named_metrics():
            own = {k[len(prefix) :] for k in keys if k.startswith(prefix)}
            own = {k for k in own if "." not in k}  # not a child's
            hint = metric._state_key_hint(own) if own else ""
            if hint and hint not in hints:
                hints.append(hint)
        return "".join(f"; {hint}" for hint in hints)

    def _children_hint(self, saved_keys: Iterable[str]) -> str:
        """How to go on when whole child metrics were added or removed since the checkpoint.

        A script edited between a checkpoint and its resume (a metric added to a
        ``ComposeMetric``, or one dropped) got the keys only, and no way forward.
        """
        children = {name for name, value in self._declared_items() if isinstance(value, Metric)}
        saved = {k.split(".", 1)[0] for k in saved_keys if "." in k and "/" not in k}
        kept = sorted(children & saved)
        added, dropped = sorted(children - saved), sorted(saved - children)
        if not kept or not (added or dropped):
            return ""
        changes = []
        if added:
            changes.append(f"child metric(s) {added} are not in the checkpoint")
        if dropped:
            changes.append(f"the checkpoint holds child metric(s) {dropped} this one lacks")
        prefix = kept[0] + "."
        return (
            f"; {' and '.join(changes)} (the metrics changed since it was saved): load the "
            "children both have one by one, each from its own keys, as "
            f"metric[{kept[0]!r}].load_state_dict({{k.removeprefix({prefix!r}): v for k, v in "
            f"state.items() if k.startswith({prefix!r})}}); a new child starts from zero"
        )

    def _state_key_hint(self, names: set[str]) -> str:
        """Why a checkpoint may lack, or hold, this metric's states ``names`` ("": no idea).

        ``load_state_dict`` adds it to its error, so a checkpoint of another configuration
        does not read as a damaged one. The default says nothing.
        """
        return ""

    def _upgrade_state_dict(self, prefix: str, state_dict: dict[str, Any]) -> None:
        """Rewrite, in place, a checkpoint's keys of an older layout of this metric's states.

        ``load_state_dict`` calls it on every metric of the tree (with the dotted prefix of its
        states) before checking keys, so a metric that changes its states can keep loading
        older checkpoints wherever it sits in a tree. The default changes nothing.
        """

    def _configurations(self) -> Iterator[tuple[str, str]]:
        """Yield ``(checkpoint key, text)`` for the tree's metrics whose counts need a setting.

        A classification metric's counts mean something only under its problem (threshold,
        top-k, ...), which no state holds: ``state_dict`` saves a hash of it under
        ``prefix + "configuration"`` (an int64 tensor, so a checkpoint stays all tensors), and
        ``load_state_dict`` refuses counts saved under another one.
        """
        for prefix, metric in self._named_metrics():
            texts = sorted(
                {
                    value._configuration
                    for _, value in metric._declared_items()
                    if isinstance(value, MetricAccumulator)
                    and value._configuration
                    and value._compared_as is None  # a constant is saved as itself
                }
            )
            if texts:
                if "configuration" in metric.__dict__.get("_declarations", {}):
                    # The settings' key would replace that state in checkpoints.
                    raise ValueError(
                        f"{type(metric).__name__}: a state or child named 'configuration' "
                        "shares its checkpoint key with the settings of this metric's "
                        "configured states; rename it"
                    )
                yield prefix + "configuration", "; ".join(texts)

    def _walk_metrics(self) -> Iterator[Metric[Any]]:
        """This metric and its children, in ``_named_metrics``' order, without their prefixes."""
        # A stack, not a generator per child: every sync walks the tree, and nested generators
        # cost a composition of 256 metrics about 250 µs of it.
        stack: list[Metric[Any]] = [self]
        while stack:
            metric = stack.pop()
            yield metric
            registry: dict[str, tuple[str | None, _Child]] | None = metric.__dict__.get(
                "_declarations"
            )
            if registry:
                # Not isinstance(Metric): an ABC check costs more than the plain class's.
                children = [v for _, v in registry.values() if not isinstance(v, MetricAccumulator)]
                stack.extend(reversed(children))

    def _sample_stores(self) -> Iterator[SampleStore]:
        """This metric's own sample stores (attributes holding a ``SampleStore``)."""
        for value in vars(self).values():
            if isinstance(value, SampleStore):
                yield value

    def named_sample_stores(self, prefix: str = "") -> Iterator[tuple[str, SampleStore]]:
        """Yield ``(dotted prefix, store)`` for the tree's growing per-sample stores.

        Each field of a store is checkpointed under ``prefix + field``.
        """
        for metric_prefix, metric in self._named_metrics(prefix):
            for store in metric._sample_stores():
                yield metric_prefix, store

    # ------------------------------------------------------------------ the arena

    _independent_children = False  # ComposeMetric: each child has its own freshness flag

    def _assign_freshness(self, flag: Freshness | None = None) -> Iterator[Freshness]:
        """Give the tree's states their freshness flags; yield each flag once.

        A metric shares one flag with everything below it (it may update its children), except
        that the children of a composition are independent metrics with flags of their own
        (unless the composition itself sits under a metric that is not one, which shares). A
        new flag takes over the metric's old one's value: the arena keeps the synced state.
        """
        shared = flag is not None
        if flag is None:
            flag = Freshness()
            previous: Freshness | None = self.__dict__.get("_freshness_flag")
            flag.current = previous is not None and previous.current
        object.__setattr__(self, "_freshness_flag", flag)
        yield flag
        for _, value in self._declared_items():
            if isinstance(value, MetricAccumulator):
                if not value._freshness.current:
                    flag.current = False  # a state new to the tree has no synced value yet
                value._freshness = flag
            elif self._independent_children and not shared:
                # Under a metric of its own (not a composition) the children share that
                # metric's flag: its compute may read them next to its own states.
                yield from value._assign_freshness()
            else:
                for inner in value._assign_freshness(flag):
                    if inner is not flag:
                        yield inner

    def _compute_settings(self) -> str:
        """What ``compute`` reads beyond the states (an average, ``zero_division``), as text.

        Compared across ranks with the structure at the first sync (with the class's name), so
        ranks configured otherwise raise ``RankMismatchError`` instead of each reporting its
        own number from the same counts; never saved (a checkpoint's counts load under any).
        """
        return ""

    def _settings_parts(self) -> tuple[StatePart, ...]:
        """Each metric's class and compute settings, as structure-check parts of no state.

        Sorted by name: children declared in another order on some rank are still the same
        tree (the arena orders states by op, not by declaration).
        """
        return tuple(
            sorted(
                settings_part(prefix, f"{type(metric).__qualname__} {metric._compute_settings()}")
                for prefix, metric in self._named_metrics()
            )
        )

    def _own_arena(self, device: torch.device | None = None) -> Arena | None:
        """This tree's arena, built when missing or dead; ``None`` inside another tree's arena."""
        arena: Arena | None = self.__dict__.get("_state_arena")
        if arena is not None and arena.alive and device is None:
            return arena if arena.root is self else None
        self._refuse_hidden_in_tree()
        states = list(self.named_accumulators())
        _refuse_twice(states)
        stores = [store for _, store in self.named_sample_stores()]
        built = Arena(
            self, states, list(self._assign_freshness()), device, stores, self._settings_parts()
        )
        for metric in self._walk_metrics():
            object.__setattr__(metric, "_state_arena", built)
        return built

    def _flags_to_mark(self, current: bool) -> list[Freshness]:
        """The freshness flags a sync (``current``) or a reset of this metric sets."""
        arena = self._own_arena()
        if arena is not None:
            return arena.flags
        if current and self._shares_freshness_above():
            # Synchronized alone (a parent's own sync may do that first): the flag is also its
            # parent's, whose other states no sync wrote. Left unset, everything reads local
            # state until the whole tree syncs, never a mix (or unwritten buffers).
            return []
        return [metric._metric_freshness for metric in self._walk_metrics()]

    def _mark_fresh(self, current: bool) -> None:
        for flag in self._flags_to_mark(current):
            flag.mark(current)

    def _mark_fresh_when_ready(self, handle: SyncHandle) -> None:
        """Mark the tree current when ``handle`` is waited on (stale until then).

        Before the wait the synchronized buffers are being written (or were never written):
        ``compute`` reads local state. A flag whose metric is updated, reset or loaded before
        the wait stays stale: the sync sent the state of its start.
        """
        flags = list(self._flags_to_mark(True))
        for flag in flags:
            flag.expect()

        def settle() -> None:
            for flag in flags:
                flag.settle()

        handle.when_ready(settle)

    # ------------------------------------------------------------------ lifecycle

    @property
    def sync_group(self) -> Group:
        """The group ``state_dict`` reduces over and ``load_state_dict`` places the state in.

        The group of the last ``sync`` of this metric or of a tree it is in (``None``, the
        default group, before any). Set it before ``load_state_dict`` when the metric syncs
        over a sub-group, such as the data-parallel dimension of a device mesh, so each such
        group's first rank takes the saved state. Setting it sets every child's too.
        """
        return self._sync_group

    @sync_group.setter
    def sync_group(self, group: Group) -> None:
        resolve_group(group)  # a wrong type fails here, not at the first collective
        # The children too: their states are reduced and placed with this metric's, so a
        # child's state_dict (or load_state_dict) over another group counted them otherwise.
        self._give_group(group)

    def _record_sync_group(self, group: Group) -> None:
        """Remember ``group`` as the group of the last sync of every metric of this tree.

        Each child's states were reduced over it with this metric's, so each child's
        ``state_dict`` reduces over it too: one that kept the default group after its parent
        synced over ``mesh["dp"]`` counted the tensor-parallel replicas twice.
        """
        if self._sync_group is group and self.__dict__.get("_groups_given") == (
            _tree_assignments,
            _group_changes,
        ):
            # No metric's group and no tree changed since this tree's last walk: a sync of
            # 256 metrics took a third longer walking them each time.
            return
        if self._sync_group is not group:
            resolve_group(group)  # a refused group (a 2-D mesh, a wrong type) is not kept
        self._give_group(group)

    def _give_group(self, group: Group) -> None:
        """Set ``group`` on every metric of this tree, and note when that was."""
        changed = False
        for inner in self._walk_metrics():
            if inner._sync_group is not group:
                object.__setattr__(inner, "_sync_group", group)  # bookkeeping: past __setattr__
                changed = True
        if changed:
            _count_group_change()
        object.__setattr__(self, "_groups_given", (_tree_assignments, _group_changes))

    def _refuse_mixed_sync_groups(self, where: str) -> None:
        """Raise if a metric of this tree was last synced over another group than the tree.

        ``state_dict`` reduces the whole tree over one group (``sync_group``): a child synced
        alone over other ranks (``compose["a"].sync(group=mesh["dp"])`` in a composition
        synced over the world) would be saved reduced over the wrong ranks, its replicas
        counted twice or its shards left out. Every rank raises, before any collective.

        Raises:
            RuntimeError: Naming the child and both groups' ranks.
        """
        group = self._sync_group
        ranks: tuple[int, ...] | None = None
        for prefix, inner in self._named_metrics():
            if inner is self or inner._sync_group is group:
                continue
            if ranks is None:
                ranks = group_ranks(resolve_group(group))
            theirs = group_ranks(resolve_group(inner._sync_group))
            if theirs != ranks:
                name = prefix.rstrip(".")
                raise RuntimeError(
                    f"{where}: metric {name!r} was last synced over the group of global ranks "
                    f"{list(theirs)}, but its tree is reduced over the group of ranks "
                    f"{list(ranks)}, which would save its state reduced over the wrong ranks "
                    "(replicas counted twice, or shards left out); sync the whole tree over "
                    "one group (or set tree.sync_group = group before state_dict), or keep "
                    "metrics reduced over different groups in separate trees (a collector "
                    "each, with its own group)"
                )

    @property
    def call_counter(self) -> CallCounter:
        """Numbers this metric's collective calls for their fingerprints (shared by copies)."""
        counter: CallCounter | None = self.__dict__.get("_call_counter")
        if counter is None:
            counter = CallCounter()
            object.__setattr__(self, "_call_counter", counter)
        return counter

    @host_call
    def sync(self, group: Group = None, *, step: int | None = None) -> None:
        """Reduce the state over ``group`` with a coalesced, fixed number of collectives.

        A no-op when torch.distributed is not initialized or the group has one rank. Every rank
        of the group must call it, in the same order relative to other collectives. The payload
        carries this call's fingerprint: if ranks pair different calls, every rank raises
        ``RankMismatchError`` (on CUDA at the next ``sync`` or ``state_dict`` of this metric, so
        the training thread does not wait for the device).

        Args:
            group: A process group, a 1-D device mesh (for example the data-parallel dimension),
                or ``None`` for the default group. Remembered for ``state_dict``.
            step: Where the loop is (a step or an epoch, the same on every rank), sent in the
                fingerprint instead of this metric's sync count: a rank that skipped a sync
                then pairs another step and every rank raises at that sync. Without it a
                skipped sync followed by more syncs pairs each rank's n-th sync with the
                others' n-th, which no fingerprint can tell from a correct loop. The count of
                the metric's earlier calls rides along too, so a rank that skipped a
                ``load_state_dict`` (or a ``state_dict``) raises as with a plain sync.

        Raises:
            RankMismatchError: If ranks hold different state, or paired different calls.
            RuntimeError: If ``WORLD_SIZE``/``RANK`` say the job has several processes but no
                process group is initialized (the sync would silently reduce nothing); or if a
                loaded checkpoint was placed for another group (``sync_group`` at the load).
            TypeError: If ``step`` is not an integer (Python or numpy).
            ValueError: If ``step`` is negative or 2**63 or more (it travels as an int64), or
                ``group`` is a device mesh of more than one dimension.
        """
        if step is not None:
            step = training_step(step)
        # Every time, not only when the sync is laid out: a container filled after the first
        # sync (a state appended to a list in an update) would otherwise be left out of every
        # later sync, and compute would mix this rank's sum with the global count.
        self._refuse_hidden_in_tree()
        check_process_group("sync")
        if step is None:
            self._sync_as(group, self._call("sync", self.call_counter.next()))
        else:
            # The count of earlier calls rides along (a load counts one): a rank that skipped
            # the checkpoint's load pairs the same step but another count, and every rank
            # raises instead of reducing without the saved state.
            earlier = self.call_counter.count
            stream = f"after {earlier} call(s)" if earlier else ""
            self._sync_as(group, self._call("sync at step", step, stream))

    def _call(self, kind: str, sequence: int, stream: str = "") -> CallFingerprint:
        """The fingerprint of a call of this tree, with the digests of loads since the last.

        After a load, ``"sync"`` and ``"state_dict"`` become their ``"... after a load"``
        kinds, whose stream holds the digests; ``"sync at step"`` adds them to its stream.
        """
        loaded = self._take_load_digests()
        if not loaded:
            return CallFingerprint(kind, sequence, stream)
        if kind == "sync at step":
            return CallFingerprint(kind, sequence, f"{stream}, {loaded}" if stream else loaded)
        return CallFingerprint(
            f"{kind} after a load", sequence, f"{stream}: {loaded}" if stream else loaded
        )

    def _take_load_digests(self) -> str:
        """The digests of the checkpoints the tree loaded since its last sync; then forgotten.

        The first sync or ``state_dict`` after a load sends them with its call, so ranks that
        loaded different checkpoints raise instead of going on with the first rank's numbers.
        """
        digests = []
        for prefix, metric in self._named_metrics():
            digest = metric.__dict__.pop("_loaded_digest", None)
            if digest is not None:  # a child loaded alone is named
                digests.append(f"{prefix.rstrip('.')}: {digest}" if prefix else digest)
        return "; ".join(digests)

    def _track(self, handle: SyncHandle) -> None:
        """Keep a CUDA sync whose fingerprint check is deferred, for ``verify_sync``."""
        if handle.deferred:
            pending = self.__dict__.setdefault("_unverified_syncs", [])
            pending.append(handle)
            if len(pending) > _MAX_UNVERIFIED_SYNCS:
                pending.pop(0).verify()  # the device is that far behind: wait for the oldest

    def _shares_freshness_above(self) -> bool:
        """Whether this metric shares its freshness flag with metrics above it in a tree.

        A child of a metric (not of a ``ComposeMetric``) shares one flag with its parent, whose
        ``compute`` reads synchronized values of the whole tree once it is set.
        """
        home: Arena | None = self.__dict__.get("_state_arena")
        if home is None or not home.alive or home.root is self:
            return False
        flag = self.__dict__.get("_freshness_flag")
        inside = {id(metric) for metric in self._walk_metrics()}
        return any(
            metric.__dict__.get("_freshness_flag") is flag
            for metric in home.root._walk_metrics()
            if id(metric) not in inside
        )

    def sync_as(self, group: Group, fingerprint: CallFingerprint) -> None:
        """``sync`` under the caller's ``fingerprint`` (a collector's window), blocking.

        For trees with metrics of their own sync or sample stores (``has_own_sync``), which
        cannot be replayed: the tree's states and every sample gather carry ``fingerprint``,
        so ranks that pair different windows raise ``RankMismatchError``. A metric whose class
        overrides ``sync`` has that called, with its own fingerprints, after one small gather
        of ``fingerprint`` (``sync.check_same_call``; on CUDA checked later, without a host
        wait, like a sync's).
        """
        if type(self).sync is not Metric.sync:
            # The override sends fingerprints of its own, or none: the caller's goes first, so
            # ranks at different windows fail here instead of reducing each other's data.
            self._track(check_same_call(group, fingerprint, self.device))
            # A process group (or None), never a DeviceMesh: the override's own collectives
            # (all_gather_object(..., group=group)) take no mesh.
            self.sync(resolve_group(group))
        else:
            self._sync_as(group, fingerprint)

    def _sync_as(self, group: Group, fingerprint: CallFingerprint) -> None:
        self._record_sync_group(group)
        self.verify_sync(block=False)
        prepared = self.prepare_sync(group)
        try:
            self._track(prepared.batched.start(fingerprint))
            for metric in prepared.own_sync:
                metric.sync_as(group, fingerprint)
            for store in self._sample_stores():
                store.gather(group, fingerprint)
        except BaseException:
            # The results were written before the fingerprints were compared: a sync that
            # raised leaves mixed numbers in the synced buffers, which a flag still set by an
            # earlier sync would have compute read. Local state is what is left.
            self._mark_fresh(False)
            raise
        self._mark_fresh(True)

    def start_sync(
        self,
        group: Group,
        fingerprint: CallFingerprint,
        *,
        async_op: bool = True,
        mark: bool = True,
    ) -> SyncHandle:
        """Start the reduction of every state with ``fingerprint`` (the collector's windows).

        For trees whose metrics have no ``sync`` of their own and no sample stores (see
        ``has_own_sync``): those need ``sync``. The state counts as synchronized once the
        handle was waited on. A ``state_dict`` or another ``start_sync`` before that wait
        finishes this sync first (both reuse the same buffers); the handle's ``wait`` is then
        a no-op.

        Args:
            group: The process group to reduce over (``None``: the default group).
            fingerprint: Which call this is; every rank of the group must send the same.
            async_op: Return before the collectives finish; call ``wait`` on the handle.
            mark: Mark the tree's synced state current (with ``async_op``: when the handle
                is waited on, unless an update, reset or load came first). A caller whose
                tree nothing updates, resets or loads between its syncs (the collector's
                staging copies) marks it once: marking loops over the tree's metrics.

        Raises:
            TypeError: If a metric of the tree has its own ``sync`` or sample stores, which
                this would skip (each rank would then compute from its own data alone).
            RuntimeError: If the launcher says the job has several processes but no process
                group is initialized (as ``sync``).
        """
        check_process_group("start_sync")
        # Even when this metric's group is ``group`` already: a child synced alone over
        # another group since must take it back, or the tree's next state_dict refused the
        # tree as synced over mixed groups. A walk only when some group changed since.
        self._record_sync_group(group)
        prepared = self.prepare_sync(group)
        if not prepared.arena_only:
            raise TypeError(
                f"start_sync: {type(self).__name__} has metrics with their own sync or stored "
                "samples (exact mode), which start_sync does not reduce; call sync() instead"
            )
        if fingerprint.kind == "sync":  # as sync() sends it
            fingerprint = self._call("sync", fingerprint.sequence, fingerprint.stream)
        _finish_in_flight(prepared)
        handle = prepared.every_state.start(fingerprint, async_op=async_op)
        prepared.in_flight = handle if async_op else None
        if mark and async_op:
            self._mark_fresh_when_ready(handle)
        elif mark:
            self._mark_fresh(True)
        return handle

    def verify_sync(self, *, block: bool = True) -> None:
        """Check the fingerprints of this metric's CUDA syncs not checked yet.

        On CUDA a sync's fingerprints reach the host after the device ran it, so each ``sync``
        checks the earlier ones the device has passed, with no wait, and raises a mismatch
        found there; ``state_dict`` checks them all. At most ``_MAX_UNVERIFIED_SYNCS`` stay
        unchecked (a sync beyond that waits for the oldest). Off CUDA every sync checks its own
        at once.

        Args:
            block: Also wait for syncs the device has not reached yet (a host sync).

        Raises:
            RankMismatchError: If ranks paired different calls in one of those syncs.
        """
        pending: list[SyncHandle] = self.__dict__.get("_unverified_syncs", [])
        # In stream order: once one is not reached yet, neither are the later ones.
        while pending and (block or pending[0].ready()):
            try:
                pending.pop(0).verify()
            except RankMismatchError:
                # That sync's mixed numbers may still be what the synced buffers hold.
                self._mark_fresh(False)
                raise

    def prepare_sync(self, group: Group, *, check: bool = True) -> _Prepared:
        """This metric's sync over ``group``, laid out once and kept while the tree is unchanged.

        The first call per structure and group is blocking and a collective (the structure
        check, skipped with ``check=False`` for copies of an already checked structure). If the
        tree changed since the last layout, the old layout is sent once more with a
        ``"changed"`` fingerprint, so other ranks that did not change fail with
        ``RankMismatchError`` instead of hanging in collectives of other sizes; when every rank
        changed together, the new layout is checked and used.

        Raises:
            RuntimeError: If the launcher says the job has several processes but no process
                group is initialized (as ``sync``).
        """
        check_process_group("prepare_sync")
        self._check_loads(group)
        arena = self._own_arena()
        # The arena this tree's states live in: its own, or its parent tree's.
        home: Arena | None = self.__dict__.get("_state_arena")
        cache: dict[int, _Prepared] = self.__dict__.setdefault("_sync_layouts", {})
        # Weakly: an error raised below keeps this frame in its traceback, and a strong
        # reference there would keep the group alive past destroy_process_group() (gloo then
        # aborts the process at exit, exit code -6, instead of it exiting with the error).
        default = _weak_default() if group is None else None
        prepared = cache.get(id(group))
        reusable = prepared is not None and _made_for(prepared, group, default)
        if (
            reusable
            and prepared is not None
            and prepared.arena is home
            and home is not None
            and home.alive
        ):
            return prepared
        # Laid out anew (a metric moved by to() has a new arena): before any collective.
        self._refuse_meta_device()
        # A container filled since the last check (a state appended to a list in the first
        # update) would be left out of this sync: each rank would report its own numbers.
        self._refuse_hidden_in_tree()
        if reusable and prepared is not None:
            del cache[id(group)]
            if prepared.every_state.collective:
                changed = CallFingerprint("changed", self.call_counter.next())
                prepared.every_state.start(changed).verify()
        prepared = self._lay_out(group, arena, home, check)
        prepared.default_at_layout = default
        cache[id(group)] = prepared
        return prepared

    def _refuse_meta_device(self) -> None:
        """Raise ``ValueError`` if the states are on the meta device, which holds no values.

        Before the sync's first collective: torch's own error came after the structure check
        had started, and left the other ranks waiting in it.
        """
        if self.device.type == "meta":
            raise ValueError(
                "sync: the metric's states are on device 'meta', which holds no values to "
                "reduce or save; move it to the device it is updated on (metric.to('cpu'), "
                "metric.to('cuda:0')) before sync or state_dict"
            )

    def _check_loads(self, group: Group) -> None:
        """``_check_load`` of this metric, and of its children if one took a checkpoint."""
        self._check_load(group)
        if self.__dict__.get("_children_loaded"):  # a child took a checkpoint of its own
            for inner in self._walk_metrics():
                if inner is not self:
                    inner._check_load(group)

    def _check_load(self, group: Group) -> None:
        """Raise if this metric's loaded checkpoint was placed for another group than ``group``.

        Until a reset: the saved state stays on that group's first rank, so a later sync over
        another group (after a state_dict over the load's own) would go without it.
        """
        loaded_for: tuple[int, ...] | None = self.__dict__.get("_loaded_for")
        if loaded_for is not None and self.__dict__.get("_load_checked") != id(group):
            _check_load_group(loaded_for, group)
            self.__dict__["_load_checked"] = id(group)  # the same group again costs nothing

    def _lay_out(
        self, group: Group, arena: Arena | None, home: Arena | None, check: bool
    ) -> _Prepared:
        own_sync = [m for m in self._walk_metrics() if m is not self and has_own_sync(m)]
        # A child synced alone: its states are named by its place in the tree, so ranks that
        # pair two children of one shape (a and b synced in other orders) differ.
        place = "" if arena is not None else _place_in_tree(self, home)
        everything = SyncBatch()
        if arena is not None:
            for segment in arena.segments:
                everything.add(
                    segment, group, segment.synced, name=segment.parts[0][0], parts=segment.parts
                )
        else:
            for name, state in self.named_accumulators():
                everything.add(state, group, state._synced, name=place + name)
        every_state = everything.program(check=check)
        if not own_sync:
            return _Prepared(group, home, every_state, every_state, [], not has_own_sync(self))
        skipped = {id(s) for m in own_sync for _, s in m.named_accumulators()}
        batched = SyncBatch()
        for name, state in self.named_accumulators():
            if id(state) not in skipped:
                batched.add(state, group, state._synced, name=place + name)
        return _Prepared(group, home, every_state, batched.program(check=check), own_sync, False)

    def reset(self) -> None:
        """Return every state to its initial value (no communication).

        Child metrics whose class overrides ``reset`` (to clear data of their own, besides
        their states) have it called too, once each, after their states were reset.
        """
        # The loaded state is gone, and with it what the next sync would compare.
        for key in ("_loaded_for", "_load_checked", "_loaded_digest"):
            self.__dict__.pop(key, None)
        if self.__dict__.pop("_children_loaded", None):  # theirs too: the whole tree resets
            for inner in self._walk_metrics():
                for key in ("_loaded_for", "_load_checked", "_loaded_digest"):
                    inner.__dict__.pop(key, None)
        arena = self._own_arena()
        if arena is not None:
            arena.reset()
            cached: tuple[Arena, list[Metric[Any]]] | None = self.__dict__.get("_reset_children")
            if cached is None or cached[0] is not arena:
                cached = (arena, self._overriding_children())
                object.__setattr__(self, "_reset_children", cached)
            for child in cached[1]:
                child.reset()
            return
        states = [state for _, state in self.named_accumulators()]
        if states:
            torch._foreach_copy_([s.local for s in states], [s.initial for s in states])
        for _, store in self.named_sample_stores():
            store.clear()
        self._mark_fresh(False)
        for child in self._overriding_children():
            child.reset()

    def _check_readable(self, call: str) -> None:
        """Raise if this metric's states cannot be read as they are (by default: never).

        A hook for metrics that also keep data outside their states (the torchmetrics bridge's
        wrapped object, updated directly): ``state_dict`` and a collector's
        ``schedule_collection`` call it, naming themselves as ``call``, on every metric of the
        tree whose class overrides it, before they read any state.
        """

    def _readability_checked(self) -> list[Metric[Any]]:
        """The metrics of this tree whose class overrides ``_check_readable``."""
        return [
            metric
            for metric in self._walk_metrics()
            if type(metric)._check_readable is not Metric._check_readable
        ]

    def _overriding_children(self) -> list[Metric[Any]]:
        """The topmost metrics below this one whose class overrides ``reset``."""
        found: list[Metric[Any]] = []
        for _, child in self._declared_items():
            if isinstance(child, Metric):
                if type(child).reset is not Metric.reset:
                    found.append(child)
                else:
                    found.extend(child._overriding_children())
        return found

    def to(self, device: torch.device | str | int) -> Self:
        """Move every state of the tree to ``device`` (into a new arena) and return ``self``.

        Each metric of the tree, children included, also moves its own non-state tensors
        through ``_move_extras``. A tree whose arena already holds it on ``device`` keeps that
        arena (so ``to`` the same device after a collector's ``bind`` changes nothing).

        Raises:
            TypeError: If ``device`` is not a ``torch.device``, a str or an int (a dtype, say).
            ValueError: If ``device`` is a str torch cannot parse (``"gpu"``) or a negative
                index.
            RuntimeError: If ``device`` is a CUDA device and CUDA is not available.
            NotImplementedError: If the metric is on the meta device and ``device`` is not:
                meta tensors hold no values to move (torch's own error, said plainly).
        """
        check_device("to", device)
        target = torch.device(device)
        check_cuda_available("to", target)
        if self.device.type == "meta" and target.type != "meta":
            raise NotImplementedError(
                f"to: this {type(self).__name__} is on the meta device, which holds no values "
                f"to move to {target}; build a new metric there instead"
            )
        target = resolve_device(target)  # cuda -> cuda:N, cpu:0 -> cpu
        self._refuse_hidden_in_tree()  # before anything moves
        for metric in self._walk_metrics():
            metric._move_extras(target)
        if not self._arena_holds_tree_on(target):
            self._own_arena(target)
        return self

    def _arena_holds_tree_on(self, device: torch.device) -> bool:
        """Whether this tree's live arena already holds every state of the tree on ``device``.

        Then ``to`` keeps it: a new arena would be a new layout, which a bound collector takes
        for a metric that changed its states after ``bind``.
        """
        arena: Arena | None = self.__dict__.get("_state_arena")
        if arena is None or not arena.alive or arena.root is not self or arena.device != device:
            return False
        held = [state for _, state in arena.states]
        current = [state for _, state in self.named_accumulators()]
        stores = [store for _, store in self.named_sample_stores()]
        return (
            len(held) == len(current)
            and all(a is b for a, b in zip(held, current, strict=True))
            and len(stores) == len(arena.stores)
            and all(a is b for a, b in zip(stores, arena.stores, strict=True))
        )

    def _move_extras(self, device: torch.device) -> None:
        """Move tensors the metric holds besides its states (constants such as bin edges).

        Called by ``to`` on every metric of a tree, so a child inside a composition moves its
        constants with the root; ``to`` of a child is not called. Override it, not ``to``.
        """

    def __repr__(self) -> str:
        # The class, not the object's address: what print(metric) and error messages show.
        return f"{type(self).__name__}()"

    @property
    def device(self) -> torch.device:
        """The device of the metric's state (CPU for a metric without state)."""
        arena: Arena | None = self.__dict__.get("_state_arena")
        if arena is not None and arena.alive:
            return arena.device
        for _, state in self.named_accumulators():
            return state.device
        return torch.device("cpu")

    def state_dict(self) -> dict[str, Any]:
        """The globally reduced state, keyed by dotted state name.

        A sample store's fields (``SampleStore``) are saved under ``prefix + field`` as
        ``SavedRows`` (its ``rows`` tensor: every rank's rows, concatenated in rank order), an
        object ``torch.distributed.checkpoint`` saves whole, since their row count is unknown
        to the metric it loads into. A classification metric adds a hash of its problem under
        ``prefix + "configuration"`` (an int64 tensor; see ``load_state_dict``), and the
        ``"sidestream/dtypes"`` key holds each state's dtype by name (JSON text): a load
        through ``torch.distributed.checkpoint`` converts every tensor into the dtype of the
        metric it loads into, so only this record tells a checkpoint of another dtype.

        On a multi-rank job this is a blocking collective over the group of the last ``sync``
        (the default group if there was none): every rank must call it, and every rank gets the
        same tensors. Single-process it is a copy of the local state.

        Raises:
            RankMismatchError: If ranks hold different state, or paired different calls.
            RuntimeError: If ``WORLD_SIZE``/``RANK`` say the job has several processes but no
                process group is initialized (each rank would save only its own data).
        """
        return self._reduced_state()

    def _reduced_state(
        self, stream: str = "", around_collectives: AbstractContextManager[object] | None = None
    ) -> dict[str, Any]:
        """``state_dict``, with ``stream`` (a collector's prefix) in the call's fingerprint.

        A collector's checkpoint sends its stream: ranks that reduce different collectors'
        states against each other (same structure, other order) then fail on every rank
        instead of saving each other's numbers. ``around_collectives`` is entered around the
        collectives only, after every local check (a collector names a failed one's cause).
        """
        self._refuse_hidden_in_tree()
        for metric in self._readability_checked():
            metric._check_readable("state_dict")
        check_process_group("state_dict")
        self.verify_sync()
        # prepare_sync's local check, before any collective (a collector names a failed
        # collective's cause: a local error is not one).
        self._check_loads(self._sync_group)
        self._refuse_mixed_sync_groups("state_dict")
        locals_ = {prefix: store.local() for prefix, store in self.named_sample_stores()}
        with around_collectives or contextlib.nullcontext():
            return self._reduce_for_checkpoint(stream, locals_)

    def _reduce_for_checkpoint(
        self, stream: str, locals_: dict[str, dict[str, torch.Tensor]]
    ) -> dict[str, Any]:
        """``_reduced_state``'s collectives: the states' reduction, then the stores' rows."""
        prepared = self.prepare_sync(self._sync_group)
        _finish_in_flight(prepared)
        fingerprint = self._call("state_dict", self.call_counter.next(), stream)
        # The reduction writes the synced views, which compute reads while this rank has not
        # updated since its last sync. Another rank may have (uneven data, or another child
        # of a composition): the global state of this moment is not the last sync's result,
        # and a checkpoint must not change what compute returns. Put the views back as they
        # were (a copy each way; checkpoints are rare); the freshness flags stay as they were.
        named = list(self.named_accumulators())
        kept = [state._synced.clone() for _, state in named]
        try:
            prepared.every_state.start(fingerprint).verify()
            saved: dict[str, Any] = {name: state._synced.clone() for name, state in named}
        finally:
            if named:
                torch._foreach_copy_([state._synced for _, state in named], kept)
        for key, configuration in self._configurations():
            # On the host whatever the caller's default device: under a meta one the
            # checkpoint held a meta tensor, no hash to check at load.
            saved[key] = torch.tensor(stable_hash(configuration), device="cpu")
        if saved:
            saved[DTYPES_KEY] = _dtype_record(
                (name, state.local.dtype) for name, state in self.named_accumulators()
            )
        group = resolve_group(self._sync_group)
        for prefix, local in locals_.items():
            # Every rank's rows, in rank order: the same global data on every rank.
            for field_name, rows in gather_rows(local, group, fingerprint).items():
                saved[prefix + field_name] = SavedRows(rows.clone())
        if under_dcp():
            # dcp.load loads into this dict in place and, with allow_partial_load=True, leaves
            # a key its checkpoint lacks as it is: this metric's own value, which the load
            # would take as saved (an older layout's counts came back as zeros). Remember what
            # each key held, so _prepare_load can tell the keys the checkpoint never had.
            self.__dict__["_dcp_template"] = _template_marks(saved)
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by ``state_dict`` with any number of ranks.

        The group's first rank takes the saved global state (sample stores: every saved row);
        the others start from the initial value (empty stores), so the next sync counts the
        saved data exactly once. Every rank must call it: it uses no communication, but counts
        as a call, so the next ``sync`` or ``state_dict`` raises ``RankMismatchError`` on every
        rank if one rank skipped it.

        Raises:
            KeyError: If ``state_dict`` lacks a state of this metric or has an unknown one.
            TypeError: If a saved value is not a tensor (or numbers).
            ValueError: If a saved tensor's shape or dtype differs from the state's (also
                where ``torch.distributed.checkpoint`` converted it: the checkpoint's
                ``"sidestream/dtypes"`` record tells), or the checkpoint was saved with another
                constant (``MetricAccumulator.constant``: bins, a shift) or another
                classification configuration (threshold, top-k, ...). A checkpoint saved before
                the metric kept any of these loads as it is. Or if the metric is on the meta
                device (no values to load into), or a saved value is a meta tensor (a
                checkpoint loaded with ``map_location="meta"``: no values to load).
            RuntimeError: If the metric is bound to an open collector (load before ``bind``:
                ``collector.load_state_dict`` or ``run.load_state_dict``).
        """
        self._prepare_load(state_dict)()

    def _partly_left_out(self, left_out: list[str]) -> list[str]:
        """The keys of ``left_out`` whose metric (in this tree) had some other key loaded.

        A metric of the tree all of whose keys a partial DCP load left out is not in the
        checkpoint at all: its keys are dropped from ``left_out``, so it loads its own values.
        """
        if not left_out:
            return left_out
        marks = self.__dict__.get("_dcp_template") or {}
        prefixes = sorted((prefix for prefix, _ in self._named_metrics()), key=len, reverse=True)

        def owner(key: str) -> str:  # the deepest metric whose prefix the key has
            found = (p for p in prefixes if key.startswith(p) and "." not in key[len(p) :])
            return next(found, "")

        skipped = set(left_out)
        loaded_owners = {owner(key) for key in marks if key not in skipped}
        return [key for key in left_out if owner(key) in loaded_owners]

    def _prepare_load(self, state_dict: dict[str, Any]) -> Callable[[], None]:
        """Check ``state_dict`` as ``load_state_dict`` does; return the call that restores it.

        Nothing changes until that call, which raises nothing: a ``Run`` checks every
        collector's checkpoint before it restores any, so a refused one leaves none restored.

        Raises:
            The errors of ``load_state_dict``.
        """
        prefix = self.__dict__.get("_bound_prefix")
        if prefix is not None:
            raise RuntimeError(
                f"load_state_dict: this {type(self).__name__} belongs to a bound collector "
                f"(prefix {prefix!r}), whose windows already stage it; load the checkpoint "
                "before bind, with collector.load_state_dict or run.load_state_dict"
            )
        if self.device.type == "meta":
            # The copies into meta tensors would succeed and keep nothing.
            raise ValueError(
                f"load_state_dict: this {type(self).__name__} is on the meta device, which "
                "holds no values; move it first (metric.to('cpu') or a GPU), then load"
            )
        original = state_dict
        state_dict = dict(state_dict)
        # Keys torch.distributed.checkpoint's partial load left at this metric's own values are
        # keys the checkpoint lacks: treated as absent, an older layout is upgraded, a missing
        # constant taken as this metric's, and a missing state refused, instead of loading the
        # template's numbers. Not those of a metric the checkpoint has no key of at all (a
        # child added to a composition, a collector added to a run since): it keeps its own
        # values, as such a load always did.
        left_out = self._partly_left_out(
            _left_by_partial_load(self.__dict__.get("_dcp_template"), state_dict)
        )
        for key in left_out:
            del state_dict[key]
        for prefix, metric in self._named_metrics():
            metric._upgrade_state_dict(prefix, state_dict)
        states = dict(self.named_accumulators())
        for name, state in states.items():
            if state._compared_as is not None and name not in state_dict:
                # Saved before the metric kept this constant: taken as this metric's own.
                state_dict[name] = state.initial.clone()
        for key, configuration in self._configurations():
            _check_saved_configuration(key, state_dict.pop(key, None), configuration)
        dtype_record = state_dict.pop(DTYPES_KEY, None)
        stores = list(self.named_sample_stores())
        store_keys = {prefix + name for prefix, store in stores for name in store.fields}
        missing = sorted((set(states) | store_keys) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(states) - store_keys)
        if missing or unexpected:
            raise KeyError(
                f"state_dict: missing keys {missing}, unexpected keys {unexpected} "
                f"for {type(self).__name__}{self._key_hints(missing + unexpected)}"
                f"{_partial_load_hint(missing, left_out)}"
                f"{self._children_hint(state_dict)}"
            )
        saved: dict[str, torch.Tensor] = {}
        # Constants first: a checkpoint of other bins is told as such, not as a histogram of
        # another shape.
        for name, state in sorted(states.items(), key=lambda item: item[1]._compared_as is None):
            tensor = _saved_tensor(name, state_dict[name], state.local.dtype)
            if state._compared_as is not None:
                state._check_saved_constant(name, tensor)
            if tuple(tensor.shape) != tuple(state.local.shape):
                raise ValueError(
                    f"state_dict[{name!r}]: expected shape {tuple(state.local.shape)}, "
                    f"got {tuple(tensor.shape)}"
                )
            if tensor.dtype != state.local.dtype and not _widens(tensor.dtype, state.local.dtype):
                found = (
                    f"{state_dict[name]!r}, which {state.local.dtype} does not hold exactly"
                    if isinstance(state_dict[name], int | float)
                    else f"{tensor.dtype}"
                )
                raise ValueError(
                    f"state_dict[{name!r}]: expected dtype {state.local.dtype}, got {found} (a "
                    "checkpoint of a different metric or configuration)"
                )
            saved[name] = tensor
        # The keys given: a recorded state among them was renamed by _upgrade_state_dict (an
        # older layout), or refused above as unexpected; one the record names beyond them was
        # left out by torch.distributed.checkpoint, which loads only this metric's keys.
        _check_saved_dtypes(dtype_record, states, type(self).__name__, set(original))
        load_group = resolve_group(self._sync_group)
        owner = group_rank(load_group) == 0
        loaded_for = group_ranks(load_group)
        # Checked on every rank: one that skipped the check would take the load the others
        # refused, and the group's calls would no longer pair.
        checked = [
            (store, store.check_rows({name: state_dict[prefix + name] for name in store.fields}))
            for prefix, store in stores
        ]
        rows = [store.own_copies(tensors) if owner else None for store, tensors in checked]
        targets = [state.local for state in states.values()]
        digest = checkpoint_digest(original)
        if owner:
            sources = [saved[name].to(state.device) for name, state in states.items()]
        else:
            sources = [state.initial for state in states.values()]

        def restore() -> None:
            if targets:
                torch._foreach_copy_(targets, sources)
            for (_, store), checked in zip(stores, rows, strict=True):
                store.clear()
                if checked is not None:
                    store.append(**checked)
            self._mark_fresh(False)
            # Placed for this group: a sync over another one would lose the saved state in
            # every group without that first rank (checked by every prepare_sync until a
            # reset drops the loaded state).
            self.__dict__["_loaded_for"] = loaded_for
            self.__dict__.pop("_load_checked", None)
            self.__dict__.pop("_dcp_template", None)
            home: Arena | None = self.__dict__.get("_state_arena")
            if home is not None and home.root is not self:
                # A child loaded alone: its tree's root syncs it, and checks it from there.
                home.root.__dict__["_children_loaded"] = True
            # A load counts as a call: only the group's first rank takes the saved numbers, so
            # a rank that skipped it (rank 0: the checkpoint lost) fails the next sync or
            # state_dict on every rank with RankMismatchError instead of reducing without it.
            self.call_counter.next()
            # And what was loaded rides with the next one: ranks given different checkpoints
            # raise then, instead of going on with the first rank's numbers.
            self.__dict__["_loaded_digest"] = digest

        return restore


def _weak_default() -> weakref.ref[dist.ProcessGroup] | None:
    """A weak reference to the default process group as it is now (``None`` without one)."""
    default = default_group()
    return None if default is None else weakref.ref(default)


def _made_for(
    prepared: _Prepared, group: Group, default: weakref.ref[dist.ProcessGroup] | None
) -> bool:
    """Whether ``prepared`` was laid out for ``group`` (``None``: for today's ``default``)."""
    if prepared.group is not group:
        return False
    made = prepared.default_at_layout
    if default is None:
        return made is None
    return made is not None and made() is default() is not None


def _check_load_group(loaded_for: tuple[int, ...], group: Group) -> None:
    """Raise if a metric whose checkpoint was placed for ``loaded_for`` syncs over another group.

    ``load_state_dict`` put the saved state on the first rank of the group it was given
    (``sync_group``): synced over groups of other ranks, every group without that rank would
    go on without the saved state, and report wrong numbers. Every rank of such a job raises
    (each compares its own groups), before any collective.
    """
    ranks = group_ranks(resolve_group(group))
    if ranks != loaded_for:
        raise RuntimeError(
            f"sync: this metric's checkpoint was loaded for the group of global ranks "
            f"{list(loaded_for)} (its first rank took the saved state), but it syncs over the "
            f"group of ranks {list(ranks)}, where the saved state would be lost or counted "
            "otherwise; set metric.sync_group = group before load_state_dict (the group it "
            "syncs over, for example mesh['dp']), or reset() the metric to drop the loaded state"
        )


def _refuse_twice(states: list[tuple[str, MetricAccumulator]]) -> None:
    """Raise ``ValueError`` for a state reached by two names (one child at two places)."""
    seen: dict[int, str] = {}
    for name, state in states:
        first = seen.setdefault(id(state), name)
        if first != name:
            # Laid out twice and saved under two keys: a checkpoint of it would load one
            # copy's values over the other's.
            raise ValueError(
                f"state {name!r} is state {first!r} again: one child metric (or state) at two "
                "places of one metric tree; give each place a metric of its own"
            )


_DCP_NESTED_METRIC = (
    "Its pickle holds this rank's local state, not the globally reduced one, and DCP keeps "
    "one rank's copy of it: a load would drop the other ranks' data and count the kept "
    "copy once on every loading rank."
)


def _template_marks(saved: dict[str, Any]) -> dict[str, tuple[weakref.ref[Any], int | None]]:
    """Each value of a ``state_dict`` made for ``torch.distributed.checkpoint``, as it is now.

    A weak reference (the dict is DCP's, not ours to keep alive) and, for a tensor, its version
    counter: DCP copies a loaded tensor into the template's, which bumps it, and replaces any
    other value (a string, ``SavedRows``) by the one it unpickles. ``None``: a tensor that
    tracks no version (made under ``torch.inference_mode``), never taken as left out.
    """
    marks: dict[str, tuple[weakref.ref[Any], int | None]] = {}
    for key, value in saved.items():
        version: int | None = None
        if isinstance(value, torch.Tensor):
            try:
                version = value._version
            except RuntimeError:  # an inference tensor tracks no version
                continue
        try:
            marks[key] = (weakref.ref(value), version)
        except TypeError:  # a value without weak references (none today): not checked
            continue
    return marks


def _left_by_partial_load(
    marks: dict[str, tuple[weakref.ref[Any], int | None]] | None, state_dict: dict[str, Any]
) -> list[str]:
    """The keys of ``state_dict`` that still hold the template ``_template_marks`` saw.

    Only a ``torch.distributed.checkpoint`` load with ``allow_partial_load=True`` leaves one so
    (a strict load raises for a key its checkpoint lacks): that key was not in the checkpoint.
    """
    if not marks:
        return []
    left = []
    for key, (ref, version) in marks.items():
        value = state_dict.get(key)
        if value is None or ref() is not value:
            continue  # another object: loaded (or a dict that never was a template)
        if isinstance(value, torch.Tensor) and value._version != version:
            continue  # loaded in place
        left.append(key)
    return left


def _partial_load_hint(missing: list[str], left_out: list[str]) -> str:
    """The end of a missing-keys error for the keys a partial DCP load left out, if any."""
    left = sorted(set(missing) & set(left_out))
    if not left:
        return ""
    return (
        f"; {left} are not in the checkpoint (torch.distributed.checkpoint's partial load, "
        "allow_partial_load=True, left them at this metric's own values): a checkpoint of "
        "another metric, or of an earlier sidestream whose states had other names (such as "
        "a ConfusionCountMetric's 'tp', 'fp', 'fn', 'tn' before 'counts'), which DCP cannot "
        "load into this layout; convert it with torch.distributed.checkpoint.format_utils."
        "dcp_to_torch_save and give the metric's part to load_state_dict, which upgrades it"
    )


DTYPES_KEY = "sidestream/dtypes"
"""The ``state_dict`` key of the states' dtype record (no state name holds a ``/``)."""


def _dtype_record(states: Iterator[tuple[str, torch.dtype]]) -> str:
    """Each state's dtype by name, as JSON text (``{"count": "float64", ...}``).

    Text, not a tensor: ``torch.distributed.checkpoint`` saves it whole and loads it as it was
    saved, where a tensor would have to keep its length (one more state in a later version
    would make an older checkpoint fail to load).
    """
    return json.dumps({name: str(dtype).removeprefix("torch.") for name, dtype in states})


def _check_saved_dtypes(
    saved: object,
    states: dict[str, MetricAccumulator],
    metric: str = "metric",
    given: Collection[str] = (),
) -> None:
    """Raise if the checkpoint recorded a state this metric lacks, or one it cannot load.

    A state saved in a dtype that does not load into this metric's raises too. ``None``: a
    checkpoint from before the record (or a child's part of its parent's); a state the record
    does not name (saved by a layout without it), or in a dtype this torch does not have, is
    not checked. ``metric``: the loading metric's class, for the message. ``given``: the keys
    of the dict given to the load; a recorded state among them that this metric lacks was
    renamed by ``_upgrade_state_dict`` (a checkpoint of an older layout), not left out.
    """
    if saved is None:
        return
    try:
        recorded = json.loads(saved) if isinstance(saved, str | bytes) else None
    except ValueError:
        recorded = None
    if not isinstance(recorded, dict):
        raise TypeError(
            f"state_dict[{DTYPES_KEY!r}]: expected the states' dtype record (JSON text of a "
            f"mapping), got {saved!r}"
        )
    # A name with a "/" is no state's: a collector records its window mode so.
    extra = sorted(set(recorded) - set(states) - set(given) - {n for n in recorded if "/" in n})
    if extra:
        # Only through torch.distributed.checkpoint (a direct load refuses the keys first): it
        # loads the keys this metric has and drops the rest, so a MeanMetric's checkpoint went
        # into a SumMetric, or an "ignore" metric's into a "disable" one, without a word.
        raise KeyError(
            f"state_dict: the checkpoint holds states {extra} that this {metric} lacks (its "
            f"record of saved states says so): a checkpoint of another metric or configuration"
        )
    for name, state in states.items():
        dtype = state.local.dtype
        found = getattr(torch, str(recorded.get(name)), None)
        if isinstance(found, torch.dtype) and found != dtype and not _widens(found, dtype):
            raise ValueError(
                f"state_dict[{name!r}]: expected dtype {dtype}, saved as {found} (the "
                "checkpoint's record says so: torch.distributed.checkpoint converted it on load, "
                "which rounds, overflows or wraps the saved numbers; a checkpoint of a metric "
                "made with another dtype)"
            )


def _check_saved_configuration(key: str, saved: object, configuration: str) -> None:
    """Raise if a checkpoint's configuration hash (None: saved before it was) is another's."""
    if saved is None:
        return
    if isinstance(saved, torch.Tensor) and saved.is_meta:
        # Not "expected a configuration hash (an int64 tensor)": it is one, with no values (a
        # checkpoint loaded with map_location="meta"), as the states' check says.
        raise ValueError(
            f"state_dict[{key!r}]: a meta tensor holds no values (load the checkpoint's "
            "tensors, for example with torch.load or dcp.load into this metric's state_dict())"
        )
    try:
        # device=: not the caller's default device (see _saved_tensor).
        own = saved.device if isinstance(saved, torch.Tensor) else torch.device("cpu")
        value = int(torch.as_tensor(saved, device=own).item())
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            f"state_dict[{key!r}]: expected a configuration hash (an int64 tensor), got {saved!r}"
        ) from error
    if value != stable_hash(configuration):
        raise ValueError(
            f"state_dict[{key!r}]: saved by a metric configured otherwise; this one counts "
            f"under {configuration!r}, and counts of another problem (threshold, top-k, "
            "classes, ...) mean something else, so load the checkpoint into a metric "
            "configured as the one that saved it"
        )


def _building_the_arena(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` that, as the instance's outermost ``__init__``, builds the finished tree's arena.

    Built at construction, not at the first ``to``, ``reset`` or sync: a compiled update then
    never sees the states' layout change under it (after such a change, torch 2.13 fails to
    recompile an update with automatic dynamic shapes: "sources must not be empty for symbol").
    A parent's arena replaces its children's when the parent's ``__init__`` ends. A class whose
    ``__init__`` does not reach a metric ``__init__`` (a ``@dataclass``) gets its arena at its
    first ``to``, ``reset`` or sync.
    """

    @functools.wraps(init)
    def build_after(self: Metric[Any], *args: Any, **kwargs: Any) -> None:
        # Counted, not compared with type(self).__init__: behind a plain mixin (first in the
        # bases) the outermost __init__ is the mixin's, which no wrapper sees.
        depth: int = self.__dict__.get("_init_depth", 0)
        outer = _BUILT_FOR_META.get()
        # A metric's __init__ reads its arguments on the host (a SUM state starts at 0, bin
        # edges increase, a fill value fits the dtype). Under a meta default device
        # (torch.set_default_device("meta"), or `with torch.device("meta")` around a model
        # built for its size) its tensors were meta ones, and every metric but MaxMetric and
        # MinMetric failed with torch's "Tensor.item() cannot be called on meta tensors". It is
        # built on the CPU, then moved: the same metric as `.to("meta")` gives.
        for_meta = not depth and outer is None and _default_device_type() == "meta"
        token = _BUILT_FOR_META.set(set()) if for_meta else None
        object.__setattr__(self, "_init_depth", depth + 1)
        try:
            with torch.device("cpu") if for_meta else contextlib.nullcontext():
                init(self, *args, **kwargs)
        finally:
            if depth:
                object.__setattr__(self, "_init_depth", depth)
            else:
                del self.__dict__["_init_depth"]
            built_here = _BUILT_FOR_META.get()
            if token is not None:
                _BUILT_FOR_META.reset(token)
        if not depth:  # the outermost metric __init__ ended
            if outer is not None:  # a child built inside a parent's meta build: it moves along
                outer.add(id(self))
            if for_meta:
                _refuse_a_meta_mix(self, built_here or set())
            self._own_arena()
            # Only a tree made here, or already on meta, moves: children the caller built
            # elsewhere (a ComposeMetric of CPU metrics) stay where they are, as torch's
            # default device leaves existing tensors alone.
            if for_meta and all(
                inner is self or id(inner) in (built_here or ()) or inner.device.type == "meta"
                for inner in self._walk_metrics()
            ):
                self.to("meta")

    return build_after


def _refuse_a_meta_mix(metric: Metric[Any], built_here: set[int]) -> None:
    """Raise if a tree built under a meta default device joins meta metrics and others.

    A metric built earlier in the block is meta already, and a CPU metric the caller built
    before it stays on the CPU: the tree's arena then spanned both devices and every metric of
    it reported the first state's device (the CPU child refused CPU updates as "expected a
    tensor on the metric's device meta", or a meta child took CPU updates and checkpointed
    meta tensors). Checked before the arena is built: the children are left as they were.
    """
    on_meta: list[tuple[str, Metric[Any]]] = []
    elsewhere: list[tuple[str, Metric[Any]]] = []
    for prefix, inner in metric._named_metrics():
        if inner is metric or id(inner) in built_here:
            continue  # built on the CPU for this block: moves with the tree
        if next(iter(inner.named_accumulators()), None) is None:
            continue  # no state (an empty ComposeMetric): on no device of its own
        (on_meta if inner.device.type == "meta" else elsewhere).append((prefix, inner))
    if on_meta and elsewhere:

        def named(group: list[tuple[str, Metric[Any]]]) -> str:
            return ", ".join(repr(prefix.rstrip(".")) for prefix, _ in group)

        raise ValueError(
            f"{type(metric).__name__}: built under a meta default device with metrics on meta "
            f"({named(on_meta)}, built in the block) and on {elsewhere[0][1].device} "
            f"({named(elsewhere)}); a metric tree is on one device: build the metrics you "
            'train with outside the `with torch.device("meta")` block'
        )


# The ids of the metrics built inside an outermost metric __init__ run on the CPU for a meta
# default device (see _building_the_arena); None outside one.
_BUILT_FOR_META: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar(
    "_BUILT_FOR_META", default=None
)


# Unchecked CUDA syncs a metric keeps before a sync waits for the oldest (``verify_sync``).
_MAX_UNVERIFIED_SYNCS = 4
_BUILT_ON_THE_ARENA = frozenset(
    {"_state_arena", "_sync_layouts", "_unverified_syncs", "_reset_children"}
)
"""A metric's attributes that hold or depend on its tree's arena (made again when it is)."""
_NOT_PICKLED = _BUILT_ON_THE_ARENA | {
    "_sync_group",
    "_bound_prefix",
    "_load_checked",
    "_container_scan",
    "_groups_given",
    "_dcp_template",
}
"""Left out of a pickle: what is built on the arena (made again on load), the process group,
which cannot be pickled, the collector that holds the metric (a copy belongs to none), the id
of the group a loaded checkpoint was last checked against (another process's ids), which
attributes held containers (of the original objects), when the group was last given to the
tree (of this process's counters), and the weak references to a DCP
template (``_template_marks``: of this process's dict)."""

_tree_assignments = 0
"""How many containers, states and metrics were assigned to a metric's attribute (or
declared), in any metric: a tree's container scan is made again when it changes."""


def _count_tree_assignment() -> None:
    global _tree_assignments
    _tree_assignments += 1


_group_changes = 0
"""How many times a tree's walk changed a metric's ``_sync_group``, in any metric: a tree
walks its metrics again at a sync when it changed since its last walk (``_groups_given``)."""


def _count_group_change() -> None:
    global _group_changes
    _group_changes += 1


_BOOKKEEPING = _NOT_PICKLED | {"_declarations", "_freshness_flag", "_call_counter"}
"""Attributes the library keeps on every metric (not a metric's own data)."""

_RESERVED = _BOOKKEEPING | {"_loaded_for", "_children_loaded", "_init_depth", "_loaded_digest"}
"""Names a subclass may not assign (the library writes them past ``__setattr__``)."""


def own_data(metric: Metric[Any]) -> Iterator[tuple[str, Any]]:
    """``(attribute, value)`` of what ``metric`` keeps besides its declared states and children.

    Library bookkeeping and sample stores (part of the state arena) are left out, and so are
    containers that hold states or metrics (a composition's dict of children, a list of
    declared states: structure, not data; a copy would stand in for the copy's own states).
    What is left is, for a metric that overrides ``sync``, the data its own sync gathers.
    """
    for attribute, value in vars(metric).items():
        if attribute in _BOOKKEEPING or isinstance(value, SampleStore | MetricAccumulator | Metric):
            continue
        if not any(True for _ in _tree_objects(value)):
            yield attribute, value


def _tree_objects(value: Any) -> Iterator[tuple[MetricAccumulator | Metric[Any], Any]]:
    """``(state or metric, the container holding it)`` for each one inside a container value."""
    if not isinstance(value, _CONTAINERS):
        return
    for item in value.values() if isinstance(value, _MAPPINGS) else value:
        if isinstance(item, _TREE_TYPES):
            yield item, value
        else:
            yield from _tree_objects(item)


def _place_in_tree(metric: Metric[Any], home: Arena | None) -> str:
    """The dotted prefix of ``metric``'s states in the tree whose arena holds them (``""``)."""
    if home is None or home.root is metric:
        return ""
    for prefix, inner in home.root._named_metrics():
        if inner is metric:
            return str(prefix)  # root is typed Any
    return ""


def _saved_tensor(name: str, value: Any, dtype: torch.dtype) -> torch.Tensor:
    """``state_dict[name]`` as a tensor with no autograd history, checked for a readable kind.

    A Python float takes a floating state's dtype (rounded; refused past its range), and a
    Python int any state's dtype that holds it exactly (``5`` for an int32 count).

    Raises:
        TypeError: If ``value`` is neither a tensor nor a number.
        ValueError: If it is a meta tensor (no values to load).
    """
    # device= always: torch.as_tensor without it takes the caller's default device
    # (torch.set_default_device, `with torch.device(...)`), moving a saved tensor there too,
    # and under a meta one every load was refused as "a meta tensor holds no values".
    host = value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
    try:
        tensor = torch.as_tensor(value, device=host)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"state_dict[{name!r}]: expected a tensor, got {value!r}") from error
    if tensor.is_meta:
        raise ValueError(
            f"state_dict[{name!r}]: a meta tensor holds no values (load the checkpoint's "
            "tensors, for example with torch.load or dcp.load into this metric's state_dict())"
        )
    if isinstance(value, float) and dtype.is_floating_point:
        tensor = torch.as_tensor(value, dtype=dtype, device=host)
        if math.isfinite(value) and not bool(torch.isfinite(tensor)):
            raise ValueError(
                f"state_dict[{name!r}]: {value!r} is past the range of this state's {dtype} "
                f"(at most {torch.finfo(dtype).max:g} in magnitude)"
            )
    elif isinstance(value, int) and not isinstance(value, bool) and dtype is not torch.bool:
        try:
            exact: torch.Tensor | None = torch.as_tensor(value, dtype=dtype, device=host)
        except RuntimeError:  # out of the dtype's range: refused below, as a saved int64
            exact = None
        if exact is not None and exact.item() == value:
            tensor = exact
    # Detached: a saved tensor that requires grad would pull the state buffer into autograd,
    # and every later in-place update of the metric tree would raise.
    return tensor.detach()


def _widens(saved: torch.dtype, state: torch.dtype) -> bool:
    """Whether a saved value loads exactly in a wider state (float32 in float64, int8 in int32)."""
    if saved.is_floating_point != state.is_floating_point:
        return False
    info = torch.finfo if saved.is_floating_point else torch.iinfo
    try:
        return info(saved).bits < info(state).bits and torch.promote_types(saved, state) == state
    except (TypeError, RuntimeError):  # no iinfo (bool, complex), no promotion (uint32, float8)
        return False


def has_own_sync(metric: Metric[Any]) -> bool:
    """Whether ``metric`` takes the slow sync path: its own ``sync``, or sample stores."""
    return type(metric).sync is not Metric.sync or any(True for _ in metric._sample_stores())


# The collections module's wrappers too: a UserDict or ChainMap of states hides them as well.
_MAPPINGS = (dict, collections.UserDict, collections.ChainMap, MappingProxyType)
_CONTAINERS = (list, tuple, set, frozenset, collections.deque, collections.UserList, *_MAPPINGS)
# A tuple, not MetricAccumulator | Metric: torch 2.8's dynamo cannot trace isinstance with a
# types.UnionType, and a compiled update runs __setattr__ and __delattr__.
_TREE_TYPES = (MetricAccumulator, Metric)

_CONTAINER_TYPES: dict[type, bool] = {}
"""Whether each type met is a container: ``isinstance`` against the ABC-registered ones
(``UserDict``, ``ChainMap``) costs a microsecond, and every sync asks of every attribute."""


def _items(container: Any) -> Iterable[Any]:
    """The items of a container: a mapping's values, else the container itself."""
    return container.values() if isinstance(container, _MAPPINGS) else container


def _may_hold_tree_objects(container: Any) -> bool:
    """Whether an item of ``container`` is a state, a metric or another container."""
    for kind in set(map(type, _items(container))):
        if issubclass(kind, _TREE_TYPES) or _is_container_type(kind):
            return True
    return False


def _default_device_type() -> str:
    """The type of the device tensors are made on by default (``torch.set_default_device``)."""
    try:
        return torch.get_default_device().type
    except AttributeError:
        # torch 2.8 after torch.set_default_device(None), which leaves its context None and
        # get_default_device failing on it: the default is the CPU again.
        return "cpu"


def _is_container_type(kind: type) -> bool:
    known = _CONTAINER_TYPES.get(kind)
    if known is None:
        known = _CONTAINER_TYPES[kind] = issubclass(kind, _CONTAINERS)
    return known
