"""Putting a pooled rank back into the state a fresh rank starts a case in.

A pooled rank runs many cases in one interpreter. Before each case, what a
freshly spawned rank inherits from the launcher -- its environment, working
directory, ``sys.path`` and file-mode creation mask (umask) -- is taken from
the launcher *now* (``Inherited``), so fixtures that set them for the case
reach the ranks. ContextVars (e.g. a ``channel_loss.capture()`` scope a case
left open) need no restoring: each case runs in a copy of the rank's
untouched context (``fresh_context``).

Everything else a case can change in the process is one entry of
``FACTS``, the list of *interpreter facts*: how to read it, and either how to
put it back (restore) or nothing (retire: a rank where it changed is not
reused). ``Baseline`` records every fact before the pool's first case;
``restore`` puts back the restorable ones before each later case, and
``leftovers`` names, after a case, the facts that changed and cannot be (or
could not be) put back, plus what the case left running: threads, process
groups, an accelerator error. A new kind of left-over state is one more
entry in ``FACTS``.

Nothing here imports torch at module level: a rank imports this module before
its environment (``CUDA_VISIBLE_DEVICES`` ...) is set.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import logging
import multiprocessing
import os
import random
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.devices import accelerators
from harness.launcher.groups import kept_entries, process_groups


def set_environ(target: dict[str, str]) -> None:
    """Make ``os.environ`` equal ``target``, touching only the keys that differ."""
    for key in [k for k in os.environ if k not in target]:
        del os.environ[key]
    for key, value in target.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@dataclass(frozen=True)
class Inherited:
    """What a rank spawned now would inherit from the launcher (as ``spawn`` passes it)."""

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    umask: int = 0o022

    @classmethod
    def now(cls) -> Inherited:
        """The launcher's current environment, working directory, ``sys.path`` and umask."""
        return cls(dict(os.environ), os.getcwd(), list(sys.path), _umask())

    def apply(self, overlay: dict[str, str]) -> None:
        """Take them over in this rank, with ``overlay`` (the rank's own variables) on top."""
        set_environ({**self.environ, **overlay})
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        os.umask(self.umask)


def fresh_context() -> contextvars.Context:
    """A context in which a case runs: a copy of this (never case-touched)
    context, so ContextVars the case sets do not outlive it."""
    return contextvars.copy_context()


@dataclass(frozen=True)
class Fact:
    """One piece of process state a case can change.

    ``read()`` gives its value now; ``restore(value)`` puts a recorded value
    back (None: it cannot be, and a rank where the fact changed is retired).
    ``torch``: the fact exists only once torch is imported. ``compare``:
    values compare with ``==`` (False: restored unconditionally, e.g. random
    generator states, and never a reason to retire). ``after``: the value a
    fresh rank would have, given the recorded one (e.g. the thread count that
    ``OMP_NUM_THREADS`` asks for); by default the recorded one.
    """

    name: str
    read: Callable[[], Any]
    restore: Callable[[Any], None] | None = None
    torch: bool = False
    compare: bool = True
    after: Callable[[Any], Any] | None = None


def _resource() -> Any:
    try:
        import resource
    except ImportError:  # not on every platform
        return None
    return resource


def _limits() -> dict[int, tuple[int, int]]:
    resource = _resource()
    if resource is None:
        return {}
    out = {}
    for name in (
        "RLIMIT_NOFILE",
        "RLIMIT_CORE",
        "RLIMIT_STACK",
        "RLIMIT_AS",
        "RLIMIT_NPROC",
        "RLIMIT_DATA",
        "RLIMIT_FSIZE",
        "RLIMIT_CPU",
    ):
        which = getattr(resource, name, None)
        if which is not None:
            with contextlib.suppress(OSError, ValueError):
                out[which] = resource.getrlimit(which)
    return out


def _set_limits(limits: dict[int, tuple[int, int]]) -> None:
    resource = _resource()
    for which, limit in limits.items():
        with contextlib.suppress(OSError, ValueError):
            if resource.getrlimit(which) != limit:
                resource.setrlimit(which, limit)


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


def _set_warning_filters(filters: list) -> None:
    warnings.filters[:] = filters
    mutated = getattr(warnings, "_filters_mutated", None)
    if mutated is not None:
        mutated()  # invalidates the "already warned" caches, as warnings.filterwarnings does


def _set_log_handlers(handlers: list) -> None:
    logging.getLogger().handlers[:] = handlers


def _signals() -> dict[int, Any]:
    return {sig: signal.getsignal(sig) for sig in _SIGNALS}


