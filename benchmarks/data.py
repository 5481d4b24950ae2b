"""Part 7 of `python -m benchmarks.run`: the input pipeline against the step it feeds, and its memory.

- Loader batches/s (this process's batch, prefetch off, one thread: the loader's own cost) for
  the char GPT's batches read from a token file (global batch 64 windows of 64 tokens) and from
  its in-memory character windows (an ArrayDataset), for 64
  32×32 uint8 images from a grain MapDataset and from an ArrayRecord file, and from the grain
  source with a transform-heavy per-example augmentation in Python (`heavy`), the latter also
  with 2 threads and with 2 grain worker processes; against the char GPT's compiled step
  (configs/char_gpt.yaml's model) on 2 fake CPU devices. Target: loader ≥ 5× the step.
- Anonymous memory (RssAnon, from /proc/self/status) of a fresh process that opens a token file
  and reads batches from it, for a 10 MB and a 1 GB file (sparse files in a temporary directory:
  zero token ids, no disk space): flat as the file grows. VmRSS is shown too (with the memory map
  jdp used before `os.pread`, it also counted the file pages the kernel read ahead: page cache).

    python -m benchmarks.data memory FILE BATCHES   # one memory measurement (what part 7 runs)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONTEXT, BATCH = 64, 64  # configs/char_gpt.yaml's windows and global batch


def heavy(example, rng):
    """A transform-heavy augmentation written in Python: random crop and flip of a 32×32 image, then 24
    rounds of per-row jitter (a stand-in for per-example decoding and augmentation)."""
    y, x = rng.integers(0, 5, 2)
    image = example["image"][y:y + 28, x:x + 28]
    if rng.random() < 0.5:
        image = image[:, ::-1]
    image = image.astype(np.float32) / 255.0
    for _ in range(24):
        image = image + 0.001 * rng.standard_normal(28, dtype=np.float32)[:, None]
    return {"image": np.ascontiguousarray(image), "label": example["label"]}


def image_source(n: int = 4096):
    """A grain MapDataset of n 32×32 uint8 images with int32 labels."""
    import grain

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, n).astype(np.int32)
    return grain.MapDataset.range(n).map(lambda i: {"image": images[i], "label": labels[i]})


def batches_per_s(make, count: int, ahead: int = 0) -> float:
    """Batches/s of `count` batches from a fresh `make()` iterator; the first 1 + `ahead` batches (worker
    start-up, and the batches computed ahead meanwhile) are read before the clock starts."""
    it = make()
    for _ in range(1 + ahead):
        next(it)
    t0 = time.perf_counter()
    for _ in range(count):
        next(it)
    rate = count / (time.perf_counter() - t0)
    it.close()
    return rate


def char_gpt_steps_per_s(steps: int) -> float:
    """Steps/s of configs/char_gpt.yaml's compiled step on 2 fake CPU devices, batches pre-staged."""
    import jax

    from jdp.config import load_config
    from jdp.data import make_batches
    from jdp.step import make_train_step
    from jdp.run.tasks import build_task

    config = load_config(os.path.join(ROOT, "configs", "char_gpt.yaml"), ["parallel.devices=2"])
    task = build_task(config)
    step = make_train_step(task.loss_fn, config.optimizer_spec(), devices=jax.devices()[:2], has_aux=True,
                           needs_rng=True, has_state=True)
    it = make_batches(task.train, BATCH, prefetch=0)
    placed = [step.shard_batch(next(it)) for _ in range(4)]
    state = step.init(task.params, task.model_state, seed=0)
    for b in placed:  # compile and warm up
        state, _ = step(state, b)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for i in range(steps):
        state, _ = step(state, placed[i % 4])
    jax.block_until_ready(state)
    return steps / (time.perf_counter() - t0)


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (Linux)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def memory_worker(path: str, count: int) -> dict:
    """RssAnon and VmRSS after the imports, after opening the token file, and after reading `count` batches."""
    import jax  # noqa: F401 - `import jdp` no longer imports jax: count it with the imports, not the file

    from jdp.data import load_tokens, make_batches

    out = {"file_bytes": os.path.getsize(path), "batches": count, "after_import": _status("RssAnon")}
    tokens = load_tokens(path, context_length=CONTEXT, vocab_size=256)
    it = make_batches(tokens, BATCH, prefetch=0)
    next(it)
    out["after_open"] = _status("RssAnon")
    for _ in range(count):
        next(it)
    out |= {"after_batches": _status("RssAnon"), "vmrss_after_batches": _status("VmRSS"), "windows": len(tokens),
            "permutation_bytes_it_would_need": 8 * len(tokens)}
    it.close()
    return out


