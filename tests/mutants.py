"""Mutation check: deliberate bugs in jdp, each of which the tests must catch, and which tier catches it.

  python -m tests.mutants                 # every mutant: the quick tier first, then its selection
  python -m tests.mutants --only A,B      # these mutants
  python -m tests.mutants --selection     # the fast path: each mutant's own selection only, no tier
  python -m tests.mutants --whole-quick   # where the quick tests of its files miss it, the whole quick tier
  python -m tests.mutants --jdp DIR       # mutate another copy of the package (e.g. an older commit's)
  python -m tests.mutants --baseline      # first, every selection on the unmutated copy: must pass
  python -m tests.mutants --list

Each mutant is one edit: an exact snippet of a file under jdp/ that must occur exactly once there,
and its replacement, and a selection of tests (the cheapest that catches it). For each, the package
(the repo's jdp/, or --jdp DIR), the repo's tests/, benchmarks/, configs/, examples/, docs/,
pyproject.toml, README.md and CONTRIBUTING.md are copied into a fresh temporary directory, the edit
is applied, and pytest runs there (`python -m pytest -n0 -x`, cwd and PYTHONPATH the copy, so
`import jdp` finds the mutant before the editable install; checked for every mutant, and the
`sanity_import_fails` mutant proves it by failing at import with the copy's path).

Which tier catches it. By default each mutant runs in up to two stages, and the first that fails
decides:

1. quick: `pytest -m quick FILES`, the quick tier's tests in the files (and node ids) of its
   selection, its `-k` dropped. A failure here is the quick tier failing on the bug.
2. full: its selection, which the full suite runs. Caught only here: the quick tier's tests of
   those files pass on it.

Stage 1 costs what the selection costs (it collects only those files), so the default costs the
selections plus one short run for each mutant stage 1 misses. It answers "does the quick tier catch it?" exactly when the
quick test that would catch it is in the selection's files, which is where a mutant's own quick
test lives (every mutant added since the quick tier was checked names one). `--whole-quick`
settles the rest: a mutant stage 1 misses runs the whole quick tier before its selection (the
whole tier, ~1-2 min per such mutant on 2 cores), so "full suite only" then means no quick test
catches it. `--selection` is the fast path while you work on one mutant.

The snippet check in tests/test_mutants.py reads the unmutated package (JDP_MUTANTS_SOURCE), so it
never "catches" a mutant in the whole quick tier.

A mutant is caught when a test fails, survives when every stage passes. The table (with the tier
of each) goes to stdout and, for a run of every mutant, to tests/mutants.md. Exit
status 1 if any mutant survives, any snippet does not occur exactly once (a stale mutant is an
error, never a pass), or a stage errs.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "tests", "mutants.md")
SANITY = "mutant sanity check: jdp imported from"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the jdp package directory
    old: str  # must occur exactly once in that file
    new: str
    tests: tuple[str, ...]  # pytest arguments: files or node ids relative to the repo, cheapest first; "-k" EXPR


MUTANTS = [
    Mutant("sanity_import_fails", "__init__.py",
           '__version__ = "0.1.0"',
           f'raise RuntimeError(f"{SANITY} {{__file__}}")',
           ("tests/test_data_order.py",)),
    Mutant("mean_forgets_1_over_n", "core/reduce.py",
           'divide = [reduction == "mean" or not g for g in is_grad]',
           'divide = [not g for g in is_grad]',  # the gradient is summed under "mean" too
           ("tests/test_scale_visible.py", "-k", "adamw_eps_clip")),  # Adam + clip sees it now
    Mutant("sum_also_sums_metrics", "core/reduce.py",
           'divide = [reduction == "mean" or not g for g in is_grad]',
           'divide = [reduction == "mean" for g in is_grad]',  # "sum" sums loss, aux and model state too
           ("tests/test_sum_metrics.py",)),
    Mutant("fp16_summed_before_dividing", "core/reduce.py",
           "return x.dtype in (jnp.float16, jnp.bfloat16)",
           "return False",
           ("tests/test_sum.py::test_fp16_mean_divides_before_summing",)),
    Mutant("last_sums_micro_grads", "core/algorithm.py",
           "mean = jax.tree.map(lambda x: x / o.accum_steps, sums)",
           "mean = jax.tree.map(lambda x: x / o.accum_steps, sums)._replace(grads=sums.grads)",
           ("tests/test_scale_visible.py", "-k", "adamw_eps_clip and last")),
    Mutant("every_sums_micro_grads", "core/step.py",
           "optax.MultiSteps(with_grad_scale(tx), every_k_schedule=o.accum_steps)",
           "optax.MultiSteps(with_grad_scale(tx), every_k_schedule=o.accum_steps, use_grad_mean=False)",
           ("tests/test_scale_visible.py", "-k", "adamw_eps_clip and every")),
    Mutant("every_reports_last_call_only", "core/algorithm.py",
           "sums = jax.tree.map(jnp.add, state.accum, reduced)",
           "sums = jax.tree.map(lambda a, r: r * o.accum_steps, state.accum, reduced)",
           ("tests/test_step_rules.py::test_every_and_last_report_the_whole_step",)),
    Mutant("pcast_dropped", "core/layouts.py",
           'return lax.pcast(params, self.axis, to="varying")',
           "return params",
           ("tests/test_traps.py",)),
    Mutant("auto_forgets_1_over_n", "core/optim.py",
           "return optax.chain(tx, optax.scale(1.0 / num_devices))",
           "return tx",
           ("tests/test_sum_metrics.py",)),
    Mutant("mask_rescale_skipped", "core/weighting.py",
           "weight = jnp.sum(batch[mask_key], dtype=jnp.float32)",
           "weight = jnp.float32(rows)",
           ("tests/test_state_and_mask.py::test_padded_batch_equals_its_real_examples",)),
    Mutant("skip_keeps_new_params", "core/algorithm.py",
           "return keep(params, old_params), keep(opt_state, old_opt_state), ~finite",
           "return params, keep(opt_state, old_opt_state), ~finite",
           ("tests/test_nonfinite.py",)),
    Mutant("skip_every_keeps_nan_sum", "core/algorithm.py",
           "acc = jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), opt_state.acc_grads)",
           "acc = opt_state.acc_grads",  # MultiSteps' (1 - emit)·NaN reset: every later step is NaN too
           ("tests/test_nonfinite.py", "-k", "every")),
    Mutant("skip_ignores_new_params", "core/algorithm.py",
           "jax.tree.leaves((real_grads, real_params, inner))",
           "jax.tree.leaves((real_grads,))",
           ("tests/test_faults_api.py", "-k", "finite_gradient")),
    Mutant("bf16_compute_skipped", "core/precision.py",
           'if precision == "float32":\n        return loss',
           'if True:\n        return loss',  # precision="bfloat16" silently computes in float32
           ("tests/test_precision.py::test_bf16_compute_is_in_the_program_and_fp32_is_not",)),
    Mutant("reduce_dtype_ignored", "core/reduce.py",
           "if reduce_dtype is not None:",
           "if False:",
           ("tests/test_precision.py::test_bf16_reduce_dtype_halves_the_allreduce_bytes",)),
    Mutant("mask_cast_to_bf16", "core/precision.py",
           "(v if k in kept else cast_floats(v, low))",
           "cast_floats(v, low)",
           ("tests/test_precision.py::test_model_state_and_mask_stay_float32",)),
    Mutant("bf16_master_params_accepted", "core/precision.py",
           'if precision == "float32":\n        return\n',
           'if True:\n        return\n',
           ("tests/test_precision.py::test_bf16_master_params_are_refused",)),
    Mutant("zero_scatter_forgets_1_over_n", "core/zero.py",
           "row = row / total if mean and not before else row",
           "row = row",  # the reduce-scatter sums where it should average
           ("tests/test_zero.py", "-k", "sharded_equals_replicated and adam")),
    Mutant("zero_clips_each_slice", "core/blockwise.py",
           "return [Blocks(REDUCTIONS[eqn.primitive.name](out, self.axis), WHOLE)]",
           "return [Blocks(out, WHOLE)]",  # a reduction over a split dimension left local: clip over the local slice
           ("tests/test_sharded_optax.py::test_optimizer_as_written_equals_one_device[clip_adamw_mask-zero1]",)),
    Mutant("zero_norm_of_own_slice", "core/zero.py",
           "return jnp.sqrt(lax.psum(local, self.shard_axis) + ",
           "return jnp.sqrt(local + ",
           ("tests/test_zero.py", "-k", "sharded_equals_replicated and sgd")),
    Mutant("zero_skip_decided_per_device", "core/zero.py",
           "return lax.psum(jnp.logical_not(flag).astype(jnp.int32), self.axis) == 0",
           "return flag",
           ("tests/test_zero.py::test_nonfinite_step_is_skipped_on_every_device",)),
    Mutant("zero_slices_shifted", "core/zero.py",
           "lax.dynamic_slice_in_dim(x, d * (x.shape[k] // self.n),",
           "lax.dynamic_slice_in_dim(x, (d + 1) % self.n * (x.shape[k] // self.n),",
           ("tests/test_zero.py", "-k", "sharded_equals_replicated and sgd")),
    Mutant("zero_update_on_blocks_as_written", "core/zero.py",
           "return optax.GradientTransformationExtraArgs(tx.init, update)",
           "return tx",  # the optimizer's update on the blocks as if they were whole arrays
           ("tests/test_sharded_optax.py", "-k", "equals_one_device and clip and zero1")),
    Mutant("blockwise_contraction_not_completed", "core/blockwise.py",
           "return [Blocks(lax.psum(self.bind(eqn, values)[0], self.axis), WHOLE)]",
           "return [Blocks(self.bind(eqn, values)[0], WHOLE)]",
           ("tests/test_blockwise.py", "-k", "norms_and_dots")),
    Mutant("blockwise_cond_first_branch", "core/blockwise.py",
           "lax.select_n(which, *values) if len(values) > 1 else values[0]",
           "values[0]",
           ("tests/test_blockwise.py", "-k", "cond")),
    Mutant("blockwise_reshape_unchecked", "core/blockwise.py",
           "if prod(new[:j]) == prod(old[:k]) and after",
           "if after",  # a flattening that interleaves the blocks kept as blocks
           ("tests/test_blockwise.py", "-k", "gathered")),
    Mutant("opt_state_not_split", "core/zero.py",
           "lambda i: WHOLE if i < 0 else cuts.dims[i]",
           "lambda i: WHOLE",
           ("tests/test_zero.py::test_optimizer_state_bytes_per_device_are_one_nth",
            "tests/test_sharded_optax.py::test_masked_partitioned_and_muon_equal_one_device")),
    Mutant("fsdp_layers_reduced_once_for_the_model", "core/fsdp.py",
           "        if self.in_model:\n            return self.marked(params)\n",
           "",  # the whole model gathered before the loss: one reduce-scatter after the backward pass
           ("tests/test_fsdp_layers.py::test_the_loop_gathers_each_layer_and_reduce_scatters_its_gradient",)),
    Mutant("fsdp_layers_gathered_outside_the_scan", "models/gpt.py",
           "    graphdef, stack = nnx.split(layers)\n",
           "    graphdef, stack = nnx.split(layers)\n    stack = gather(stack)\n",  # every layer whole, never freed
           ("tests/test_fsdp_layers.py::test_the_loop_gathers_each_layer_and_reduce_scatters_its_gradient",)),
    Mutant("fsdp_layers_gradient_not_averaged", "core/fsdp.py",
           'scale = self.num_devices if o.reduction == "mean" else 1',
           "scale = 1",
           ("tests/test_fsdp_layers.py::test_per_layer_gathering_equals_one_device[fp32]",)),
    Mutant("fsdp_layers_bf16_gradient_reduced_in_bf16", "core/split.py",
           "lax.psum_scatter(g.astype(like.dtype), axis, scatter_dimension=dim, tiled=True)",
           "lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True).astype(like.dtype)",
           ("tests/test_fsdp_layers.py::test_a_layer_gathered_in_bf16_reduce_scatters_its_gradient_in_float32",
            "tests/test_fsdp_layers.py::test_per_layer_gathering_equals_one_device[bf16]")),
    Mutant("fsdp_params_left_replicated", "core/step.py",
           "else FullyShardedLayout(self.mesh, accum, self.optimizer, o.precision, o.gather_in_model)",
           "else ShardedStateLayout(self.mesh, accum, self.optimizer)",  # ZeRO-1
           ("tests/test_fsdp.py::test_params_and_optimizer_state_are_one_nth_per_device",)),
    Mutant("fsdp_gradient_allreduced_then_sliced", "core/zero.py",
           'blocks = cuts.scatter(grads, o.reduction == "mean", o.reduce_dtype)',
           "blocks = cuts.treedef.flatten_up_to(cuts.own(reduce_step_values(grads, (), o.reduction, None, self.axis)[0]))",
           ("tests/test_fsdp.py::test_collectives_gather_params_scatter_gradient_and_no_gradient_allreduce",)),
    Mutant("fsdp_get_params_block", "core/step.py",
           "if x.sharding.is_fully_replicated else host_whole(x)",
           "",  # device 0's block of every split leaf, not the leaf
           ("tests/test_fsdp.py::test_params_and_optimizer_state_are_one_nth_per_device",)),
    Mutant("fsdp_pmap_refusal_dropped", "core/options.py",
           'if self.shard_params and self.backend == "pmap":',
           "if False:",
           ("tests/test_fsdp.py::test_refusals_and_config_key",)),
    Mutant("fsdp_optimizer_state_not_implied", "core/options.py",
           'object.__setattr__(self, "shard_optimizer_state", True)',
           "pass",
           ("tests/test_fsdp.py::test_refusals_and_config_key",)),
    Mutant("fsdp_layout_in_run_identity", "run/config.py",
           '"parallel.shard_optimizer_state", "parallel.shard_params",',
           '"parallel.shard_optimizer_state",',
           ("tests/test_fsdp.py::test_trainer_resumes_across_shard_params_and_device_counts",)),
    Mutant("fsdp_gathers_float32_under_bf16", "core/zero.py",
           "x = x.astype(dtype) if dtype is not None and x.dtype == jnp.float32 else x",
           "x = x",  # the same step, twice the gather's bytes
           ("tests/test_fsdp.py::test_model_state_mask_aux_and_bf16_compute",)),
    Mutant("fsdp_bf16_gradient_reduced_in_bf16", "core/fsdp.py",
           "grads = jax.tree.map(lambda g, leaf: g.astype(leaf.dtype), grads, self.cuts.struct)",
           "grads = grads",  # the gradient w.r.t. bf16 params is summed in bf16 though reduce_dtype is float32
           ("tests/test_fsdp.py::test_model_state_mask_aux_and_bf16_compute",)),
    Mutant("scanned_gpt_swaps_its_dropout_keys", "models/gpt.py",
           "jnp.stack([rngs.dropout(), rngs.dropout()])",
           "jnp.stack([rngs.dropout(), rngs.dropout()][::-1])",  # the scanned GPT drops other units than the unrolled
           ("tests/test_models.py::test_gpt_scanned_is_the_same_model",)),
    Mutant("scanned_gpt_blocks_from_split_rngs", "models/gpt.py",
           "blocks = [Block(*args, rngs=rngs, **kwargs) for _ in range(n_layers)]",
           "blocks = [Block(*args, rngs=rngs.fork(), **kwargs) for _ in range(n_layers)]",  # other initial params
           ("tests/test_models.py::test_gpt_scanned_is_the_same_model",)),
    Mutant("fsdp_gpt_not_scanned_by_default", "run/config.py",
           'if written.model.name != "gpt" or not written.parallel.shard_params or "scan_layers" in model:',
           "if True:",  # FSDP gathers the GPT whole again
           ("tests/test_fsdp_layers.py::test_jdp_train_scans_the_gpt_per_layer_under_fsdp_unless_the_config_says",)),
    Mutant("fsdp_gpt_scanned_without_a_word", "run/cli.py",
           "for line in (scaled, layered):",
           "for line in (scaled,):",  # the model scanned and rematerialised, and the user not told
           ("tests/test_fsdp_layers.py::test_jdp_train_and_jdp_memory_gather_a_gpt_per_layer_by_default",)),
    Mutant("fsdp_gpt_scanned_over_the_configs_choice", "run/config.py",
           'or not written.parallel.shard_params or "scan_layers" in model:',
           "or not written.parallel.shard_params:",  # a config's scan_layers=false overruled
           ("tests/test_fsdp_layers.py::test_jdp_train_scans_the_gpt_per_layer_under_fsdp_unless_the_config_says",)),
    Mutant("hybrid_blocks_not_summed_across_groups", "core/zero.py",
           "return tree if self.replica_axis is None else lax.psum(tree, self.replica_axis)",
           "return tree",  # each replica group steps on its own share of the batch
           ("tests/test_hybrid.py::test_hybrid_sharding_equals_one_device[sgd-fsdp-2-None]",)),
    Mutant("hybrid_mean_over_a_group", "core/zero.py",
           "before, total = mean and low_precision(buf), self.n * self.replicas",
           "before, total = mean and low_precision(buf), self.n",  # R times the mean gradient
           ("tests/test_hybrid.py::test_hybrid_sharding_equals_one_device[sgd-fsdp-2-None]",)),
    Mutant("hybrid_norm_counts_every_copy", "core/zero.py",
           "return jnp.sqrt(lax.psum(local, self.shard_axis) + ",
           "return jnp.sqrt(lax.psum(local, self.axis) + ",  # each group's copy of a block counted
           ("tests/test_hybrid.py::test_hybrid_sharding_equals_one_device[sgd-fsdp-2-None]",)),
    Mutant("hybrid_blockwise_over_every_device", "core/zero.py",
           "(cuts.dim_tree(), self.opt_dims), self.shard_axis, self.group)",
           "(cuts.dim_tree(), self.opt_dims), self.axis, self.group)",  # clip's norm summed over both groups
           ("tests/test_hybrid.py::test_hybrid_sharding_equals_one_device[adamw_clip-fsdp-2-None]",)),
    Mutant("hybrid_batchnorm_over_one_axis", "bridges/nnx.py",
           'options.get("backend") != "jit", device_axes(options.get("axis_name", DATA_AXIS),',
           'options.get("backend") != "jit", (lambda a, r: a)(options.get("axis_name", DATA_AXIS),',
           ("tests/test_hybrid.py::test_synchronised_batchnorm_reduces_over_both_axes",)),
    Mutant("replica_check_skips_group_copies", "inspect/replicas.py",
           "parts.setdefault(repr(s.index), []).append((s.device, np.asarray(s.data)))",
           "parts.setdefault(s.device.id, []).append((s.device, np.asarray(s.data)))",  # each block alone
           ("tests/test_hybrid.py::test_a_diverged_group_copy_is_found",)),
    Mutant("donated_state_not_checked", "core/step.py",
           "isinstance(state.step, jax.Array) and state.step.is_deleted()",
           "False",
           ("tests/test_faults_api.py::test_reusing_a_donated_state_raises_instead_of_crashing",)),
    Mutant("all_padding_batch_accepted", "core/placement.py",
           "if isinstance(mask, np.ndarray) and not mask.any():",
           "if False:",
           ("tests/test_faults_api.py::test_all_padding_batch_is_refused",)),
    Mutant("non_scalar_aux_accepted", "core/loss.py",
           "        if shapes:  # averaged over devices",
           "        if False:  # averaged over devices",
           ("tests/test_step_rules.py::test_non_scalar_aux_is_refused_with_its_path_and_shape",)),
    Mutant("key_not_folded_with_device", "core/state.py",
           "return jax.random.fold_in(key, 0 if axis is None else lax.axis_index(axis))",
           "return key",
           ("tests/test_model_dp.py::test_dropout_masks_differ_per_device_and_step_and_are_reproducible",)),
    Mutant("key_not_folded_with_micro_step", "core/state.py",
           "key = jax.random.fold_in(base_key, micro_step)",
           "key = base_key",
           ("tests/test_model_dp.py::test_dropout_masks_differ_per_device_and_step_and_are_reproducible",)),
    Mutant("restore_resets_micro_step", "run/checkpoint.py",
           'return step.place(restored, like), data_state, candidate',
           'return step.place(restored.replace(micro_step=restored.micro_step * 0), like), data_state, candidate',
           ("tests/test_resume_rng.py::test_dropout_model_resumes_bit_exactly",)),  # the dropout keys diverge
    Mutant("restore_resets_step", "run/checkpoint.py",
           'return step.place(restored, like), data_state, candidate',
           'return step.place(restored.replace(step=restored.step * 0), like), data_state, candidate',
           ("tests/test_resume_rng.py::test_restore_brings_back_every_counter",)),
    Mutant("restore_resets_skip_counters", "run/checkpoint.py",
           'return step.place(restored, like), data_state, candidate',
           'return step.place(restored.replace(skipped=restored.skipped * 0, skip_streak=restored.skip_streak * 0), '
           'like), data_state, candidate',
           ("tests/test_resume_rng.py::test_restore_brings_back_every_counter",)),
    Mutant("damaged_arrays_accepted", "run/checkpoint.py",
           'if tree_digest(jax.device_get(restored)) != saved["checksums"].get("state"):',
           "if False:",
           ("tests/test_faults_checkpoint.py", "-k", "damaged_arrays")),
    Mutant("nonfinite_state_saved", "run/checkpoint_faults.py",
           "if np.issubdtype(leaf.dtype, np.inexact) and not np.all(np.isfinite(leaf)):",
           "if False:",
           ("tests/test_faults_checkpoint.py", "-k", "nonfinite")),
    Mutant("lock_not_exclusive", "run/lock.py",
           "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
           "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",  # two runs may hold it at once
           ("tests/test_faults_run.py", "-k", "lock_names_its_holder")),
    Mutant("epoch_not_in_seed", "data/order.py",
           "default_rng(np.random.SeedSequence([seed, epoch]))",
           "default_rng(np.random.SeedSequence([seed, 0]))",
           ("tests/test_data_order.py", "tests/test_data.py::test_every_epoch_has_a_new_order")),
    Mutant("epoch_order_rolled", "data/order.py",
           "np.random.SeedSequence([seed, epoch])).permutation(n)",
           "np.random.SeedSequence([seed, epoch])).permutation(n)[np.arange(n) - 1]",  # one position late
           ("tests/test_data_order.py",)),
    Mutant("batch_positions_shifted", "data/batches.py",
           "positions = c * self.local_batch_size + np.arange(self.local_batch_size)",
           "positions = c * self.local_batch_size + np.arange(self.local_batch_size) + 1",
           ("tests/test_data_order.py", "tests/test_data.py::test_batches_follow_the_documented_order")),
    Mutant("drop_last_false_extra_batch", "data/batches.py",
           "-(-n // self.global_batch_size)",
           "n // self.global_batch_size + 1",
           ("tests/test_drop_last_divisible.py",)),
    Mutant("bijection_ignores_epoch", "data/order.py",
           "keys = np.random.SeedSequence([seed, epoch]).generate_state(ROUNDS, np.uint64)",
           "keys = np.random.SeedSequence([seed, 0]).generate_state(ROUNDS, np.uint64)",  # every epoch one order
           ("tests/test_data_sources.py::test_the_bijection_is_a_permutation_of_every_size",)),
    Mutant("bijection_without_cycle_walk", "data/order.py",
           "    while outside.any():",
           "    while False:",  # values in [n, 4^half) escape: not a permutation of [0, n)
           ("tests/test_data_sources.py::test_the_bijection_is_a_permutation_of_every_size",)),
    Mutant("slice_ignores_process_index", "data/batches.py",
           "c = step * self.num_processes + self.process_index",
           "c = step * self.num_processes",  # every process reads process 0's rows
           ("tests/test_data_sources.py", "-k", "concatenated_equal_one_process and tokens")),
    Mutant("resume_drops_the_step", "data/batches.py",
           "self._next = epoch * self.steps_per_epoch + step",
           "self._next = epoch * self.steps_per_epoch",  # resumes at the start of the saved epoch
           ("tests/test_data_sources.py", "-k", "mid_epoch_state_resumes_exactly and tokens")),
    Mutant("transform_rng_without_epoch", "data/batches.py",
           "self.transform(self.source[int(i)], example_rng(seed, epoch, i))",
           "self.transform(self.source[int(i)], example_rng(seed, 0, i))",  # the same augmentation every epoch
           ("tests/test_data_sources.py::test_a_random_transform_is_seeded_from_seed_epoch_and_index",)),
    Mutant("token_targets_not_shifted", "data/tokens.py",
           'return {"x": windows[:, :-1], "y": windows[:, 1:]}',
           'return {"x": windows[:, :-1], "y": windows[:, :-1]}',  # the model learns to copy its input
           ("tests/test_data_sources.py::test_token_windows_follow_the_documented_definition",)),
    Mutant("token_ids_not_checked_per_batch", "data/tokens.py",
           "if self.vocab_size is not None and windows.size and windows.max() >= self.vocab_size:",
           "if False:",  # only the sample at start is checked
           ("tests/test_data_sources.py::test_a_token_id_outside_the_sample_is_refused_when_its_batch_is_read",)),
    Mutant("token_file_size_not_checked", "data/tokens.py",
           "if size % self.dtype.itemsize:",
           "if False:",  # a trailing half token is silently dropped
           ("tests/test_data_sources.py", "-k", "bad_token_files")),
    Mutant("token_digest_skips_content", "data/tokens.py",
           'h.update(self._read_bytes(starts, block) if block else b"")',
           "h.update(b'')",  # the digest sees only the size and settings
           ("tests/test_data_sources.py::test_the_token_digest_reads_a_sample_and_sees_size_and_content",)),
    Mutant("token_sample_not_checked", "data/tokens.py",
           "            self._check_sample()",
           "            pass",  # a file of out-of-range ids opens; only its batches would fail, mid-run
           ("tests/test_data_sources.py", "-k", "bad_token_files")),
    Mutant("data_digest_ignores_the_source", "run/digests.py",
           'digest = data.digest() if hasattr(data, "digest") and not hasattr(data, "arrays") else tree_digest(arrays)',
           'digest = tree_digest(arrays) if hasattr(data, "arrays") else hashlib.sha256(b"").hexdigest()',
           ("tests/test_tokens_train.py::test_the_run_identity_hashes_arrays_as_before_and_a_token_file_by_its_sample",)),
    Mutant("token_file_read_whole", "data/tokens.py",
           "chunks = [os.pread(fd, size, int(offset)) for offset in offsets]",
           "self._whole = getattr(self, '_whole', None) or os.pread(fd, self.size, 0); "
           "chunks = [self._whole[int(o):int(o) + size] for o in offsets]",  # the same batches, the file in memory
           ("tests/test_data_sources.py::test_a_token_file_is_never_read_whole",)),
    Mutant("trainer_drops_the_transform", "run/train.py",
           "workers=d.workers, transform=task.transform,",
           "workers=d.workers, transform=None,",  # jdp.nnx.task(transform=...) silently unused
           ("tests/test_tokens_train.py::"
            "test_jdp_nnx_task_trains_on_a_grain_source_with_a_transform_and_resumes_bit_exactly",)),
    Mutant("items_not_checked_against_item_0", "data/sources.py",
           "    if got == spec:\n        return",
           "    if True:\n        return",
           ("tests/test_data_sources.py", "-k", "unlike_item_0")),
    Mutant("exact_forgets_eps_times_n", "core/optim.py",
           'changes["eps"] = spec.eps * n',
           'changes["eps"] = spec.eps',
           ("tests/test_sum.py::test_exact_correction_makes_sum_equal_mean[adam-clipNone-shard_map]",)),
    Mutant("exact_forgets_clip_times_n", "core/optim.py",
           'changes["clip_norm"] = spec.clip_norm * n',
           'changes["clip_norm"] = spec.clip_norm',
           ("tests/test_train_reference.py",)),
    Mutant("linen_to_train_state_drops_batch_stats", "bridges/linen.py",
           'trained["batch_stats"] = get_tree(state, state.model_state)',
           'trained["batch_stats"] = train_state.batch_stats',  # the initial statistics come back
           ("tests/test_linen.py", "-k", "batch_stats_field")),
    Mutant("per_device_model_state_accepted", "core/first_call.py",
           "            check_agreement(spread, scale, data_axes(self.mesh))\n",
           "",  # BatchNorm without an axis name trains on per-device statistics, silently
           ("tests/test_linen.py", "-k", "batchnorm_mistakes")),
    Mutant("model_state_structure_unchecked", "core/first_call.py",
           "        check_structure(one.model_state, returned)\n",
           "",  # a nested batch_stats dict re-initialises the statistics and recompiles every call
           ("tests/test_linen.py", "-k", "batchnorm_mistakes")),
    Mutant("unbound_axis_left_to_jax", "core/loss.py",
           "unbound = unbound_axes(e, bound) if isinstance(e, (AssertionError, NameError)) else []",
           "unbound = []",  # jax's bare AssertionError from inside flax's BatchNorm
           ("tests/test_linen.py", "-k", "batchnorm_mistakes")),
    Mutant("weight_summed_locally", "core/algorithm.py",
           "grads = divided(grads, weight)",
           "grads = divided(grads, local.weight)",  # each device divides by its own token count (lm1b's pmap)
           ("tests/test_weighted.py::test_weighted_loss_equals_one_device_per_token",)),
    Mutant("micro_batches_weighted_equally", "core/algorithm.py",
           "if weighted and o.multi_steps:",
           "if False:",  # every call divides by its own weight: the mean of micro-batch means
           ("tests/test_weighted.py::test_weighted_loss_equals_one_device_per_token",)),
    Mutant("aux_not_weighted_by_the_loss", "core/weighting.py",
           "lambda a: Weighted(_times(a, weight), weight)",
           "lambda a: Weighted(a, jnp.float32(1))",  # plain aux averaged with equal weight per device
           ("tests/test_weighted.py::test_weighted_loss_equals_one_device_per_token",)),
    Mutant("eval_weights_ignored", "core/evaluate.py",
           "return Weighted(rows(value.total), rows(value.weight))",
           "return Weighted(rows(value.total), rows(jnp.ones_like(value.weight)))",
           ("tests/test_weighted.py::test_evaluate_takes_per_token_weights_and_two_argument_metric_fns",)),
    Mutant("auto_mask_entry_not_refused", "core/loss.py",
           'and o.mask_key == "auto" and isinstance(batch, dict)',
           'and o.mask_key == "never" and isinstance(batch, dict)',
           ("tests/test_weighted.py::test_mask_key_beside_a_plain_loss_is_refused_unless_named",)),
    Mutant("axis_name_ignored_by_the_mesh", "core/mesh.py",
           "return Mesh(np.array(devices), (axis_name,))",
           "return Mesh(np.array(devices), (DATA_AXIS,))",
           ("tests/test_linen.py", "-k", "batch_stats_field")),
    Mutant("exactness_reference_unbound_axis", "inspect/reference.py",
           "step = jax.jit(jax.vmap(one_device, axis_name=axis))",
           "step = jax.jit(one_device)",  # the reference cannot run a loss that reduces over its axis
           ("tests/test_linen.py", "-k", "assert_data_parallel_exact")),
    Mutant("schema_rule_drifts_from_check", "run/sections.py",
           'schema={"minimum": 0, "exclusiveMaximum": 1}',
           'schema={"minimum": 0, "maximum": 1}',  # UNIT's schema takes 1, its check does not
           ("tests/test_config_schema.py::test_the_schema_and_the_section_agree_on_every_field",)),
    Mutant("schema_section_takes_unknown_keys", "run/config_schema.py",
           '"properties": properties,\n            "additionalProperties": False}',
           '"properties": properties}',
           ("tests/test_config_schema.py::test_unknown_keys_and_wrong_types_are_refused",)),
    Mutant("plot_hint_ignores_the_checkout", "extras.py",
           "root = checkout()",
           "root = None",  # always pip install 'jdp[plot]': in a source checkout pip asks the index for jdp
           ("tests/test_papercuts.py::test_plot_without_matplotlib_names_the_install_command_of_this_checkout",)),
    Mutant("explain_cells_cut_with_ellipsis", "inspect/explain_common.py",
           'overflow="fold"',
           'overflow="ellipsis"',
           ("tests/test_papercuts.py::test_explain_tables_fit_80_columns_when_piped",)),
    Mutant("explain_sweep_runs_silently", "inspect/explain.py",
           '_tell(progress, k, len(scales), f"loss × {scale:g}, mean and raw sum on {n} devices")',
           'pass',
           ("tests/test_explain.py::test_cli_json",)),
    Mutant("console_batch_factors_unnamed", "run/train.py",
           "{plural(n, 'device')}",
           "{n}",
           ("tests/test_papercuts.py::test_the_first_console_line_names_the_factors_of_the_global_batch",)),
    # Nothing outside the workdir: each guard against a symlink left in it, and rotation's proof.
    Mutant("lock_follows_symlink", "run/workfiles.py",
           "return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)",
           "return os.open(path, flags | os.O_CLOEXEC, mode)",  # the lock file is opened through the link
           ("tests/test_workdir_files.py", "-k", "lock")),
    Mutant("checkpoints_symlink_followed", "run/train.py",
           'refuse_symlink(os.path.join(workdir, "checkpoints"), "the checkpoint directory")',
           "None",  # orbax writes (and rotates) in the directory the link points to
           ("tests/test_workdir_files.py", "-k", "symlinked_checkpoint_directory")),
    Mutant("rotation_deletes_without_proof", "run/workfiles.py",
           "    if not is_jdp_checkpoint(path):\n        return False\n",
           "",  # any step-named directory is deleted, someone else's included
           ("tests/test_workdir_files.py", "-k", "rotation")),
    # Multi-process: what decides the collective schedule, and each process's device count, agreed.
    Mutant("schedule_not_agreed", "run/facts.py",
           'agreed = {dotted: d[dotted.split(".")[0]][dotted.split(".")[1]] for dotted in HASH_EXCLUDED}',
           "agreed = {}",  # a different --checkpoint-every deadlocks at the first checkpoint
           ("tests/test_multiprocess.py", "-k", "another_schedule")),
    Mutant("local_devices_not_agreed", "run/facts.py",
           '"devices": len(devices), "local devices": mine}',
           '"devices": len(devices)}',  # 2 + 4 devices pass as 6 and fail later in a reshape
           ("tests/test_multiprocess.py", "-k", "another_schedule")),
    Mutant("checkpoints_at_log_steps", "run/facts.py",
           "return itstime(step, self.checkpoint_every, end)",
           "return itstime(step, self.log_every, end)",  # one cadence read for another
           ("tests/test_facts.py::test_one_rule_says_which_steps_log_evaluate_and_checkpoint",)),
    Mutant("data_digest_left_out_of_facts", "run/facts.py",
           "identity = with_data_digest(self.identity, train)",
           'identity = {**self.identity, "data": {**self.identity["data"], "train_arrays_sha256": "0" * 16}}',
           ("tests/test_facts.py::test_the_data_joins_the_identity_and_the_agreed_sizes_and_digests",)),
    Mutant("failed_save_tasks_print_at_exit", "run/cli.py",
           "logging.getLogger(\"asyncio\").addFilter(",
           "(lambda f: None)(",  # asyncio's tracebacks of the failed save's other writes print again
           ("tests/test_faults_run.py::test_the_failed_saves_other_write_tasks_print_nothing_at_exit",)),
    # Twelve one-line bugs of kinds the quick tier once missed (issue 33); each now has a quick test.
    Mutant("eval_sums_ignore_the_mask", "core/evaluate.py",
           "    return jnp.sum(value.astype(jnp.float32) * mask)",
           "    return jnp.sum(value.astype(jnp.float32))",  # padding counted in the metric
           ("tests/test_train.py::test_evaluation_leaves_the_padding_of_the_last_batch_out",)),
    Mutant("last_model_state_not_averaged", "core/algorithm.py",
           "model_state=mean_over_devices(model_state, layout.axis) if jax.tree.leaves(model_state) else model_state",
           "model_state=model_state",  # accum_sync="last": each device keeps its own BatchNorm statistics
           ("tests/test_state_and_mask.py::test_model_state_is_carried_and_averaged[2-last-shard_map]",)),
    Mutant("nnx_stored_rngs_not_reseeded", "bridges/nnx.py",
           "nnx.reseed(model, **{s: jax.random.fold_in(key, i) for i, s in enumerate(split.streams)})",
           "pass",  # every device (and every call) draws the stored nnx.Rngs' one dropout mask
           ("tests/test_nnx.py::test_stored_rngs_are_reseeded_per_device",)),
    Mutant("linen_micro_step_not_scaled", "bridges/linen.py",
           "micro_step=count * step.options.accum_steps",
           "micro_step=count",  # an odd TrainState.step with accum_steps=2: updates on the wrong micro-batch
           ("tests/test_linen.py::test_bridge_equals_the_linen_loop_and_hands_back[shard_map-adam-2-last-1]",)),
    Mutant("token_windows_ignore_the_stride", "data/tokens.py",
           "starts = indices * self.stride",
           "starts = indices * self.context_length",
           ("tests/test_data_sources.py::test_token_windows_follow_the_documented_definition",)),
    Mutant("token_sample_skips_last_id", "data/tokens.py",
           "chunk = self.read(start, block)",
           "chunk = self.read(start, block - 1)",  # a bad id as the file's last token opens
           ("tests/test_data_sources.py::test_bad_token_files_raise_one_sentence",)),
    Mutant("stop_decided_by_process_0", "run/distributed.py",
           "return bool(_gather(np.array([flag], np.int32)).any())",
           "return bool(_gather(np.array([flag], np.int32))[0])",  # a SIGTERM to process 1 stops nobody
           ("tests/test_facts.py::test_a_stop_asked_by_any_one_process_is_every_process_decision",)),
    Mutant("checkpoint_metadata_read_through_link", "run/workfiles.py",
           "fd = os.open(names[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)",
           "fd = os.open(names[-1], os.O_RDONLY | os.O_CLOEXEC, dir_fd=fd)",  # a linked meta/metadata proves nothing
           ("tests/test_workdir_files.py::test_a_checkpoint_is_proven_jdps_only_without_following_a_link",)),
    Mutant("fallback_takes_the_oldest_intact", "run/checkpoint.py",
           "reverse=True)]:",
           "reverse=False)]:",  # checkpoints 1, 2 intact, 3 damaged: resumes from 1
           ("tests/test_faults_checkpoint.py::test_fallback_resumes_from_the_newest_intact_checkpoint",)),
    Mutant("model_state_not_checked_before_saving", "run/checkpoint_faults.py",
           'for name in ("params", "opt_state", "model_state"):',
           'for name in ("params", "opt_state"):',  # NaN BatchNorm statistics are checkpointed
           ("tests/test_faults_api.py::test_a_nonfinite_model_state_is_never_saved",)),
    Mutant("distribution_named_jdp", "extras.py",
           'DISTRIBUTION = "jdp-train"',
           'DISTRIBUTION = "jdp"',  # a wheel's hint would install the index's other project named jdp
           ("tests/test_papercuts.py::test_an_installed_wheel_names_the_distribution_on_the_index",)),
    Mutant("import_jdp_imports_jax", "cpu.py",
           "from jdp.text import quoted  # jax is imported where it is used",
           "import jax  # noqa\nfrom jdp.text import quoted  #",  # jdp --version costs jax's import again
           ("tests/test_cli_edges.py::test_the_command_and_import_jdp_do_not_import_jax",)),
    Mutant("ctrl_c_left_to_keyboardinterrupt", "run/exits.py",
           "return signal.signal(signal.SIGINT, _interrupted)",
           "return None",  # swallowed in jax's gc callback ("Exception ignored"), the run goes on
           ("tests/test_cli_edges.py::test_ctrl_c_in_a_gc_callback_prints_one_line_and_exits_130",)),
    Mutant("ctrl_c_handler_after_the_command_line_imports", "run/entry.py",
           "    quiet_interrupts()\n    from jdp.run.cli import main as run",
           "    from jdp.run.cli import main as run\n    quiet_interrupts()",  # a Ctrl-C while argparse loads: a traceback
           ("tests/test_cli_edges.py::test_ctrl_c_from_jdps_first_line_prints_one_line_and_exits_130",)),
    Mutant("closed_pipe_traceback", "run/exits.py",
           "    except BrokenPipeError:\n        _quiet_closed_stdout()\n        return CLOSED_PIPE\n",
           "",  # `jdp config schema | head -1` ends in a BrokenPipeError traceback
           ("tests/test_cli_edges.py::test_a_closed_pipe_ends_quietly",)),
    Mutant("ctrl_c_in_training_exits_0", "run/cli.py",
           'return INTERRUPTED if result.stopped_by == "SIGINT" else 0',
           "return 0",  # a Ctrl-C'd run would read as finished to a shell or a script
           ("tests/test_multiprocess.py::test_sigint_on_a_single_process_run_checkpoints_and_exits_130",)),
    Mutant("steps_keep_a_warmup_that_outlasts_them", "run/config.py",
           "if not schedule_uses_steps(written) or warmup < steps:",
           "if True:",  # `jdp train char_gpt --steps 20` is refused again: 40 warmup steps of a 20-step cosine
           ("tests/test_config.py::test_steps_shorter_than_the_warmup_keep_its_fraction_and_a_set_warmup_wins",)),
    Mutant("steps_scale_a_warmup_set_on_the_command_line", "run/config.py",
           'if any(parse_override(text, _check_key)[:2] == ("optim", "warmup_steps") for text in overrides):',
           "if False:",  # --set optim.warmup_steps=40 --steps 20 would quietly train with 2
           ("tests/test_config.py::test_steps_shorter_than_the_warmup_keep_its_fraction_and_a_set_warmup_wins",)),
    Mutant("scaled_warmup_not_said", "run/cli.py",
           "for line in (scaled, layered):",
           "for line in (layered,):",  # the run's warmup changes without a word
           ("tests/test_feedback.py::test_steps_shorter_than_the_warmup_run_with_its_fraction_and_resume_as_they_ran",)),
    Mutant("shipped_config_not_found_by_name", "run/shipped.py",
           'return os.path.join(CONFIG_DIR, name + ".yaml")',
           "return arg",  # `jdp train char_gpt` outside a checkout: no such file
           ("tests/test_shipped.py::test_a_config_is_found_by_name_and_a_file_of_that_path_wins",)),
    Mutant("prepare_tokens_overwrites", "data/prepare.py",
           "        if existing:  #",
           "        if False:  #",  # a second prepare-tokens would replace the token files a run trains on
           ("tests/test_prepare_tokens.py::test_existing_files_are_never_overwritten",
            "tests/test_shipped.py::test_prepare_tokens_writes_the_reference_text_as_byte_tokens_and_never_overwrites")),
    Mutant("compile_time_in_samples_per_s", "run/records.py",
           "seconds, self.step, self.time = now - self.time, self.step + 1, now",
           "seconds = now - self.time",  # the first interval's rate counts compilation again
           ("tests/test_observe.py::test_samples_per_s_counts_each_interval_from_the_end_of_the_one_before",
            "tests/test_observe.py::test_the_first_step_is_timed_once_and_left_out_of_samples_per_s")),
    Mutant("step_lines_hidden_under_the_bar", "run/metrics.py",
           "            self.log(f\"step {s:6d}  loss ",
           "            self._progress or self.log(f\"step {s:6d}  loss ",  # the bar hides every step line
           ("tests/test_observe.py::test_the_progress_bar_shows_below_the_step_lines_and_goes_when_the_run_ends",)),
    Mutant("profile_misses_the_last_step", "run/profile.py",
           "if self.tracing and s == self.steps[1]:",
           "if self.tracing and s == self.steps[1] - 1:",  # the trace stops before the last step asked for
           ("tests/test_observe.py::test_the_profile_traces_first_to_last_inclusive",
            "tests/test_observe.py::test_profile_steps_writes_a_trace_of_those_steps_into_the_workdir")),
    Mutant("wandb_gets_no_records", "run/metrics.py",
           "            self._tracker.write(record)\n",
           "            pass\n",
           ("tests/test_observe.py::test_a_wandb_offline_run_holds_the_config_every_record_and_the_runs_identity",)),
    Mutant("token_file_size_unchecked", "data/tokens.py",
           "if os.fstat(fd).st_size == self.size:",
           "if True:",  # a token file rewritten under the run is read as if it were the one opened
           ("tests/test_faults_data.py::test_a_token_file_that_changes_size_is_refused_at_the_next_batch",)),
    Mutant("token_open_error_escapes", "data/tokens.py",
           'getattr(os, "O_CLOEXEC", 0))\n        except OSError as e:',
           'getattr(os, "O_CLOEXEC", 0))\n        except FileNotFoundError as e:',  # PermissionError: a traceback
           ("tests/test_faults_data.py::test_an_unreadable_token_file_is_one_sentence_exit_2_before_anything_is_written",)),
    Mutant("token_dtype_too_narrow_accepted", "data/tokens.py",
           "if vocab_size > DTYPE_IDS[dtype.name]:",
           "if vocab_size > DTYPE_IDS[dtype.name] ** 2:",  # uint8 ids read for a 50304-id vocabulary
           ("tests/test_faults_data.py::test_a_dtype_too_narrow_for_the_vocabulary_is_refused_naming_the_likely_one",)),
    Mutant("late_data_error_not_checkpointed", "run/train.py",
           "self.save(trained, state, wait=True)",
           "pass",  # a bad id found at step 5 loses steps 1-4
           ("tests/test_faults_data.py::test_a_bad_token_id_found_late_through_the_api_checkpoints_first",)),
    Mutant("agreement_without_data_digests", "run/facts.py",
           "data[f\"the {what}'s digest\" + (f\" (read from {path!r})\" if path else \"\")] = digest",
           "pass",  # two hosts with different copies of train.bin train on a mix of both
           ("tests/test_facts.py::test_the_data_joins_the_identity_and_the_agreed_sizes_and_digests",)),
    Mutant("agreement_names_only_the_digest", "run/facts.py",
           'agreed |= {f"{section}.{key}": value for section, fields in identity.items() for key, value in fields.items()}',
           "agreed |= {}",  # another train.seed is refused naming only the "config" digests
           ("tests/test_facts.py::test_the_data_joins_the_identity_and_the_agreed_sizes_and_digests",)),
    Mutant("optimizer_state_compared_before_params", "run/checkpoint_faults.py",
           'for part, what in (("params", "params"), ("model_state", "a model state"), ("opt_state", "an optimizer state")):',
           'for part, what in (("opt_state", "an optimizer state"), ("params", "params"), ("model_state", "a model state")):',
           ("tests/test_faults_data.py::test_another_models_checkpoint_is_named_as_another_model_in_every_layout[fsdp]",)),
    Mutant("ocdbt_resource_exhausted_not_out_of_space", "run/checkpoint_faults.py",
           'if found is None and re.search(r"RESOURCE_EXHAUSTED',
           'if False and re.search(r"RESOURCE_EXHAUSTED',  # a full disk reported by OCDBT's writer: a traceback
           ("tests/test_faults_data.py::test_orbax_ocdbt_resource_exhausted_without_an_os_error_is_out_of_space",)),
    Mutant("cpp_abort_shown_on_the_console", "run/supervisor.py",
           "if self.hidden or _FATAL.match(line):",
           "if False:",  # jax's SIGABRT stack dump printed on the console again
           ("tests/test_faults_data.py::test_the_supervisor_hides_a_cpp_abort_and_names_a_duplicated_process_id",)),
    Mutant("duplicate_process_id_unnamed", "run/supervisor.py",
           "if _DUPLICATE in stderr_tail:",
           "if False:",  # a --process-id given twice gets "restart with the same command", which fails again
           ("tests/test_faults_data.py::test_the_supervisor_hides_a_cpp_abort_and_names_a_duplicated_process_id",)),
    # A message changed in the code and not in the docs that quote it (docs/reliability.md).
    Mutant("quoted_oom_advice_reworded", "run/records.py",
           "lower data.eval_batch_size (now ",
           "lower the evaluation batch size (now ",
           ("tests/test_docs.py::test_every_console_line_the_pages_quote_is_what_jdp_prints",)),
    Mutant("quoted_heartbeat_sentence_reworded", "run/supervisor.py",
           "stopped responding (it may be ",
           "stopped responding (it is ",  # "stalled rather than dead": the docs promise a doubt jdp no longer says
           ("tests/test_docs.py::test_every_console_line_the_pages_quote_is_what_jdp_prints",)),
    Mutant("quoted_error_loses_its_full_stop", "run/cli.py",
           'print(f"jdp: error: {e}.", file=sys.stderr)',
           'print(f"jdp: error: {e}", file=sys.stderr)',  # the CLI's own part of a quoted line
           ("tests/test_docs.py::test_every_console_line_the_pages_quote_is_what_jdp_prints",)),
    # issue 39: docs and reality
    Mutant("quoted_flag_renamed", "run/cli.py",
           'train.add_argument("--profile-steps", ',
           'train.add_argument("--profile-range", ',  # docs/training.md still says --profile-steps 20:25
           ("tests/test_docs.py::test_every_command_the_pages_quote_is_one_jdp_takes",)),
    Mutant("quoted_interrupt_line_reworded", "run/exits.py",
           "_INTERRUPTED_LINE = \"jdp: interrupted (Ctrl-C); a run's",
           "_INTERRUPTED_LINE = \"jdp: stopped (Ctrl-C); a run's",
           ("tests/test_docs.py::test_every_console_line_the_pages_quote_is_what_jdp_prints",)),
    Mutant("memory_progress_silent", "run/cli.py",
           "print(line, file=sys.stderr, flush=True)",
           "pass",  # jdp memory silent for minutes again
           ("tests/test_fsdp_layers.py::test_jdp_memory_says_what_it_compiles_as_it_goes",)),
    Mutant("memory_progress_counts_from_zero", "run/memory_table.py",
           "layout=name, number=i + 1, total",
           "layout=name, number=i, total",
           ("tests/test_fsdp_layers.py::test_jdp_memory_says_what_it_compiles_as_it_goes",)),
    Mutant("comm_loop_flag_lost", "inspect/comm.py",
           'f["loop_trips"] = trips.get(f["computation"], 1)',
           'f["loop_trips"] = 1',  # every collective reported as outside any loop, as before
           ("tests/test_fsdp_layers.py::test_the_loop_gathers_each_layer_and_reduce_scatters_its_gradient",)),
    Mutant("comm_nested_loops_not_multiplied", "inspect/comm.py",
           "None if n is None or k is None else n * k",
           "None if n is None or k is None else max(n, k)",
           ("tests/test_fsdp_layers.py::test_comm_report_counts_a_collective_once_per_iteration_of_the_loops_around_it",)),
    Mutant("comm_loop_runs_counted_once", "inspect/comm.py",
           ' * (c["loop_trips"] or 1),',
           ",",  # a collective in a scan over L layers counted once per call, not L times
           ("tests/test_fsdp_layers.py::test_the_loop_gathers_each_layer_and_reduce_scatters_its_gradient",)),
    Mutant("gathered_nnx_module_not_gathered", "bridges/gathered.py",
           "return nnx.merge(graphdef, gather(state))",
           "return nnx.merge(graphdef, state)",
           ("tests/test_fsdp_patterns.py::test_gathered_makes_a_modules_split_params_whole_and_changes_nothing_else",)),
    Mutant("gathered_linen_reads_blocks", "bridges/gathered.py",
           'nn.map_variables(module, "params", trans_in_fn=gather, init=True)',
           'nn.map_variables(module, "params", trans_in_fn=lambda tree: tree, init=True)',
           ("tests/test_fsdp_patterns.py::test_gathered_makes_a_modules_split_params_whole_and_changes_nothing_else",)),
    # issue 39: exactness helper and errors
    Mutant("exactness_nnx_weighted_as_plain", "inspect/reference.py",
           "if is_weighted_model_loss(loss, params_or_model, batches[0]):",
           "if False:",  # an nnx loss returning jdp.Weighted: JAX's "Gradient only defined for scalar-output functions"
           ("tests/test_exactness_models.py::test_the_helper_passes_on_every_documented_model[nnx-weighted]",)),
    Mutant("exactness_weighted_hint_reads_a_float", "inspect/exactness_hints.py",
           "    if is_weighted(whole):\n",
           "    if False:\n",  # a failing weighted check: TypeError from float(Weighted) instead of the report
           ("tests/test_exactness_models.py::test_a_mean_of_means_fails_with_the_report[params-weighted]",)),
    Mutant("exactness_mask_key_read_as_plain_mean", "inspect/reference.py",
           "if key is None or not isinstance(batch, dict) or key not in batch or is_weighted(loss):",
           "if True:",  # the reference divides by every row, padding included, where jdp divides by the real ones
           ("tests/test_exactness_models.py::test_a_mean_of_means_fails_with_the_report[params-mask_key-accum2]",)),
    Mutant("exactness_zero_gradient_unnamed", "inspect/exactness_hints.py",
           "if scales[row.name] <= max(ZERO_GRADIENT, 10 * eps) * scales[top]:",
           "if scales[row.name] <= 0:",  # a key bias's Adam noise fails the check with no word of why
           ("tests/test_exactness_models.py::test_a_leaf_whose_gradient_is_zero_is_named_with_its_fix",)),
    Mutant("exactness_atol_for_ignored", "inspect/exactness.py",
           "return next((a for pattern, a in setup.atol_for if fnmatch.fnmatchcase(name, pattern)), setup.atol)",
           "return setup.atol",
           ("tests/test_exactness_models.py::test_a_leaf_whose_gradient_is_zero_is_named_with_its_fix",)),
    Mutant("split_subscript_unexplained", "core/split.py",
           "__getitem__ = __matmul__ = __rmatmul__",
           "__matmul__ = __rmatmul__",  # p["w"][:, 0] under gather_in_model: "'Split' object is not subscriptable"
           ("tests/test_fsdp_layers.py::test_refusals",)),
    Mutant("needs_rng_not_named", "core/loss.py",
           "if not needs_rng and binds(len(names) + 1):",
           "if False:",  # a loss taking (model, batch, rngs): "loss_fn must take (model, batch)" and no fix
           ("tests/test_nnx.py::test_bad_input_is_one_sentence",
            "tests/test_step_rules.py::test_options_are_one_validated_value")),
    Mutant("token_file_missing_without_prepare_tokens", "run/config.py",
           'if d.name != "tokens":\n                raise ConfigError(f"{where} (relative',
           'if True:\n                raise ConfigError(f"{where} (relative',
           ("tests/test_tokens_train.py::test_a_missing_token_file_says_how_to_make_it",)),
    Mutant("workdir_read_as_a_config", "run/shipped.py",
           "if arg is None or os.path.isfile(arg) or (os.path.exists(arg) and not os.path.isdir(arg)):",
           "if arg is None or os.path.exists(arg):",  # jdp train digits_mlp --workdir digits_mlp, run again: refused
           ("tests/test_shipped.py::test_a_directory_is_never_a_config_and_a_shipped_name_wins_over_one",)),
    Mutant("profile_range_past_the_run_accepted", "run/config.py",
           "if steps is not None and steps[1] > config.train.steps:",
           "if False:",  # --steps 4 --profile-steps 10:20: exit 0, no trace, no word
           ("tests/test_cli_edges.py::test_a_profile_range_the_run_cannot_reach_is_refused_before_training",)),
    Mutant("exactness_dropout_unnamed", "inspect/exactness_hints.py",
           "if isinstance(m, nnx.Dropout) and not m.deterministic and m.rate > 0]",
           "if False]",  # docs/nnx.md's CNN, Dropout on, fails the check with no word of why
           ("tests/test_exactness_models.py::test_a_model_whose_dropout_is_on_is_named",)),
    # backend="jit", the global view
    Mutant("jit_sum_not_refused", "core/options.py",
           'if self.reduction != "mean":\n            raise OptionError("reduction", f"reduction={self.reduction!r} sums per-device',
           'if False:\n            raise OptionError("reduction", f"reduction={self.reduction!r} sums per-device',
           ("tests/test_jit_backend.py::test_what_jit_cannot_mean_is_refused_in_one_sentence",)),
    Mutant("jit_last_not_refused", "core/options.py",
           'if self.accum_steps > 1 and self.accum_sync == "last":\n            raise OptionError("accum_sync", "accum_sync=\'last\' needs',
           'if False:\n            raise OptionError("accum_sync", "accum_sync=\'last\' needs',
           ("tests/test_jit_backend.py::test_what_jit_cannot_mean_is_refused_in_one_sentence",)),
    Mutant("jit_key_not_one_devices", "core/state.py",
           "0 if axis is None else lax.axis_index(axis)", "1 if axis is None else lax.axis_index(axis)",
           ("tests/test_jit_backend.py::test_dropout_keys_under_jit_are_one_devices",)),
    Mutant("jit_residual_stream_not_pinned", "core/global_view.py",
           "return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)", "return x",
           ("tests/test_jit_backend.py::test_the_gpt_residual_stream_is_pinned_batch_sharded_under_jit",)),
    Mutant("jit_loss_sees_per_device_rows", "core/global_view.py",
           "            return step(state, batch)\n",
           "            return step(state, jax.tree.map(lambda x: x[:x.shape[0] // 4], batch))\n",
           ("tests/test_jit_backend.py::test_dropout_keys_under_jit_are_one_devices",)),
    Mutant("jit_nnx_batchnorm_gets_an_axis", "bridges/nnx.py",
           'sync_batchnorm and options.get("backend") != "jit"', "sync_batchnorm",
           ("tests/test_jit_backend.py::test_jdp_nnx_with_a_batchnorm_model_is_exact_under_jit",)),
    Mutant("jit_weight_is_n_times", "core/global_view.py",
           "    weight_devices = 1  #", "    weight_devices = 4  #",
           ("tests/test_jit_backend.py::test_a_weighted_losss_metrics_are_the_global_batchs",)),
    # the model's own sharding annotations
    Mutant("nnx_annotations_not_read", "bridges/nnx.py",
           "        annotations = param_annotations(copy)\n", "        annotations = None\n",
           ("tests/test_annotations.py::test_annotations_are_set_aside_under_shard_map_and_pmap_and_said_once",)),
    Mutant("callers_mesh_not_set_aside", "core/annotations.py",
           "    if current == mesh.abstract_mesh or (current.empty and not explicit_axes(mesh)):", "    if True:",
           ("tests/test_annotations.py::test_annotations_are_set_aside_under_shard_map_and_pmap_and_said_once",)),
    Mutant("axis_rules_not_refused_off_jit", "core/options.py",
           'if rules and self.backend != "jit":', "if False:",
           ("tests/test_annotations.py::test_bad_axis_rules_are_one_sentence",)),
    Mutant("axis_rules_ignored", "core/annotations.py",
           "axis = axis_rules.get(name, name if name in sizes else None)", "axis = name if name in sizes else None",
           ("tests/test_annotations.py::test_annotations_under_jit_map_through_axis_rules_and_the_rest_is_replicated",)),
    # jdp explain under backend="jit": the per-device parts skipped, the seeds' psum rows left out
    Mutant("explain_jit_runs_the_per_device_parts", "inspect/explain.py",
           '    if backend == "jit":\n        runs.update(', '    if backend == "jit" and False:\n        runs.update(',
           ("tests/test_explain.py::test_explain_under_jit_runs_the_seed_and_says_the_per_device_parts_are_skipped",)),
    Mutant("explain_jit_seed_sums_per_device", "inspect/explain.py",
           'per_device = {} if backend == "jit" else {', 'per_device = {} if backend == "pmap!" else {',
           ("tests/test_explain.py::test_explain_under_jit_runs_the_seed_and_says_the_per_device_parts_are_skipped",)),
    Mutant("explain_jit_tokens_keep_the_psum_runs", "inspect/explain_tokens.py",
           'for r in RUNS if "reduction" not in r[4]]', 'for r in RUNS]',
           ("tests/test_explain.py::test_token_normalisations_under_jit_the_batchs_own_count_is_exact",)),
    # issue 40: sampling and eval units
    Mutant("decode_cache_slot_off_by_one", "models/decode.py",
           "logits, cache = forward_cached(model, previous, cache, p + i - 1, first)",
           "logits, cache = forward_cached(model, previous, cache, p + i, first)",  # a gap of zeros the token sees
           ("tests/test_generate.py", "-k", "whole_forward_pass")),
    Mutant("decode_sees_the_left_padding", "models/decode.py",
           "visible = (keys <= slots[:, None])[None] & (keys[None, None] >= first[:, None, None])",
           "visible = (keys <= slots[:, None])[None] & (keys[None, None] >= 0 * first[:, None, None])",
           ("tests/test_generate.py", "-k", "whole_forward_pass")),
    Mutant("decode_positions_count_the_padding", "models/decode.py",
           "positions = jnp.maximum(slots[None, :] - first[:, None], 0)",
           "positions = jnp.maximum(slots[None, :] + 0 * first[:, None], 0)",
           ("tests/test_generate.py", "-k", "whole_forward_pass")),
    Mutant("top_k_keeps_k_plus_1", "models/decode.py",
           "jnp.broadcast_to(top_k - 1, ",
           "jnp.broadcast_to(jnp.minimum(top_k, logits.shape[1] - 1), ",
           ("tests/test_generate.py", "-k", "filter_logits or draws")),
    Mutant("top_p_drops_the_token_that_reaches_it", "models/decode.py",
           "kept = (before < top_p) | (top_p >= 1.0)",
           "kept = (before + probs < top_p) | (top_p >= 1.0)",
           ("tests/test_generate.py", "-k", "filter_logits")),
    Mutant("temperature_ignored", "models/decode.py",
           "scaled = logits / jnp.where(temperature > 0, temperature, 1.0)",
           "scaled = logits",
           ("tests/test_generate.py", "-k", "draws")),
    Mutant("perplexity_in_base_2", "run/records.py",
           'units = {"perplexity": math.exp(loss) if loss < 700 else math.inf}',
           'units = {"perplexity": 2.0 ** loss if loss < 700 else math.inf}',
           ("tests/test_sample.py", "-k", "units")),
    Mutant("bits_per_byte_in_nats", "run/records.py",
           'units["bits_per_byte"] = loss / math.log(2) / bytes_per_token',
           'units["bits_per_byte"] = loss / bytes_per_token',
           ("tests/test_sample.py", "-k", "units")),
    Mutant("eval_units_left_out_of_the_run", "run/train.py",
           "return language_model_units(metrics, self.task.bytes_per_token) if self.task.per_token else metrics",
           "return metrics",
           ("tests/test_sample.py", "-k", "per_token_loss_perplexity")),
    Mutant("bytes_per_token_guessed_without_metadata", "run/tasks.py",
           "return 1.0 if vocab_size == 256 else None",
           "return 1.0",  # a GPT-2 token file without meta.json would get bits per byte of byte tokens
           ("tests/test_sample.py", "-k", "bytes_per_token")),
    Mutant("char_bytes_per_token_counts_characters", "run/tasks.py",
           'return len(text.encode("utf-8")) / len(text)',
           "return len(text) / len(text)",
           ("tests/test_sample.py", "-k", "bytes_per_token")),
    Mutant("eval_line_loses_per_token", "run/metrics.py",
           "f\"{'loss/token' if k == 'loss' and per_token else k} {v:.4f}\"",
           'f"{k} {v:.4f}"',
           ("tests/test_sample.py", "-k", "per_token_loss_perplexity")),
    Mutant("plot_says_per_example_for_a_language_model", "run/metrics.py",
           'per = "token" if any("eval_perplexity" in r or "weight" in r for r in records) else "example"',
           'per = "example"',
           ("tests/test_sample.py", "-k", "plot_labels")),
    Mutant("sample_accepts_a_top_p_above_1", "run/commands.py",
           '_number(0.0, 1.0, "in (0, 1]", closed_low=False)',
           '_number(0.0, None, "in (0, 1]", closed_low=False)',
           ("tests/test_sample.py", "-k", "bad_sample_arguments")),
    Mutant("sample_stops_at_a_damaged_checkpoint", "run/checkpoint_reading.py",
           'log(f"{e.finding}; trying the one before it")',
           'raise',
           ("tests/test_sample.py", "-k", "damaged")),
    # prepare-tokens: its tokenizers, meta.json, and what jdp train takes from it.
    Mutant("prepare_empty_input_written", "data/prepare.py",
           "n_train = _split_sizes(given, total, val_fraction)",
           "n_train = int(round(total * (1.0 - val_fraction)))",  # empty.txt gives 0-token files and exit 0
           ("tests/test_prepare_tokens.py::test_an_empty_input_is_refused_and_nothing_is_written",)),
    Mutant("prepare_partial_link_followed", "data/prepare.py",
           'os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)',
           "os.O_WRONLY | os.O_CREAT | os.O_TRUNC",  # a planted OUTPUT/x.partial link writes the file it names
           ("tests/test_prepare_tokens.py::test_a_planted_partial_link_is_refused_and_nothing_outside_output_is_written",)),
    Mutant("prepare_publish_replaces", "data/prepare.py",
           'os.link(path + ".partial", path, follow_symlinks=False)',
           'os.replace(path + ".partial", path)',  # a file that appeared under the name is overwritten
           ("tests/test_prepare_tokens.py::test_existing_files_are_never_overwritten",)),
    Mutant("prepare_no_train_command", "data/prepare.py",
           'f"train on it: jdp train {TRAIN_CONFIG} --set data.path={out}"]',
           ']',  # the output no longer says how to train on it
           ("tests/test_prepare_tokens.py::test_bpe_is_trained_here_on_the_training_split_deterministically",)),
    Mutant("prepare_meta_bytes_are_characters", "data/prepare.py",
           'nbytes += len(chunk.encode("utf-8"))',
           "nbytes += len(chunk)",  # bits per byte from meta.json's bytes: wrong for non-ASCII text
           ("tests/test_prepare_tokens.py::test_bytes_by_default_are_the_files_of_before_read_in_chunks_and_meta_json_says_what_they_hold",)),
    Mutant("tokenizer_ids_above_65536_in_uint16", "data/tokenizer.py",
           'return "uint16" if vocab_size <= 1 << 16 else "uint32"',
           'return "uint16"',  # ids of a large vocabulary wrap around
           ("tests/test_prepare_tokens.py::test_more_than_65536_ids_are_written_as_uint32",)),
    Mutant("chunks_cut_inside_a_pre_token", "data/text_inputs.py",
           "if text[at].isspace() and not text[at - 1].isspace():",
           "if True:",  # a chunk boundary splits a pre-token: other tokens than the whole text's
           ("tests/test_prepare_tokens.py::test_chunks_are_cut_where_the_pre_tokenizer_splits_anyway",
            "tests/test_prepare_tokens.py::test_a_tokenizer_json_encodes_the_splits_as_the_library_does_whatever_the_chunk_size")),
    Mutant("train_ignores_meta_json_disagreement", "run/prepared.py",
           "if written is not None and written != meta[key]:",
           "if False:",  # a config's data.vocab_size that is not the files' trains on other ids
           ("tests/test_prepare_tokens.py::test_jdp_train_takes_vocab_size_and_dtype_from_meta_json_and_refuses_a_config_that_disagrees",)),
    # The first-call audit (jdp/core/audit.py): a loss divided by each device's own count is refused.
    Mutant("audit_not_run_on_the_first_call", "core/step.py",
           "if not self._first.audited:",
           "if False:",  # an own-count loss trains as a mean of per-device means, silently
           ("tests/test_audit.py::test_a_loss_divided_by_each_devices_own_count_is_refused_in_one_sentence[shard_map]",)),
    Mutant("audit_compares_the_gathered_rows_with_themselves", "core/audit.py",
           "jnp.concatenate([a, b]), rotated, repeated)",
           "jnp.concatenate([a, b]), rotated, rotated)",
           ("tests/test_audit.py::test_batch_statistics_and_dropout_pass_as_a_mean_and_are_refused_as_an_own_count",)),
    Mutant("audit_tolerance_too_loose_to_fire", "core/audit_verdict.py",
           "RTOL = 1e-4",
           "RTOL = 1e-1",
           ("tests/test_audit.py::test_a_loss_divided_by_each_devices_own_count_is_refused_in_one_sentence[shard_map]",)),
    Mutant("audit_rows_not_rotated", "core/audit.py",
           "first = 0 if axis is None else lax.axis_index(axis) * m",
           "first = 0",  # dropout masks no longer meet the same rows both ways: a false alarm
           ("tests/test_audit.py::test_batch_statistics_and_dropout_pass_as_a_mean_and_are_refused_as_an_own_count",)),
    Mutant("audit_key_per_device", "core/audit.py",
           "key = jax.random.fold_in(rng, micro_step)",
           "key = jax.random.fold_in(jax.random.fold_in(rng, micro_step), lax.axis_index(axis))",
           ("tests/test_audit.py::test_batch_statistics_and_dropout_pass_as_a_mean_and_are_refused_as_an_own_count",)),
    Mutant("audit_weighted_loss_audited", "core/audit.py",
           "seen.weighted, seen.dtype = weight is not None, total.dtype",
           "seen.weighted, seen.dtype = False, total.dtype",
           ("tests/test_audit.py::test_weighted_losses_are_not_audited_and_a_mask_key_loss_is_audited_as_a_mean",)),
    # issue 39: padding, optax under sharding, split axis
    Mutant("padding_first_call_divides_by_zero", "core/algorithm.py",
           "so_far = jnp.where((calls < accum_steps) & (so_far == 0), jnp.ones_like(so_far), so_far)",
           "so_far = so_far",  # a first micro-batch of padding only: 1/0, then MultiSteps' 0 · NaN params
           ("tests/test_weighted.py::test_a_call_or_device_of_padding_only_equals_one_device",)),
    Mutant("padding_step_of_no_weight_not_nan", "core/algorithm.py",
           "(calls < accum_steps) & (so_far == 0)",
           "(so_far == 0)",  # a step of weight 0 divides by 1 on its last call: params silently unchanged
           ("tests/test_weighted.py::test_a_step_of_padding_only_gives_nan_or_is_skipped",)),
    Mutant("padding_device_aux_nan", "core/weighting.py",
           "return jnp.where(weight == 0, jnp.zeros_like(mean * weight), mean * weight)",
           "return mean * weight",  # a plain aux on a device of padding only: 0/0 · 0 = NaN for the step
           ("tests/test_weighted.py::test_a_call_or_device_of_padding_only_equals_one_device",)),
    Mutant("sharded_state_matched_by_whole_path_only", "core/zero.py",
           "i = paths.get(tuple(path[len(path) - n:])) if n <= len(path) else None",
           "i = paths.get(tuple(path))",  # the state's paths (.mu['l0']['w']) never equal a param's: all whole
           ("tests/test_sharded_optax.py::test_masked_partitioned_and_muon_equal_one_device",)),
    Mutant("scanned_layer_axis_split", "models/gpt.py",
           "stack = gather_layer_axis(stack)",
           "stack = stack",  # a stacked leaf split along its layers: the scan gets 1 layer per device
           ("tests/test_fsdp_layers.py::test_a_stacked_leaf_split_along_its_layers_is_gathered_before_the_scan",)),
    Mutant("whole_leaves_not_reported", "inspect/memory.py",
           "whole=() if cuts is None else tuple(cuts.whole_leaves())",
           "whole=()",  # memory_report silent about the leaves every device holds whole
           ("tests/test_fsdp.py::test_the_leaves_kept_whole_are_named_with_their_bytes",)),
    Mutant("whole_leaves_not_in_the_train_line", "run/train.py",
           'whole = f"; {report.whole_text()}" if report.whole else ""',
           'whole = ""',  # jdp train's memory line no longer names them
           ("tests/test_fsdp.py::test_the_leaves_kept_whole_are_named_with_their_bytes",)),
    Mutant("failed_start_leaves_its_workdir", "run/workfiles.py",
           "remove_if_empty(self.dirs)",
           "pass",  # a run that failed as its first step compiled leaves an empty workdir behind
           ("tests/test_faults_run.py::test_a_run_that_fails_before_its_first_step_leaves_no_workdir",)),
    Mutant("refused_run_takes_back_the_live_runs_files", "run/train.py",
           "locked_workdir(workdir, log), made.files_on_failure(),",
           "made.files_on_failure(), locked_workdir(workdir, log),",  # cleanup armed before the lock is held
           ("tests/test_faults_run.py::test_a_run_that_fails_before_its_first_step_leaves_no_workdir",)),
    # the global view's optimizer state by the state's paths
    Mutant("jit_opt_state_left_replicated", "core/global_view.py",
           "opt_specs = jax.tree.map(opt_spec, state_owners(opt_struct, cuts), opt_struct)",
           "opt_specs = jax.tree.map(lambda i, x: P(), state_owners(opt_struct, cuts), opt_struct)",
           ("tests/test_sharded_optax.py::test_masked_and_muon_under_jit_equal_one_device",)),
    # test gaps (issue 39)
    Mutant("mask_key_aux_over_padded_rows", "core/weighting.py",
           "weighted_aux(aux, lambda a: Weighted(a * rows, weight)), weight",
           "weighted_aux(aux, lambda a: Weighted(a * rows, jnp.float32(rows))), weight",  # aux's mean counts padding
           ("tests/test_state_and_mask.py::test_a_plain_aux_under_mask_key_is_its_mean_over_the_real_rows",)),
    Mutant("stacked_leaf_split_along_its_layer_axis", "core/zero.py",
           "later = [i for i in dims if i > 0]",
           "later = [i for i in dims if i >= 0]",  # (8 layers, 4) over 4 devices: each holds 2 whole layers
           ("tests/test_zero.py::test_a_stacked_leaf_is_split_after_its_layer_axis_even_where_that_axis_is_the_largest",)),
    Mutant("blockwise_transpose_inverted", "core/blockwise.py",
           'list(eqn.params["permutation"]).index(ins[0].dim)',
           'list(eqn.params["permutation"])[ins[0].dim]',  # right for a 2-D .T only, its own inverse
           ("tests/test_blockwise.py::test_blockwise_equals_the_whole_function",)),
    Mutant("token_short_read_accepted", "data/tokens.py",
           "if all(len(chunk) == size for chunk in chunks):",
           "if True:",  # a file truncated under the read gives a batch of fewer tokens
           ("tests/test_data_sources.py::test_a_short_read_is_a_changed_token_file_not_a_batch_of_fewer_tokens",)),
    Mutant("samples_per_s_clock_not_restarted", "run/records.py",
           "self.step, self.time = step, now",
           "self.step = step",  # every interval after the first counts from the first step's end
           ("tests/test_observe.py::test_samples_per_s_counts_each_interval_from_the_end_of_the_one_before",)),
    Mutant("token_id_vocab_size_passes_a_batch", "data/tokens.py",
           "windows.max() >= self.vocab_size:",
           "windows.max() > self.vocab_size:",  # the id vocab_size itself indexes past the embedding
           ("tests/test_data_sources.py::test_the_id_equal_to_vocab_size_is_refused_when_the_file_opens_and_when_its_batch_is_read",)),
    Mutant("token_id_vocab_size_passes_the_sample", "data/tokens.py",
           "if chunk.max() >= self.vocab_size:",
           "if chunk.max() > self.vocab_size:",
           ("tests/test_data_sources.py::test_the_id_equal_to_vocab_size_is_refused_when_the_file_opens_and_when_its_batch_is_read",)),
    Mutant("hybrid_layers_blocks_not_summed_across_groups", "core/fsdp.py",
           "split = iter(self.cuts.across_replicas([x.value for x in leaves if is_split(x)]))",
           "split = iter([x.value for x in leaves if is_split(x)])",  # each group steps on its half of the batch
           ("tests/test_hybrid.py::test_per_layer_gathering_in_replica_groups_sums_the_blocks_across_the_groups",)),
    Mutant("agreement_compares_the_names_of_the_facts", "run/distributed.py",
           "blob = json.dumps(facts, sort_keys=True).encode()",
           "blob = json.dumps(sorted(facts)).encode()",  # two hosts' train.bin of one size agree
           ("tests/test_facts.py::test_processes_whose_data_digests_differ_are_refused_naming_both",)),
    Mutant("wheel_taken_for_a_checkout", "extras.py",
           'return root if os.path.isfile(os.path.join(root, "pyproject.toml")) else None',
           "return root",  # an installed wheel's hint: pip install -e '.../site-packages[plot]'
           ("tests/test_papercuts.py::test_the_install_hint_names_the_wheel_where_no_pyproject_lies_beside_the_package",)),
    Mutant("profile_starts_after_the_first_step", "run/profile.py",
           "if self.steps is None or not self.steps[0] <= s <= self.steps[1]:",
           "if self.steps is None or not self.steps[0] < s <= self.steps[1]:",  # --profile-steps 3:5 traces 4..5
           ("tests/test_observe.py::test_the_profile_traces_first_to_last_inclusive",)),
    Mutant("wandb_run_id_not_the_config_hash", "run/trackers.py",
           "id=config_hash[:16],",
           "id=None,",  # a resumed run syncs into a new W&B run
           ("tests/test_observe.py::test_the_wandb_run_is_offline_and_named_by_the_config_hash",)),
    Mutant("config_name_keeps_its_yaml_suffix", "run/shipped.py",
           'name = name[:-len(".yaml")] if name.endswith(".yaml") else name',
           "name = name",  # `jdp train char_gpt.yaml` outside a checkout: "neither a file nor a shipped config"
           ("tests/test_shipped.py::test_a_config_is_found_by_name_and_a_file_of_that_path_wins",)),
    # The GPT's architecture options and nanoGPT's weights in it (tests/test_nanogpt_parity.py needs torch).
    Mutant("gpt_tied_head_still_made", "models/gpt.py",
           "if not tie_embeddings:",
           "if True:",  # a tied GPT keeps an untrained (vocab, d_model) head beside the embedding
           ("tests/test_gpt_options.py::test_the_architecture_options_do_what_they_say",)),
    Mutant("gpt_gelu_always_tanh", "models/gpt.py",
           "approximate=self.gelu_approximate",
           "approximate=True",  # gelu_approximate=False (nanoGPT's exact GELU) ignored
           ("tests/test_gpt_options.py::test_the_architecture_options_do_what_they_say",)),
    Mutant("gpt_ln_epsilon_ignored", "models/gpt.py",
           "ln = dict(kw, epsilon=ln_epsilon)",
           "ln = dict(kw)",  # the blocks' LayerNorms keep nnx's 1e-6
           ("tests/test_gpt_options.py::test_the_architecture_options_do_what_they_say",)),
    Mutant("gpt_bias_false_ignored", "models/gpt.py",
           "kw = dict(dtype=dtype, param_dtype=jnp.float32, use_bias=bias, rngs=rngs)",
           "kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)",  # bias=False keeps the blocks' biases
           ("tests/test_gpt_options.py::test_the_architecture_options_do_what_they_say",)),
    Mutant("nanogpt_query_and_key_swapped", "models/hub/nanogpt.py",
           'enumerate(("query", "key", "value"))',
           'enumerate(("key", "query", "value"))',  # c_attn's first third is q, not k
           ("tests/test_gpt_options.py::test_gpt_from_nanogpt_puts_each_matrix_where_nanogpt_uses_it",)),
    Mutant("nanogpt_linear_not_transposed", "models/hub/nanogpt.py",
           'out = {"kernel": take(prefix + ".weight").T.reshape(kernel_shape)}',
           'out = {"kernel": take(prefix + ".weight").reshape(kernel_shape)}',  # torch's (out, in) read as (in, out)
           ("tests/test_gpt_options.py::test_gpt_from_nanogpt_puts_each_matrix_where_nanogpt_uses_it",)),
    Mutant("nanogpt_params_are_views", "models/hub/nanogpt.py",
           "return np.array(value, dtype=np.float32)",
           "return np.asarray(value, dtype=np.float32)",  # the GPT would change as torch trains its tensors in place
           ("tests/test_gpt_options.py::test_gpt_from_nanogpt_puts_each_matrix_where_nanogpt_uses_it",)),
    # gemma through jit: backend="jit" on the caller's mesh (make_train_step(mesh=...)).
    Mutant("jit_mesh_option_ignored", "core/step.py",
           "self.mesh, data_axis = ((make_mesh(devices, o.axis_name, o.replicas), None) if mesh is None",
           "self.mesh, data_axis = ((make_mesh(devices, o.axis_name, o.replicas), None) if True",
           ("tests/test_annotations.py::test_a_model_for_an_explicit_mesh_of_its_own_axis_names_runs_on_it_under_jit[jit-fsdp]",)),
    Mutant("explicit_mesh_split_by_jdp_fsdp", "core/annotations.py",
           "elif shard_params and not explicit:",
           "elif shard_params:",  # an unannotated bias split over the batch axis: the model's types no longer meet
           ("tests/test_annotations.py::test_a_model_for_an_explicit_mesh_of_its_own_axis_names_runs_on_it_under_jit[jit-fsdp]",)),
    Mutant("explicit_mesh_not_set_outside_the_callers_context", "core/annotations.py",
           "(current.empty and not explicit_axes(mesh))",
           "current.empty",  # the model's own out_sharding names axes no context mesh has
           ("tests/test_annotations.py::test_a_model_for_an_explicit_mesh_of_its_own_axis_names_runs_on_it_under_jit[jit-fsdp]",)),
    Mutant("users_mesh_state_split_along_its_last_axis", "core/global_view.py",
           "self.shard_axis = mesh.axis_names[-1] if data_axis is None else data_axis",
           "self.shard_axis = mesh.axis_names[-1]",  # FSDP along the size-1 axis: nothing split
           ("tests/test_annotations.py::test_on_a_callers_auto_mesh_shard_params_splits_the_unannotated_leaves_too",)),
    Mutant("users_mesh_batch_over_a_size_one_axis", "core/mesh.py",
           "wide = [a for a in mesh.axis_names if mesh.shape[a] > 1]",
           "wide = list(mesh.axis_names)",
           ("tests/test_annotations.py::test_a_model_for_an_explicit_mesh_of_its_own_axis_names_runs_on_it_under_jit[jit-fsdp]",)),
    Mutant("jit_missing_axis_left_to_jax", "core/global_view.py",
           "if found is None or found.group(1) in self.layout.mesh.axis_names:",
           "if True:",  # JAX's "Resource axis ... not found in mesh", which does not say to pass mesh=
           ("tests/test_annotations.py::test_a_model_that_names_its_own_meshs_axes_on_jdps_mesh_is_told_to_pass_mesh",)),
    # init traced for its shapes
    Mutant("traced_init_reads_a_tracers_sharding", "core/annotations.py",
           "        except AttributeError:  # a traced value (init under jax.eval_shape or jit): placed by the trace\n"
           "            return x\n",
           "        except IndexError:\n            return x\n",
           ("tests/test_annotations.py::test_init_can_be_traced_for_the_states_shapes",)),
    # The audit's parts (issue 43): devices and micro-batches, sums and fixed divisors, mask_key, dtypes,
    # dropout, aux.
    Mutant("audit_skipped_under_pmap", "core/audit.py",
           "if options.backend != \"jit\" and devices > 1 and options.has_state and not options.sync_batchnorm:",
           "if options.backend == \"pmap\":",  # an own-count loss trains silently under pmap
           ("tests/test_audit.py::test_a_loss_divided_by_each_devices_own_count_is_refused_in_one_sentence[pmap]",)),
    Mutant("audit_micro_batches_not_parts", "core/audit.py",
           "return per_device, options.accum_steps",
           "return per_device, 1",  # jit with accumulation: a mean of micro-batch means, silently
           ("tests/test_audit_cases.py::test_an_own_count_loss_split_into_micro_batches_is_refused_before_step_one"
            "[jit_accum]",)),
    Mutant("audit_no_scale_check", "core/audit_verdict.py",
           "return parts > 1 and np.isfinite(ratio) and abs(math.log(ratio)) > math.log(parts) / 2",
           "return False",  # a sum is called an own count
           ("tests/test_audit_cases.py::test_a_sum_or_a_fixed_divisor_is_refused_on_devices_and_micro_batches"
            "[shard_map-sum]",)),
    Mutant("audit_mask_key_loss_not_audited", "core/audit.py",
           "return replace(options, mask_key=None) if options.mask_key not in (None, \"auto\") else options",
           "return options",  # sum(mask·l)/sum(mask) is taken as weighted and trains silently
           ("tests/test_audit_cases.py::test_a_mask_key_loss_divided_by_sum_of_the_mask_is_refused_and_names_what_"
            "mask_key_expects",)),
    Mutant("audit_tolerance_ignores_the_dtype", "core/audit_verdict.py",
           "return RTOL if dtype.itemsize >= 4 else",
           "return RTOL if True else",  # a bfloat16 mean is refused as an own count
           ("tests/test_audit_cases.py::test_a_mean_returned_in_bfloat16_trains_and_equals_one_device",)),
    Mutant("audit_aux_count_not_named", "core/audit.py",
           "if aux[0] == \"refused\":",
           "if False:",
           ("tests/test_audit_cases.py::test_a_count_in_aux_is_named_once_and_trains",)),
    Mutant("audit_dropout_taken_as_deterministic", "core/audit.py",
           "seen.random = needs_rng and depends_on(",
           "seen.random = False and depends_on(",  # dropout masks differ by shape: a false alarm
           ("tests/test_audit_cases.py::test_dropout_from_the_key_passes[jit_accum]",)),
    Mutant("audit_hints_jit_under_accumulation", "core/audit_verdict.py",
           "if options.backend != \"jit\" and options.accum_steps == 1 and not masked:",
           "if options.backend != \"jit\" and not masked:",  # jit would not fix a per-micro-batch count
           ("tests/test_audit_cases.py::test_an_own_count_loss_split_into_micro_batches_is_refused_before_step_one"
            "[one_device_accum]",)),
    Mutant("audit_micro_batches_with_batch_statistics", "core/audit.py",
           "            m = 1\n",
           "            m = m\n",  # each micro-batch's own statistics: a false alarm
           ("tests/test_audit_cases.py::test_synchronised_statistics_with_accumulation_audit_the_devices_only",)),
    Mutant("audit_where_not_located", "core/audit.py",
           "if n > 1 and m > 1 and not seen.random:",
           "if False:",  # both dimensions named where only the micro-batches fail
           ("tests/test_audit_cases.py::test_a_loss_exact_per_device_but_normalised_per_micro_batch_is_located_there",)),
    # The exactness helper's reference is the definition, and the Linen papercuts found porting nanodo
    Mutant("reference_accumulates_micro_batch_means", "inspect/reference.py",
           "per_micro = has_model_state(setup, params_or_model) and m > 1",
           "per_micro = m > 1",  # the reference steps MultiSteps over micro-batch means, sharing the bug
           ("tests/test_exactness_definition.py::test_accumulating_an_own_count_loss_fails_and_its_weighted_form_passes",)),
    Mutant("helper_refuses_multisteps", "inspect/exactness.py",
           "tx, every_k = multi_steps_inner(given)",
           "tx, every_k = given, 1",  # "optimizer must be an optax.GradientTransformation, got MultiSteps"
           ("tests/test_exactness_definition.py::test_multisteps_is_taken_as_the_step_takes_it",)),
    Mutant("linen_dropout_named_own_count", "inspect/exactness_hints.py",
           "hint = linen_dropout_hint(setup, batch, axis) or own_count_hint(",
           "hint = own_count_hint(",  # dropout's masks reported as a loss dividing by its own count
           ("tests/test_exactness_definition.py::test_linen_dropout_is_named_as_the_cause",)),
    Mutant("boxed_params_not_reboxed", "bridges/linen.py",
           "    if boxed is not train_state:\n        trained[\"params\"]",
           "    if False:\n        trained[\"params\"]",  # to_train_state refuses (its structure check) or hands back bare arrays
           ("tests/test_exactness_definition.py::test_to_train_state_gives_boxed_params_back_boxed",)),
    Mutant("constraints_not_refused", "core/constraints.py",
           "    if backend == \"jit\":\n        return loss_fn",
           "    if True:\n        return loss_fn",  # the raw JAX/Flax with_sharding_constraint error
           ("tests/test_exactness_definition.py::test_a_sharding_constraint_in_the_model_is_refused_under_shard_map",)),
    # prepare-tokens reads each input once; its encoders (tiktoken checked against the library, the
    # library otherwise) on 1 or more worker processes; the uint16/uint32 boundary (issues 43, 45).
    Mutant("token_dtype_65536_ids_in_uint32", "data/tokenizer.py",
           'return "uint16" if vocab_size <= 1 << 16 else "uint32"',
           'return "uint16" if vocab_size < 1 << 16 else "uint32"',  # the boundary off by one: files twice the size
           ("tests/test_prepare_encoders.py::test_65536_ids_fit_uint16_and_65537_need_uint32[65535]",)),
    Mutant("prepare_dtype_uint16_refuses_65536_ids", "data/prepare.py",
           'if dtype == "uint16" and tok.vocab_size > 1 << 16:',
           'if dtype == "uint16" and tok.vocab_size >= 1 << 16:',
           ("tests/test_prepare_encoders.py::test_65536_ids_fit_uint16_and_65537_need_uint32[65535]",)),
    Mutant("prepare_encodes_a_second_read_of_the_inputs", "data/prepare.py",
           "text = lambda: spooled_pieces(files.partial(SPOOL), read_bytes)  # noqa: E731",
           "text = lambda: (p for path in paths for p in __import__('jdp.data.text_inputs', fromlist=['_'])"
           ".input_pieces(path, field=field, read_bytes=read_bytes))",  # a file changed since is encoded as it is now
           ("tests/test_prepare_encoders.py::test_each_input_is_read_once_and_its_sha256_is_of_the_bytes_encoded",)),
    Mutant("prepare_digest_from_a_second_read", "data/text_inputs.py",
           '"sha256": h.hexdigest()}',
           '"sha256": hashlib.sha256(b"".join(_read_blocks(path, read_bytes))).hexdigest()}',  # of the file as it is now
           ("tests/test_prepare_encoders.py::test_each_input_is_read_once_and_its_sha256_is_of_the_bytes_encoded",)),
    Mutant("prepare_leaves_its_spool", "data/prepare.py",
           "    files.drop(SPOOL)\n",
           "",  # OUTPUT/text.partial, a copy of the whole text, stays behind
           ("tests/test_prepare_encoders.py::test_each_input_is_read_once_and_its_sha256_is_of_the_bytes_encoded",)),
    Mutant("prepare_ctrl_c_leaves_its_files", "data/prepare.py",
           "restore = _raise_on_ctrl_c()",
           "restore = lambda: None",  # jdp's command exits at once on Ctrl-C: .partial files and workers left
           ("tests/test_prepare_encoders.py::test_ctrl_c_removes_what_the_run_wrote_and_gives_the_handler_back",)),
    Mutant("encoder_tiktoken_used_unchecked", "data/encoders.py",
           "if not np.array_equal(theirs, ours):",
           "if False:",  # a BPE whose merges are not in id order gets tiktoken's other ids
           ("tests/test_prepare_encoders.py::test_a_tokenizer_tiktoken_does_not_reproduce_falls_back_to_the_library_and_says_why",)),
    Mutant("encoder_tiktoken_without_added_tokens", "data/encoders.py",
           "special = bool(enc.special_tokens_set)",
           "special = False",  # <|endoftext|> in the text: bytes to tiktoken, one id to the library
           ("tests/test_prepare_encoders.py::test_tiktoken_the_library_and_1_or_2_workers_give_the_librarys_ids_of_each_split",)),
    Mutant("prepare_small_text_starts_every_core", "data/prepare.py",
           "return cores if chars is None else max(1, min(cores, -(-chars // WORKER_CHARS)))",
           "return cores",  # a 4.7 MB text waits for processes to start: slower than one
           ("tests/test_prepare_encoders.py::test_workers_default_to_the_cores_but_one_per_16_mi_characters_and_are_at_least_1",)),
    Mutant("encoder_workers_results_out_of_order", "data/encoders.py",
           "            if len(pending) >= 2 * workers:\n                yield pending.popleft().get()",
           "            if len(pending) >= 2 * workers:\n                yield pending.pop().get()",
           ("tests/test_prepare_encoders.py::test_tiktoken_the_library_and_1_or_2_workers_give_the_librarys_ids_of_each_split",)),
    # model FLOPs (MFU) and the defaults chosen for the device
    Mutant("gpt_flops_miss_attention", "inspect/flops.py",
           "return 6 * int(n_params) + 12 * int(n_layers) * int(d_model) * int(seq_len)",
           "return 6 * int(n_params)",
           ("tests/test_flops.py::test_the_gpts_count_is_nanogpts_formula_exactly",)),
    Mutant("remat_counted_as_model_flops", "inspect/flops.py",
           'total += inner * (eqn.params["length"] if name == "scan" else 1)',
           'total += inner * (eqn.params["length"] if name == "scan" else 2 if name in ("remat2", "checkpoint") else 1)',
           ("tests/test_flops.py::test_remat_is_never_counted_as_model_flops",)),
    Mutant("auto_attention_not_cudnn_on_gpu", "run/device_defaults.py",
           'if platform == "gpu" and precision == "bfloat16":',
           'if platform == "gpu" and precision == "float32":',
           ("tests/test_device_defaults.py::test_auto_attention_is_cudnn_only_on_a_gpu_in_bfloat16",)),
    Mutant("remat_margin_boundary", "run/device_defaults.py",
           "if peak_without <= margin * memory:",
           "if peak_without < margin * memory:",
           ("tests/test_device_defaults.py::test_auto_remat_is_off_only_where_the_peak_without_it_fits_with_margin",)),
    # The fused, chunked cross-entropy (jdp/models/xent.py) and model.loss_chunk.
    Mutant("xent_chunk_gradient_not_accumulated", "models/xent.py",
           "return dw + dw_c, dx.astype(x.dtype)", "return dw_c, dx.astype(x.dtype)",
           ("tests/test_xent.py::test_fused_equals_plain_in_loss_argmax_and_gradients",)),
    Mutant("xent_log_sum_exp_in_bf16", "models/xent.py",
           "lse = jax.nn.logsumexp(logits, axis=-1)",
           "lse = jax.nn.logsumexp(logits.astype(jnp.bfloat16), axis=-1).astype(jnp.float32)",
           ("tests/test_xent.py::test_fused_equals_plain_in_loss_argmax_and_gradients",)),
    Mutant("xent_token_weights_ignored", "models/xent.py",
           "- onehot) * gc[..., None])", "- onehot))",
           ("tests/test_xent.py::test_fused_equals_plain_in_loss_argmax_and_gradients",)),
    Mutant("xent_last_partial_chunk_dropped", "models/xent.py",
           "    t = x.shape[1]\n    n_chunks = -(-t // chunk)\n", "    t = x.shape[1]\n    n_chunks = t // chunk\n",
           ("tests/test_xent.py::test_fused_equals_plain_in_loss_argmax_and_gradients",)),
    Mutant("xent_head_gradient_not_per_device", "models/xent.py",
           "return jax.lax.pcast(zeros, tuple(sorted(axes)), to=\"varying\") if axes else zeros", "return zeros",
           ("tests/test_xent.py::test_eight_devices_take_the_one_device_step_on_the_global_batch",)),
    Mutant("loss_chunk_ignored_by_the_task", "run/tasks.py", "    if loss_chunk:\n", "    if False:\n",
           ("tests/test_xent.py::test_model_loss_chunk_takes_the_fused_loss_in_training_and_evaluation",)),
    Mutant("loss_chunk_allowed_on_another_model", "run/config.py",
           "or m.scan_layers or m.loss_chunk):", "or m.scan_layers):",
           ("tests/test_xent.py::test_loss_chunk_on_another_model_is_refused",)),
    # Decoding and jdp sample beside a running jdp train: the cache updated in place, a key per token, a
    # checkpoint rotated away mid-read, a damaged one said in one line.
    Mutant("decode_cache_writes_the_wrong_slot", "models/decode.py",
           "at = (layer, 0, start, 0, 0)",
           "at = (layer, 0, start + 1, 0, 0)",  # each token's keys one slot late
           ("tests/test_generate.py", "-k", "greedy_equals")),
    Mutant("decode_cache_writes_the_wrong_layer", "models/decode.py",
           "at = (layer, 0, start, 0, 0)",
           "at = (0, 0, start, 0, 0)",  # every layer writes layer 0's slice
           ("tests/test_generate.py", "-k", "greedy_equals")),
    Mutant("decode_same_key_every_token", "models/decode.py",
           "pick(logits[:, 0], jax.random.fold_in(key, i),",
           "pick(logits[:, 0], jax.random.fold_in(key, 0),",
           ("tests/test_generate.py", "-k", "own_key")),
    Mutant("sample_calls_a_removed_checkpoint_damaged", "run/checkpoint_reading.py",
           "if not os.path.isdir(os.path.join(directory, str(number))):",
           "if False:",
           ("tests/test_sample.py::test_a_checkpoint_removed_while_it_is_read_is_not_damaged_the_newest_one_there_now_is_read",)),
    Mutant("sample_spills_orbax_log_records", "run/checkpoint_reading.py",
           "logger.handlers, logger.propagate = [collect], False",
           "logger.handlers, logger.propagate = [collect] + logger.handlers, True",
           ("tests/test_sample.py::test_a_truncated_checkpoint_is_said_in_one_line_whatever_is_cut[step_metadata_half]",)),
    # Hugging Face GPT-2 checkpoints in and out (jdp/models/hub/gpt2_in.py, gpt2_out.py, jdp/run/hf_init.py)
    Mutant("hf_conv1d_kernel_transposed", "models/hub/gpt2_in.py",
           'return {"kernel": take(prefix + ".weight").reshape(kernel_shape),',
           'return {"kernel": take(prefix + ".weight").T.reshape(kernel_shape),',  # torch Linear's (out, in) habit
           ("tests/test_hf.py::test_a_transformers_gpt2_loads_with_its_logits[options]",)),
    Mutant("hf_ln_epsilon_dropped_on_import", "models/hub/gpt2_in.py",
           "GELUS[activation], float(epsilon),",
           "GELUS[activation], 1e-6,",  # jdp's GPT default
           ("tests/test_hf.py::test_a_transformers_gpt2_loads_with_its_logits[options]",)),
    Mutant("hf_exact_gelu_read_as_tanh", "models/hub/gpt2_in.py",
           'GELUS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}',
           'GELUS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": True}',
           ("tests/test_hf.py::test_a_transformers_gpt2_loads_with_its_logits[options]",)),
    Mutant("hf_tied_head_untied_on_export", "models/hub/gpt2_out.py",
           '"tie_word_embeddings": model.tie_embeddings}',
           '"tie_word_embeddings": False}',
           ("tests/test_hf.py::test_save_hf_writes_what_transformers_loads_with_the_same_logits_and_greedy_text[gpt2]",)),
    Mutant("hf_ln_epsilon_dropped_on_export", "models/hub/gpt2_out.py",
           '"layer_norm_epsilon": model.ln_f.epsilon, ',
           "",  # transformers' default, 1e-5
           ("tests/test_hf.py::test_save_hf_writes_what_transformers_loads_with_the_same_logits_and_greedy_text[options]",)),
    Mutant("hf_export_writes_into_a_full_directory", "models/hub/folder.py",
           "if os.path.isdir(out) and os.listdir(out):",
           "if False:",
           ("tests/test_hf.py::test_save_hf_overwrites_nothing",)),
    Mutant("hf_contradicting_size_accepted", "run/hf_init.py",
           "if _is_int(written) and written != value:",
           "if False:",
           ("tests/test_hf.py::test_model_init_from_takes_the_sizes_and_refuses_a_contradicting_one",)),
    Mutant("hf_init_from_trains_random_weights", "run/tasks.py",
           "if m.init_from is not None:",
           "if False:",
           ("tests/test_hf.py::test_model_init_from_takes_the_sizes_and_refuses_a_contradicting_one",)),
    Mutant("hf_pickled_weights_not_refused", "models/hub/folder.py",
           "    if others:\n",
           "    if False:\n",
           ("tests/test_hf.py::test_what_is_not_a_gpt2_checkpoint_is_refused_in_one_sentence",)),
    # The Llama family (jdp/models/llama.py, rope.py, hub/llama_in.py, llama_out.py): each a bug a refactor makes.
    Mutant("llama_rmsnorm_drops_its_epsilon", "models/llama.py",
           "keepdims=True) + self.eps)",
           "keepdims=True))",
           ("tests/test_llama.py::test_a_transformers_checkpoint_loads_with_its_logits_and_first_loss",)),
    Mutant("llama_rotate_half_with_the_sign_on_the_wrong_half", "models/rope.py",
           "turned = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)",
           "turned = jnp.concatenate([x[..., half:], -x[..., :half]], axis=-1)",
           ("tests/test_llama.py::test_a_transformers_checkpoint_loads_with_its_logits_and_first_loss",)),
    Mutant("llama_query_heads_tiled_over_the_kv_heads", "models/llama.py",
           "grouped = q.reshape(b, t, kv, heads // kv, hd)",
           "grouped = q.reshape(b, t, heads // kv, kv, hd).swapaxes(2, 3)",
           ("tests/test_llama.py::test_a_transformers_checkpoint_loads_with_its_logits_and_first_loss",)),
    Mutant("llama3_rope_smoothing_weights_swapped", "models/rope.py",
           "smoothed = ((1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled)",
           "smoothed = (smooth * scaled / np.float32(scaling.factor) + (1 - smooth) * scaled)",
           ("tests/test_llama.py::test_a_transformers_checkpoint_loads_with_its_logits_and_first_loss",)),
    Mutant("llama_rope_theta_of_the_file_ignored", "models/hub/llama_in.py",
           'theta = params.get("rope_theta", config.get("rope_theta", 10000.0))',
           'theta = params.get("rope_theta", 10000.0)',
           ("tests/test_llama.py::test_an_older_config_json_with_top_level_rope_theta_and_rope_scaling_loads_the_same",)),
    Mutant("llama_head_dim_always_hidden_over_heads", "models/hub/llama_in.py",
           'head_dim = config.get("head_dim") or sizes["hidden_size"] // heads',
           'head_dim = sizes["hidden_size"] // heads',
           ("tests/test_llama.py::test_a_transformers_checkpoint_loads_with_its_logits_and_first_loss",)),
    Mutant("llama_swiglu_gates_the_wrong_projection", "models/llama.py",
           "self.down_proj(nnx.silu(self.gate_proj(h)) * self.up_proj(h))",
           "self.down_proj(self.gate_proj(h) * nnx.silu(self.up_proj(h)))",
           ("tests/test_llama.py::test_a_transformers_checkpoint_loads_with_its_logits_and_first_loss",)),
    Mutant("llama_tied_head_checked_by_shape", "models/hub/llama_in.py",
           'not np.array_equal(head.T, params["embed"]["embedding"])',
           'head.T.shape != params["embed"]["embedding"].shape',
           ("tests/test_llama.py::test_a_missing_unknown_or_untied_head_tensor_is_named",)),
    Mutant("llama_sliding_window_boundary_off_by_one", "models/hub/llama_in.py",
           "if window is not None and window < positions:",
           "if window is not None and window < positions - 1:",
           ("tests/test_llama.py::test_what_jdps_llama_cannot_compute_is_refused_naming_the_key",)),
    Mutant("llama_export_drops_the_rope_scaling", "models/hub/llama_out.py",
           'return {"rope_theta": a.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}',
           'return {"rope_theta": a.rope_theta, "rope_scaling": None, "rope_parameters": {"rope_theta": a.rope_theta, "rope_type": "default"}}',
           ("tests/test_llama.py::test_save_hf_gives_back_every_tensor_bit_for_bit_and_transformers_loads_it",)),
    # The Llama family's KV cache (jdp/models/decode_llama.py).
    Mutant("llama_cache_sized_for_the_query_heads", "models/decode_llama.py",
           "return model.arch.n_kv_heads, model.arch.head_dim, jnp.dtype(model.dtype)",
           "return model.arch.n_heads, model.arch.head_dim, jnp.dtype(model.dtype)",
           ("tests/test_llama_decode.py::test_the_cache_holds_the_kv_heads_only_and_the_scanned_model_decodes_the_same",)),
    # (Positions shifted by a constant, per row or for all, are not a bug: rotary attention depends on
    # position differences only. Each token rotated at the cache slot's own position instead is one.)
    Mutant("llama_cached_rotary_at_the_prompt_start_only", "models/decode_llama.py",
           "cos, sin = model.rotary(positions)  # (b, L, head_dim)",
           "cos, sin = model.rotary(jnp.broadcast_to(positions[:, :1], positions.shape))  # (b, L, head_dim)",
           ("tests/test_llama_decode.py::test_greedy_tokens_equal_transformers_generate_and_the_whole_forward_pass",)),
    Mutant("llama_cached_step_skips_the_mlp", "models/decode_llama.py",
           "return x + block.mlp(x), type(cache)(keys, values)",
           "return x, type(cache)(keys, values)",
           ("tests/test_llama_decode.py::test_greedy_tokens_equal_transformers_generate_and_the_whole_forward_pass",)),
]

def occurrences(mutant: Mutant, jdp_dir: str) -> int:
    with open(os.path.join(jdp_dir, mutant.file), encoding="utf-8") as f:
        return f.read().count(mutant.old)


def _copy_tree(src: str, dst: str) -> None:
    if os.path.islink(src):  # configs/ links to jdp/configs/: the copy links to its own copy
        os.symlink(os.readlink(src), dst)
        return
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results", "runs", "_build"))


def baseline() -> Mutant:
    """No edit, and every mutant's selection: in the copy, unmutated, all of it must pass."""
    tests = tuple(dict.fromkeys(t for m in MUTANTS if m.name != "sanity_import_fails" for t in m.tests
                                if t.startswith("tests/")))  # whole files where a mutant narrows with -k
    return Mutant("baseline (no mutant)", "__init__.py", "", "", tests)


