"""Fake CPU devices, and the thread-pool setting that keeps their all-reduce from deadlocking.

N fake CPU devices are N XLA host devices in one process (tests, CPU-only machines). Their
collectives are in-process rendezvous, and XLA's CPU client runs every device's launch and
execution on one shared thread pool of max(cores, N) threads. Once the host has dispatched 32
steps ahead, each new launch blocks a pool thread waiting for a free slot; with every thread
blocked (launches, plus executions waiting on the all-reduce), the device whose execution is
still queued never runs, the others wait in the rendezvous, and XLA aborts after 40 s
("Expected N threads to join the rendezvous"). That needs ~2N threads to rule out, far more than
2 cores give. jdp therefore (1) sizes the pool to 2N + 2 threads via `PJRT_NPROC` before jax
starts its CPU backend, and (2) bounds its own step's run-ahead (`RunAhead`).
`benchmarks/cpu_collective_stall.py` measures both.
"""
from __future__ import annotations

import collections
import os
import re
import sys

from jdp.text import quoted  # jax is imported where it is used: `import jdp` (and the jdp command) stays instant

THREADS_ENV = "JDP_CPU_THREADS"  # "xla": leave XLA's pools alone; a number: use that many threads
MAX_THREADS = 4096  # XLA starts every thread of its pool: a typo of 10^9 would exhaust the machine
_XLA_POOL_ENV = ("PJRT_NPROC", "NPROC")  # read by XLA's DefaultThreadPoolSize, in this order
_set_by_jdp = False


def backends_started() -> bool:
    """True once jax has created its backends (after which the CPU device count is fixed)."""
    if "jax" not in sys.modules:  # jax not imported yet: no backend can exist
        return False
    from jax._src import xla_bridge  # no public API says whether backends exist yet

    return xla_bridge.backends_are_initialized()


def requested_cpu_devices() -> int:
    """The CPU device count jax will create: `jax_num_cpu_devices`, else XLA_FLAGS, else 1."""
    if "jax" in sys.modules:
        n = sys.modules["jax"].config.jax_num_cpu_devices
    else:  # what jax will read from its environment variable when it is imported
        text = os.environ.get("JAX_NUM_CPU_DEVICES", "").strip()
        n = int(text) if text.lstrip("-").isdigit() else None
    if n is not None and n > 0:
        return n
    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 1


def threads_choice() -> str | int | None:
    """`JDP_CPU_THREADS` as jdp reads it: None (unset or blank), "xla", or a thread count.

    Raises ValueError for any other value, naming it and what is allowed.
    """
    choice = os.environ.get(THREADS_ENV, "").strip()
    if not choice or choice == "xla":
        return choice or None
    if not (choice.isascii() and choice.isdigit() and len(choice) <= 4 and 1 <= int(choice) <= MAX_THREADS):
        raise ValueError(f"{THREADS_ENV}={quoted(choice)} must be 'xla' or a number of threads from 1 to "
                         f"{MAX_THREADS}.")
    return int(choice)


def configure_cpu_threads(num_devices: int | None = None) -> str | None:
    """Size XLA's CPU client pool so N-device collectives cannot starve it; returns the size set.

    Does nothing (returns None) once the backend has started, for a single device, or when the
    user chose: `JDP_CPU_THREADS=xla`, or `PJRT_NPROC`/`NPROC` already in the environment. Raises
    ValueError for a bad `JDP_CPU_THREADS` (`threads_choice`), even once the backend has started.
    """
    global _set_by_jdp
    choice = threads_choice()
    if backends_started():
        return None
    if choice == "xla" or (any(v in os.environ for v in _XLA_POOL_ENV) and not _set_by_jdp):
        return None
    if choice is not None:
        threads = choice
    else:
        n = num_devices or requested_cpu_devices()
        if n < 2:
            return None
        threads = max(os.cpu_count() or 1, 2 * n + 2)
    os.environ["PJRT_NPROC"] = str(threads)
    _set_by_jdp = True
    return str(threads)


def configure_at_import() -> None:
    """What `import jdp` runs: `configure_cpu_threads()`, leaving a bad `JDP_CPU_THREADS` to be refused later.

    The command line is entered through `import jdp`, before it can turn an exception into its
    one-line error (exit code 2), so raising here would print a traceback. A bad value is refused
    instead, as a ValueError, by `configure_cpu_threads` and `use_cpu_devices` (which the command
    line calls before setting up devices) and by every step jdp builds (`RunAhead`).
    """
    try:
        threads_choice()
    except ValueError:
        return  # refused by the first of the calls above
    configure_cpu_threads()


def use_cpu_devices(n: int) -> None:
    """Make jax expose `n` CPU devices (call before any jax computation or `jax.devices()`).

    Only the CPU backend is affected: on a machine with accelerators, jax still defaults to them.
    Raises ValueError if `n` < 1, for a bad `JDP_CPU_THREADS`, or if jax already started its CPU
    backend with another count.
    """
    import jax

    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"devices={n!r} must be a positive integer.")
    threads_choice()  # refuse a bad JDP_CPU_THREADS even where the backend has started
    if backends_started():
        have = jax.device_count()
        if jax.default_backend() != "cpu" or have == n:
            return
        raise ValueError(f"devices={n} cannot be set: jax already started with {have} "
                         f"{jax.default_backend()} device(s); set it before any jax computation.")
    jax.config.update("jax_num_cpu_devices", n)
    configure_cpu_threads(n)


class RunAhead:
    """Bounds how many steps the host dispatches ahead of the devices: `limit` (None: unbounded).

    On CPU devices XLA admits 32 launches per device and then blocks a client-pool thread per
    launch, which can starve the threads that run the steps and deadlock the all-reduce; 16 in
    flight never reaches that. Accelerators need no bound.
    """

    def __init__(self, devices):
        threads_choice()  # a bad JDP_CPU_THREADS, which `import jdp` leaves alone, stops every step here
        self.limit = 16 if all(d.platform == "cpu" for d in devices) else None
        self._inflight = collections.deque()

    def wait(self) -> None:
        """Before a launch: wait for the oldest step in flight if `limit` are (only if the devices lag)."""
        if self.limit is not None and len(self._inflight) >= self.limit:
            self._inflight.popleft().block_until_ready()

    def launched(self, marker) -> None:
        """After a launch: remember `marker` (an output of that step) to wait on later."""
        if self.limit is not None:
            self._inflight.append(marker)
