"""Naming a function so that a freshly spawned process can import and call it (module,
qualified name, file; a test module loaded from its file with pytest's assertion
rewriting), and the test's conftest chain imported there."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
        if not isinstance(plugin, types.ModuleType) or not path:
            continue
        if os.path.basename(path) != "conftest.py":
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
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name} from {path}")
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
