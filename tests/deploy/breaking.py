"""Rendered manifests broken on purpose, for the tests that show a check
fails on the mistake it guards against."""

from __future__ import annotations

import copy
from collections.abc import Callable

from .manifests import Obj, render

__all__ = ["broken", "config_edit"]


def broken(change: Callable[[list[Obj]], None], overlay: str = "overlays/dev-cpu") -> list[Obj]:
    """A copy of the overlay's objects with `change` applied."""
    objects = copy.deepcopy(render(overlay))
    change(objects)
    return objects


def config_edit(old: str, new: str) -> Callable[[list[Obj]], None]:
    """A change replacing `old` (which must be there) by `new` in the kvmesh.yaml of ConfigMap kvmesh-config."""
    def change(objects: list[Obj]) -> None:
        cm = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("kvmesh-config"))
        assert old in cm["data"]["kvmesh.yaml"]
        cm["data"]["kvmesh.yaml"] = cm["data"]["kvmesh.yaml"].replace(old, new)
    return change
