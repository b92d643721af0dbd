"""Placement as plugins (llm-d style): filters narrow the engines, scorers
rate them in [0, 1], a picker chooses one. Contracts: interfaces.py; the one
registry of the scheduler's plugins (these and the queue's fairness and
ordering policies): registry.py; named policies and the framework:
policies.py."""

from .interfaces import EngineView, Filter, Picker, PickerState, PlacementRequest, ScoredEngine, Scorer
from .policies import Placement, PlacementPolicy, build_policy, builtin_profiles
from .registry import PluginRegistry, builtin_registry

__all__ = [
    "EngineView",
    "Filter",
    "Picker",
    "PickerState",
    "Placement",
    "PlacementPolicy",
    "PlacementRequest",
    "PluginRegistry",
    "ScoredEngine",
    "Scorer",
    "build_policy",
    "builtin_profiles",
    "builtin_registry",
]
