"""The five sections of a `jdp.config.Config`: frozen dataclasses with a docstring and a rule per field.

`jdp.config` re-exports every name here; import them from there. Each field is type- and
range-checked on construction (`jdp.run.sections.Section`). The step's own options (train.precision,
parallel.reduce_dtype) are checked, and their aliases resolved ("bf16" -> "bfloat16"), by
`jdp.core.options.StepOptions` itself, so that a config and `make_train_step` follow one rule and two
spellings of one run have one identity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jdp.core.optim import OPTIMIZERS, SCHEDULES
from jdp.core.options import ACCUM_SYNCS, BACKENDS, LR_CORRECTIONS, REDUCTIONS, OptionError, StepOptions
from jdp.core.precision import ALIASES, DTYPES
from jdp.data.datasets import SEED_REGRESSIONS
from jdp.data.tokens import TOKEN_DTYPES
from jdp.run.sections import (BOOL, COUNT, FRACTION, NON_NEGATIVE, PATH, POSITIVE, POSITIVE_INT, SEED, TWO_WIDTHS, UNIT,
                          WIDTHS, ConfigError, Rule, Section, one_of, or_null)

MODELS = ("mlp", "cnn", "gpt", "linear")
DATASETS = ("digits", "chars", "seed_linear", "arrays", "tokens")
# The datasets each model can train on (the model's input and loss must fit the arrays).
MODEL_DATA = {"mlp": ("digits", "arrays"), "cnn": ("digits", "arrays"), "gpt": ("chars", "tokens"),
              "linear": ("seed_linear", "arrays")}
HOSTS = "hosts"  # parallel.replicas: one replica group per process
ATTENTIONS = ("flax", "fused", "cudnn")  # the gpt's attention functions, as `jdp.models.gpt.ATTENTIONS` names them
AUTO = "auto"  # model.attention, model.remat: chosen for the device when a run starts (`jdp.run.device_defaults`)
REMAT = Rule("true, false or 'auto'",
             lambda v: v == AUTO if isinstance(v, str) else True, schema={"pattern": "^auto$"})
# train.precision and parallel.reduce_dtype: what the section checks itself (the type); StepOptions
# checks the value, so "fp16" gets its one-sentence reason and "bf16" its canonical name.
DTYPE = Rule("'float32' ('fp32') or 'bfloat16' ('bf16')", schema={"enum": [*DTYPES, *ALIASES]})
REPLICAS = Rule("a positive integer or 'hosts' (one group per process)",
                lambda v: v == HOSTS if isinstance(v, str) else v >= 1, schema={"minimum": 1, "pattern": "^hosts$"})
PROFILE_STEPS = Rule("'FIRST:LAST' (quoted: YAML reads 20:25 unquoted as a number), two step numbers with "
                     "1 <= FIRST <= LAST", lambda v: _profile_steps_ok(v), schema={"pattern": r"^\d+:\d+$"})


def _profile_steps_ok(text: str) -> bool:
    from jdp.run.profile import parse_steps

    try:
        return parse_steps(text) is not None
    except ValueError:
        return False


def step_option_key(option: str) -> str:
    """The dotted config key of a `StepOptions` field: train.precision, parallel.<any other>."""
    return "train.precision" if option == "precision" else f"parallel.{option}"


def _step_option(name: str, value):
    """`value` of StepOptions field `name` as StepOptions resolves it ("bf16" -> "bfloat16"); a ConfigError
    with its message under the dotted key if it refuses it."""
    try:
        return getattr(StepOptions(**{name: value}), name)
    except OptionError as e:
        raise ConfigError(f"{step_option_key(e.field)}: {e}") from None



@dataclass(frozen=True)
class ModelConfig(Section):
    """The network. Each model reads only its own fields; the others keep their defaults."""

    name: str = "mlp"
    """One of "mlp", "cnn", "gpt", "linear" (y = w·x, for the seed regressions and user arrays)."""
    hidden: tuple[int, ...] = (128,)
    """mlp: the hidden layer widths, input to output (the input and class counts come from the data)."""
    channels: tuple[int, ...] = (16, 32)
    """cnn: the widths of its two 3×3 convolutions."""
    sync_batchnorm: bool = False
    """cnn: BatchNorm statistics over the global batch (SyncBatchNorm) instead of each device's shard."""
    d_model: int = 64
    """gpt: the embedding width; divisible by n_heads."""
    n_heads: int = 4
    """gpt: attention heads per layer."""
    n_layers: int = 2
    """gpt: transformer blocks."""
    dropout: float = 0.1
    """gpt: dropout rate in [0, 1); keys differ per device and micro-step."""
    context: int = 64
    """gpt: tokens per training window (and the longest sequence the model accepts)."""
    attention: str = "flax"
    """gpt only: "flax" (nnx.MultiHeadAttention with a materialised (T, T) causal mask), "fused"
    (jax.nn.dot_product_attention with is_causal=True and no mask; XLA's implementation on every
    backend), "cudnn" (the same call with cuDNN flash attention: GPUs only, and train.precision
    bfloat16) or "auto" (chosen when the run starts, and said: cudnn on a GPU in bfloat16, else
    fused). The params are the same for all of them. Other models take only "flax"."""
    remat: bool | str = False
    """gpt only: recompute each transformer block in the backward pass instead of storing its
    activations (less memory, one more forward pass of the blocks); "auto": chosen when the run
    starts, and said: off where the compiled step's peak without it is at most 85% of the device's
    memory, on where it is more or the memory is not known (a CPU). Other models refuse true and auto."""
    scan_layers: bool = False
    """gpt only: stack the blocks' params and run them in one lax.scan (with model.remat, a
    rematerialised scan body). Under parallel.shard_params each layer's params are then gathered
    inside the scan body and its gradient reduce-scattered there: the step's peak holds about one
    layer whole instead of the model. The same model either way (initial params, dropout masks);
    the checkpoint stacks the layers. Unset, `jdp train` turns it and model.remat on for the gpt
    under parallel.shard_params, and says so. Other models refuse true."""
    loss_chunk: int = 0
    """gpt only: 0, the loss from the whole (batch, T, vocab) float32 logits; N > 0, a fused, chunked
    cross-entropy (jdp.models.fused_cross_entropy): the head matmul and log-sum-exp N positions
    at a time, the backward pass recomputing each block's logits; the same loss and gradients to
    rounding, less memory, one more head matmul. 0 by default: on a CPU the fused loss measured
    slower (docs/performance.md). Other models refuse a value above 0."""
    init_from: str | None = None
    """gpt only: a Hugging Face GPT-2 checkpoint directory (config.json, model.safetensors) to start
    from instead of random weights. Its config.json sets d_model, n_heads and n_layers (a value set
    here that contradicts it is refused) and the vocabulary; model.context is the training window,
    at most its n_positions (default: n_positions). Trains on data.name tokens; null: random weights."""

    _section: ClassVar[str] = "model"
    _rules: ClassVar[dict[str, Rule]] = dict(
        name=one_of(MODELS), hidden=WIDTHS, channels=TWO_WIDTHS, sync_batchnorm=BOOL, d_model=POSITIVE_INT,
        n_heads=POSITIVE_INT, n_layers=POSITIVE_INT, dropout=UNIT, context=POSITIVE_INT,
        attention=one_of((*ATTENTIONS, AUTO)), remat=REMAT, scan_layers=BOOL, loss_chunk=COUNT,
        init_from=or_null(PATH))


