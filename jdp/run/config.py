"""`jdp train`'s configuration: typed, validated values, read from YAML and `section.key=value` overrides.

A config has five sections, each a frozen dataclass with a docstring per field: `model`, `data`,
`optim`, `parallel`, `train` (defined in `jdp.run.config_sections`, importable from here). `Config()`
is the default run (an MLP on scikit-learn's digits).

Checks happen in three places, each failing with a `ConfigError`: one sentence that names the
dotted key and what it accepts.

1. Construction (every section's `__post_init__`, `jdp.run.sections`): the type and range of each
   field on its own.
2. `load_config` / `config_from_dict`: unknown sections and keys, malformed files and overrides;
   then `validate(config, None)`.
3. `validate(config, num_devices)`: combinations (model × data, batch × dataset size, ...); the
   step's and the optimizer's own rules, which `jdp.core.options.StepOptions` and `jdp.OptimizerSpec`
   state once (their message, after the dotted key); and, once the device count is known, batch
   divisibility.

YAML is read as `yaml.safe_load` reads it, within limits (`jdp.run.sections.parse_yaml`): no repeated
key, no nesting deeper than 16, at most 10,000 values with aliases expanded, 64-bit integers.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from jdp.core.optim import OptimizerSpec
from jdp.core.options import OptionError, StepOptions
from jdp.data.datasets import DIGITS_EXAMPLES, SEED_REGRESSIONS, held_out_count
from jdp.run.config_sections import (ATTENTIONS, DATASETS, HOSTS, MODEL_DATA, MODELS, SECTIONS, DataConfig, ModelConfig,
                                 OptimConfig, ParallelConfig, TrainConfig, step_option_key)
from jdp.run.hf_init import check_init_from, init_from_values
from jdp.run.prepared import prepared_data
from jdp.run.sections import ConfigError, field_docs, parse_override, read_yaml
from jdp.text import quoted, shorten

# Fields left out of `config_hash`: they may change between runs of the same training (so may
# train.steps where the schedule does not use it: `run_identity`).
HASH_EXCLUDED = ("data.eval_batch_size", "data.val_path", "data.threads", "data.workers", "parallel.devices",
                 "parallel.shard_optimizer_state", "parallel.shard_params", "parallel.replicas", "train.log_every",
                 "train.eval_every", "train.checkpoint_every", "train.keep_checkpoints", "train.max_nonfinite",
                 "train.profile_steps")
# Fields that say where a run may start, not what it trains: left out of `run_identity` as well.
PLACEMENT_ONLY = ("train.accelerator_only",)
# Identity fields added after checkpoints already existed, with the value every earlier run had:
# a checkpoint whose identity lacks one resumes when the config keeps that value.
ADDED_DEFAULTS = {"model.attention": "flax", "model.remat": False, "model.scan_layers": False, "model.loss_chunk": 0,
                  "model.init_from": None,
                  "parallel.reduce_dtype": None,
                  "train.precision": "float32", "data.dtype": "uint16", "data.vocab_size": None}


@dataclass(frozen=True)
class Config:
    """A whole `jdp train` run; `Config()` is the default (an MLP on digits, Adam 3e-3, 300 steps)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The network."""
    data: DataConfig = field(default_factory=DataConfig)
    """The dataset and its batches."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and its schedule."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Devices, reduction and accumulation."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Length, cadence and seed of the loop."""

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"Config.{name} must be of type {cls.__name__}, got {type(getattr(self, name)).__name__}.")

    def optimizer_spec(self) -> OptimizerSpec:
        """The optimizer as a `jdp.OptimizerSpec`: lr after linear scaling (if on), and the schedule,
        which decays (cosine, linear) to 0 at train.steps. Its `build()` is the optax chain a run
        uses; `learning_rate(step)` the lr it logs. Raises OptionError (`validate` names the key).
        """
        o = self.optim
        lr = o.lr * self.data.batch_size / o.base_batch_size if o.linear_scaling else o.lr
        return OptimizerSpec(o.name, lr=lr, momentum=o.momentum, b1=o.b1, b2=o.b2, eps=o.eps,
                             weight_decay=o.weight_decay, clip_norm=o.clip_norm, schedule=o.schedule,
                             warmup_steps=o.warmup_steps,
                             decay_steps=self.train.steps if schedule_uses_steps(self) else None)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """`{section: {field: value}}` of JSON types (tuples become lists); `config_from_dict` inverts it."""
        return {name: {f.name: _plain(getattr(getattr(self, name), f.name)) for f in fields(cls)}
                for name, cls in SECTIONS.items()}


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _section_fields(section: str) -> list[str]:
    return [f.name for f in fields(SECTIONS[section])]


