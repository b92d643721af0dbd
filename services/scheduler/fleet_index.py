"""The fleet's placement indexes: per model, its engines sorted by each figure
a policy ranks on (placement/candidates.py says which and why), and the
candidate engines of one request taken from them.

Kept up to date, not rebuilt: the fleet marks an engine whenever its report,
leases or reservations change (`touch`); the view of a marked engine is
rebuilt and re-keyed with a bisect per figure when its report is applied
(leases: at the next decision), one engine at a time, whatever the fleet's
size. Decisions read
those views (fleet.py `_current`), so a candidate's view is not rebuilt
either. A figure is built from every engine of the model the first time a
policy asks for it (a policy swap), then kept like the rest. Freshness and
draining are read live by the fleet, so a silent engine needs no mark. Sorted lists of (key, registration order,
engine id): insertion and removal are a C-level memmove, cheap at 1,000s of
engines, and a walk from the front yields the best engines first.

Registration order is the registry's (a re-registration keeps its place),
so the candidates come back in the order a full scan sees them and a model
scanned whole behaves exactly as before.

Owned by `EngineFleet` (fleet.py) and called only from it (the scheduler
core's one thread).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Set
from dataclasses import dataclass, field

from .placement import EngineView, PlacementRequest
from .placement.candidates import ORDER_KEYS, CandidatePlan

__all__ = ["FleetIndex"]

_Entry = tuple[float, int, str]


@dataclass
class _Model:
    """One model's engines: registration order and the figures built so far."""

    seq: dict[str, int] = field(default_factory=dict)
    orders: dict[str, list[_Entry]] = field(default_factory=dict)
    keys: dict[str, dict[str, float]] = field(default_factory=dict)   # figure -> engine -> key
    # Engines with a lease slot free, as of their last re-key: for a P0
    # (leases < lease_limit), and below the P0-reserved slots (for the
    # rest). A request that needs a slot looks only among them (`_pool`): a
    # busy fleet has few or none, and a walk over every full engine of
    # 1,024 cost ~3 ms per failed attempt (scripts/bench_heartbeats.py).
    open: set[str] = field(default_factory=set)
    open_unreserved: set[str] = field(default_factory=set)