@dataclass(frozen=True)
class DataConfig(Section):
    """The dataset and how it is batched."""

    name: str = "digits"
    """One of "digits" (scikit-learn's 8×8 digits), "chars" (a character corpus, for gpt),
    "seed_linear" (the seed regressions y = w·x, `jdp.data.SEED_REGRESSIONS`), "arrays" (your own .npz),
    "tokens" (a flat file of token ids, nanoGPT's train.bin, read window by window; for gpt)."""
    path: str | None = None
    """arrays: a .npz file holding arrays "x" and "y"; tokens: the training token file (relative to
    the working directory). Its windows of model.context tokens tile it (`jdp.data.load_tokens`)."""
    val_path: str | None = None
    """tokens: the held-out token file, evaluated in windows of model.context tokens; null: none."""
    dtype: str = "uint16"
    """tokens: the dtype of the files' token ids, "uint8", "uint16" (nanoGPT's) or "uint32"."""
    vocab_size: int | None = None
    """tokens (required there): the number of token ids; the gpt gets one embedding per id, and a file
    holding an id >= vocab_size is refused (a sample when it opens, then every batch as it is read)."""
    seed_example: int = 2
    """seed_linear: which seed regression, 1 (one weight, 4 examples) or 2 (two weights, 8 examples)."""
    batch_size: int = 128
    """The GLOBAL batch of one optimizer step: all devices and all micro-batches together."""
    eval_batch_size: int = 256
    """Examples per evaluation batch."""
    drop_last: bool = True
    """Skip each epoch's last, incomplete batch; false pads it and masks the padding out."""
    test_fraction: float = 0.2
    """digits: the fraction held out to measure test accuracy, strictly between 0 and 1."""
    threads: int = 1
    """Threads of this process computing batches ahead (grain's); more help where reading or a
    transform releases the GIL. Never changes the batches."""
    workers: int = 0
    """grain worker processes computing batches ahead (0: none, threads only); for per-example work
    that holds the GIL. Never changes the batches."""

    _section: ClassVar[str] = "data"
    _rules: ClassVar[dict[str, Rule]] = dict(
        name=one_of(DATASETS), path=or_null(PATH), val_path=or_null(PATH), dtype=one_of(TOKEN_DTYPES),
        vocab_size=or_null(POSITIVE_INT),
        seed_example=Rule(" or ".join(map(str, SEED_REGRESSIONS)), lambda v: v in SEED_REGRESSIONS,
                          schema={"enum": list(SEED_REGRESSIONS)}),
        batch_size=POSITIVE_INT, eval_batch_size=POSITIVE_INT, drop_last=BOOL, test_fraction=FRACTION,
        threads=POSITIVE_INT, workers=COUNT)


