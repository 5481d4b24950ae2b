"""Fake CPU devices: N XLA host devices in one process, for tests and for CPU-only machines.

The device count must be fixed before jax starts its backends; after that it cannot change.
"""
from __future__ import annotations

import jax


def backends_started() -> bool:
    """True once jax has created its backends (after which the CPU device count is fixed)."""
    from jax._src import xla_bridge  # no public API says whether backends exist yet

    return xla_bridge.backends_are_initialized()


def use_cpu_devices(n: int) -> None:
    """Make jax expose `n` CPU devices (call before any jax computation or `jax.devices()`).

    Raises ValueError if `n` < 1, and if jax already started with a different device count.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"devices={n!r} must be a positive integer.")
    if backends_started():
        have = jax.device_count()
        if jax.default_backend() != "cpu" or have == n:
            return
        raise ValueError(f"devices={n} cannot be set: jax already started with {have} "
                         f"{jax.default_backend()} device(s); set it before any jax computation.")
    jax.config.update("jax_num_cpu_devices", n)  # affects the CPU backend only
