"""Eight fake CPU devices for every test: set before jax initialises its backends.

JDP_TEST_PLATFORM=cuda (or any JAX_PLATFORMS value) runs the tests on that platform's real
devices instead, as many as it has and no fake ones: for tests that need one device only, e.g. on
one GPU (benchmarks/gpu_check.sh). JDP_TEST_PLATFORM=cpu rehearses that on one CPU device.
"""
import json
import os
import subprocess
import sys
from importlib.metadata import version

PLATFORM = os.environ.get("JDP_TEST_PLATFORM", "")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Compiling is most of the suite's time, and the programs it compiles are tiny: XLA's CPU compiler
# with LLVM at -O0 and its classic fusion emitters compiles them ~3x faster (measured: 5.3 s -> 1.6 s
# of backend compile for 12 steps). The HLO passes still run (collectives and sharding are the ones
# users get; the classic emitters fuse differently); every equivalence compares two programs
# compiled alike. JDP_TEST_FAST_COMPILE=0 keeps XLA's defaults, as users' programs are compiled.
# Subprocesses inherit the flags (benchmarks.common.child_env drops only the fake device count).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flags: str) -> bool:
    """Whether this jaxlib's XLA knows `flags` (it aborts the process on an unknown flag), asked once
    per jaxlib version in a subprocess and remembered in .pytest_cache."""
    record = os.path.join(ROOT, ".pytest_cache", "jdp-xla-flags.json")
    key = f"jaxlib {version('jaxlib')}: {flags}"
    try:
        with open(record) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    if key not in known:
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        try:
            known[key] = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                                        capture_output=True, timeout=120).returncode == 0
        except subprocess.TimeoutExpired:
            known[key] = False
        os.makedirs(os.path.dirname(record), exist_ok=True)
        with open(record, "w") as f:
            json.dump(known, f)
    return known[key]


if PLATFORM:
    os.environ["JAX_PLATFORMS"] = PLATFORM