@dataclass(frozen=True)
class OptimConfig(Section):
    """The optimizer and its learning-rate schedule (turned into a `jdp.OptimizerSpec`, schedule included)."""

    name: str = "adam"
    """One of "sgd", "momentum", "adam", "adamw"."""
    lr: float = 3e-3
    """The peak learning rate (before linear scaling, if that is on)."""
    momentum: float = 0.9
    """momentum: the heavy-ball coefficient, in [0, 1)."""
    b1: float = 0.9
    """adam/adamw: first-moment decay, in [0, 1)."""
    b2: float = 0.999
    """adam/adamw: second-moment decay, in [0, 1)."""
    eps: float = 1e-8
    """adam/adamw: added to sqrt(v); positive."""
    weight_decay: float = 0.0
    """adamw only: decoupled weight decay (multiplied by the scheduled lr)."""
    clip_norm: float | None = None
    """Clip the gradient's global norm to this before the optimizer; null turns clipping off."""
    schedule: str = "constant"
    """After warmup: "constant", "cosine" or "linear" (both decay to 0 at train.steps)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr; 0 starts at lr."""
    linear_scaling: bool = False
    """Opt-in linear scaling rule (Goyal et al., 2017): lr × data.batch_size / base_batch_size. It
    compensates for fewer steps per epoch at a larger batch; it is not the gradient averaging
    that makes N devices equal one."""
    base_batch_size: int = 256
    """linear_scaling: the batch size at which lr was tuned."""

    _section: ClassVar[str] = "optim"
    _rules: ClassVar[dict[str, Rule]] = dict(
        name=one_of(OPTIMIZERS), lr=POSITIVE, momentum=UNIT, b1=UNIT, b2=UNIT, eps=POSITIVE,
        weight_decay=NON_NEGATIVE, clip_norm=or_null(POSITIVE), schedule=one_of(SCHEDULES),
        warmup_steps=COUNT, linear_scaling=BOOL, base_batch_size=POSITIVE_INT)