def memory(sizes: dict[str, int], count: int) -> dict:
    """`memory_worker` in a fresh process for a sparse token file of each size."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in sizes.items():
            path = os.path.join(tmp, f"{name}.bin")
            with open(path, "wb") as f:
                f.truncate(size)  # sparse: reads as zeros, takes no disk space
            r = subprocess.run([sys.executable, "-m", "benchmarks.data", "memory", path, str(count)], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=300)
            if r.returncode:
                raise RuntimeError(f"memory worker failed: {r.stderr[-1000:]}")
            out[name] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def bench_data(quick: bool, log=print) -> dict:
    """Part 7: loader batches/s (token file, transform-heavy source; threads, workers) vs the char GPT step."""
    from jdp.data import (char_windows, load_array_record, load_char_corpus, load_tokens, make_batches,
                          write_array_record)

    count, steps = (20, 5) if quick else (150, 40)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "prepare_tokens.py"), "--out", tmp],
                       check=True, capture_output=True, timeout=120)
        tokens = load_tokens(os.path.join(tmp, "train.bin"), context_length=CONTEXT, vocab_size=256)
        rates = {"tokens": batches_per_s(lambda: make_batches(tokens, BATCH, prefetch=0), count * 4)}
        corpus = load_char_corpus()  # configs/char_gpt.yaml's in-memory windows, for comparison
        windows = char_windows(corpus.train, CONTEXT, stride=CONTEXT // 2)
        rates["arrays"] = batches_per_s(lambda: make_batches(windows, BATCH, prefetch=0), count * 4)
        records = os.path.join(tmp, "images.array_record")
        write_array_record(records, (image_source()[i] for i in range(1024)))
        rates["array_record"] = batches_per_s(lambda: make_batches(load_array_record(records), BATCH, prefetch=0),
                                              count)
    source = image_source()
    rates["grain_source"] = batches_per_s(lambda: make_batches(source, BATCH, prefetch=0), count)
    settings = {"transform_inline": dict(prefetch=0), "transform_2_threads": dict(prefetch=4, threads=2),
                "transform_2_workers": dict(prefetch=4, workers=2)}
    rounds, repeats = {name: [] for name in settings}, 1 if quick else 5
    for r in range(repeats):  # alternating rounds: the machine's load changes between them
        for name, kw in settings.items():
            # A worker holds up to 2·prefetch batches (its own prefetch and grain's buffer): read them all first.
            ahead = 2 * kw["prefetch"] * max(1, kw.get("workers", 1))
            rounds[name].append(batches_per_s(lambda kw=kw: make_batches(source, BATCH, transform=heavy, **kw),
                                              2 * count, ahead))
        log(f"  part 7: round {r + 1}/{repeats}, loader batches/s: "
            + ", ".join(f"{n} {v[-1]:,.1f}" for n, v in rounds.items()))
    rates |= {name: float(np.median(v)) for name, v in rounds.items()}
    step_rate = char_gpt_steps_per_s(steps)
    log(f"  part 7: char GPT step on 2 devices: {step_rate:,.1f} steps/s; token loader {rates['tokens']:,.0f} "
        f"batches/s")
    mem = memory({"10MB": 10 * 2**20, "1GB": 2**30}, count * 4)
    for name, m in mem.items():
        log(f"  part 7: {name} token file: RssAnon {m['after_open'] / 2**20:.1f} MiB after opening, "
            f"{m['after_batches'] / 2**20:.1f} MiB after {m['batches']} batches "
            f"(VmRSS {m['vmrss_after_batches'] / 2**20:.1f} MiB)")
    return {"global_batch": BATCH, "context": CONTEXT, "batches_timed": count, "loader_batches_per_s": rates,
            "char_gpt_steps_per_s_2_devices": step_rate,
            "ratio_loader_tokens_over_step": rates["tokens"] / step_rate,
            "ratio_loader_transform_over_step": max(rates[k] for k in settings) / step_rate,
            "speedup_2_threads": float(np.median(np.divide(rounds["transform_2_threads"], rounds["transform_inline"]))),
            "speedup_2_workers": float(np.median(np.divide(rounds["transform_2_workers"], rounds["transform_inline"]))),
            "transform_rounds": rounds,
            "memory": mem, "cpu_count": os.cpu_count()}


if __name__ == "__main__":
    if sys.argv[1:2] == ["memory"]:
        print(json.dumps(memory_worker(sys.argv[2], int(sys.argv[3]))))
