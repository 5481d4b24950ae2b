"""`jdp`: the command line. Thin: parse, set up devices, call the library."""
from __future__ import annotations

import argparse
import errno
import os
import sys

from jdp import __version__
from jdp.run.commands import (add_configs_parser, add_data_parser, add_export_parser, add_sample_parser, cmd_configs,
                              cmd_data, cmd_export, cmd_sample)
from jdp.run.exits import INTERRUPTED, run_quietly
from jdp.run.supervisor import SUPERVISED


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _device_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list device counts of at least 1")
    return tuple(sorted(set(values)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jdp", description="jdp: a small, exact JAX data-parallel trainer. N devices average their "
        "gradients and take exactly the step one device takes on the global batch.")
    parser.add_argument("--version", action="version", version=f"jdp {__version__}",
                        help="print jdp's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train_parser(sub)
    _add_plot_parser(sub)
    _add_explain_parser(sub)
    _add_config_parser(sub)
    add_configs_parser(sub)
    add_data_parser(sub)
    add_sample_parser(sub)
    add_export_parser(sub)
    memory = sub.add_parser("memory", help="bytes per device of a config's step, replicated / ZeRO-1 / FSDP",
                            description="Compile CONFIG's step in each layout (nothing is trained) and print "
                            "the state between steps and the compiled step's peak, bytes per device.")
    memory.add_argument("config", nargs="?", help="YAML config (default: the built-in digits MLP)")
    memory.add_argument("--devices", type=_positive_int, help="number of devices (as for jdp train)")
    memory.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    return parser


def _add_train_parser(sub) -> None:
    """`jdp train`: a config on N devices, resumable, with the multi-process options in their own group."""
    train = sub.add_parser(
        "train", help="train a config (default: an MLP on scikit-learn's digits)",
        description="Train CONFIG (a shipped config's name, e.g. char_gpt: `jdp configs` lists them; or a YAML file; "
        "default: an MLP on scikit-learn's bundled digits) "
        "with data parallelism over N devices; on a CPU-only machine, N fake CPU devices. Writes metrics.jsonl and "
        "orbax checkpoints to --workdir; running the same command again resumes from the newest checkpoint.")
    train.add_argument("config", nargs="?", help="a shipped config's name (jdp configs) or a YAML file (default: the "
                       "built-in digits MLP)")
    train.add_argument("--workdir", help="run directory (default: runs/<config name>)")
    train.add_argument("--devices", type=_positive_int, help="number of devices; on a CPU-only machine, fake CPU "
                       "devices (default: the config's parallel.devices, else 4 on CPU, all accelerators otherwise)")
    train.add_argument("--steps", type=_positive_int, help="total optimizer steps (train.steps); where a cosine or "
                       "linear schedule's warmup would not be shorter, it keeps the config's warmup fraction, said in "
                       "one line (--set optim.warmup_steps=W sets it instead); also lets a config with "
                       "train.accelerator_only run on CPUs")
    train.add_argument("--log-every", type=_positive_int, help="log every K steps (train.log_every)")
    train.add_argument("--checkpoint-every", type=_positive_int, help="checkpoint every K steps (train.checkpoint_every)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set optim.lr=3e-4 --set data.batch_size=512")
    train.add_argument("--stop-after", type=_positive_int, metavar="N",
                       help="stop (with a checkpoint) after N optimizer steps of this invocation; rerun to continue "
                       "(also lets a config with train.accelerator_only run N steps on CPUs)")
    train.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    train.add_argument("--tensorboard", action="store_true",
                       help="also write the logged scalars to DIR/tensorboard (needs tensorboardX)")
    train.add_argument("--wandb", action="store_true", help="also log the config and every record to a Weights & "
                       "Biases run in offline mode, in DIR/wandb (no server; `wandb sync` uploads it; needs wandb)")
    train.add_argument("--profile-steps", metavar="FIRST:LAST", help="write a jax.profiler trace of optimizer steps "
                       "FIRST..LAST into DIR/profile (train.profile_steps), for TensorBoard's profile plugin or Perfetto")
    train.add_argument("--fallback-to-intact", action="store_true",
                       help="if the newest checkpoint is damaged, resume from the newest intact one and move the "
                       "damaged ones to DIR/checkpoints.damaged (default: refuse)")
    _add_multi_process_args(train)


def _add_multi_process_args(train) -> None:
    """`jdp train`'s options for a job of several processes (jax.distributed)."""
    multi = train.add_argument_group("multi-process runs (jax.distributed; --devices is then per process)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0, which hosts the coordinator")
    multi.add_argument("--num-processes", type=_positive_int, metavar="P",
                       help="how many processes the job has (with --coordinator)")
    multi.add_argument("--process-id", type=int, metavar="I", help="this process, 0..P-1")
    multi.add_argument("--auto-distributed", action="store_true",
                       help="detect the cluster (SLURM, Open MPI, ...) with jax.distributed.initialize()")
    multi.add_argument("--init-timeout", type=_positive_int, default=60, metavar="S",
                       help="seconds to wait for all processes to join (default 60)")
    multi.add_argument("--heartbeat-timeout", type=_positive_int, default=10, metavar="S",
                       help="seconds without a heartbeat after which a process counts as gone and the others stop "
                       "(default 10); raise it for processes that may pause (a debugger, a swapping host)")


def _add_plot_parser(sub) -> None:
    """`jdp plot`: a run's curves as a PNG."""
    plot = sub.add_parser("plot", help="save a PNG of a run's loss and accuracy curves",
                          description="Read DIR/metrics.jsonl and write DIR/curves.png (or --out).")
    plot.add_argument("workdir", metavar="DIR", help="the run directory (jdp train's --workdir)")
    plot.add_argument("--out", metavar="FILE.png", help="where to save the PNG (default: DIR/curves.png)")


def _add_explain_parser(sub) -> None:
    """`jdp explain`: why jdp averages gradients, measured on fake CPU devices."""
    explain = sub.add_parser("explain", help="show, with numbers, why jdp averages gradients instead of summing",
                             description="Run jdp's step on 8 fake CPU devices and print: the seed examples "
                             "(mean vs sum), the deviation of every optimizer x clipping x reduction x N from one "
                             "device, bf16 gradient communication, Adam's ε, clipping rates and fp16 overflow. It compiles "
                             "~120 steps: 434-466 s measured on a 2-core CPU shared with other work (load average 7-8), "
                             "less on an idle one; it says so when it starts, and each part, and each run within it, "
                             "is reported on stderr as it starts.")
    explain.add_argument("--json", action="store_true",
                         help="print the results as JSON on stdout instead (progress goes to stderr)")
    explain.add_argument("--plot", metavar="FILE.png", help="also save a plot of deviation vs N (needs matplotlib)")
    explain.add_argument("--backend", choices=("shard_map", "pmap", "jit"), default="shard_map",
                         help="the step's backend (default shard_map); under jit, the parts that compare "
                         "per-device reductions (psum, bf16 communication, Adam's ε, clipping, fp16) say they "
                         "are skipped, and the exactness parts run")
    explain.add_argument("--devices", type=_device_list, default=(2, 4, 8), metavar="N,N,...",
                         help="device counts of the matrix (default 2,4,8)")


def _add_config_parser(sub) -> None:
    config = sub.add_parser("config", help="the config's JSON Schema, for editors",
                            description="Tools for jdp train's YAML configs.")
    what = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND",
                                 help="what to do with configs")
    what.add_parser("schema", help="print the config's JSON Schema (draft 2020-12)",
                    description="Print the JSON Schema of a config on stdout: every section and key with its "
                    "type, default, allowed values and description; unknown keys are refused. Save it "
                    "(jdp config schema > jdp.schema.json) and point your editor at it, e.g. a first line "
                    "'# yaml-language-server: $schema=jdp.schema.json' in a config.")


def _devices(requested: int | None):
    import jax

    from jdp.cpu import backends_started, use_cpu_devices

    if not backends_started():
        use_cpu_devices(requested or 4)  # shapes only the CPU backend; accelerators win if present
    devices = jax.devices()
    if requested is not None and requested > len(devices):
        raise ValueError(f"--devices {requested} exceeds the {len(devices)} available "
                         f"{devices[0].platform} device(s).")
    return devices[:requested] if requested else devices


def _cpu_asked_for(args, config, devices) -> bool:
    """Whether this command asks for a number of steps (--steps, --stop-after): that lets a config
    meant for accelerators (train.accelerator_only) train on CPUs. Without it, such a config on
    CPUs is refused here, in one sentence that says how to run it anyway."""
    from jdp.run.train import meant_for_accelerators

    asked = args.steps is not None or args.stop_after is not None
    if meant_for_accelerators(config, devices) and not asked:
        raise ValueError(f"{args.config or 'the config'} is meant for accelerators (GPU/TPU) and jax sees only CPUs "
                         f"here; pass --stop-after N (or --steps N) to run N steps on the CPU anyway.")
    return asked


def _quiet_closed_loop_callbacks() -> None:
    """Hide the tracebacks tensorstore's pending writes print when a checkpoint save that already failed
    (reported in one sentence) calls them back into orbax's closed asyncio loop; anything else prints."""
    default = sys.unraisablehook

    def hook(info):
        if info.exc_type is RuntimeError and str(info.exc_value) == "Event loop is closed":
            return
        default(info)

    sys.unraisablehook = hook


def _quiet_failed_save_tasks() -> None:
    """After a save that ran out of space is reported: orbax's other write tasks of that save failed
    alike, and asyncio logs each one's traceback when it is collected at exit ("Task exception was
    never retrieved", or "_GatheringFuture ..." for the gather that awaited them); whether any is
    left uncollected depends on timing."""
    import logging

    def kept(record) -> bool:
        return not record.getMessage().split("\n", 1)[0].endswith(" exception was never retrieved")

    logging.getLogger("asyncio").addFilter(kept)


def train_workdir(args) -> str:
    """`jdp train`'s workdir: --workdir, or runs/<config name>."""
    name = os.path.splitext(os.path.basename(args.config))[0] if args.config else "digits_mlp"
    return os.path.join("runs", name) if args.workdir is None else args.workdir


def cmd_train(args) -> int:
    if args.workdir == "":
        raise ValueError("--workdir '' is empty; name the run's directory (or leave --workdir out for "
                         "runs/<config name>).")
    config, devices = _train_config_and_devices(args)
    # Imported once the devices are set up: the fake CPU devices must be asked for before jax starts.
    from jdp.run.checkpoint import CheckpointWriteError, NonFiniteStateError
    from jdp.run.train import DataStoppedError, EvaluationOutOfMemoryError, NonFiniteError, train

    allow_cpu = _cpu_asked_for(args, config, devices)
    _quiet_closed_loop_callbacks()
    workdir = train_workdir(args)
    try:
        result = train(config, workdir, devices=devices, progress=not args.no_progress, stop_after=args.stop_after,
                       tensorboard=args.tensorboard, fallback_to_intact=args.fallback_to_intact, allow_cpu=allow_cpu,
                       wandb=args.wandb)
    except (NonFiniteError, NonFiniteStateError) as e:
        print(f"jdp: {e}", file=sys.stderr)
        return 1
    except (EvaluationOutOfMemoryError, DataStoppedError) as e:
        print(f"jdp: error: {e}.", file=sys.stderr)
        return 1
    except CheckpointWriteError as e:
        _quiet_failed_save_tasks()
        print(f"jdp: error: {e.strerror}: free some space (or raise the file-size limit) and rerun the same command "
              f"to resume.", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # train() has saved the step it failed at (or an earlier checkpoint is intact): say so, no traceback.
        where = f" writing {e.filename!r}" if e.filename else ""
        print(f"jdp: error: the disk is full ({e.strerror}{where}); every checkpoint already saved is intact: free "
              f"some space and rerun the same command to resume.", file=sys.stderr)
        return 1
    _print_result(result, config, workdir)
    return INTERRUPTED if result.stopped_by == "SIGINT" else 0  # Ctrl-C: checkpointed, yet interrupted


def _train_config_and_devices(args, layer_defaults: bool = True) -> tuple:
    """`jdp train`'s config (file, --set and the flags; with `layer_defaults`, a GPT under FSDP scanned
    per layer unless the config says otherwise) and devices: this process's own, or every process's
    once jax.distributed is initialised (--coordinator, --auto-distributed)."""
    from jdp.run.config import fsdp_layer_defaults, load_config, steps_override
    from jdp.run.shipped import resolve_config

    distributed = args.coordinator is not None or args.auto_distributed
    flags = {"parallel.devices": None if distributed else args.devices,
             "train.log_every": args.log_every, "train.checkpoint_every": args.checkpoint_every,
             "train.profile_steps": None if args.profile_steps is None else repr(args.profile_steps)}
    overrides = [*args.set, *(f"{k}={v}" for k, v in flags.items() if v is not None)]
    path, scaled = resolve_config(args.config), None
    if args.steps is not None:  # a short run of a config whose warmup outlasts it keeps its warmup fraction
        added, scaled = steps_override(path, args.set, args.steps)
        overrides += added
    layered = None
    if layer_defaults:
        added, layered = fsdp_layer_defaults(path, overrides)
        overrides += added
    config = load_config(path, overrides)  # a bad config fails before any device is set up
    for line in (scaled, layered):
        if line and not args.process_id:  # one line, from process 0 (or the only one)
            print(line)
    if not distributed:
        if args.num_processes or args.process_id is not None:
            raise ValueError("--num-processes and --process-id need --coordinator HOST:PORT.")
        return config, _devices(config.parallel.devices)
    from jdp.cpu import use_cpu_devices
    from jdp.run.distributed import initialize

    if config.parallel.devices:
        raise ValueError("parallel.devices cannot be set in a multi-process run: every process's devices "
                         "join; --devices sets each process's (fake CPU) device count.")
    use_cpu_devices(args.devices or 1)  # CPU-only machines: fake devices per process
    initialize(args.coordinator, args.num_processes, args.process_id, timeout_s=args.init_timeout,
               heartbeat_s=args.heartbeat_timeout)
    import jax

    return config, jax.devices()


def _print_result(result, config, workdir: str) -> None:
    """The run's last console line (process 0): how far it got, the held-out metrics, the workdir;
    the params themselves for tiny models (the seed examples)."""
    import jax
    import numpy as np

    if jax.process_index():
        return
    from jdp.run.metrics import eval_text

    evals = eval_text(result.eval)
    if result.resumed_from == result.steps == config.train.steps:  # nothing left to train
        head = f"the run is complete ({result.steps} of {config.train.steps} steps, trained earlier)"
    else:
        head = (f"{'stopped' if result.steps < config.train.steps else 'done'} at step {result.steps} of "
                f"{config.train.steps} in {result.seconds:.1f} s")
    print(head + (f"; held-out {evals}" if evals else "") + f"; workdir {workdir}")
    leaves = jax.tree_util.tree_leaves_with_path(result.params)
    if sum(np.size(v) for _, v in leaves) <= 8:  # tiny models (the seed examples): show the params
        print("params: " + ", ".join(f"{jax.tree_util.keystr(k)} = {np.round(np.asarray(v, np.float64), 6).tolist()}"
                                     for k, v in leaves))


def cmd_plot(args) -> int:
    from jdp.run.metrics import plot_metrics

    if args.out and not args.out.lower().endswith(".png"):
        raise ValueError(f"--out {args.out!r} must name a .png file.")
    folder = os.path.dirname(args.out or os.path.join(args.workdir, "curves.png")) or "."
    if args.out and not os.path.isdir(folder):
        raise ValueError(f"--out {args.out!r} is in a directory that does not exist ({folder!r}); create it or "
                         f"choose another path.")
    try:
        print(f"saved {plot_metrics(args.workdir, args.out)}")
    except OSError as e:  # a directory without write permission, a full disk, --out naming a directory
        raise ValueError(f"cannot write the plot to {args.out or folder!r} ({e.strerror or e}); choose another "
                         f"--out.") from None
    return 0


def cmd_explain(args) -> int:
    import json

    from jdp.cpu import backends_started, use_cpu_devices
    from jdp.inspect.explain import EXPLAIN_DEVICES, MEASURED_TIME, PARTS, explain, plot, progress_to, render

    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot {args.plot!r} must name a .png file.")
    if not backends_started():
        use_cpu_devices(max(EXPLAIN_DEVICES, *args.devices))
    print(f"jdp explain: {len(PARTS)} parts, ~120 steps to compile on {max(EXPLAIN_DEVICES, *args.devices)} fake CPU "
          f"devices; {MEASURED_TIME}", file=sys.stderr, flush=True)
    with progress_to(sys.stderr) as progress:  # stderr: with --json, stdout is the JSON document alone
        results = explain(args.devices, backend=args.backend, progress=progress)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        render(results)
    if args.plot:
        plot(results, args.plot)
        print(f"saved {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_memory(args) -> int:
    args.steps = args.log_every = args.checkpoint_every = args.coordinator = args.num_processes = None
    args.auto_distributed, args.process_id, args.profile_steps = False, None, None
    config, devices = _train_config_and_devices(args, layer_defaults=False)
    from jdp.run.config import fsdp_layer_defaults
    from jdp.run.memory_table import memory_table, render
    from jdp.run.shipped import resolve_config

    per_layer, _ = fsdp_layer_defaults(resolve_config(args.config), [*args.set, "parallel.shard_params=true"])
    def say(line):  # progress on stderr: stdout is the table alone, as `jdp memory CONFIG > table.txt` keeps it
        print(line, file=sys.stderr, flush=True)

    print(render(memory_table(config, devices, fsdp_extra=per_layer, say=say), len(devices)))
    return 0


def cmd_config(args) -> int:
    import json

    from jdp.run.config_schema import config_schema

    print(json.dumps(config_schema(), indent=2, ensure_ascii=False))  # config_command is "schema", the only one
    return 0


def main(argv: list[str] | None = None) -> int:
    """`jdp ARGS`: the exit code. Ctrl-C ends with one line and 130 (in `jdp train`, after the
    step it stops at is checkpointed); a reader that closes the pipe (`| head`) ends it quietly
    (`jdp.run.exits`)."""
    return run_quietly(_main, argv)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    distributed = args.command == "train" and (args.coordinator is not None or args.auto_distributed)
    if distributed and not os.environ.get(SUPERVISED):
        from jdp.run.supervisor import supervise

        return supervise(argv, args.process_id, args.heartbeat_timeout, workdir=train_workdir(args),
                         num_processes=args.num_processes, init_timeout=args.init_timeout)
    try:
        return {"train": cmd_train, "explain": cmd_explain, "plot": cmd_plot, "config": cmd_config,
                "configs": cmd_configs, "data": cmd_data, "memory": cmd_memory,
                "sample": cmd_sample, "export": cmd_export}[args.command](args)
    except ValueError as e:  # bad input: one sentence, exit code 2, no traceback
        print(f"jdp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
