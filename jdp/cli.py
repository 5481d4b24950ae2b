"""`jdp`: the command line. Thin: parse, set up devices, call the library."""
from __future__ import annotations

import argparse
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="train the default model (an MLP on scikit-learn's digits)",
                           description="Train an MLP on scikit-learn's bundled digits (no download) with "
                           "data parallelism over N devices; on a CPU-only machine N fake devices.")
    train.add_argument("--devices", type=_positive_int, default=None,
                       help="number of devices; on a CPU-only machine, fake CPU devices (default: 4 on CPU, "
                       "all accelerators otherwise)")
    train.add_argument("--backend", choices=("shard_map", "pmap"), default="shard_map")
    train.add_argument("--steps", type=_positive_int, default=300, help="optimizer steps (default 300)")
    train.add_argument("--batch-size", type=_positive_int, default=128, help="GLOBAL batch size (default 128)")
    train.add_argument("--lr", type=_positive_float, default=3e-3, help="Adam learning rate (default 3e-3)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--log-every", type=_positive_int, default=50)

    explain = sub.add_parser("explain", help="show, with numbers, why jdp averages gradients instead of summing",
                             description="Run jdp's step on 8 fake CPU devices and print: the seed examples "
                             "(mean vs sum), the deviation of every optimizer x clipping x reduction x N from one "
                             "device, Adam's ε, clipping rates and fp16 overflow.")
    explain.add_argument("--json", action="store_true", help="print the results as JSON on stdout instead")
    explain.add_argument("--plot", metavar="FILE.png", help="also save a plot of deviation vs N (needs matplotlib)")
    explain.add_argument("--backend", choices=("shard_map", "pmap"), default="shard_map")
    explain.add_argument("--devices", type=_device_list, default=(2, 4, 8), metavar="N,N,...",
                         help="device counts of the matrix (default 2,4,8)")
    return parser


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


def cmd_train(args) -> int:
    import optax
    from flax import nnx

    from jdp.data import load_digits
    from jdp.models import MLP
    from jdp.train import train_classifier

    devices = _devices(args.devices)
    data = load_digits()
    model = MLP([64, 128, 10], rngs=nnx.Rngs(args.seed))
    result = train_classifier(model, data, optax.adam(args.lr), steps=args.steps, batch_size=args.batch_size,
                              devices=devices, backend=args.backend, seed=args.seed, log_every=args.log_every)
    print(f"test accuracy {result.test_accuracy:.4f} on {len(data[3])} held-out digits after {result.steps} "
          f"steps ({result.seconds:.1f} s)")
    return 0


def cmd_explain(args) -> int:
    import json

    from jdp.cpu import backends_started, use_cpu_devices
    from jdp.explain import EXPLAIN_DEVICES, explain, plot, render

    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot {args.plot!r} must name a .png file.")
    if not backends_started():
        use_cpu_devices(max(EXPLAIN_DEVICES, *args.devices))
    results = explain(args.devices, backend=args.backend)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        render(results)
    if args.plot:
        plot(results, args.plot)
        print(f"saved {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"train": cmd_train, "explain": cmd_explain}[args.command](args)
    except ValueError as e:  # bad input: one sentence, exit code 2, no traceback
        print(f"jdp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