else:
    # xdist's workers inherit the flags this sets in the main process: add each one once
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count=" not in f]
    if os.environ.get("JDP_TEST_FAST_COMPILE", "1") != "0" and _xla_accepts(FAST_COMPILE):
        fast = FAST_COMPILE.split()
        flags = fast + [f for f in flags if f not in fast]
    os.environ["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# jax's persistent compilation cache: a second run of the suite loads compiled steps instead of
# compiling them again (measured: 25.6 s -> 4.7 s for three step-heavy test files). Subprocesses
# (CLI, multi-process, README and docs blocks) inherit it through these variables. Set the directory to
# another path to move it; the cache is keyed by the HLO, jax version and flags, never stale.
_CACHE = os.path.join(ROOT, ".pytest_cache", "jax")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Workers share it without a lock: jax writes an entry (~15 kB on average) in one call, so a reader
# that finds one half written (it would warn: an error here) is rare, as it already was between a
# multi-process test's processes. jax's locked mode (set by a size limit) was tried: it failed on a
# cache written without it, and it reads every entry's access time on each write.

import jdp  # noqa: E402  (applies jdp's CPU collective settings before the backend starts)
import jax  # noqa: E402

assert PLATFORM or jax.device_count() == 8, "tests need 8 fake CPU devices; XLA_FLAGS was overridden"

import pytest  # noqa: E402

# The quick tier (`pytest -m quick`, 31 s cold and 24 s warm on a 2-core machine with 351 tests; the 37
# added since cost ~6% more CPU time, measured back to back): every public path
# once, one representative per path rather than whole parametrized files. Both backends, mean and sum
# with each correction, both accumulation modes, model state and masks, the step's guards, the seed
# numbers, mixed precision, ZeRO-1 and FSDP, models, jdp.nnx and Linen, configs, data and its order, the
# trainer with one resume, `jdp train` as one multi-process run, the CLI's one-sentence exits, `jdp
# plot` in process, the docs' files, schema and quoted console lines. The slower end-to-end runs (the
# CLI's train-plot-resume, every trap, every case) are in the full suite. Every new check or path adds a
# cheap test here that a one-line bug in it fails (its mutant in tests/mutants.py is caught by the
# quick tier). An entry is a file, a test, or one parametrized case of a test (`name[id]`).
QUICK = (
    "test_seeds.py", "test_config.py", "test_data.py", "test_data_order.py", "test_drop_last_divisible.py",
    "test_faults_input.py", "test_mutants.py", "test_replicas.py", "test_flops.py", "test_device_defaults.py",
    "test_cli_edges.py", "test_papercuts.py::test_an_installed_wheel_names_the_distribution_on_the_index",
    "test_traps.py::test_shard_map_check_vma_grad_is_local_then_averaged",
    "test_traps.py::test_pmap_with_empty_optimizer_state[4]",
    "test_step_rules.py::test_non_scalar_aux_is_refused_with_its_path_and_shape",
    "test_step_rules.py::test_options_are_one_validated_value",
    "test_step_rules.py::test_every_and_last_report_the_whole_step[pmap]",
    "test_scale_visible.py::test_the_clip_threshold_engages_on_some_steps_only",
    "test_scale_visible.py::test_scale_visible_equivalence[momentum-d2-m2-every-shard_map]",
    "test_scale_visible.py::test_scale_visible_equivalence[adamw_eps_clip-d4-m2-last-pmap]",
    "test_sum_metrics.py::test_sum_reports_means_for_every_correction[none-shard_map]",
    "test_sum_metrics.py::test_sum_reports_means_for_every_correction[auto-pmap]",
    "test_sum_metrics.py::test_sum_reports_means_for_every_correction[exact-shard_map]",
    "test_state_and_mask.py::test_padded_batch_equals_its_real_examples[2-last-shard_map]",
    "test_weighted.py::test_weighted_loss_equals_one_device_per_token[every]",
    "test_weighted.py::test_weighted_loss_equals_one_device_per_token[fsdp-last]",
    "test_weighted.py::test_a_call_or_device_of_padding_only_equals_one_device[first-every]",
    "test_weighted.py::test_a_call_or_device_of_padding_only_equals_one_device[one_device-shard_map]",
    "test_weighted.py::test_a_step_of_padding_only_gives_nan_or_is_skipped",
    "test_weighted.py::test_evaluate_takes_per_token_weights_and_two_argument_metric_fns",
    "test_weighted.py::test_mask_key_beside_a_plain_loss_is_refused_unless_named",
    "test_weighted.py::test_weighted_loss_errors_name_the_fix",
    "test_state_and_mask.py::test_model_state_is_carried_and_averaged[2-every-pmap]",
    "test_state_and_mask.py::test_model_state_contract_is_checked",
    "test_state_and_mask.py::test_new_model_state_of_another_structure_is_refused_at_the_first_call[nest]",
    "test_faults_api.py::test_reusing_a_donated_state_raises_instead_of_crashing",
    "test_faults_api.py::test_empty_batch_is_refused", "test_faults_api.py::test_all_padding_batch_is_refused",
    "test_faults_api.py::test_devices_as_ids_are_accepted_and_bad_ones_refused",
    "test_faults_api.py::test_finite_gradient_that_makes_params_nan_is_skipped[accum2]",
    "test_faults_api.py::test_an_integer_leaf_in_params_is_named_with_where_it_belongs",
    "test_faults_api.py::test_an_optimizer_that_needs_the_loss_as_value_is_refused_in_one_sentence",
    "test_faults_api.py::test_restoring_another_optimizers_checkpoint_names_the_structure_and_keeps_it",
    "test_faults_data.py::test_a_token_file_that_changes_size_is_refused_at_the_next_batch",
    "test_faults_data.py::test_a_dtype_too_narrow_for_the_vocabulary_is_refused_naming_the_likely_one",
    "test_faults_data.py::test_an_unreadable_token_file_is_one_sentence_exit_2_before_anything_is_written",
    "test_faults_data.py::test_a_bad_token_id_found_late_through_the_api_checkpoints_first",
    "test_faults_data.py::test_another_models_checkpoint_is_named_as_another_model_in_every_layout[fsdp]",
    "test_faults_data.py::test_orbax_ocdbt_resource_exhausted_without_an_os_error_is_out_of_space",
    "test_faults_data.py::test_the_supervisor_hides_a_cpp_abort_and_names_a_duplicated_process_id",
    "test_facts.py::test_the_data_joins_the_identity_and_the_agreed_sizes_and_digests",
    "test_train_reference.py",
    "test_nnx.py::test_bad_input_is_one_sentence",
    "test_nnx.py::test_step_works_with_jdps_tools_and_hands_back_to_nnx_optimizer",
    "test_precision.py::test_bf16_reduce_dtype_halves_the_allreduce_bytes[last]",
    "test_precision.py::test_bad_dtypes_are_refused_in_one_sentence",
    "test_nonfinite.py::test_nan_batch_is_skipped_and_counted[1-every-shard_map]",
    "test_model_dp.py::test_cnn_sync_batchnorm_equals_one_device_and_local_does_not[pmap]",
    "test_model_precision.py::test_bad_dtype_is_a_one_sentence_error_naming_it",
    "test_model_precision.py::test_cnn_bf16_train_call_keeps_batch_stats_float32",
    "test_model_precision.py::test_remat_is_in_the_jaxpr_and_fused_attention_builds_no_mask",
    "test_linen.py::test_one_sentence_errors", "test_exactness_definition.py",
    "test_linen.py::test_bridge_equals_the_linen_loop_and_hands_back[shard_map-adam-2-last-1]",
    "test_linen.py::test_batchnorm_mistakes_are_one_sentence",
    "test_papercuts.py::test_plot_has_axis_labels_the_run_name_and_marked_eval_points",
    "test_multiprocess.py::test_two_processes_equal_one",
    "test_workdir_files.py::test_a_symlinked_file_in_the_workdir_is_refused_and_its_target_untouched[.jdp-lock-the lock file]",
    "test_workdir_files.py::test_rotation_deletes_only_checkpoints_jdp_provably_wrote",
    "test_precision_train.py::test_bad_values_are_one_sentence_naming_the_key",
    "test_precision_train.py::test_resume_with_another_precision_is_refused_and_the_checkpoint_kept",
    "test_zero.py::test_accumulation_and_psum_variant[last-sum-exact]", "test_zero.py::test_refusals_name_the_problem",
    "test_zero.py::test_config_key_and_its_refusal",
    "test_docs.py::test_every_file_the_pages_name_exists",
    "test_docs.py::test_config_reference_names_every_field_with_its_rule",
    "test_docs.py::test_every_console_line_the_pages_quote_is_what_jdp_prints",
    "test_docs.py::test_every_command_the_pages_quote_is_one_jdp_takes",
    "test_config_schema.py::test_cli_prints_the_schema", "test_papercuts.py::test_version_flag_prints_the_package_version",
    "test_papercuts.py::test_explain_tables_fit_80_columns_when_piped",
    "test_fsdp.py::test_params_and_optimizer_state_are_one_nth_per_device", "test_fsdp.py::test_refusals_and_config_key",
    "test_fsdp.py::test_the_leaves_kept_whole_are_named_with_their_bytes",
    "test_faults_run.py::test_a_run_that_fails_before_its_first_step_leaves_no_workdir",
    "test_blockwise.py", "test_sharded_optax.py::test_optimizer_as_written_equals_one_device[clip_adamw_mask-zero1]",
    "test_sharded_optax.py::test_masked_partitioned_and_muon_equal_one_device[masked-zero1]",
    "test_sharded_optax.py::test_masked_partitioned_and_muon_equal_one_device[muon-fsdp]",
    "test_sharded_optax.py::test_masked_and_muon_under_jit_equal_one_device[masked-fsdp]",
    "test_annotations.py::test_init_can_be_traced_for_the_states_shapes",
    "test_fsdp_layers.py::test_the_loop_gathers_each_layer_and_reduce_scatters_its_gradient",
    "test_fsdp_layers.py::test_per_layer_gathering_equals_one_device[fp32]",
    "test_fsdp_layers.py::test_a_stacked_leaf_split_along_its_layers_is_gathered_before_the_scan",
    "test_fsdp_layers.py::test_refusals",
    "test_fsdp_layers.py::test_jdp_train_scans_the_gpt_per_layer_under_fsdp_unless_the_config_says",
    "test_fsdp_layers.py::test_jdp_memory_says_what_it_compiles_as_it_goes",
    "test_fsdp_layers.py::test_comm_report_counts_a_collective_once_per_iteration_of_the_loops_around_it",
    "test_fsdp_patterns.py::test_gathered_makes_a_modules_split_params_whole_and_changes_nothing_else",
    "test_models.py::test_gpt_scanned_is_the_same_model",
    "test_fsdp_patterns.py::test_scanned_model_gathers_per_layer_and_equals_one_device[linen]",
    "test_hybrid.py::test_hybrid_sharding_equals_one_device[sgd-fsdp-2-None]",
    "test_hybrid.py::test_hybrid_sharding_equals_one_device[adamw_clip-fsdp-2-None]",
    "test_hybrid.py::test_gradient_blocks_cross_the_groups_in_one_all_reduce",
    "test_hybrid.py::test_a_diverged_group_copy_is_found", "test_hybrid.py::test_refusals_name_the_problem",
    "test_hybrid.py::test_synchronised_batchnorm_reduces_over_both_axes",
    "test_data_sources.py::test_a_mid_epoch_state_resumes_exactly",
    "test_data_sources.py::test_a_random_transform_is_seeded_from_seed_epoch_and_index",
    "test_tokens_train.py::test_a_bad_token_config_exits_2[overrides0-data.name='tokens' needs data.vocab_size]",
    # Each catches one-line bugs of a kind the quick tier once missed (tests/mutants.py names them).
    "test_facts.py", "test_train.py::test_evaluation_leaves_the_padding_of_the_last_batch_out",
    "test_state_and_mask.py::test_model_state_is_carried_and_averaged[2-last-shard_map]",
    "test_nnx.py::test_stored_rngs_are_reseeded_per_device",
    "test_data_sources.py::test_token_windows_follow_the_documented_definition",
    "test_data_sources.py::test_bad_token_files_raise_one_sentence",
    "test_workdir_files.py::test_a_checkpoint_is_proven_jdps_only_without_following_a_link",
    "test_faults_checkpoint.py::test_fallback_resumes_from_the_newest_intact_checkpoint",
    "test_faults_api.py::test_a_nonfinite_model_state_is_never_saved",
    # `jdp train CONFIG --steps N` shorter than the config's warmup: scaled, said in one line, resumable.
    "test_feedback.py::test_steps_shorter_than_the_warmup_run_with_its_fraction_and_resume_as_they_ran",
    # assert_data_parallel_exact on the kinds of loss the docs show, and errors that name their fix.
    "test_exactness_models.py::test_the_helper_passes_on_every_documented_model[nnx-weighted]",
    "test_exactness_models.py::test_a_mean_of_means_fails_with_the_report[params-weighted]",
    "test_exactness_models.py::test_a_mean_of_means_fails_with_the_report[params-mask_key-accum2]",
    "test_exactness_models.py::test_a_leaf_whose_gradient_is_zero_is_named_with_its_fix",
    "test_exactness_models.py::test_a_model_whose_dropout_is_on_is_named",
    "test_tokens_train.py::test_a_missing_token_file_says_how_to_make_it",
    "test_shipped.py::test_a_directory_is_never_a_config_and_a_shipped_name_wins_over_one",
    "test_jit_backend.py::test_what_jit_cannot_mean_is_refused_in_one_sentence",
    "test_jit_backend.py::test_a_loss_that_names_an_axis_is_refused_under_jit",
    "test_jit_backend.py::test_comm_and_memory_reports_read_the_jit_program",
    "test_jit_backend.py::test_dropout_keys_under_jit_are_one_devices",
    "test_jit_backend.py::test_a_weighted_losss_metrics_are_the_global_batchs",
    "test_jit_backend.py::test_jdp_nnx_with_a_batchnorm_model_is_exact_under_jit",
    "test_annotations.py::test_bad_axis_rules_are_one_sentence",
    "test_annotations.py::test_annotations_are_set_aside_under_shard_map_and_pmap_and_said_once[shard_map]",
    "test_jit_backend.py::test_the_gpt_residual_stream_is_pinned_batch_sharded_under_jit",
    "test_explain.py::test_explain_under_jit_runs_the_seed_and_says_the_per_device_parts_are_skipped",
    # Sampling (the cached decode against the whole forward pass, top-k/top-p/temperature) and the eval units.
    "test_generate.py", "test_sample.py::test_evaluation_reports_the_per_token_loss_perplexity_and_bits_per_byte",
    "test_sample.py::test_bad_sample_arguments_exit_2_in_one_sentence",
    "test_sample.py::test_an_empty_checkpoint_folder_is_refused_in_one_sentence",
    "test_sample.py::test_language_model_units_are_exp_and_log2_of_the_per_token_loss",
    "test_sample.py::test_plot_labels_the_loss_per_token_for_a_language_model_and_per_example_otherwise",
    "test_sample.py::test_bytes_per_token_of_the_char_corpus_and_of_token_folders",
    # prepare-tokens: tokenizers, meta.json, refusals, its encoders on 1 and 2 processes, each input read once
    # (no compile; tiny tokenizers).
    "test_prepare_tokens.py", "test_prepare_encoders.py",
    # jdp sample beside a running jdp train: a checkpoint rotated away mid-read; a damaged one in one line.
    "test_sample.py::test_a_checkpoint_removed_while_it_is_read_is_not_damaged_the_newest_one_there_now_is_read",
    "test_sample.py::test_a_truncated_checkpoint_is_said_in_one_line_whatever_is_cut[manifest_half]",
    "test_sample.py::test_a_truncated_checkpoint_is_said_in_one_line_whatever_is_cut[step_metadata_half]",
    # prepare-tokens: tokenizers, meta.json, refusals (no compile; tiny tokenizers).
    "test_prepare_tokens.py",
    # The first-call audit: an own-count loss refused; a mean with synchronised statistics and dropout
    # passes; a weighted loss is not audited.
    "test_audit.py::test_a_loss_divided_by_each_devices_own_count_is_refused_in_one_sentence[shard_map]",
    "test_audit.py::test_batch_statistics_and_dropout_pass_as_a_mean_and_are_refused_as_an_own_count",
    "test_audit.py::test_weighted_losses_are_not_audited_and_a_mask_key_loss_is_audited_as_a_mean",
    "test_audit.py::test_a_loss_divided_by_each_devices_own_count_is_refused_in_one_sentence[pmap]",
    # The audit's parts: micro-batches, sums and fixed divisors, mask_key, bfloat16 returns, dropout, aux.
    "test_audit_cases.py::test_an_own_count_loss_split_into_micro_batches_is_refused_before_step_one[jit_accum]",
    "test_audit_cases.py::test_a_sum_or_a_fixed_divisor_is_refused_on_devices_and_micro_batches[shard_map-sum]",
    "test_audit_cases.py::test_a_mask_key_loss_divided_by_sum_of_the_mask_is_refused_and_names_what_mask_key_expects",
    "test_audit_cases.py::test_a_mean_returned_in_bfloat16_trains_and_equals_one_device",
    "test_audit_cases.py::test_a_count_in_aux_is_named_once_and_trains",
    "test_audit_cases.py::test_dropout_from_the_key_passes[jit_accum]",
    # nanodo as written (Linen, boxed params, jit): its own-count loss accumulated is refused before step 1.
    "test_nanodo.py::test_the_first_step_audit_refuses_the_loss_as_written_accumulated_before_step_one",
    "test_audit_cases.py::test_an_own_count_loss_split_into_micro_batches_is_refused_before_step_one[one_device_accum]",
    "test_audit_cases.py::test_a_loss_exact_per_device_but_normalised_per_micro_batch_is_located_there",
    "test_audit_cases.py::test_synchronised_statistics_with_accumulation_audit_the_devices_only",
    # backend="jit" on the caller's mesh (mesh=): a model written for an Explicit mesh of its own axis
    # names, its annotations kept; an Auto mesh with FSDP; the meshes jdp refuses.
    "test_annotations.py::test_a_model_for_an_explicit_mesh_of_its_own_axis_names_runs_on_it_under_jit[jit-fsdp]",
    "test_annotations.py::test_on_a_callers_auto_mesh_shard_params_splits_the_unannotated_leaves_too",
    "test_annotations.py::test_a_mesh_jdp_cannot_run_on_is_refused_in_one_sentence",
    "test_annotations.py::test_a_mesh_with_two_wide_axes_needs_the_batch_axis_named",
    "test_annotations.py::test_a_model_that_names_its_own_meshs_axes_on_jdps_mesh_is_told_to_pass_mesh",
    # Test gaps: each catches a one-line bug that only slower tests (or none) saw.
    "test_state_and_mask.py::test_a_plain_aux_under_mask_key_is_its_mean_over_the_real_rows",
    "test_zero.py::test_a_stacked_leaf_is_split_after_its_layer_axis_even_where_that_axis_is_the_largest",
    "test_data_sources.py::test_the_id_equal_to_vocab_size_is_refused_when_the_file_opens_and_when_its_batch_is_read",
    "test_data_sources.py::test_a_short_read_is_a_changed_token_file_not_a_batch_of_fewer_tokens",
    "test_observe.py::test_samples_per_s_counts_each_interval_from_the_end_of_the_one_before",
    "test_observe.py::test_the_profile_traces_first_to_last_inclusive",
    "test_observe.py::test_the_wandb_run_is_offline_and_named_by_the_config_hash",
    "test_fsdp_layers.py::test_a_layer_gathered_in_bf16_reduce_scatters_its_gradient_in_float32",
    "test_hybrid.py::test_per_layer_gathering_in_replica_groups_sums_the_blocks_across_the_groups",
    "test_papercuts.py::test_the_install_hint_names_the_wheel_where_no_pyproject_lies_beside_the_package",
    "test_shipped.py::test_a_config_is_found_by_name_and_a_file_of_that_path_wins",
    # The GPT's nanoGPT options and weight mapping, torch-free (the parity with nanoGPT needs torch: full tier).
    "test_gpt_options.py",
    # The fused, chunked cross-entropy: equal to the plain one, less memory, 8 devices = 1, the trainer's option.
    "test_xent.py::test_fused_equals_plain_in_loss_argmax_and_gradients",
    "test_xent.py::test_bad_arguments_are_one_sentence",
    "test_xent.py::test_the_compiled_temporary_memory_is_a_fraction_of_the_plain_loss",
    "test_xent.py::test_eight_devices_take_the_one_device_step_on_the_global_batch",
    "test_xent.py::test_model_loss_chunk_takes_the_fused_loss_in_training_and_evaluation",
    "test_xent.py::test_loss_chunk_on_another_model_is_refused",
    # Hugging Face GPT-2 in and out, against transformers (the CLI's end to end run: full tier)
    "test_hf.py::test_a_transformers_gpt2_loads_with_its_logits[options]",
    "test_hf.py::test_save_hf_writes_what_transformers_loads_with_the_same_logits_and_greedy_text",
    "test_hf.py::test_what_is_not_a_gpt2_checkpoint_is_refused_in_one_sentence",
    "test_hf.py::test_save_hf_overwrites_nothing",
    "test_hf.py::test_jdp_export_refuses_a_full_output_and_a_workdir_without_a_checkpoint",
    "test_hf.py::test_model_init_from_takes_the_sizes_and_refuses_a_contradicting_one",
    # The Llama family in and out: four transformers configurations, sharded and bfloat16, refusals (~12 s).
    "test_llama.py",
    "test_llama_decode.py::test_greedy_tokens_equal_transformers_generate_and_the_whole_forward_pass[llama_untied_llama3]",
    "test_llama_decode.py::test_greedy_tokens_equal_transformers_generate_and_the_whole_forward_pass[mistral]",
    "test_llama_decode.py::test_the_cache_holds_the_kv_heads_only_and_the_scanned_model_decodes_the_same",
)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4; each worker holds 8 fake devices, compiles and
    starts subprocesses of its own, and more than 4 buy little on the suite (compiling dominates)."""
    return max(1, min(os.cpu_count() or 1, 4))


def _cases(function):
    """How many parametrized cases a test function defines (the product over its parametrize marks)."""
    count = 1
    for mark in getattr(function, "pytestmark", []):
        if mark.name == "parametrize":
            count *= len(mark.args[1])
    return count


def pytest_collection_modifyitems(config, items):
    """Mark the quick tier; an entry of QUICK naming a test its file does not define is an error
    (checked against the file's module, so that running a single test id never trips it; a
    parametrized case is checked when every case of its test was collected)."""
    modules = {item.path.name: item.module for item in items if getattr(item, "module", None) is not None}
    collected = {}
    for item in items:
        node = f"{item.path.name}::{item.originalname}"
        collected.setdefault(node, set()).add(f"{item.path.name}::{item.name}")
        if any(entry in (item.path.name, node, f"{item.path.name}::{item.name}") for entry in QUICK):
            item.add_marker(pytest.mark.quick)
    stale = []
    for entry in (e for e in QUICK if "::" in e and e.split("::")[0] in modules):
        file, name = entry.split("::")
        function = getattr(modules[file], name.split("[")[0], None)
        node = f"{file}::{name.split('[')[0]}"
        if function is None or ("[" in name and len(collected.get(node, ())) == _cases(function)
                                and entry not in collected[node]):
            stale.append(entry)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py QUICK names tests that do not exist: {stale}")
