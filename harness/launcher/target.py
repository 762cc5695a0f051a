"""How a launched test reaches its ranks: its function named so that a freshly spawned
process can import it (``FunctionRef``: a test module loaded with pytest's assertion
rewriting), its conftest chain, and its values (``dumps``: fixtures, arguments, ``self``
state pickled, a module by name, pytest's ``MonkeyPatch`` as the patches it holds, applied
again in the rank; environment variables need none: ranks start from the launcher's)."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import pickle
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class FunctionRef:
    """A module-level function or a test method by ``module``, ``qualname`` and the module's
    ``path``; ``load()`` gives back the callable in any process."""

    module: str
    qualname: str
    path: str | None = None
    rewrite_asserts: bool = False

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> FunctionRef:
        """Reference a module-level function; ``ValueError`` for one a spawned process could
        not import (a lambda, a closure)."""
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise ValueError(
                f"harness.launch needs a function defined at module level so that the "
                f"spawned ranks can import it; got {fn!r}"
            )
        mod = sys.modules.get(module)
        return cls(module, qualname, getattr(mod, "__file__", None))

    @classmethod
    def for_test(cls, item: Any) -> FunctionRef:
        """Reference the function (or method) of a pytest ``Function`` item."""
        module = item.module
        name = item.originalname
        qualname = f"{item.cls.__qualname__}.{name}" if item.cls is not None else name
        return cls(module.__name__, qualname, getattr(module, "__file__", None), True)

    def load(self, *, fresh: bool = False) -> Callable[..., Any]:
        """The callable, its module imported if it is not yet (``fresh``: a module with a
        source file executed again into a new module object; what it imports is not
        reloaded); a test method bound to a fresh instance of its class."""
        module = None if fresh and _loadable(self.path) else sys.modules.get(self.module)
        if module is None:
            module = _import(self.module, self.path, self.rewrite_asserts, fresh=fresh)
        parts = self.qualname.split(".")
        owner: Any = module
        obj: Any = module
        for part in parts:
            owner = obj
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise ImportError(
                    f"{self.qualname} not found in module {self.module} "
                    f"({self.path or 'no file'}) in the rank process"
                ) from None
        if isinstance(owner, type) and isinstance(
            inspect.getattr_static(owner, parts[-1]), types.FunctionType
        ):
            obj = getattr(owner(), parts[-1])
        return obj


def conftests_for(item: Any) -> tuple[tuple[str, str], ...]:
    """The ``conftest.py`` modules pytest loaded for ``item``'s directory and its ancestors,
    outermost first, as (module name, file)."""
    test_dir = os.path.dirname(os.path.abspath(str(item.path)))
    found = []
    for plugin in item.config.pluginmanager.get_plugins():
        path = getattr(plugin, "__file__", None)
        if (
            not isinstance(plugin, types.ModuleType)
            or os.path.basename(path or "") != "conftest.py"
        ):
            continue
        where = os.path.dirname(os.path.abspath(path))
        if test_dir == where or test_dir.startswith(where + os.sep):
            found.append((where.count(os.sep), plugin.__name__, path))
    return tuple((name, path) for _, name, path in sorted(found))


#: The conftest modules this process imported, by file (each may be named ``conftest``).
_conftests: dict[str, types.ModuleType] = {}


def import_conftests(conftests: tuple[tuple[str, str], ...]) -> None:
    """Import each conftest module this process has not (assertion rewriting), outermost
    first; the innermost holds a shared name in ``sys.modules`` (its classes unpickle)."""
    for name, path in conftests:
        module = _conftests.get(path)
        if module is None and _loadable(path):
            held = sys.modules.get(name)
            if held is not None and getattr(held, "__file__", None) == path:
                module = held
            else:
                sys.modules.pop(name, None)
                module = _load_from_file(name, path, rewrite=True)
            _conftests[path] = module
        if module is not None:
            sys.modules[name] = module


def _loadable(path: str | None) -> bool:
    return path is not None and path.endswith(".py") and os.path.isfile(path)


def _import(name: str, path: str | None, rewrite: bool, *, fresh: bool = False) -> types.ModuleType:
    loadable = _loadable(path)
    if loadable and (rewrite or fresh):
        return _load_from_file(name, path, rewrite=rewrite)
    try:
        return importlib.import_module(name)
    except ImportError:
        if not loadable:
            raise
        return _load_from_file(name, path, rewrite=False)


def _load_from_file(name: str, path: str, *, rewrite: bool) -> types.ModuleType:
    parent = name.rpartition(".")[0]
    if parent and parent not in sys.modules:
        with contextlib.suppress(ImportError):  # its relative imports will fail and say so
            importlib.import_module(parent)
    spec = importlib.util.spec_from_file_location(name, path)  # a .py file: never None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        code = _rewritten_code(path) if rewrite else None
        if code is None:
            spec.loader.exec_module(module)
        else:
            exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


#: (path, mtime, size) -> rewritten code (a kept rank executes a test module per case).
_rewritten: dict[tuple[str, int, int], types.CodeType] = {}


def _rewritten_code(path: str) -> types.CodeType | None:
    """The module compiled with pytest's assertion rewriting (None: it cannot be: plain
    asserts still fail, with less explanation)."""
    try:
        stat = os.stat(path)
        key = (path, stat.st_mtime_ns, stat.st_size)
        if key in _rewritten:
            return _rewritten[key]
        from _pytest.assertion.rewrite import rewrite_asserts

        with open(path, "rb") as f:
            source = f.read()
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path, None)
        code = compile(tree, path, "exec", dont_inherit=True)
        _rewritten[key] = code
        return code
    except Exception:
        return None


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
        # A class's own entry: getattr would resolve a descriptor (staticmethod, ...).
        now = (
            vars(target).get(name, _ABSENT)
            if isinstance(target, type)
            else getattr(target, name, _ABSENT)
        )
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


class _Global(NamedTuple):
    """A module global, named so the rank patches its own (not a copy of it)."""

    module: str
    name: str


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
            target = getattr(importlib.import_module(target.module), target.name)
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
