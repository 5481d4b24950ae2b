"""Eight fake CPU devices for every test: set before jax initialises its backends."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jdp  # noqa: E402  (applies jdp's CPU collective settings before the backend starts)
import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 fake CPU devices; XLA_FLAGS was overridden"