def scratch_copy(mutant: Mutant, jdp_dir: str, base: str) -> str:
    """A fresh directory holding the mutated package, the repo's tests and what they read."""
    where = tempfile.mkdtemp(prefix=f"{mutant.name}-", dir=base)
    _copy_tree(jdp_dir, os.path.join(where, "jdp"))
    for name in ("tests", "benchmarks", "configs", "examples", "docs"):
        _copy_tree(os.path.join(ROOT, name), os.path.join(where, name))
    for name in ("pyproject.toml", "README.md", "CONTRIBUTING.md"):
        shutil.copy(os.path.join(ROOT, name), where)
    if not mutant.old:  # the baseline
        return where
    path = os.path.join(where, "jdp", mutant.file)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.count(mutant.old) != 1:
        raise ValueError(f"mutant {mutant.name}: its snippet occurs {text.count(mutant.old)} times in jdp/{mutant.file}, "
                         f"not once: {mutant.old!r}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(mutant.old, mutant.new))
    return where


def quick_paths(tests: tuple[str, ...]) -> tuple[str, ...]:
    """The files and node ids of a selection without its "-k EXPR": where the quick stage looks first."""
    paths, skip = [], False
    for t in tests:
        if skip or t == "-k":
            skip = not skip
            continue
        paths.append(t)
    return tuple(paths)


def stages(mutant: Mutant, mode: str) -> list[tuple[str, tuple[str, ...]]]:
    """The pytest runs for a mutant, cheapest first, each with the tier it speaks for; the first that
    fails decides. "quick" is the quick tier's tests in the selection's files (or the whole quick
    tier), "full" the selection itself (which the full suite runs)."""
    if not mutant.old or mode == "selection":
        return [("full", mutant.tests)]
    quick = [("quick", ("-m", "quick", *quick_paths(mutant.tests)))]
    if mode == "whole-quick":
        quick.append(("quick", ("-m", "quick", "tests")))
    return [*quick, ("full", mutant.tests)]


def _pytest(args: tuple[str, ...], where: str, env: dict, timeout: float):
    return subprocess.run([sys.executable, "-m", "pytest", "-n0", "-x", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=where, env=env, timeout=timeout)


def run_mutant(mutant: Mutant, jdp_dir: str, base: str, timeout: float, mode: str = "quick") -> dict:
    """Apply `mutant` in a scratch copy and run its stages (`stages`) until one fails.

    Returns {"status": caught | survived | passed (the baseline) | error, "tier": the tier of the
    stage that caught it, "detail", "seconds"}.
    """
    t0 = time.perf_counter()
    where = scratch_copy(mutant, jdp_dir, base)
    env = {**os.environ, "PYTHONPATH": where, "PYTHONDONTWRITEBYTECODE": "1",
           "JDP_MUTANTS_SOURCE": jdp_dir}  # tests/test_mutants.py checks the snippets against the unmutated package
    env.pop("XLA_FLAGS", None)  # tests/conftest.py sets the device count
    # The repo's compilation cache: keyed by the HLO, so a mutant's changed steps never hit it.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".pytest_cache", "jax"))
    result = lambda status, detail="", tier=None, **more: {  # noqa: E731
        "status": status, "tier": tier, "detail": detail, "seconds": time.perf_counter() - t0, **more}
    try:
        # `import jdp` must find the copy, not the editable install of the repo's jdp/.
        origin = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('jdp').origin)"],
                                capture_output=True, text=True, cwd=where, env=env, timeout=60).stdout.strip()
        if not origin.startswith(where + os.sep):
            return result("error", f"`import jdp` found {origin!r}, not the mutated copy")
        for tier, args in stages(mutant, mode):
            try:
                r = _pytest(args, where, env, timeout)
            except subprocess.TimeoutExpired:
                return result("error", f"timed out after {timeout:.0f} s")
            out = r.stdout + r.stderr
            failed = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, re.MULTILINE)
            if mutant.name == "sanity_import_fails":  # it must fail at import, from the copy
                if f"{SANITY} {os.path.join(where, 'jdp')}" in out:
                    return result("caught", "import jdp (the mutated copy)", tier)
                return result("error", "the sanity mutant did not fail at import of the copy", output=out[-3000:])
            if r.returncode == 1 and failed and mutant.old:
                return result("caught", failed.group(1), tier)
            if r.returncode < 0 and mutant.old:  # the mutant crashed the test process: what the guard prevents
                return result("caught", f"the tests crashed (signal {-r.returncode})", tier)
            if r.returncode == 5 and tier == "quick":  # the selection's files hold no quick test
                continue
            if r.returncode != 0:
                return result("error", f"pytest {' '.join(args)}: exit status {r.returncode}", output=out[-3000:])
        if not mutant.old:
            return result("passed", "every selection passes unmutated")
        return result("survived")
    finally:
        shutil.rmtree(where, ignore_errors=True)