def _set_signals(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


def _timer() -> Any:
    return signal.getitimer(signal.ITIMER_REAL) if hasattr(signal, "getitimer") else None


def _cancel_timer(_: Any) -> None:
    if hasattr(signal, "alarm"):
        signal.alarm(0)
    if hasattr(signal, "setitimer"):
        signal.setitimer(signal.ITIMER_REAL, 0)


def _signal_mask() -> frozenset[int]:
    return frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def _set_signal_mask(mask: frozenset[int]) -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _set_trace(trace: Any) -> None:
    sys.settrace(trace)
    threading.settrace(trace)


def _set_profile(profile: Any) -> None:
    sys.setprofile(profile)
    threading.setprofile(profile)


def _set_attr(owner: Any, name: str) -> Callable[[Any], None]:
    return lambda value: setattr(owner, name, value)


def _set_gc_enabled(enabled: bool) -> None:
    (gc.enable if enabled else gc.disable)()


def _tz() -> tuple:
    return (time.tzname, time.timezone, time.altzone, time.daylight)


def _reset_tz(_: Any) -> None:
    # The environment (TZ included) is the launcher's by now; what the time
    # module derived from a TZ a case set is recomputed from it.
    time.tzset()


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def _set_nice(value: int) -> None:
    os.setpriority(os.PRIO_PROCESS, 0, value)


def _affinity() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0))


def _set_affinity(cpus: frozenset[int]) -> None:
    os.sched_setaffinity(0, cpus)


def _int_digits() -> int:
    return sys.get_int_max_str_digits()


def _set_start_method(method: str | None) -> None:
    multiprocessing.set_start_method(method, force=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _torch() -> Any:
    import torch

    return torch


def _setter(name: str) -> Callable[[Any], None]:
    """``torch.<name>(value)``."""
    return lambda value: getattr(_torch(), name)(value)


def _torch_fact(name: str, getter: str, setter: str, **kw: Any) -> Fact:
    """A fact torch reads with ``torch.<getter>()`` and sets with ``torch.<setter>(value)``."""
    return Fact(name, lambda: getattr(_torch(), getter)(), _setter(setter), torch=True, **kw)


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
    # Every generator to a known state: accelerators' (lazily, without
    # initialising a runtime) reseeded with the rank's initial seed, then the
    # recorded states put back exactly.
    torch = _torch()
    torch.manual_seed(state["seed"])
    torch.set_rng_state(state["cpu"])
    for kind in accelerators():
        if kind.name in state["devices"]:
            kind.torch_runtime().set_rng_state_all(state["devices"][kind.name])


def _default_device() -> Any:
    get = getattr(_torch(), "get_default_device", None)
    return None if get is None else get()


def _set_default_device(device: Any) -> None:
    if device is not None:
        _torch().set_default_device(None if device.type == "cpu" else device)


def _deterministic() -> tuple[bool, bool]:
    torch = _torch()
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _set_deterministic(value: tuple[bool, bool]) -> None:
    _torch().use_deterministic_algorithms(value[0], warn_only=value[1])


def _threads_wanted(recorded: int) -> int:
    # A fresh rank's torch starts with the threads OMP_NUM_THREADS (as the
    # launcher's environment has it now, e.g. set by a fixture) asks for.
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else recorded


def _flush_denormal() -> bool:
    torch = _torch()
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    return bool((tiny * 1.0).item() == 0.0)


def _print_options() -> dict[str, Any]:
    opts = _torch()._tensor_str.PRINT_OPTS
    return {
        name: getattr(opts, name)
        for name in ("precision", "threshold", "edgeitems", "linewidth", "sci_mode")
    }


def _set_print_options(options: dict[str, Any]) -> None:
    _torch().set_printoptions(**options)


def _saved_tensors_hooks() -> Any:
    """The innermost active default saved-tensor hooks (None: none active)."""
    return _torch()._C._autograd._top_saved_tensors_default_hooks(True)


def _clear_saved_tensors_hooks(recorded: Any) -> None:
    # Scopes a case left entered are popped; the baseline has none.
    autograd = _torch()._C._autograd
    for _ in range(1000):
        if autograd._top_saved_tensors_default_hooks(True) is recorded:
            return
        autograd._pop_saved_tensors_default_hooks()


def _set_saved_tensors_hooks_enabled(enabled: bool) -> None:
    autograd = _torch()._C._autograd
    if enabled:
        autograd._saved_tensors_hooks_enable()
    else:
        autograd._saved_tensors_hooks_disable("disabled by the pool's first case")


def _mode_stacks() -> tuple[int, int]:
    c = _torch()._C
    return (c._len_torch_function_stack(), c._len_torch_dispatch_stack())


def _pop_modes(depths: tuple[int, int]) -> None:
    c = _torch()._C
    while c._len_torch_function_stack() > depths[0]:
        c._pop_torch_function_stack()
    while c._len_torch_dispatch_stack() > depths[1]:
        c._pop_torch_dispatch_stack()


def _backends_flags() -> dict[str, Any]:
    backends = _torch().backends
    return {
        "cudnn_deterministic": backends.cudnn.deterministic,
        "cudnn_benchmark": backends.cudnn.benchmark,
        "cudnn_tf32": backends.cudnn.allow_tf32,
        "cuda_matmul_tf32": backends.cuda.matmul.allow_tf32,
    }


def _set_backends_flags(flags: dict[str, Any]) -> None:
    backends = _torch().backends
    backends.cudnn.deterministic = flags["cudnn_deterministic"]
    backends.cudnn.benchmark = flags["cudnn_benchmark"]
    backends.cudnn.allow_tf32 = flags["cudnn_tf32"]
    backends.cuda.matmul.allow_tf32 = flags["cuda_matmul_tf32"]


#: Signals whose handlers a case may have replaced (the stack-dump signal is
#: the harness's own and stays).
_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGUSR2", "SIGCHLD", "SIGPIPE")
    if hasattr(signal, name)
)

