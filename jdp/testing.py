"""Test your own model on fake CPU devices: a pytest plugin and `assert_data_parallel_exact`.

The public name of `jdp.inspect.testing`, where it is implemented; import it as `jdp.testing`.
"""
from jdp.inspect.testing import (ExactnessReport, LeafDiff, NotExactError, TOLERANCES, assert_data_parallel_exact,
                                 default_tolerance)
from jdp.inspect.testing import pytest as _pytest

if _pytest is not None:  # the plugin's hooks and fixture (`-p jdp.testing`) must be this module's attributes
    from jdp.inspect.testing import (jdp_devices, pytest_addoption, pytest_configure,
                                     pytest_load_initial_conftests, requested_devices)

__all__ = ["ExactnessReport", "LeafDiff", "NotExactError", "TOLERANCES", "assert_data_parallel_exact",
           "default_tolerance"]