def _check_key(section, key) -> None:
    """Raise for a section or a `section.key` that a config does not have."""
    if section not in SECTIONS:
        dotted = section if key is None else f"{section}.{key}"
        raise ConfigError(f"unknown key {quoted(dotted)}; a config has: {', '.join(SECTIONS)}.")
    if key is not None and key not in _section_fields(section):
        raise ConfigError(f"unknown key {quoted(f'{section}.{key}')}; {section} has: "
                          f"{', '.join(_section_fields(section))}.")


def config_from_dict(data: Mapping | None, *, source: str = "the config") -> Config:
    """A `Config` from `{section: {field: value}}` (missing sections and fields keep their defaults).

    Checks every key and value and the combinations that do not need the device count
    (`validate(config, None)`). `source` names the data in the message when it is not a mapping.
    """
    return validate(_config_as_written(data, source), None)


def _config_as_written(data: Mapping | None, source: str) -> Config:
    """`config_from_dict` without `validate`: every key and value checked, not their combinations."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source} must be a mapping of sections ({', '.join(SECTIONS)}), "
                          f"got {type(data).__name__}.")
    sections = {}
    for name, values in data.items():
        _check_key(name, None)
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise ConfigError(f"{name} must be a mapping of its keys ({', '.join(_section_fields(name))}), "
                              f"got {type(values).__name__}.")
        for key in values:
            _check_key(name, key)
        if name == "data":  # a folder prepared by jdp data prepare-tokens says vocab_size and dtype
            values = prepared_data(values)
        if name == "model":  # a Hugging Face checkpoint to start from says the sizes
            values = init_from_values(values)
        sections[name] = SECTIONS[name](**values)
    return Config(**sections)


def _apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """`data` with each `"section.key=value"` set; the value is parsed as YAML (numbers, bools, lists, null)."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'section.key=value' strings, got the string "
                          f"{quoted(overrides)}.")
    for text in overrides:
        section, key, value = parse_override(text, _check_key)
        values = data.get(section)
        if values is None:
            values = data[section] = {}
        if isinstance(values, Mapping):
            data[section] = {**values, key: value}
    return data


def load_config(path: str | os.PathLike | None, overrides: Iterable[str] | None = ()) -> Config:
    """The config in the YAML file `path` (None: the defaults), with `overrides` applied in order.

    The file's top-level keys are sections, its nested keys their fields; anything missing keeps
    its default. `overrides` are strings like `"optim.lr=3e-4"`, `"model.hidden=[256,128]"`,
    `"optim.clip_norm=null"`. Raises ConfigError for a missing or malformed file, an unknown key, a
    value of the wrong type or range, or an impossible combination; `validate(config, num_devices)`
    adds the device-count checks once the devices are set up.
    """
    data, source = _read_with_overrides(path, overrides)
    return config_from_dict(data, source=source)


def _read_with_overrides(path, overrides) -> tuple[dict, str]:
    """The data of the YAML file `path` (None: none) with `overrides` applied, and its name for messages."""
    data = {} if path is None else read_yaml(os.fspath(path))
    source = "the config" if path is None else shorten(os.fspath(path))
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{source} must hold a mapping of sections ({', '.join(SECTIONS)}), "
                          f"got {type(data).__name__}.")
    return _apply_overrides(dict(data or {}), overrides or ()), source


def steps_override(path, overrides: Iterable[str], steps: int) -> tuple[list[str], str | None]:
    """What `jdp train --steps STEPS` adds to `overrides` (its `--set`s) for the config file `path`
    (None: the defaults): `train.steps=STEPS`, and, where the config's optim.warmup_steps is not
    shorter than STEPS under a schedule that decays to 0 at train.steps (which the optimizer's rule
    refuses), the warmup scaled to keep its fraction of the config's train.steps,
    max(0, min(STEPS - 1, round(warmup_steps × STEPS / train.steps))): 40 of 400 steps become 2 of
    20. Returns the overrides and the line that says what was scaled (None if nothing was). An
    optim.warmup_steps in `overrides` is the user's own and is never scaled.
    """
    overrides = list(overrides)
    added = [f"train.steps={steps}"]
    if any(parse_override(text, _check_key)[:2] == ("optim", "warmup_steps") for text in overrides):
        return added, None
    written = _config_as_written(*_read_with_overrides(path, overrides))
    warmup, config_steps = written.optim.warmup_steps, written.train.steps
    if not schedule_uses_steps(written) or warmup < steps:
        return added, None
    scaled = max(0, min(steps - 1, round(warmup * steps / config_steps)))
    return [*added, f"optim.warmup_steps={scaled}"], (
        f"optim.warmup_steps {warmup} -> {scaled}: --steps {steps} keeps the config's warmup fraction "
        f"({warmup} of {config_steps} steps)")


