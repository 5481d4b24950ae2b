"""FSDP with the model gathering each layer inside its scanned, rematerialised body: the same step as one
device, and the compiled loop holds the per-layer all-gathers and reduce-scatters."""
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp.inspect.comm import parse_collectives
from jdp.models import GPT
from tests.helpers import max_abs_diff

RNG = np.random.default_rng(0)
DATA = [{"x": RNG.integers(0, 32, (16, 8)).astype(np.int32), "y": RNG.integers(0, 32, (16, 8)).astype(np.int32)}
        for _ in range(4)]
LAYERS = 3


def make_model():
    return GPT(32, 8, d_model=16, n_heads=2, n_layers=LAYERS, dropout=0.0, scan_layers=True, remat=True,
               rngs=nnx.Rngs(0))


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"], train=False), batch["y"]).mean()


def optimizer():  # clipping engages (the gradient norm is about 1.5); SGD shows any error in the gradient's scale
    return optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.5, momentum=0.9))


@functools.lru_cache(maxsize=None)
def run(n, **options):
    step = jdp.nnx.make_train_step(make_model(), loss_fn, optimizer(), devices=jax.devices()[:n], **options)
    state = step.init()
    for batch in DATA:
        state, metrics = step(state, batch)
    return step, state, float(metrics["grad_norm"])


@pytest.mark.parametrize("options", [{}, {"precision": "bf16"}, {"accum_steps": 2, "accum_sync": "every"},
                                     {"accum_steps": 2, "accum_sync": "last"}], ids=["fp32", "bf16", "every", "last"])
def test_per_layer_gathering_equals_one_device(options):
    # bf16 rounds per device's batch, so there the reference is the replicated step on the same devices
    _, one, norm = run(4 if "precision" in options else 1, **options)
    assert max_abs_diff(jdp.get_params(one), nnx.state(make_model(), nnx.Param)) > 1e-2  # the params moved
    _, sharded, sharded_norm = run(4, shard_params=True, gather_in_model=True, **options)
    # bf16: the layers gather bf16 and reduce-scatter the gradient cast back to float32, as the replicated step
    assert max_abs_diff(jdp.get_params(sharded), jdp.get_params(one)) <= 1e-6
    assert sharded_norm == pytest.approx(norm, rel=1e-5)  # the gradient's scale (clipping hides it from the params)


def in_loop(step, state):
    """{(kind, inside a loop): how many} of the compiled step's collectives (`jdp.comm_report`); each one
    inside runs once per layer."""
    found = {}
    for c in jdp.comm_report(step, state, DATA[0]).collectives:
        assert c.loop_trips == (LAYERS if c.in_loop else 1) and c.executions_per_update == c.loop_trips, c
        found[c.kind, c.in_loop] = found.get((c.kind, c.in_loop), 0) + 1
    return found


def test_the_loop_gathers_each_layer_and_reduce_scatters_its_gradient():
    step, state, _ = run(4, shard_params=True, gather_in_model=True)
    per_layer = len(jax.tree.leaves(nnx.state(make_model().layers, nnx.Param)))  # the stacked leaves: one layer's
    found = in_loop(step, state)
    # forward body: every layer leaf gathered; backward body: gathered again (remat), and reduce-scattered
    assert found.get(("all-gather", True), 0) >= per_layer + 1
    assert found.get(("reduce-scatter", True), 0) == per_layer
    assert found.get(("all-gather", False), 0) == found.get(("reduce-scatter", False), 0) > 0  # embeddings, head
    assert jdp.memory_report(step, state).gathered == "per layer, by the model (gather_in_model)"
    whole_step, whole_state, _ = run(4, shard_params=True)
    assert jdp.memory_report(whole_step, whole_state).gathered == "whole model, before the loss"
    assert not any(inside for _, inside in in_loop(whole_step, whole_state))  # the whole model, outside the loop


