"""The rows of `benchmarks.gpu_side_by_side`, one per process: each builds its framework's GPT-2 step,
times it on the same tokens and returns a dict (`run_row`).

The model is GPT-2 small as nanoGPT trains it (no bias, tied head, exact GELU, LayerNorm eps 1e-5,
dropout 0), float32 master params with bfloat16 compute, AdamW(lr, b 0.9/0.95, wd 0.1 on the
matrices only, as nanoGPT's `configure_optimizers`) after clipping the global norm at 1.0, the
mean cross-entropy over every token of the batch.
"""
from __future__ import annotations

import contextlib
import io
import time

import numpy as np

RECIPE = dict(lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, clip=1.0, eps=1e-8)


def mean_token_loss(fm, chunk: int):
    """loss_fn(params, batch) of a functional GPT on (B, T+1) token rows: the mean next-token cross-entropy
    over the B·T positions, from the whole logits (chunk 0) or the fused, chunked loss (chunk positions a block)."""
    import jax.numpy as jnp
    import optax

    def loss_fn(params, batch):
        x, y = batch[:, :-1], batch[:, 1:]
        if chunk:
            nll, _ = fm.apply_method_with_state(params, fm.rest, "token_losses", x, y, chunk=chunk, train=False)[0]
        else:
            nll = optax.softmax_cross_entropy_with_integer_labels(fm.apply(params, x, train=False), y)
        return jnp.mean(nll)

    return loss_fn


def token_batches(spec: dict) -> list[np.ndarray]:
    """`spec["distinct"]` int32 (batch, context + 1) windows of seeded random tokens: every row's process draws
    the same ones (x = [:, :-1], y = [:, 1:])."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, spec["vocab"], (spec["batch"], spec["context"] + 1)).astype(np.int32)
            for _ in range(spec["distinct"])]


def timed(step, batches, spec: dict, sync) -> dict:
    """`warmup` calls (compilation included), then `repeats` windows of `steps` calls: the median over
    windows of the mean step time, and the loss of the last call (`step(tokens) -> loss`, lazy;
    `sync(loss)` waits for the device and returns a float)."""
    t0 = time.perf_counter()
    for i in range(spec["warmup"]):
        loss = step(batches[i % len(batches)])
    first_loss = sync(loss)
    warmup_s = time.perf_counter() - t0
    windows = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        for i in range(spec["steps"]):
            loss = step(batches[i % len(batches)])
        last = sync(loss)
        windows.append((time.perf_counter() - t0) / spec["steps"])
    return {"median_step_s": float(np.median(windows)), "windows_s": windows, "warmup_s": warmup_s,
            "loss_after_warmup": first_loss, "last_loss": last}


def _jax_model(spec: dict):
    """jdp's GPT in nanoGPT's architecture, bfloat16 compute: (model, attention used)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jdp.models import GPT

    attention = "cudnn" if jax.default_backend() == "gpu" else "fused"  # cuDNN flash attention needs a GPU
    model = GPT(spec["vocab"], spec["context"], d_model=spec["d_model"], n_heads=spec["n_heads"],
                n_layers=spec["n_layers"], dropout=0.0, dtype=jnp.bfloat16, attention=attention, bias=False,
                tie_embeddings=True, gelu_approximate=False, ln_epsilon=1e-5, rngs=nnx.Rngs(0))
    return model, attention