def fsdp_layer_defaults(path, overrides: Iterable[str]) -> tuple[list[str], str | None]:
    """What `jdp train` adds to `overrides` for the config file `path` (None: the defaults) when it
    trains the GPT under parallel.shard_params and neither the file nor `overrides` sets
    model.scan_layers: `model.scan_layers=true` and, unless set, `model.remat=true`, so that FSDP
    gathers one layer at a time inside the rematerialised scan (the step's peak holds about one
    layer's whole params and gradient, not the model's). Scanning changes how the layers run, not
    the model: the same initial params and dropout masks. Returns the overrides and the line that
    says what was set (None if nothing was)."""
    data, source = _read_with_overrides(path, overrides)
    written = _config_as_written(data, source)
    model = data.get("model") or {}
    if written.model.name != "gpt" or not written.parallel.shard_params or "scan_layers" in model:
        return [], None
    added = ["model.scan_layers=true", *([] if "remat" in model else ["model.remat=true"])]
    return added, (f"{', '.join(added)}: under parallel.shard_params the GPT gathers one layer at a time (the same "
                   f"model, its layers scanned); set model.scan_layers=false to gather it whole")


def apply_overrides(config: Config, overrides: Iterable[str]) -> Config:
    """A new config: `config` with `"section.key=value"` overrides applied (checked as in load_config)."""
    return config_from_dict(_apply_overrides(config.to_dict(), overrides))


def validate(config: Config, num_devices: int | None) -> Config:
    """Raise ConfigError for a combination that cannot run; return `config` unchanged otherwise.

    `num_devices`: the devices available (after setting them up). None checks everything that
    does not need it; the batch-divisibility check then runs only when parallel.devices is set.
    """
    if num_devices is not None and (isinstance(num_devices, bool) or not isinstance(num_devices, int)
                                    or num_devices < 1):
        raise ValueError(f"num_devices={num_devices!r} must be a positive integer, or None.")
    m, d, p = config.model, config.data, config.parallel

    if d.name not in MODEL_DATA[m.name]:
        raise ConfigError(f"model.name={m.name!r} cannot train on data.name={d.name!r}; "
                          f"{m.name} takes data.name {' or '.join(MODEL_DATA[m.name])}.")
    if m.sync_batchnorm and m.name != "cnn":
        raise ConfigError(f"model.sync_batchnorm=true needs model.name='cnn' (the model with BatchNorm), "
                          f"got {m.name!r}.")
    if m.name != "gpt" and (m.attention != "flax" or m.remat or m.scan_layers or m.loss_chunk):
        key = (f"model.attention={m.attention!r}" if m.attention != "flax"
               else f"model.remat={str(m.remat).lower()}" if m.remat
               else "model.scan_layers=true" if m.scan_layers else f"model.loss_chunk={m.loss_chunk}")
        raise ConfigError(f"{key} applies to the transformer only and needs model.name='gpt', got {m.name!r}.")
    if m.attention == "cudnn" and config.train.precision != "bfloat16":  # (the model checks for a GPU itself)
        raise ConfigError(f"model.attention='cudnn' (cuDNN flash attention) computes in bfloat16 and needs "
                          f"train.precision='bfloat16', got {config.train.precision!r}.")
    if m.name == "gpt" and m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}.")

    _check_data_files(d)
    check_init_from(config)
    if d.name == "digits" and held_out_count(DIGITS_EXAMPLES, d.test_fraction) >= DIGITS_EXAMPLES:
        raise ConfigError(f"data.test_fraction={d.test_fraction} holds out round({DIGITS_EXAMPLES} × {d.test_fraction}) "
                          f"= {held_out_count(DIGITS_EXAMPLES, d.test_fraction)} of the {DIGITS_EXAMPLES} digits "
                          f"examples (arrays 'x' and 'y'), leaving no training example; lower data.test_fraction.")
    if d.drop_last and d.name in ("digits", "seed_linear"):
        if d.name == "digits":
            n, what = DIGITS_EXAMPLES - held_out_count(DIGITS_EXAMPLES, d.test_fraction), "digits training examples"
        else:
            n, what = len(SEED_REGRESSIONS[d.seed_example].x), f"examples of data.seed_example={d.seed_example}"
        if d.batch_size > n:
            raise ConfigError(f"data.batch_size={d.batch_size} is more than the {n} {what}, so with "
                              f"data.drop_last=true no batch is ever full.")

    _check_step_and_optimizer(config)
    _check_profile_steps(config)
    if num_devices is not None and p.devices is not None and p.devices > num_devices:
        raise ConfigError(f"parallel.devices={p.devices} is more than the {num_devices} devices available.")
    devices = p.devices if p.devices is not None else num_devices
    if devices is not None and p.replicas != HOSTS and devices % p.replicas:
        raise ConfigError(f"parallel.replicas={p.replicas} does not divide the {devices} devices into equal groups; "
                          f"use a divisor of {devices}.")
    if devices is not None and d.batch_size % (p.accum_steps * devices):
        raise ConfigError(f"data.batch_size={d.batch_size} is not a multiple of parallel.accum_steps × devices "
                          f"= {p.accum_steps} × {devices}; use a multiple of {p.accum_steps * devices}.")
    return config


