"""Test your own model on fake CPU devices: a pytest plugin and `assert_data_parallel_exact`.

The plugin, loaded with `-p jdp.testing` (or `addopts = "-p jdp.testing"` in your pytest
configuration):

    pytest -p jdp.testing --jdp-devices 4 tests/      # or the ini value `jdp_devices = 4`

makes jax expose 4 fake CPU devices before any conftest or test module is imported (they may
import jax, even compute, at module level), makes the CPU jax's default platform unless
`JAX_PLATFORMS` is set, and gives tests a `jdp_devices` fixture: the devices, skipping with the
command to run when there is only one. Without the option and the ini value it changes nothing:
no environment variable, no jax setting.

It is not registered for autoloading: an autoloaded plugin is imported before any conftest, so
`import jdp` would size XLA's thread pool (jdp/cpu.py) before a conftest that sets XLA_FLAGS
itself (as jdp's own does) asks for its devices, and those would run on XLA's default pool.

`assert_data_parallel_exact(loss_fn, optimizer, params_or_model, batches)` checks that jdp on N
devices takes the steps plain one-device JAX takes on the same global batches, and returns the
per-leaf report (or raises `NotExactError`, an AssertionError, with it, worst leaf first).
"""
from __future__ import annotations

import os

import jax

from jdp.cpu import backends_started, use_cpu_devices
from jdp.inspect.exactness import (ExactnessReport, LeafDiff, NotExactError, TOLERANCES, assert_data_parallel_exact,
                           default_tolerance)

try:
    import pytest
except ImportError:  # jdp's dependencies do not include pytest
    pytest = None

if pytest is not None:  # the plugin needs pytest; assert_data_parallel_exact does not
    _APPLIED = pytest.StashKey[int]()

    def pytest_addoption(parser: pytest.Parser) -> None:
        group = parser.getgroup("jdp", "jdp: fake CPU devices")
        group.addoption("--jdp-devices", dest="jdp_devices", default=None, metavar="N",
                        help="make jax expose N fake CPU devices (set before conftest and test modules are imported; "
                             "the CPU becomes jax's default platform unless JAX_PLATFORMS is set).")
        parser.addini("jdp_devices", "jdp: the number of fake CPU devices, as --jdp-devices (the option wins).",
                      default="")

    def requested_devices(config: pytest.Config) -> int | None:
        """The device count asked for by `--jdp-devices` or the `jdp_devices` ini value (None: not asked)."""
        namespace = getattr(config, "known_args_namespace", None)  # set before pytest_configure, at startup
        value = getattr(config.option, "jdp_devices", None) or getattr(namespace, "jdp_devices", None)
        where = "--jdp-devices"
        if value is None:
            value, where = str(config.getini("jdp_devices")).strip() or None, "the jdp_devices ini value"
        if value is None:
            return None
        text = str(value).strip()
        if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 4096):
            raise pytest.UsageError(f"{where} must be a number of devices from 1 to 4096, got {text[:50]!r}.")
        return int(text)

    def _apply(config: pytest.Config) -> None:
        n = requested_devices(config)
        if n is None or config.stash.get(_APPLIED, None) == n:
            return  # not asked for: nothing at all is changed
        if "JAX_PLATFORMS" not in os.environ and not backends_started():
            jax.config.update("jax_platforms", "cpu")
        try:
            use_cpu_devices(n)
        except ValueError as e:
            raise pytest.UsageError(f"--jdp-devices {n}: {e} A conftest or plugin loaded before jdp.testing ran jax; "
                                    f"load it first, with -p jdp.testing.") from None
        config.stash[_APPLIED] = n

    @pytest.hookimpl(tryfirst=True)
    def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
        """Before the first conftest.py is imported: set the device count (they may import jax)."""
        _apply(early_config)

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(config: pytest.Config) -> None:
        """The same, for a plugin loaded too late for the hook above (`pytest_plugins` in a conftest)."""
        _apply(config)

    @pytest.fixture(scope="session")
    def jdp_devices(request: pytest.FixtureRequest) -> list[jax.Device]:
        """The devices `--jdp-devices N` asked for (the first N of `jax.devices()`), else all of them.

        Fails if jax has fewer than asked (it started its backend before the plugin could set the
        count); skips, naming the command, if there is only one device and nothing was asked.
        """
        n = requested_devices(request.config)
        devices = jax.devices()
        if n is None:
            if len(devices) < 2:
                pytest.skip("only 1 jax device: run pytest with --jdp-devices N (N >= 2) to test data parallelism.")
            return devices
        if len(devices) < n:
            pytest.fail(f"--jdp-devices {n} asked for {n} devices but jax has {len(devices)} "
                        f"{jax.default_backend()} device(s): jax started its backend before the option could set the "
                        f"count (check JAX_PLATFORMS and plugins that run jax at import).", pytrace=False)
        return devices[:n]


__all__ = ["ExactnessReport", "LeafDiff", "NotExactError", "TOLERANCES", "assert_data_parallel_exact",
           "default_tolerance"]
