"""Putting a pooled rank back into the state a fresh rank starts a case in.

A pooled rank runs many cases in one interpreter. Before each case:

* what a freshly spawned rank inherits from the launcher -- its environment,
  working directory, ``sys.path`` and file-mode creation mask (umask) -- is
  taken from the launcher *now*
  (``Inherited``), so fixtures that set them for the case reach the ranks;
* the process-wide state a test can change is restored to a *baseline* taken
  before the pool's first case ran (``Baseline``): the Python, NumPy and
  torch random generators, torch's global modes (default dtype and device,
  deterministic algorithms, TF32 / matmul precision, grad and anomaly mode,
  intra-op threads), warning filters, the root logger, signal handlers and a
  pending ``alarm``, and ``sys.stdout`` / ``sys.stderr``;
* the interpreter settings a case can change (``InterpreterState``): the
  recursion limit, ``gc.disable()`` and its thresholds, the
  switch interval, trace / profile functions, exception and display hooks,
  the default socket timeout, resource limits;
* ContextVars (e.g. a ``channel_loss.capture()`` scope a case left open) need
  no restoring: each case runs in a copy of the rank's untouched context
  (``fresh_context``).

What cannot be put back is detected after the case instead (``leftovers``):
Python threads the case left running, process groups it created or
destroyed, a hard resource limit it lowered, a CUDA error. A rank with
leftovers is not reused.

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
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

from harness.devices import accelerators

#: Signals whose handlers a case may have replaced (the stack-dump signal is
#: the harness's own and stays).
_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGUSR2", "SIGCHLD", "SIGPIPE")
    if hasattr(signal, name)
)


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


@dataclass
class Baseline:
    """What a rank looked like before its pool's first case (``capture``)."""

    py_random: Any
    np_random: Any
    warning_filters: list
    log_level: int
    log_handlers: list
    signals: dict[int, Any]
    stdout: Any
    stderr: Any
    threads: frozenset[int]
    interpreter: InterpreterState | None = None
    torch: dict[str, Any] = field(default_factory=dict)
    groups: int = 0
    default_group: Any = None

    @classmethod
    def capture(cls) -> Baseline:
        """Record the current state; call it once the process group is up (torch imported)."""
        root = logging.getLogger()
        np_random = None
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            np_random = numpy.random.get_state()
        baseline = cls(
            py_random=random.getstate(),
            np_random=np_random,
            warning_filters=list(warnings.filters),
            log_level=root.level,
            log_handlers=list(root.handlers),
            signals={sig: signal.getsignal(sig) for sig in _SIGNALS},
            stdout=sys.stdout,
            stderr=sys.stderr,
            threads=frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
            interpreter=InterpreterState.capture(),
        )
        if "torch" in sys.modules:
            baseline.torch = _torch_state()
            baseline.groups, baseline.default_group = _process_groups()
        # What exists now (the imported libraries) lives as long as the rank:
        # keep it out of every later collection, so that collecting a case's
        # garbage costs milliseconds, not a scan of all of torch.
        gc.collect()
        gc.freeze()
        return baseline

    def restore(self) -> None:
        """Put back everything ``capture`` recorded."""
        random.setstate(self.py_random)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            if self.np_random is not None:
                numpy.random.set_state(self.np_random)
            else:  # first imported by a case: fresh entropy, as a new process would get
                numpy.random.seed()
        warnings.filters[:] = self.warning_filters
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:
            mutated()  # invalidates the "already warned" caches, as warnings.filterwarnings does
        root = logging.getLogger()
        root.setLevel(self.log_level)
        root.handlers[:] = self.log_handlers
        if hasattr(signal, "alarm"):
            signal.alarm(0)
        if hasattr(signal, "setitimer"):
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self.signals.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        if self.interpreter is not None:
            self.interpreter.restore()
        if self.torch:
            _restore_torch(self.torch)

    def leftovers(self) -> str | None:
        """Why this rank cannot run another case (None: it can). Called after a case."""
        if self.interpreter is not None:
            changed = self.interpreter.unrestorable()
            if changed:
                return changed
        threads = [t for t in threading.enumerate() if t.ident not in self.threads and t.is_alive()]
        if threads:
            names = ", ".join(sorted(t.name for t in threads))
            return f"the case left {len(threads)} thread(s) running ({names})"
        if "torch" not in sys.modules:
            return None
        groups, default = _process_groups()
        if default is not self.default_group:
            return "the case destroyed or replaced the default process group"
        if groups != self.groups:
            # Sub-groups hold connections and threads of their own; destroying
            # them is itself a hang risk, so their ranks are not reused.
            return f"the case created {groups - self.groups} process group(s)"
        return _device_error()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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


def _resource() -> Any:
    try:
        import resource
    except ImportError:  # not on every platform
        return None
    return resource