_has = hasattr

#: Every interpreter fact a case can change, with its restore (or None: retire).
FACTS: tuple[Fact, ...] = tuple(
    f
    for f in (
        Fact("the Python random generator", random.getstate, random.setstate, compare=False),
        Fact("the NumPy random generator", _np_random, _set_np_random, compare=False),
        Fact("the warning filters", lambda: list(warnings.filters), _set_warning_filters),
        Fact(
            "the root logger's level",
            lambda: logging.getLogger().level,
            lambda level: logging.getLogger().setLevel(level),
        ),
        Fact(
            "the root logger's handlers",
            lambda: list(logging.getLogger().handlers),
            _set_log_handlers,
        ),
        Fact("signal handlers", _signals, _set_signals),
        Fact("a pending alarm / interval timer", _timer, _cancel_timer, compare=False),
        Fact("the signal mask", _signal_mask, _set_signal_mask)
        if _has(signal, "pthread_sigmask")
        else None,
        Fact("sys.stdin", lambda: sys.stdin, _set_attr(sys, "stdin")),
        Fact("sys.stdout", lambda: sys.stdout, _set_attr(sys, "stdout")),
        Fact("sys.stderr", lambda: sys.stderr, _set_attr(sys, "stderr")),
        Fact("the recursion limit", sys.getrecursionlimit, sys.setrecursionlimit),
        Fact("the int-to-str digits limit", _int_digits, sys.set_int_max_str_digits)
        if _has(sys, "set_int_max_str_digits")
        else None,
        Fact("garbage collection (enabled)", gc.isenabled, _set_gc_enabled),
        Fact(
            "the garbage collector's thresholds",
            gc.get_threshold,
            lambda value: gc.set_threshold(*value),
        ),
        Fact("the thread switch interval", sys.getswitchinterval, sys.setswitchinterval),
        Fact("the trace function", sys.gettrace, _set_trace),
        Fact("the profile function", sys.getprofile, _set_profile),
        Fact("sys.excepthook", lambda: sys.excepthook, _set_attr(sys, "excepthook")),
        Fact("sys.unraisablehook", lambda: sys.unraisablehook, _set_attr(sys, "unraisablehook")),
        Fact("sys.displayhook", lambda: sys.displayhook, _set_attr(sys, "displayhook")),
        Fact(
            "threading.excepthook", lambda: threading.excepthook, _set_attr(threading, "excepthook")
        ),
        Fact("the default socket timeout", socket.getdefaulttimeout, socket.setdefaulttimeout),
        Fact(
            "sys.dont_write_bytecode",
            lambda: sys.dont_write_bytecode,
            _set_attr(sys, "dont_write_bytecode"),
        ),
        Fact("resource limits", _limits, _set_limits) if _resource() is not None else None,
        Fact(
            "the multiprocessing start method",
            lambda: multiprocessing.get_start_method(allow_none=True),
            _set_start_method,
        ),
        Fact("the time zone", _tz, _reset_tz, compare=False),
        Fact("the CPU affinity", _affinity, _set_affinity)
        if _has(os, "sched_setaffinity")
        else None,
        Fact("the scheduling priority (nice)", _nice, _set_nice)
        if _has(os, "setpriority")
        else None,
        Fact("torch's random generators", _torch_rng, _set_torch_rng, torch=True, compare=False),
        Fact("torch's default device", _default_device, _set_default_device, torch=True),
        _torch_fact("torch's default dtype", "get_default_dtype", "set_default_dtype"),
        Fact("torch's deterministic algorithms", _deterministic, _set_deterministic, torch=True),
        _torch_fact("torch's grad mode", "is_grad_enabled", "set_grad_enabled"),
        _torch_fact("torch's anomaly mode", "is_anomaly_enabled", "set_anomaly_enabled"),
        _torch_fact(
            "torch's intra-op threads", "get_num_threads", "set_num_threads", after=_threads_wanted
        ),
        _torch_fact(
            "torch's float32 matmul precision",
            "get_float32_matmul_precision",
            "set_float32_matmul_precision",
        ),
        Fact("torch's cuDNN / TF32 flags", _backends_flags, _set_backends_flags, torch=True),
        Fact(
            "torch's flush-denormal mode",
            _flush_denormal,
            _setter("set_flush_denormal"),
            torch=True,
        ),
        Fact("torch's print options", _print_options, _set_print_options, torch=True),
        Fact(
            "saved-tensor hooks (activation offload scopes) left active",
            _saved_tensors_hooks,
            _clear_saved_tensors_hooks,
            torch=True,
        ),
        Fact(
            "saved-tensor hooks disabled",
            lambda: _torch()._C._autograd._saved_tensors_hooks_is_enabled(),
            _set_saved_tensors_hooks_enabled,
            torch=True,
        ),
        Fact("torch function / dispatch modes left entered", _mode_stacks, _pop_modes, torch=True),
    )
    if f is not None
)


