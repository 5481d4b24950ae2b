"""Defaults chosen for the device: the GPT's `model.attention: auto` and `model.remat: auto`, said once.

The choices are pure functions of what they are given (the platform, the compute dtype, a compiled peak
and the device's memory), so they are tested on a CPU with a GPU's figures. `resolve_device_defaults`
applies them to a config before a run starts: the run's identity (and its checkpoints) then hold the
choice, not "auto", so a run cannot resume with other arithmetic on another device.
"""
from __future__ import annotations

AUTO = "auto"
# remat off only where the compiled step's peak without it is at most this fraction of the device's
# memory: the rest is headroom for the evaluation step, the allocator's fragmentation and XLA's estimate.
REMAT_MARGIN = 0.85


def choose_attention(configured: str, platform: str, precision: str) -> tuple[str, str | None]:
    """The GPT's attention for `configured` (model.attention) on `platform` (jax's: "gpu", "cpu", "tpu")
    computing in `precision` ("bfloat16" or "float32"), and the line that says why (None: the config
    named it). auto: cuDNN flash attention on a GPU in bfloat16 (the only dtype it takes), else XLA's
    attention through jax.nn.dot_product_attention ("fused": causal without a (T, T) mask)."""
    if configured != AUTO:
        return configured, None
    if platform == "gpu" and precision == "bfloat16":
        return "cudnn", "attention: cudnn (GPU, bfloat16; the config left it auto)"
    why = ("float32 on a GPU: cuDNN flash attention takes bfloat16 only" if platform == "gpu" else
           f"{platform}: cuDNN flash attention needs a GPU")
    return "fused", f"attention: fused (XLA's, without a (T, T) mask; {why}; the config left it auto)"


def choose_remat(configured, peak_without: int | None, memory: int | None,
                 margin: float = REMAT_MARGIN) -> tuple[bool, str | None]:
    """Whether the GPT rematerialises its blocks for `configured` (model.remat), and the line that says
    why (None: the config named it). auto: off when `peak_without` (bytes per device of the compiled
    step without remat) is at most `margin` × `memory` (the device's bytes), else on; on when either
    figure is unknown (a CPU reports no memory limit): the choice that cannot run out of memory first."""
    if configured != AUTO:
        return bool(configured), None
    if not peak_without or not memory:
        return True, "remat: on (the device's memory is not known; the config left it auto)"
    gb = lambda b: f"{b / 1e9:,.1f} GB"  # noqa: E731
    if peak_without <= margin * memory:
        return False, (f"remat: off (compiled peak {gb(peak_without)} without it fits {gb(memory)} with margin: "
                       f"at most {margin:.0%})")
    return True, (f"remat: on (compiled peak {gb(peak_without)} without it is over {margin:.0%} of the device's "
                  f"{gb(memory)})")


def device_memory(device) -> int | None:
    """Bytes the device's allocator may use (jax's `memory_stats()["bytes_limit"]`); None where jax
    reports none (CPUs)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def resolve_device_defaults(config, devices, measure, log=print):
    """`config` with the GPT's model.attention and model.remat "auto" replaced by what
    `choose_attention` and `choose_remat` pick on `devices`, each choice said in one line to `log`.
    The peak without remat is `measure(config, devices)` (bytes per device, compiled, not run: the
    trainer passes `jdp.run.memory_table.compiled_peak`, which builds the task and so cannot be
    imported here without a circle), measured only where the device's memory is known. Other configs
    are returned as they are."""
    from jdp.run.config import apply_overrides

    m = config.model
    if m.name != "gpt" or AUTO not in (m.attention, m.remat):
        return config
    attention, said = choose_attention(m.attention, devices[0].platform, config.train.precision)
    config = apply_overrides(config, [f"model.attention={attention}"])
    lines = [said]
    if m.remat == AUTO:
        memory = device_memory(devices[0])
        if memory:
            peak = measure(apply_overrides(config, ["model.remat=false"]), devices)
        remat, why = choose_remat(AUTO, peak if memory else None, memory)
        config = apply_overrides(config, [f"model.remat={str(remat).lower()}"])
        lines.append(why)
    for line in lines:
        if line:
            log(line)
    return config


__all__ = ["AUTO", "REMAT_MARGIN", "choose_attention", "choose_remat", "device_memory", "resolve_device_defaults"]