class FleetIndex:
    def __init__(self, fallback_tokens_per_second: float) -> None:
        self._fallback = fallback_tokens_per_second
        self._models: dict[str, _Model] = {}
        self._model_of: dict[str, str] = {}
        self._views: dict[str, EngineView] = {}      # as of the last re-key (fleet.py `_current`)
        self._dirty: set[str] = set()
        self._seq = itertools.count()

    # ------------------------------------------------------------ upkeep

    def join(self, engine_id: str, model: str) -> None:
        """A registration (new, or replacing one of the same id: same place)."""
        old = self._model_of.get(engine_id)
        if old != model:
            seq = self._models[old].seq[engine_id] if old is not None else next(self._seq)
            if old is not None:
                self._remove(engine_id)
            self._models.setdefault(model, _Model()).seq[engine_id] = seq
            self._model_of[engine_id] = model
        self._dirty.add(engine_id)

    def leave(self, engine_id: str) -> None:
        if engine_id in self._model_of:
            self._remove(engine_id)
        self._dirty.discard(engine_id)
        self._views.pop(engine_id, None)

    def touch(self, engine_id: str) -> None:
        """Its report, leases or reservations changed: re-key it before the next decision."""
        if engine_id in self._model_of:
            self._dirty.add(engine_id)

    def _remove(self, engine_id: str) -> None:
        model = self._models[self._model_of.pop(engine_id)]
        model.open.discard(engine_id)
        model.open_unreserved.discard(engine_id)
        seq = model.seq.pop(engine_id)
        for name, entries in model.orders.items():
            key = model.keys[name].pop(engine_id, None)
            if key is not None:
                del entries[bisect.bisect_left(entries, (key, seq, engine_id))]

    def refresh(self, view_of: Callable[[str], EngineView]) -> None:
        """Re-key the engines marked since the last decision."""
        for engine_id in self._dirty:
            model_name = self._model_of.get(engine_id)
            if model_name is None:
                continue
            view = self._views[engine_id] = view_of(engine_id)
            model = self._models[model_name]
            for slots, free in ((model.open, view.leases < view.lease_limit),
                                (model.open_unreserved, view.unreserved_room())):
                if free:
                    slots.add(engine_id)
                else:
                    slots.discard(engine_id)
            seq = model.seq[engine_id]
            for name, entries in model.orders.items():
                self._rekey(model, name, entries, engine_id, seq, self._key(name, view))
        self._dirty.clear()

    @staticmethod
    def _rekey(model: _Model, name: str, entries: list[_Entry], engine_id: str, seq: int, key: float) -> None:
        keys = model.keys[name]
        old = keys.get(engine_id)
        if old == key:
            return
        if old is not None:
            del entries[bisect.bisect_left(entries, (old, seq, engine_id))]
        keys[engine_id] = key
        bisect.insort(entries, (key, seq, engine_id))

    def _key(self, name: str, view: EngineView) -> float:
        """The figure's key; a NaN (a report's NaN speed) sorts last, so the
        lists stay ordered and every entry can be found again."""
        key = ORDER_KEYS[name](view, self._fallback)
        return key if key == key else math.inf

    def _order(self, model: _Model, name: str) -> list[_Entry]:
        entries = model.orders.get(name)
        if entries is None:  # first use of this figure: build it once from every engine
            model.keys[name] = {e: self._key(name, self._views[e]) for e in model.seq}
            entries = model.orders[name] = sorted((k, model.seq[e], e) for e, k in model.keys[name].items())
        return entries

    def rest(self, model_name: str, skip: Set[str], keep: Callable[[str], bool]) -> list[str]:
        """The model's engines not in `skip` that `keep`, in registration order."""
        model = self._models.get(model_name)
        if model is None:
            return []
        return sorted((e for e in model.seq if e not in skip and keep(e)), key=model.seq.__getitem__)

    def members(self, model: str) -> Collection[str]:
        """The ids of the engines registered for `model`."""
        found = self._models.get(model)
        return found.seq.keys() if found is not None else ()

    def view(self, engine_id: str) -> EngineView:
        """The engine's view as of its last re-key: current but for what
        changes without a mark (freshness, drains: the fleet reads those live)."""
        return self._views[engine_id]

    @property
    def views(self) -> Mapping[str, EngineView]:
        """`view` of every engine, read only (for loops over many ids)."""
        return self._views

    # ------------------------------------------------------------ candidates

    def candidates(
        self, request: PlacementRequest, plan: CandidatePlan,
        holders: Callable[[int], Set[str]], eligible: Callable[[str], bool],
    ) -> list[str] | None:
        """The engine ids to score for `request`, in registration order;
        [] = no engine of the model passes the plan's checks (nor would a
        full scan place it); None = scan the model whole (small, unknown)."""
        model = self._models.get(request.model)
        if model is None or plan.scans_whole(len(model.seq)):
            return None
        pool = self._pool(model, request, plan)
        if pool is not None and not pool:
            return []          # every engine's slots are taken: none passes
        chosen = self._warm(model, request, plan, holders, eligible, pool)
        for i, name in enumerate(plan.orders):
            taken = self._walk(self._within(model, name, pool), plan.k, chosen, eligible)
            if i == 0 and taken == 0:
                return []      # walked every engine: none passes
        return sorted(chosen, key=model.seq.__getitem__)

    @staticmethod
    def _pool(model: _Model, request: PlacementRequest, plan: CandidatePlan) -> Set[str] | None:
        """The only engines that may pass `eligible` (fleet_reads.py) for
        `request`, or None (any may): its slot checks, read off the sets."""
        if not request.reserved_slots:
            return model.open_unreserved
        if "lease_slots" in plan.checks:
            return model.open if request.slot_priority == 0 else model.open_unreserved
        return None   # reserved slots and no slot check: a full engine passes too

    def _within(self, model: _Model, name: str, pool: Set[str] | None) -> Iterable[_Entry]:
        """Figure `name`'s entries, in order, of `pool`'s engines (None: all)."""
        return self._order(model, name) if pool is None else self._among(model, name, pool)

    def _warm(
        self, model: _Model, request: PlacementRequest, plan: CandidatePlan,
        holders: Callable[[int], Set[str]], eligible: Callable[[str], bool], pool: Set[str] | None,
    ) -> set[str]:
        """The warm candidates (placement/candidates.py says which). The
        walks look only among `pool` (None: all): the same engines pass,
        in the same order, without walking past the full ones."""
        prefix = request.prefix_hashes
        if not prefix:
            return set()
        first = model.seq.keys() & holders(prefix[0])
        if len(first) <= plan.warm_cap:
            return {e for e in first if eligible(e)}
        deep: set[str] = set()
        for h in reversed(prefix[1:]):
            deep = model.seq.keys() & holders(h)
            if deep:
                break
        chosen: set[str] = set()
        if 0 < len(deep) <= plan.warm_cap:
            chosen.update(e for e in deep if eligible(e))
        elif deep:
            self._walk(self._among(model, plan.warm, deep if pool is None else deep & pool),
                       plan.warm_cap, chosen, eligible)
        self._walk(self._among(model, plan.warm, first if pool is None else first & pool), plan.k, chosen, eligible)
        return chosen

    def _among(self, model: _Model, name: str, engines: Set[str]) -> Iterable[_Entry]:
        """The entries of figure `name` for `engines` (of `model`), in the
        figure's order. A few dozen warm engines of a large fleet are sorted
        apart rather than looked for along the whole list (~1,000 entries
        walked at 1,024 engines, a hot context on 32 of them)."""
        entries = self._order(model, name)
        if len(engines) * 16 > len(entries):
            return (entry for entry in entries if entry[2] in engines)
        keys, seq = model.keys[name], model.seq
        return sorted((keys[e], seq[e], e) for e in engines)

    @staticmethod
    def _walk(entries: Iterable[_Entry], n: int, chosen: set[str], eligible: Callable[[str], bool]) -> int:
        """Add to `chosen` the first `n` eligible engines of `entries`
        (already chosen ones count). Returns how many."""
        taken = 0
        for _, _, engine_id in entries:
            if engine_id in chosen or eligible(engine_id):
                chosen.add(engine_id)
                taken += 1
                if taken >= n:
                    break
        return taken
