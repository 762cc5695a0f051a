"""How a launched case's values (fixtures, arguments, ``self`` state) reach its ranks:
pickled, a module by name, pytest's ``MonkeyPatch`` as the patches it holds, applied again
in the rank (environment variables need none: ranks start from the launcher's)."""

from __future__ import annotations

import importlib
import io
import os
import pickle
import sys
import types
from typing import Any

#: ("setattr", target, name, value), ("delattr", target, name),
#: ("setitem", mapping, key, value) or ("delitem", mapping, key)
Operation = tuple
_ABSENT = object()
#: The ``MonkeyPatch`` objects this process rebuilt since ``undo_monkeypatches`` ran.
_rebuilt: list[Any] = []


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType) and obj.__name__ in sys.modules:
            return importlib.import_module, (obj.__name__,)
        monkeypatch = sys.modules.get("_pytest.monkeypatch")
        if monkeypatch is not None and isinstance(obj, monkeypatch.MonkeyPatch):
            return _rebuild_monkeypatch, (_operations(obj),)
        return NotImplemented


def dumps(value: Any) -> bytes:
    """``value`` pickled for a rank (``pickle.loads`` reads it back there)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _operations(patch: Any) -> list[Operation]:
    """What ``patch`` patched, as operations setting the values in effect now (each target
    once, in the order first patched; ``os.environ`` left out)."""
    operations: list[Operation] = []
    seen: set[tuple[int, Any]] = set()
    for target, name, _ in patch._setattr:
        if (id(target), name) in seen:
            continue
        seen.add((id(target), name))
        if isinstance(target, type):
            now = target.__dict__.get(name, _ABSENT)
        else:
            now = getattr(target, name, _ABSENT)
        operations.append(
            ("delattr", target, name) if now is _ABSENT else ("setattr", target, name, now)
        )
    for mapping, key, _ in patch._setitem:
        if mapping is os.environ or (id(mapping), key) in seen:
            continue
        seen.add((id(mapping), key))
        now = mapping.get(key, _ABSENT)
        place = _global_holding(mapping) or mapping
        operations.append(
            ("delitem", place, key) if now is _ABSENT else ("setitem", place, key, now)
        )
    return operations


class _Global:
    """A module global, named so the rank patches its own (not a copy of it)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)


def _global_holding(value: Any) -> _Global | None:
    for module_name, module in list(sys.modules.items()):
        for name, held in list(getattr(module, "__dict__", {}).items()):
            if held is value and not name.startswith("__"):
                return _Global(module_name, name)
    return None


def _rebuild_monkeypatch(operations: list[Operation]) -> Any:
    """In a rank: a ``MonkeyPatch`` that has applied ``operations`` here."""
    from _pytest.monkeypatch import MonkeyPatch

    patch = MonkeyPatch()
    _rebuilt.append(patch)
    for kind, target, key, *value in operations:
        if isinstance(target, _Global):
            target = target.resolve()
        if kind == "setattr":
            patch.setattr(target, key, value[0], raising=False)
        elif kind == "delattr":
            patch.delattr(target, key, raising=False)
        elif kind == "setitem":
            patch.setitem(target, key, value[0])
        else:
            patch.delitem(target, key, raising=False)
    return patch


def undo_monkeypatches() -> None:
    """Undo, in a rank, the patches of the ``MonkeyPatch`` objects it received, newest first."""
    while _rebuilt:
        _rebuilt.pop().undo()