def test_comm_report_counts_a_collective_once_per_iteration_of_the_loops_around_it():
    """A psum inside a scan of 3 inside a scan of 2 runs 6 times per call; one after them, once."""
    from jax.sharding import Mesh, PartitionSpec as P

    def body(x):
        inner = lambda c, _: (jax.lax.psum(c, "d") * 0.5, None)  # noqa: E731
        outer = lambda c, _: (jax.lax.scan(inner, c, None, length=3)[0], None)  # noqa: E731
        return jax.lax.psum(jax.lax.scan(outer, x, None, length=2)[0] * 2.0, "d")

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False))
    hlo = f.lower(np.ones((2, 4), np.float32)).compile().as_text()
    runs = sorted((c["kind"], c["loop_trips"]) for c in parse_collectives(hlo))
    assert runs == [("all-reduce", 1), ("all-reduce", 6)], runs


def test_refusals():
    with pytest.raises(ValueError, match=r"^gather_in_model=True needs shard_params=True"):
        jdp.make_train_step(lambda p, b: 0.0, optax.sgd(0.1), gather_in_model=True)
    with pytest.raises(ValueError, match=r"^gather_in_model=True reduce-scatters each layer's gradient in the backward "
                                         r"pass, in the params' dtype, so reduce_dtype='bfloat16' cannot apply"):
        jdp.make_train_step(lambda p, b: 0.0, optax.sgd(0.1), shard_params=True, gather_in_model=True,
                            reduce_dtype="bf16")
    # A loss that indexes (or computes with) a params leaf it has not gathered: the fix, in one sentence.
    step = jdp.make_train_step(lambda p, b: (b["x"] @ p["w"][:, 0]).mean(), optax.sgd(0.1), shard_params=True,
                               gather_in_model=True, devices=jax.devices()[:4])
    with pytest.raises(TypeError, match=r"^a params leaf under gather_in_model=True is a jdp.fsdp.Split, this "
                                        r"device's block of it \(shape \(8, 1\), split along dimension -1\), not an "
                                        r"array; gather it first with jdp.fsdp.gather\(leaf\)"):
        step(step.init({"w": np.ones((8, 4), np.float32)}), {"x": np.ones((8, 8), np.float32)})
    with pytest.raises(TypeError, match=r"gather it first with jdp.fsdp.gather\(leaf\)"):
        jdp.fsdp.Split(np.ones((8, 1), np.float32), -1, "data") * 2.0


def test_trainer_scanned_gpt_gathers_per_layer_under_shard_params(tmp_path):
    from jdp.config import load_config
    from jdp.train import train

    def go(name, *extra):
        config = load_config(None, ["model.name=gpt", "data.name=chars", "model.d_model=16", "model.n_heads=2",
                                    "model.n_layers=2", "model.context=16", "model.scan_layers=true", "model.remat=true",
                                    "optim.name=momentum", "optim.lr=0.1", "optim.clip_norm=1.0", "train.steps=3",
                                    "train.log_every=1", "train.eval_every=0", "data.batch_size=16", *extra])
        return train(config, str(tmp_path / name), devices=jax.devices()[:4], log=lines.append, progress=False)

    lines = []
    replicated, sharded = go("replicated"), go("fsdp", "parallel.shard_params=true")
    assert max_abs_diff(sharded.params, replicated.params) <= 1e-6
    # the start says each run's bytes per device, and metrics.jsonl's first record holds them
    said = [line for line in lines if line.startswith("memory per device")]
    assert len(said) == 2 and "gathered per layer, by the model" in said[1]
    first = [json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
             for name in ("replicated", "fsdp")]
    assert first[1]["memory_state_bytes"] < first[0]["memory_state_bytes"] / 3
    assert 0 < first[1]["memory_peak_bytes"] < first[0]["memory_peak_bytes"]


