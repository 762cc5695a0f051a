"""What a kept rank puts back before each case, DESIGN's list and nothing else:
``Inherited`` (what the harness set up, from the launcher *now*) and ``FACTS`` (the torch
state distributed tests commonly change; one that cannot be put back retires the rank).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.devices import ACCELERATOR_NAMES, accelerators
from harness.launcher.groups import kept_entries, process_groups


@dataclass(frozen=True)
class Inherited:
    """What a rank spawned now would inherit from the launcher (as ``spawn`` passes it)."""

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]

    @classmethod
    def now(cls) -> Inherited:
        """The launcher's current environment, working directory and ``sys.path``."""
        return cls(dict(os.environ), os.getcwd(), list(sys.path))

    def apply(self, overlay: dict[str, str]) -> None:
        """Take them over in this rank, with ``overlay`` (the rank's own variables) on top."""
        target = {**self.environ, **overlay}
        for key in [k for k in os.environ if k not in target]:
            del os.environ[key]
        for key, value in target.items():
            if os.environ.get(key) != value:  # only the keys that differ are touched
                os.environ[key] = value
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        tempfile.tempdir = None  # recomputed from TMPDIR, as in a fresh process


@dataclass(frozen=True)
class Fact:
    """Process state a case can change: ``read()``, ``restore(value)`` (None: cannot be
    put back, a rank where it changed is retired); ``compare`` False: restored
    unconditionally; ``after``: the value a fresh rank would have, given the recorded one."""

    name: str
    read: Callable[[], Any]
    restore: Callable[[Any], None] | None = None
    compare: bool = True
    after: Callable[[Any], Any] | None = None


def _torch() -> Any:
    import torch

    return torch


def _torch_fact(name: str, getter: str, setter: str | None, **kw: Any) -> Fact:
    restore = None if setter is None else lambda value: getattr(_torch(), setter)(value)
    return Fact(name, lambda: getattr(_torch(), getter)(), restore, **kw)


def _np_random() -> Any:
    numpy = sys.modules.get("numpy")
    return None if numpy is None else numpy.random.get_state()


def _set_np_random(state: Any) -> None:
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return
    if state is not None:
        numpy.random.set_state(state)
    else:  # first imported by a case: fresh entropy, as a new process would get
        numpy.random.seed()


def _torch_rng() -> dict[str, Any]:
    torch = _torch()
    return {
        "seed": torch.initial_seed(),
        "cpu": torch.get_rng_state(),
        "devices": {
            kind.name: runtime.get_rng_state_all()
            for kind in accelerators()
            if (runtime := kind.initialised_runtime()) is not None
        },
    }


def _set_torch_rng(state: dict[str, Any]) -> None:
    # Every generator reseeded (accelerators' lazily), then the recorded states put back.
    torch = _torch()
    torch.manual_seed(state["seed"])
    torch.set_rng_state(state["cpu"])
    for kind in accelerators():
        if kind.name in state["devices"]:
            kind.torch_runtime().set_rng_state_all(state["devices"][kind.name])


def _autocast_nesting() -> int:
    torch = _torch()
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


def _autocast() -> dict[str, Any]:
    torch = _torch()
    state: dict[str, Any] = {
        "nesting": _autocast_nesting(),
        "cache": torch.is_autocast_cache_enabled(),
    }
    for device in ("cpu", *ACCELERATOR_NAMES):
        with contextlib.suppress(RuntimeError):  # a device type this torch does not know
            state[device] = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    return state


def _set_autocast(state: dict[str, Any]) -> None:
    # An autocast left entered keeps its device type enabled and the nesting above zero.
    torch = _torch()
    for _ in range(_autocast_nesting() - state["nesting"]):
        torch.autocast_decrement_nesting()
    torch.clear_autocast_cache()
    torch.set_autocast_cache_enabled(state["cache"])
    for device in ("cpu", *ACCELERATOR_NAMES):
        if device in state:
            torch.set_autocast_enabled(device, state[device][0])
            torch.set_autocast_dtype(device, state[device][1])


def _deterministic() -> tuple[bool, bool, bool, bool]:
    torch = _torch()
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )


def _set_deterministic(value: tuple[bool, bool, bool, bool]) -> None:
    torch = _torch()
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = value[2:]


def _threads_wanted(recorded: int) -> int:
    # A fresh rank's torch starts with the threads the inherited OMP_NUM_THREADS asks for.
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else recorded


#: torch.nn.modules.module's global hook registries (register_module_forward_hook, ...).
_MODULE_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


def _module_hooks() -> dict[str, Any]:
    module = sys.modules["torch.nn.modules.module"]
    hooks: dict[str, Any] = {
        name: dict(getattr(module, name)) for name in _MODULE_HOOKS if hasattr(module, name)
    }
    hooks["_global_is_full_backward_hook"] = getattr(module, "_global_is_full_backward_hook", None)
    return hooks