@dataclass(frozen=True)
class InterpreterState:
    """Process-wide interpreter settings a case can change and a fresh rank
    would start with: the recursion limit, the garbage collector (enabled,
    thresholds), the file-mode creation mask, the thread switch interval,
    trace / profile functions, the exception / unraisable / display hooks,
    the default socket timeout, ``sys.dont_write_bytecode``, the resource
    limits and the ``multiprocessing`` start method. ``restore`` puts them back; ``unrestorable`` names what could not
    be (a hard resource limit lowered for good): such a rank is not reused."""

    recursion_limit: int
    gc_enabled: bool
    gc_threshold: tuple[int, ...]
    switch_interval: float
    trace: Any
    profile: Any
    excepthook: Any
    unraisablehook: Any
    displayhook: Any
    threading_excepthook: Any
    socket_timeout: float | None
    dont_write_bytecode: bool
    limits: dict[int, tuple[int, int]]
    start_method: str | None = None

    @classmethod
    def capture(cls) -> InterpreterState:
        """This process's settings now."""
        import socket

        return cls(
            recursion_limit=sys.getrecursionlimit(),
            gc_enabled=gc.isenabled(),
            gc_threshold=gc.get_threshold(),
            switch_interval=sys.getswitchinterval(),
            trace=sys.gettrace(),
            profile=sys.getprofile(),
            excepthook=sys.excepthook,
            unraisablehook=sys.unraisablehook,
            displayhook=sys.displayhook,
            threading_excepthook=threading.excepthook,
            socket_timeout=socket.getdefaulttimeout(),
            dont_write_bytecode=sys.dont_write_bytecode,
            limits=_limits(),
            start_method=multiprocessing.get_start_method(allow_none=True),
        )

    def restore(self) -> None:
        """Put every setting back (resource limits: as far as the kernel allows)."""
        import socket

        sys.setrecursionlimit(self.recursion_limit)
        (gc.enable if self.gc_enabled else gc.disable)()
        gc.set_threshold(*self.gc_threshold)
        sys.setswitchinterval(self.switch_interval)
        sys.settrace(self.trace)
        threading.settrace(self.trace)
        sys.setprofile(self.profile)
        threading.setprofile(self.profile)
        sys.excepthook = self.excepthook
        sys.unraisablehook = self.unraisablehook
        sys.displayhook = self.displayhook
        threading.excepthook = self.threading_excepthook
        socket.setdefaulttimeout(self.socket_timeout)
        sys.dont_write_bytecode = self.dont_write_bytecode
        if multiprocessing.get_start_method(allow_none=True) != self.start_method:
            multiprocessing.set_start_method(self.start_method, force=True)
        resource = _resource()
        if resource is not None:
            for which, limit in self.limits.items():
                with contextlib.suppress(OSError, ValueError):
                    if resource.getrlimit(which) != limit:
                        resource.setrlimit(which, limit)

    def unrestorable(self) -> str | None:
        """What a case changed that ``restore`` cannot put back (None: nothing):
        resource limits are put back now, and those the kernel keeps lowered named."""
        self.restore()
        changed = sorted(
            which for which, limit in _limits().items() if self.limits.get(which) != limit
        )
        if changed:
            return f"the case lowered resource limit(s) {changed} for good"
        return None


def _torch_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {
        "seed": torch.initial_seed(),
        "cpu_rng": torch.get_rng_state(),
        "dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "grad": torch.is_grad_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "threads": torch.get_num_threads(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
    }
    get_default_device = getattr(torch, "get_default_device", None)
    if get_default_device is not None:
        state["device"] = get_default_device()
    state["device_rng"] = {
        kind.name: runtime.get_rng_state_all()
        for kind in accelerators()
        if (runtime := kind.initialised_runtime()) is not None
    }
    return state


def _restore_torch(state: dict[str, Any]) -> None:
    import torch

    # Every generator to a known state: accelerators' (lazily, without
    # initialising a runtime) reseeded with the rank's initial seed, then the
    # recorded states put back exactly.
    torch.manual_seed(state["seed"])
    torch.set_rng_state(state["cpu_rng"])
    for kind in accelerators():
        if kind.name in state["device_rng"]:
            kind.torch_runtime().set_rng_state_all(state["device_rng"][kind.name])
    if "device" in state and torch.get_default_device() != state["device"]:
        torch.set_default_device(None if state["device"].type == "cpu" else state["device"])
    if torch.get_default_dtype() != state["dtype"]:
        torch.set_default_dtype(state["dtype"])
    if (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ) != (state["deterministic"], state["deterministic_warn_only"]):
        torch.use_deterministic_algorithms(
            state["deterministic"], warn_only=state["deterministic_warn_only"]
        )
    torch.set_grad_enabled(state["grad"])
    torch.set_anomaly_enabled(state["anomaly"])
    if torch.get_num_threads() != state["threads"]:
        torch.set_num_threads(state["threads"])
    if torch.get_float32_matmul_precision() != state["matmul_precision"]:
        torch.set_float32_matmul_precision(state["matmul_precision"])
    torch.backends.cudnn.deterministic = state["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = state["cudnn_benchmark"]
    torch.backends.cudnn.allow_tf32 = state["cudnn_tf32"]
    torch.backends.cuda.matmul.allow_tf32 = state["cuda_matmul_tf32"]


def _process_groups() -> tuple[int, Any]:
    """(number of process groups, the default group) as torch.distributed knows them."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0, None
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    # Unknown internals: report a change, so the pool is conservatively not reused.
    count = len(pg_map) if pg_map is not None else -1
    return count, c10d._get_default_group()


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