def source_label(jdp_dir: str) -> str:
    """The package's git commit, if it is in a git checkout (no local paths in the results)."""
    r = subprocess.run(["git", "-C", jdp_dir, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", jdp_dir, "status", "--porcelain", "--", "."], capture_output=True, text=True)
    if r.returncode:
        return "jdp/ (not in a git checkout)"
    return f"jdp/ at commit {r.stdout.strip()}" + (" with uncommitted changes" if dirty.stdout.strip() else "")


TIERS = {"quick": "quick", "full": "full suite"}


def table(rows: list[tuple[Mutant, dict]], mode: str) -> str:
    lines = ["| mutant | file | tier | caught by | time |", "|---|---|---|---|---|"]
    for m, res in rows:
        verdict = res["detail"] if res["status"] in ("caught", "passed") else f"**{res['status'].upper()}** {res['detail']}".strip()
        tier = TIERS.get(res.get("tier"), "—")
        if res.get("tier") == "full" and mode == "whole-quick":
            tier = "full suite only"
        lines.append(f"| {m.name} | {f'jdp/{m.file}' if m.old else '—'} | {tier} | {verdict} | {res['seconds']:.0f} s |")
    return "\n".join(lines)


def summary(rows: list[tuple[Mutant, dict]], mode: str) -> str:
    """How many mutants each tier caught, in words."""
    caught = [res for m, res in rows if m.old and res["status"] == "caught"]
    quick = sum(res["tier"] == "quick" for res in caught)
    if mode == "selection":
        return f"{len(caught)} caught by their selections (the quick tier not asked)"
    where = "the whole quick tier" if mode == "whole-quick" else "the quick tier's tests in their selections' files"
    return (f"{len(caught)} caught: {quick} by the quick tier, {len(caught) - quick} only by their selections "
            f"(the full suite; {where} passed)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jdp", default=os.path.join(ROOT, "jdp"), metavar="DIR", help="the package to mutate")
    p.add_argument("--only", metavar="NAMES", help="run these mutants only (comma-separated)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--baseline", action="store_true", help="first run every selection unmutated (it must pass)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mutant's pytest run")
    tier = p.add_mutually_exclusive_group()
    tier.add_argument("--selection", action="store_const", dest="mode", const="selection",
                      help="run each mutant's own selection only (the fast path; no tier is reported)")
    tier.add_argument("--whole-quick", action="store_const", dest="mode", const="whole-quick",
                      help="where the quick tests of a mutant's files miss it, run the whole quick tier before "
                           "its selection (minutes per such mutant): proves what only the full suite catches")
    a = p.parse_args(argv)
    mode = a.mode or "quick"
    jdp_dir = os.path.abspath(a.jdp)
    if a.list:
        for m in MUTANTS:
            print(f"{m.name:32s} jdp/{m.file:14s} {' '.join(m.tests)}")
        return 0
    names = None if a.only is None else a.only.split(",")
    chosen = [m for m in MUTANTS if names is None or m.name in names]
    unknown = sorted(set(names or ()) - {m.name for m in MUTANTS})
    if not chosen or unknown:
        print(f"no mutant named {', '.join(map(repr, unknown or [a.only]))}; see --list", file=sys.stderr)
        return 2
    stale = [(m, n) for m in chosen if (n := occurrences(m, jdp_dir)) != 1]
    for m, n in stale:
        print(f"STALE mutant {m.name}: its snippet occurs {n} times in jdp/{m.file}: {m.old!r}", file=sys.stderr)
    if stale:
        return 1
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jdp-mutants-") as base:
        for m in ([baseline()] if a.baseline else []) + chosen:
            res = run_mutant(m, jdp_dir, base, a.timeout, mode)
            rows.append((m, res))
            print(f"{m.name}: {res['status']} {TIERS.get(res['tier'], '')} {res['detail']} ({res['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)
            if res["status"] == "error" and res.get("output"):
                print(res["output"], file=sys.stderr)
    total = time.perf_counter() - t0
    bad = [m.name for m, res in rows if res["status"] not in ("caught", "passed")]
    mutants = sum(bool(m.old) for m, _ in rows)
    flags = "".join(f" {f}" for f, on in (("--baseline", a.baseline), ("--selection", mode == "selection"),
                                            ("--whole-quick", mode == "whole-quick")) if on)
    report = (f"# Mutation check\n\n`python -m tests.mutants{flags}`: {mutants} mutants of "
              f"{source_label(jdp_dir)}, {summary(rows, mode)}, in {total:.0f} s on {os.cpu_count()} CPU cores."
              f"\n\n{table(rows, mode)}\n")
    print(report)
    if a.only is None:
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w", encoding="utf-8") as f:
            f.write(report)
    if bad:
        print(f"not caught: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
