"""One PyTorch DistributedDataParallel rank (gloo, CPU, one thread) for `benchmarks.run`.

  python -m benchmarks.ddp_worker RANK WORLD PORT SIZES BATCH

Builds the same MLP (same initial numbers) and the same global batches as the JAX contenders,
takes this rank's contiguous slice of each, warms up, prints "ready", then for every line
"run N" on stdin times N DDP steps (Adam, fp32) between two barriers and prints "time SECONDS".
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np


def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(s) for s in sys.argv[4].split(",")]
    global_batch = int(sys.argv[5])
    import torch
    import torch.distributed as dist
    from torch import nn

    from benchmarks.common import mlp_batches, mlp_params

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    layers = []
    for k, (w, b) in enumerate(mlp_params(sizes)):
        lin = nn.Linear(*w.shape)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w.T.copy()))
            lin.bias.copy_(torch.from_numpy(b))
        layers.append(lin)
        if k < len(sizes) - 2:
            layers.append(nn.ReLU())
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    b = global_batch // world
    batches = [(torch.from_numpy(g["x"][rank * b:(rank + 1) * b].copy()),
                torch.from_numpy(g["y"][rank * b:(rank + 1) * b].astype(np.int64)))
               for g in mlp_batches(sizes, 8, global_batch)]
    loss_fn = nn.CrossEntropyLoss()

    def step(i):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradient buckets during backward
        opt.step()
        return loss

    for i in range(3):
        step(i)
    dist.barrier()
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.startswith("run"):
            break
        n = int(line.split()[1])
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(n):
            step(i)
        dist.barrier()
        print(f"time {time.perf_counter() - t0}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