def _set_module_hooks(hooks: dict[str, Any]) -> None:
    module = sys.modules["torch.nn.modules.module"]
    for name in _MODULE_HOOKS:
        registry = getattr(module, name, None)
        if registry is not None:
            registry.clear()
            registry.update(hooks.get(name, {}))
    module._global_is_full_backward_hook = hooks.get("_global_is_full_backward_hook")


#: The state a kept rank restores before each case (or retires over), DESIGN's list.
FACTS: tuple[Fact, ...] = (
    Fact("the Python random generator", random.getstate, random.setstate, compare=False),
    Fact("the NumPy random generator", _np_random, _set_np_random, compare=False),
    Fact("torch's random generators", _torch_rng, _set_torch_rng, compare=False),
    _torch_fact("torch's default dtype", "get_default_dtype", "set_default_dtype"),
    _torch_fact("torch's grad mode", "is_grad_enabled", "set_grad_enabled"),
    # No setter: an inference_mode() left entered is undone only by its guard.
    _torch_fact("torch's inference mode", "is_inference_mode_enabled", None),
    Fact(
        "torch's anomaly mode",
        lambda: (_torch().is_anomaly_enabled(), _torch().is_anomaly_check_nan_enabled()),
        lambda value: _torch().set_anomaly_enabled(*value),
    ),
    Fact("autocast", _autocast, _set_autocast, compare=False),
    Fact("torch's deterministic algorithms flags", _deterministic, _set_deterministic),
    _torch_fact(
        "torch's intra-op threads", "get_num_threads", "set_num_threads", after=_threads_wanted
    ),
    # torch refuses a second set_num_interop_threads in a process: the next case's would fail.
    _torch_fact("torch's inter-op threads", "get_num_interop_threads", None),
    Fact("global module hooks", _module_hooks, _set_module_hooks, compare=False),
)


@dataclass
class Baseline:
    """``FACTS`` as they were before the ranks' first case, and what else a case must not
    leave behind (threads, process groups)."""

    facts: dict[str, Any]
    threads: frozenset[int]
    groups: int = 0
    default_group: Any = None
    unrestored: list[str] = field(default_factory=list)

    @classmethod
    def capture(cls) -> Baseline:
        """Record the current state; call it once the process group is up (torch imported)."""
        facts = {}
        for fact in FACTS:
            with contextlib.suppress(Exception):  # a fact this torch cannot read is not kept
                facts[fact.name] = fact.read()
        baseline = cls(
            facts=facts,
            threads=frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
        )
        baseline.groups, baseline.default_group = process_groups()
        # What exists now lives as long as the rank: out of every later collection.
        gc.collect()
        gc.freeze()
        return baseline

    def restore(self) -> None:
        """Put back every restorable fact (as a fresh rank would have it)."""
        for fact in FACTS:
            if fact.restore is None or fact.name not in self.facts:
                continue
            want = self._wanted(fact)
            try:
                if not fact.compare or fact.read() != want:
                    fact.restore(want)
            except Exception as exc:
                self.unrestored.append(f"{fact.name} ({type(exc).__name__}: {exc})")

    def leftovers(self) -> str | None:
        """Why this rank cannot run another case (None: it can), after restoring."""
        self.restore()
        changed = list(self.unrestored)
        for fact in FACTS:
            if fact.compare and fact.name in self.facts:
                try:
                    if fact.read() != self._wanted(fact):
                        changed.append(fact.name)
                except Exception:
                    changed.append(fact.name)
        if changed:
            return "the case changed what cannot be put back: " + ", ".join(changed)
        threads = [t for t in threading.enumerate() if t.ident not in self.threads and t.is_alive()]
        if threads:
            names = ", ".join(sorted(t.name for t in threads))
            return f"the case left {len(threads)} thread(s) running ({names})"
        groups, default = process_groups()
        if default is not self.default_group:
            return "the case destroyed or replaced the default process group"
        # Destroying sub-groups risks a hang: their ranks are not reused.
        made = groups - self.groups - kept_entries()
        if made:
            return (
                f"the case created {made} process group(s) "
                "(harness.kept_group makes sub-groups a kept rank keeps)"
            )
        return _device_error()

    def _wanted(self, fact: Fact) -> Any:
        recorded = self.facts[fact.name]
        return recorded if fact.after is None else fact.after(recorded)


def _device_error() -> str | None:
    """A sticky accelerator error (it surfaces at a synchronize) retires the rank."""
    for kind in accelerators():
        runtime = kind.initialised_runtime()
        if runtime is None:
            continue
        try:
            runtime.synchronize()
        except Exception as exc:
            return f"{kind.name} error after the case: {type(exc).__name__}: {exc}"
    return None