def _check_data_files(d: DataConfig) -> None:
    """data.path, data.val_path and data.vocab_size as data.name reads them; the files must exist."""
    if d.name == "arrays" and d.path is None:
        raise ConfigError("data.name='arrays' needs data.path, a .npz file with arrays 'x' and 'y'.")
    if d.name == "tokens" and (d.path is None or d.vocab_size is None):
        missing = "data.path (the training token file)" if d.path is None else "data.vocab_size"
        raise ConfigError(f"data.name='tokens' needs {missing}; it takes data.path, data.vocab_size and optionally "
                          f"data.val_path and data.dtype.")
    if d.name not in ("arrays", "tokens") and d.path is not None:
        raise ConfigError(f"data.path is read only with data.name 'arrays' or 'tokens', got data.name={d.name!r}.")
    if d.name != "tokens":
        for key, value, default in (("val_path", d.val_path, None), ("vocab_size", d.vocab_size, None),
                                    ("dtype", d.dtype, "uint16")):
            if value != default:
                raise ConfigError(f"data.{key} is read only with data.name='tokens', got data.name={d.name!r}.")
    if d.name == "arrays" and not d.path.lower().endswith(".npz"):
        raise ConfigError(f"data.path must be the path of a .npz file with data.name='arrays', got {quoted(d.path)}.")
    for key, path in (("path", d.path), ("val_path", d.val_path)):
        if path is not None and not os.path.isfile(path):
            where = f"data.{key}={quoted(path)} is {'a directory' if os.path.isdir(path) else 'not a file'}"
            if d.name != "tokens":
                raise ConfigError(f"{where} (relative paths start at {os.getcwd()}).")
            raise ConfigError(f"{where} (relative paths start at {os.getcwd()}); {_token_files_hint(key, path)}")


def _token_files_hint(key: str, path: str) -> str:
    """How to make the token file data.path or data.val_path names: `jdp data prepare-tokens`."""
    from jdp.data.prepare import TOKEN_FILES

    wanted = TOKEN_FILES[key == "val_path"]
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, wanted)):
        return f"data.{key} is the token file itself: {quoted(os.path.join(path, wanted))}."
    folder = path if os.path.isdir(path) or os.path.basename(path) not in TOKEN_FILES else os.path.dirname(path) or "."
    return (f"make the token files with jdp data prepare-tokens INPUT OUTPUT (INPUT a UTF-8 text file, or "
            f"python-reference), which writes OUTPUT/train.bin (data.path) and OUTPUT/val.bin (data.val_path): here "
            f"jdp data prepare-tokens INPUT {folder}.")