@dataclass
class Baseline:
    """Every fact of ``FACTS`` as it was before the pool's first case
    (``capture``), and what else a case must not leave behind (threads,
    process groups)."""

    facts: dict[str, Any]
    threads: frozenset[int]
    groups: int = 0
    default_group: Any = None
    #: facts whose restore failed (the rank is then retired)
    unrestored: list[str] = field(default_factory=list)

    @classmethod
    def capture(cls) -> Baseline:
        """Record the current state; call it once the process group is up (torch imported)."""
        baseline = cls(
            facts=_read_facts(),
            threads=frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
        )
        if "torch" in sys.modules:
            baseline.groups, baseline.default_group = process_groups()
        # What exists now (the imported libraries) lives as long as the rank:
        # keep it out of every later collection, so that collecting a case's
        # garbage costs milliseconds, not a scan of all of torch.
        gc.collect()
        gc.freeze()
        return baseline

    def restore(self) -> None:
        """Put back every restorable fact (to what a fresh rank would have)."""
        for fact in _facts_now():
            if fact.restore is None or fact.name not in self.facts:
                continue
            want = self._wanted(fact)
            try:
                if not fact.compare or fact.read() != want:
                    fact.restore(want)
            except Exception as exc:
                self.unrestored.append(f"{fact.name} ({type(exc).__name__}: {exc})")

    def leftovers(self) -> str | None:
        """Why this rank cannot run another case (None: it can). Called after a case:
        restores what it can first, then names what changed for good."""
        self.restore()
        if self.unrestored:
            return "the case changed what cannot be put back: " + "; ".join(self.unrestored)
        changed = [
            fact.name
            for fact in _facts_now()
            if fact.compare and fact.name in self.facts and _differs(fact, self._wanted(fact))
        ]
        if changed:
            return "the case changed what cannot be put back: " + ", ".join(changed)
        threads = [t for t in threading.enumerate() if t.ident not in self.threads and t.is_alive()]
        if threads:
            names = ", ".join(sorted(t.name for t in threads))
            return f"the case left {len(threads)} thread(s) running ({names})"
        if "torch" not in sys.modules:
            return None
        groups, default = process_groups()
        if default is not self.default_group:
            return "the case destroyed or replaced the default process group"
        # Sub-groups hold connections and threads of their own; destroying
        # them is itself a hang risk, so their ranks are not reused. Those
        # made by harness.kept_group are the rank's own (kept on purpose).
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


def _facts_now() -> list[Fact]:
    """The facts that exist in this process now (torch's once torch is imported)."""
    has_torch = "torch" in sys.modules
    return [fact for fact in FACTS if has_torch or not fact.torch]


def _read_facts() -> dict[str, Any]:
    values = {}
    for fact in _facts_now():
        with contextlib.suppress(Exception):  # a fact this platform cannot read is not kept
            values[fact.name] = fact.read()
    return values


def _differs(fact: Fact, want: Any) -> bool:
    try:
        return bool(fact.read() != want)
    except Exception:
        return True


def _device_error() -> str | None:
    """A sticky accelerator error surfaces at a synchronize; such a rank is done."""
    for kind in accelerators():
        runtime = kind.initialised_runtime()
        if runtime is None:
            continue
        try:
            runtime.synchronize()
        except Exception as exc:
            return f"{kind.name} error after the case: {type(exc).__name__}: {exc}"
    return None
