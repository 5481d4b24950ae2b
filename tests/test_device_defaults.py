"""Defaults chosen for the device (jdp.run.device_defaults): pure choices given a GPU's figures, and a
config's "auto" resolved once, said in one line each. Nothing here compiles."""
from types import SimpleNamespace

import jax
import pytest

from jdp.run.config import ConfigError, load_config
from jdp.run.device_defaults import REMAT_MARGIN, choose_attention, choose_remat, resolve_device_defaults

GB = 10**9


@pytest.mark.parametrize("platform, precision, expected", [
    ("gpu", "bfloat16", "cudnn"), ("gpu", "float32", "fused"), ("cpu", "bfloat16", "fused"),
    ("tpu", "bfloat16", "fused"), ("cpu", "float32", "fused")])
def test_auto_attention_is_cudnn_only_on_a_gpu_in_bfloat16(platform, precision, expected):
    attention, line = choose_attention("auto", platform, precision)
    assert attention == expected and line.startswith(f"attention: {expected} (")
    for named in ("flax", "fused"):  # a config that names one keeps it, and nothing is said
        assert choose_attention(named, platform, precision) == (named, None)


def test_auto_attention_says_why():
    assert choose_attention("auto", "gpu", "bfloat16")[1] == "attention: cudnn (GPU, bfloat16; the config left it auto)"
    assert choose_attention("auto", "gpu", "float32")[1] == (
        "attention: fused (XLA's, without a (T, T) mask; float32 on a GPU: cuDNN flash attention takes bfloat16 "
        "only; the config left it auto)")


def test_auto_remat_is_off_only_where_the_peak_without_it_fits_with_margin():
    memory = 139 * GB
    edge = int(REMAT_MARGIN * memory)
    assert choose_remat("auto", edge, memory)[0] is False  # exactly at the margin: fits
    assert choose_remat("auto", edge + 1, memory)[0] is True  # one byte over: remat
    assert choose_remat("auto", int(24.4 * GB), memory) == (
        False, "remat: off (compiled peak 24.4 GB without it fits 139.0 GB with margin: at most 85%)")
    assert choose_remat("auto", 130 * GB, memory) == (
        True, "remat: on (compiled peak 130.0 GB without it is over 85% of the device's 139.0 GB)")
    assert choose_remat("auto", None, memory)[0] is True and choose_remat("auto", 1, None) == (
        True, "remat: on (the device's memory is not known; the config left it auto)")
    assert choose_remat(False, 10**15, memory) == (False, None) and choose_remat(True, 1, memory) == (True, None)


def _gpu(memory):
    return SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", memory_stats=lambda: {"bytes_limit": memory})


def test_a_config_left_auto_is_resolved_once_for_the_device_and_said():
    config = load_config("configs/gpt2_small.yaml")
    assert (config.model.attention, config.model.remat) == ("auto", "auto")
    lines, measured = [], []

    def measure(cfg, devices):  # the compiled peak of the step WITHOUT remat, as jdp memory measures it
        measured.append((cfg.model.attention, cfg.model.remat))
        return int(24.4 * GB)

    on_gpu = resolve_device_defaults(config, [_gpu(139 * GB)], measure, lines.append)
    assert (on_gpu.model.attention, on_gpu.model.remat, measured) == ("cudnn", False, [("cudnn", False)])
    assert lines == ["attention: cudnn (GPU, bfloat16; the config left it auto)",
                     "remat: off (compiled peak 24.4 GB without it fits 139.0 GB with margin: at most 85%)"]
    small = resolve_device_defaults(config, [_gpu(20 * GB)], measure, lambda line: None)
    assert small.model.remat is True
    lines.clear()
    on_cpu = resolve_device_defaults(config, jax.devices()[:1], lambda *a: pytest.fail("measured"), lines.append)
    assert (on_cpu.model.attention, on_cpu.model.remat) == ("fused", True)  # as gpt2_small always ran on a CPU
    assert lines[1] == "remat: on (the device's memory is not known; the config left it auto)"
    named = load_config("configs/gpt2_small.yaml", ["model.attention=flax", "model.remat=false"])
    assert resolve_device_defaults(named, [_gpu(139 * GB)], pytest.fail, pytest.fail) is named


def test_auto_is_refused_where_it_means_nothing():
    with pytest.raises(ConfigError, match=r"^model.remat=auto applies to the transformer only"):
        load_config(None, ["model.remat=auto"])
    with pytest.raises(ConfigError, match=r"^model.remat must be true, false or 'auto'"):
        load_config(None, ["model.name=gpt", "data.name=chars", "model.remat=sometimes"])