def _optax_adamw(params, fused_update: bool):
    """clip 1.0, then AdamW with weight decay on the kernels and embeddings (nanoGPT's dim >= 2 params).

    fused_update: the same update on one flat vector of every param (`optax.flatten`, the decay mask
    raveled alike): a few large elementwise kernels instead of a few per leaf, the multi-tensor idea
    of torch's fused AdamW. Whether it is faster is for a GPU run to measure."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.flatten_util import ravel_pytree

    from benchmarks.nanogpt import decay_mask

    r = RECIPE
    adam = dict(b1=r["betas"][0], b2=r["betas"][1], eps=r["eps"])
    if not fused_update:
        return optax.chain(optax.clip_by_global_norm(r["clip"]),
                           optax.adamw(r["lr"], weight_decay=r["weight_decay"], mask=decay_mask, **adam))
    mask = ravel_pytree(jax.tree.map(lambda p, m: jnp.full(jnp.shape(p), float(m), jnp.float32), params,
                                     decay_mask(params)))[0]

    def decay(updates, state, flat_params):  # decoupled weight decay, on the masked elements
        return updates + r["weight_decay"] * mask * flat_params, state

    inner = optax.chain(optax.scale_by_adam(**adam), optax.GradientTransformation(lambda _: optax.EmptyState(), decay),
                        optax.scale_by_learning_rate(r["lr"]))
    return optax.chain(optax.clip_by_global_norm(r["clip"]), optax.flatten(inner))


def jax_row(spec: dict, kind: str) -> dict:
    """kind "jdp": `jdp.make_train_step(..., precision="bfloat16")`; "jit": a hand-written `jax.jit` step
    (params cast to bfloat16 in the loss, donated buffers). spec["loss_chunk"] > 0: the loss by
    `GPT.token_losses` (the fused, chunked cross-entropy), else from the whole float32 logits."""
    import jax
    import jax.numpy as jnp
    import optax

    import jdp
    from jdp.models import functional

    model, attention = _jax_model(spec)
    fm, chunk = functional(model), spec.get("loss_chunk", 0)
    tx = _optax_adamw(fm.params, spec.get("fused_update", False))

    loss_fn = mean_token_loss(fm, chunk)

    device = jax.devices()[0]
    batches = [jax.device_put(b, device) for b in token_batches(spec)]
    if kind == "jdp":
        train = jdp.make_train_step(loss_fn, tx, precision="bfloat16", devices=[device])
        holder = {"state": train.init(fm.params)}

        def step(b):
            holder["state"], metrics = train(holder["state"], b)
            return metrics["loss"]
    else:
        def bf16_loss(params, batch):
            return loss_fn(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), batch)

        @jax.jit(donate_argnums=(0, 1))
        def update(params, opt, batch):
            loss, grads = jax.value_and_grad(bf16_loss)(params, batch)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, loss

        params = jax.device_put(fm.params, device)
        holder = {"state": (params, tx.init(params))}

        def step(b):
            p, opt, loss = update(*holder["state"], b)
            holder["state"] = (p, opt)
            return loss

    out = timed(step, batches, spec, lambda loss: float(jax.block_until_ready(loss)))
    stats = device.memory_stats() or {}
    return {**out, "attention": attention, "device_kind": device.device_kind, "backend": jax.default_backend(),
            "peak_memory_bytes": stats.get("peak_bytes_in_use"), "jax": jax.__version__}


def nanogpt_row(spec: dict) -> dict:
    """nanoGPT's vendored `model.py`: `torch.compile` (where a CUDA device is, or spec["torch_compile"]
    says so), autocast bfloat16, its own AdamW (fused on CUDA, as its `configure_optimizers` chooses)."""
    import torch

    from benchmarks.nanogpt_peer.model import GPT, GPTConfig

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count and fused-AdamW choice
        model = GPT(GPTConfig(block_size=spec["context"], vocab_size=spec["vocab"], n_layer=spec["n_layers"],
                              n_head=spec["n_heads"], n_embd=spec["d_model"], dropout=0.0, bias=False)).to(device)
        r = RECIPE
        optimizer = model.configure_optimizers(r["weight_decay"], r["lr"], r["betas"], device)
    fused = any(g.get("fused") for g in optimizer.param_groups)
    compile_wanted = spec.get("torch_compile", "auto")
    compile_wanted = cuda if compile_wanted == "auto" else compile_wanted
    how = "eager (torch.compile not used: no CUDA device)" if not compile_wanted else "torch.compile"
    if compile_wanted:
        try:
            model = torch.compile(model)
        except Exception as e:  # noqa: BLE001 - the row says so and runs eager
            how = f"eager (torch.compile unavailable: {type(e).__name__}: {str(e)[:120]})"
    # contiguous x and y: nanoGPT's loss views the targets flat
    batches = [tuple(torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(device) for a in (b[:, :-1], b[:, 1:]))
               for b in token_batches(spec)]

    def step(xy):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            _, loss = model(*xy)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def sync(loss):
        if cuda:
            torch.cuda.synchronize()
        return float(loss)

    out = timed(step, batches, spec, sync)
    return {**out, "how": f"{how}, autocast bf16, AdamW fused={fused}", "torch": torch.__version__,
            "device_kind": torch.cuda.get_device_name(0) if cuda else "cpu",
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def matmul_row(spec: dict) -> dict:
    """An n×n×n bfloat16 matmul in jax (n = spec["matmul_n"]): the median of 10 timed calls after one warm-up,
    as 2·n³ FLOP per call."""
    import jax
    import jax.numpy as jnp

    n = spec["matmul_n"]
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(jnp.matmul)
    jax.block_until_ready(f(a, b))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, b))
        times.append(time.perf_counter() - t0)
    seconds = float(np.median(times))
    return {"n": n, "median_s": seconds, "flops_per_s": 2 * n ** 3 / seconds, "device_kind": jax.devices()[0].device_kind}


def run_row(name: str, spec: dict) -> dict:
    """The row `name` of `benchmarks.gpu_side_by_side.ROWS` under `spec` (sizes and options)."""
    if name == "nanogpt":
        return nanogpt_row(spec)
    if name == "matmul":
        return matmul_row(spec)
    return jax_row(spec, "jit" if name == "jit" else "jdp")