@dataclass(frozen=True)
class ParallelConfig(Section):
    """How the step is spread over devices (the arguments of `jdp.make_train_step`)."""

    backend: str = "shard_map"
    """"shard_map" (jit over a 1-D mesh, the loss per device), "pmap", or "jit" (the global view: the
    loss sees the global batch, the partitioner reduces; no reduction "sum", accum_sync "last" or
    reduce_dtype)."""
    devices: int | None = None
    """Devices to use; null: all of them (on a CPU-only machine, 4 fake CPU devices)."""
    reduction: str = "mean"
    """"mean" (pmean: the global-batch gradient) or "sum" (psum: N times it)."""
    lr_correction: str | None = None
    """reduction "sum" only: null or "auto" (lr/N), "none" (raw sum), "exact" (the spec's scale-
    dependent hyperparameters, `jdp.exact_sum_spec`). With "mean": null or "none"."""
    accum_steps: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    accum_sync: str = "every"
    """accum_steps > 1: all-reduce on "every" micro-batch, or once, on the "last"."""
    reduce_dtype: str | None = None
    """The dtype of the gradient all-reduce: null (default: the gradient's own, float32), "float32"
    ("fp32") or "bfloat16" ("bf16": half the bytes; each device divides its bf16 gradient by N
    before the sum, and the mean is cast back to float32 for the optimizer). Stored as the full name."""
    shard_optimizer_state: bool = False
    """ZeRO-1 (backend shard_map or jit): each device keeps 1/N of the optimizer state; the gradient is
    reduce-scattered and the new params all-gathered. The same step; checkpoints are the same as
    without it, so a run may resume with or without it."""
    shard_params: bool = False
    """Fully sharded data parallel (backend shard_map or jit; implies shard_optimizer_state): each device
    keeps 1/N of the params too, gathers them for each forward and backward pass and reduce-scatters
    the gradient. The same step and the same checkpoints, so a run may resume with or without it."""
    replicas: int | str = 1
    """Hybrid sharding, with shard_params or shard_optimizer_state: the devices form this many equal
    groups ("hosts": one per process), the state split over a group's devices and replicated across
    the groups; the gradient is reduce-scattered within each group and its blocks all-reduced
    across them (PyTorch FSDP's HYBRID_SHARD). 1: one group of every device. The same step and the
    same checkpoints."""

    _section: ClassVar[str] = "parallel"
    _rules: ClassVar[dict[str, Rule]] = dict(
        backend=one_of(BACKENDS), devices=or_null(POSITIVE_INT), reduction=one_of(REDUCTIONS),
        lr_correction=or_null(one_of(LR_CORRECTIONS)), accum_steps=POSITIVE_INT, accum_sync=one_of(ACCUM_SYNCS),
        reduce_dtype=or_null(DTYPE), shard_optimizer_state=BOOL, shard_params=BOOL, replicas=REPLICAS)

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "reduce_dtype", _step_option("reduce_dtype", self.reduce_dtype))


@dataclass(frozen=True)
class TrainConfig(Section):
    """The loop: length, cadence of logs, evaluations and checkpoints, and the seed."""

    steps: int = 300
    """Optimizer steps (each consumes data.batch_size examples); schedules count these."""
    log_every: int = 50
    """Log every this many optimizer steps (and at the last)."""
    eval_every: int = 0
    """Evaluate every this many optimizer steps (and at the last); 0: only at the end. Each evaluation
    reads the whole held-out set."""
    checkpoint_every: int = 0
    """Checkpoint every this many optimizer steps; 0: only at the end."""
    keep_checkpoints: int = 3
    """The most recent checkpoints kept on disk; an older one is deleted once a newer one is complete,
    and only if jdp wrote it."""
    max_nonfinite: int = 3
    """Skip updates with NaN/Inf gradients, stopping after this many in a row; 0: never skip."""
    seed: int = 0
    """Seeds the params' initialisation, the data order and the dropout keys."""
    precision: str = "float32"
    """The compute dtype of the forward and backward pass and of evaluation: "float32" ("fp32") or
    "bfloat16" ("bf16"; jdp's models then compute in bfloat16). Params (float32 master copy),
    loss, logits, gradient, optimizer and model state stay float32 either way. float16 is refused:
    it needs loss scaling. Stored as the full name."""
    accelerator_only: bool = False
    """The config is meant for GPUs/TPUs: `jdp train` refuses to start it when jax sees only CPUs,
    unless --steps or --stop-after asks for a few steps there (`train(..., allow_cpu=True)` in code)."""
    profile_steps: str | None = None
    """"FIRST:LAST": write a `jax.profiler` trace of optimizer steps FIRST..LAST (inclusive) into
    WORKDIR/profile, for TensorBoard's profile plugin or Perfetto (--profile-steps); null: none."""

    _section: ClassVar[str] = "train"
    _rules: ClassVar[dict[str, Rule]] = dict(
        steps=POSITIVE_INT, log_every=POSITIVE_INT, eval_every=COUNT, checkpoint_every=COUNT,
        keep_checkpoints=POSITIVE_INT, max_nonfinite=COUNT, seed=SEED,
        precision=DTYPE, accelerator_only=BOOL, profile_steps=or_null(PROFILE_STEPS))

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "precision", _step_option("precision", self.precision))


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
                             "parallel": ParallelConfig, "train": TrainConfig}