def test_jdp_train_scans_the_gpt_per_layer_under_fsdp_unless_the_config_says(tmp_path):
    from jdp.run.config import fsdp_layer_defaults

    gpt = ["model.name=gpt", "data.name=chars", "parallel.shard_params=true"]
    assert fsdp_layer_defaults(None, gpt) == (
        ["model.scan_layers=true", "model.remat=true"], "model.scan_layers=true, model.remat=true: under "
        "parallel.shard_params the GPT gathers one layer at a time (the same model, its layers scanned); set "
        "model.scan_layers=false to gather it whole")
    assert fsdp_layer_defaults(None, [*gpt, "model.remat=false"])[0] == ["model.scan_layers=true"]
    for own in (["model.scan_layers=false"], ["model.scan_layers=true"], ["parallel.shard_params=false"]):
        assert fsdp_layer_defaults(None, [*gpt, *own]) == ([], None)
    assert fsdp_layer_defaults(None, ["parallel.shard_params=true"]) == ([], None)  # the MLP has no layers to scan
    config = tmp_path / "gpt.yaml"
    config.write_text("model: {name: gpt, scan_layers: false}\ndata: {name: chars}\nparallel: {shard_params: true}\n")
    assert fsdp_layer_defaults(str(config), []) == ([], None)  # the file's own choice