def _check_profile_steps(config: Config) -> None:
    """A profile range the run cannot reach (its LAST after train.steps, the run's last step) is refused:
    the run would end without a trace and without a word."""
    from jdp.run.profile import parse_steps

    steps = parse_steps(config.train.profile_steps)
    if steps is not None and steps[1] > config.train.steps:
        where = f"starts at step {steps[0]}" if steps[0] > config.train.steps else f"ends at step {steps[1]}"
        raise ConfigError(f"train.profile_steps={config.train.profile_steps!r} (--profile-steps) {where}, after the "
                          f"run's last step, train.steps={config.train.steps}, so no trace would be written; profile "
                          f"steps within 1..{config.train.steps}, e.g. {min(steps[0], config.train.steps)}:"
                          f"{config.train.steps}.")


def _check_step_and_optimizer(config: Config) -> None:
    """The step's and the optimizer's rules, stated once in StepOptions and OptimizerSpec, under the config's keys."""
    p = config.parallel
    try:
        StepOptions(backend=p.backend, reduction=p.reduction, lr_correction=p.lr_correction,
                    accum_steps=p.accum_steps, accum_sync=p.accum_sync, precision=config.train.precision,
                    reduce_dtype=p.reduce_dtype, shard_optimizer_state=p.shard_optimizer_state,
                    shard_params=p.shard_params, replicas=1 if p.replicas == HOSTS else p.replicas)
    except OptionError as e:
        raise ConfigError(f"{step_option_key(e.field)}: {e}") from None
    if p.replicas == HOSTS and not p.shard_optimizer_state and not p.shard_params:
        raise ConfigError("parallel.replicas='hosts' (hybrid sharding: one group per process) splits the sharded "
                          "state within each process's devices; it needs parallel.shard_params=true or "
                          "parallel.shard_optimizer_state=true.")
    try:
        config.optimizer_spec()
    except OptionError as e:  # the spec's decay_steps is train.steps
        raise ConfigError(f"{'train.steps' if e.field == 'decay_steps' else 'optim.' + e.field}: {e}") from None


def schedule_uses_steps(config: Config) -> bool:
    """Whether the learning rate of any step depends on train.steps: cosine and linear decay to 0
    there; a constant schedule (after any warmup) never looks at it."""
    return config.optim.schedule != "constant"


def run_identity(config: Config) -> dict[str, dict[str, Any]]:
    """The fields that define the training run, as `{section: {field: value}}` (JSON types).

    A checkpoint stores it; resuming with a different identity is refused. Left out
    (HASH_EXCLUDED): train.log_every, eval_every, checkpoint_every, keep_checkpoints and
    data.eval_batch_size and data.val_path (what is logged, evaluated or saved when, not what is
    trained), data.threads and data.workers (how batches are computed, never which), and
    parallel.devices, parallel.shard_optimizer_state, parallel.shard_params and parallel.replicas
    (the device count and the layout may change between runs: the step's result does not depend on
    them), and train.accelerator_only (PLACEMENT_ONLY: where a run may start, not what it trains).
    train.steps counts only where the schedule uses it (`schedule_uses_steps`): otherwise the
    first S steps of a longer run are those of an S-step run, so more steps extend a run.
    Everything else counts, train.precision, parallel.reduce_dtype, model.attention,
    model.remat and model.loss_chunk included: a resumed run cannot change the arithmetic it trains with
    (`ADDED_DEFAULTS` lets checkpoints written before those fields existed resume).
    """
    d = config.to_dict()
    for dotted in (*HASH_EXCLUDED, *PLACEMENT_ONLY):
        section, key = dotted.split(".")
        del d[section][key]
    if not schedule_uses_steps(config):
        del d["train"]["steps"]
    return d


def identity_hash(identity: dict) -> str:
    """sha256 (hex) of the canonical JSON (sorted keys) of a run identity."""
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def config_hash(config: Config) -> str:
    """sha256 (hex) of the canonical JSON (sorted keys) of `run_identity(config)`."""
    return identity_hash(run_identity(config))


__all__ = ["ADDED_DEFAULTS", "ATTENTIONS", "Config", "ConfigError", "DATASETS", "DataConfig", "HASH_EXCLUDED",
           "MODELS", "MODEL_DATA", "ModelConfig", "OptimConfig", "PLACEMENT_ONLY", "ParallelConfig", "SECTIONS",
           "TrainConfig", "apply_overrides", "config_from_dict", "config_hash", "field_docs",
           "fsdp_layer_defaults", "identity_hash", "load_config", "run_identity", "schedule_uses_steps", "steps_override",
           "validate"]