def test_jdp_train_and_jdp_memory_gather_a_gpt_per_layer_by_default(tmp_path, capsys):
    from jdp.run.cli import main

    small = [f"--set={key}" for key in ("model.name=gpt", "data.name=chars", "model.d_model=16", "model.n_heads=2",
                                        "model.n_layers=2", "model.context=16", "data.batch_size=16")]
    def train(name, *extra):
        assert main(["train", *small, *extra, "--steps", "3", "--log-every", "1", "--devices", "4", "--workdir",
                     str(tmp_path / name), "--no-progress"]) == 0
        losses = [json.loads(line).get("loss") for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return capsys.readouterr().out, [loss for loss in losses if loss is not None]

    out, fsdp = train("fsdp", "--set=parallel.shard_params=true")
    assert "model.scan_layers=true, model.remat=true: under parallel.shard_params" in out
    assert "gathered per layer, by the model" in next(line for line in out.splitlines() if line.startswith("memory"))
    out, replicated = train("replicated")
    assert "scan_layers" not in out and len(fsdp) == 3
    np.testing.assert_allclose(fsdp, replicated, rtol=1e-5)  # the same model and dropout masks, scanned or not
    assert main(["memory", *small, "--devices", "4"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "per layer" in rows["FSDP"] and "per layer" not in rows["ZeRO-1"]


def test_jdp_memory_prints_the_three_layouts(capsys):
    from jdp.run.cli import main

    assert main(["memory", "--devices", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    state = {line.split()[0]: int(line.split()[1].replace(",", "")) for line in lines[2:]}
    assert list(state) == ["replicated", "ZeRO-1", "FSDP"]
    assert state["replicated"] > state["ZeRO-1"] > state["FSDP"]  # params and optimizer state split in turn


def test_jdp_memory_says_what_it_compiles_as_it_goes(capsys):
    """`jdp memory` compiles three steps (minutes for a large model) before its table: it says on stderr
    which one it is compiling and how long it has run, and stdout keeps the table alone."""
    from jdp.run.cli import main

    assert main(["memory", "seed_linear", "--devices", "2"]) == 0
    said = capsys.readouterr()
    assert [line.split()[0] for line in said.out.splitlines()[2:]] == ["replicated", "ZeRO-1", "FSDP"]
    assert "jdp memory" not in said.out
    lines = said.err.splitlines()
    steps = [re.fullmatch(rf"jdp memory: compiling the {name} step, {i} of 3 \(([\d.]+) s so far\)", line)
             for i, (name, line) in enumerate(zip(["replicated", "ZeRO-1", "FSDP"], lines[1:4]), 1)]
    assert lines[0] == "jdp memory: building the linear model and its first batch (0.0 s so far)", lines
    assert all(steps) and len(lines) == 5, lines
    end = re.fullmatch(r"jdp memory: 3 step\(s\) compiled in ([\d.]+) s", lines[4])
    seconds = [float(m.group(1)) for m in [*steps, end]]
    assert seconds == sorted(seconds) and seconds[-1] > seconds[0], lines


def test_a_stacked_leaf_split_along_its_layers_is_gathered_before_the_scan():
    """3 layers on 3 devices, widths of 16 and 32: a stacked leaf whose only dimension 3 divides is the
    layer axis is split along it between steps, and the GPT gathers it whole before its scan (a scan
    over that block would get one layer per device: "different leading axis sizes"); the step is one
    device's."""
    data = [{k: v[:12] for k, v in b.items()} for b in DATA]

    def go(n, **options):
        step = jdp.nnx.make_train_step(make_model(), loss_fn, optimizer(), devices=jax.devices()[:n], **options)
        state = step.init()
        for batch in data:
            state, _ = step(state, batch)
        return step, jdp.get_params(state)

    _, one = go(1)
    step, sharded = go(3, shard_params=True, gather_in_model=True)
    print(f"3 devices, per-layer FSDP vs one device: {max_abs_diff(sharded, one):.1e}")
    assert max_abs_diff(sharded, one) <= 1e-6
    cuts = step.layout.cuts
    stacked = [(d, x.shape) for d, x in zip(cuts.dims, cuts.leaves) if x.shape[:1] == (LAYERS,)]
    assert stacked and all(d == 0 for d, _ in stacked)  # 3 divides no width: split along the layers


def test_jdp_train_scanned_gpt_whose_layer_count_alone_divides_the_devices(tmp_path):
    """`jdp train char_gpt --devices 3` under shard_params with 3 layers of width 16 (no width divisible by 3)
    trains: it failed in the scan ("different leading axis sizes: 1, ..., 3") and left its workdir behind
    (the step itself: `test_a_stacked_leaf_split_along_its_layers_is_gathered_before_the_scan`)."""
    import subprocess
    import sys

    def go(name):
        cmd = [sys.executable, "-m", "jdp.run.cli", "train", "char_gpt", "--devices", "3", "--set",
               "parallel.shard_params=true", "--set", "model.n_layers=3", "--set", "model.d_model=16", "--set",
               "data.batch_size=48", "--set", "train.eval_every=0", "--steps", "2", "--log-every", "1",
               "--workdir", str(tmp_path / name), "--no-progress"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return r.stdout, [x["loss"] for x in records if "loss" in x]

    out, losses = go("scanned")
    assert "gathered per layer, by the model" in out and "done at step 2 of 2" in out
    said = next(line for line in out.splitlines() if line.startswith("memory per device"))
    assert said.endswith("; 5 params leaves stay whole on every device with their optimizer state, 17,408 B, as no "
                         "dimension of theirs divides by 3: ['head']['kernel'] 6,592 B, ['tok_embed']['embedding'] "
                         "6,592 B, ['pos_embed']['embedding'] 4,096 B and 2 more"), said
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_a_layer_gathered_in_bf16_reduce_scatters_its_gradient_in_float32():
    # The gather's transpose under bf16 compute, alone (the cheap form of the [bf16] test above): each of
    # 4 devices sends a bf16 gradient of ones (device 0) or 2^-8 (the others) for the whole leaf; summed
    # in float32 each block's gradient is 1 + 3·2^-8 exactly, which bf16 cannot hold (its spacing at 1 is 2^-7).
    from jax.sharding import Mesh, PartitionSpec as P

    from jdp.fsdp import Split

    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    weights = np.full((4, 8), 2.0 ** -8, np.float32)
    weights[0] = 1.0

    def device_grad(block, w):  # block (2,) of a float32 leaf (8,), w (1, 8): this device's weights
        return jax.grad(lambda b: jnp.sum(Split(b, -1, "data", "bfloat16").whole().astype(jnp.float32) * w[0]))(block)

    grad = jax.jit(jax.shard_map(device_grad, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"),
                                 check_vma=False))(np.zeros(8, np.float32), weights)
    assert grad.dtype == np.float32
    np.testing.assert_array_equal(grad, np.full(8, 1 + 3 * 2.0 ** -8, np.float32))
