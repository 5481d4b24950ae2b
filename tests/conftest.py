"""Eight fake CPU devices for every test: set before jax initialises its backends.

JDP_TEST_PLATFORM=cuda (or any JAX_PLATFORMS value) runs the tests on that platform's real
devices instead, as many as it has and no fake ones: for tests that need one device only, e.g. on
one GPU (benchmarks/gpu_check.sh). JDP_TEST_PLATFORM=cpu rehearses that on one CPU device.
"""
import os

PLATFORM = os.environ.get("JDP_TEST_PLATFORM", "")
if PLATFORM:
    os.environ["JAX_PLATFORMS"] = PLATFORM
else:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# jax's persistent compilation cache: a second run of the suite loads compiled steps instead of
# compiling them again (measured: 25.6 s -> 4.7 s for three step-heavy test files). Subprocesses
# (CLI, multi-process, README and docs blocks) inherit it through these variables. Set the directory to
# another path to move it; the cache is keyed by the HLO, jax version and flags, never stale.
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jdp  # noqa: E402  (applies jdp's CPU collective settings before the backend starts)
import jax  # noqa: E402

assert PLATFORM or jax.device_count() == 8, "tests need 8 fake CPU devices; XLA_FLAGS was overridden"

import pytest  # noqa: E402

# The quick tier (`pytest -m quick`, ~2 min): every public path once. Both backends, mean and sum
# with each correction, both accumulation modes, model state and masks, the step's guards, the
# seed numbers, jdp.nnx and Linen, configs, data order, the CLI with one resume, one
# multi-process run. Whole files where they are cheap; one test where a file is slow.
QUICK = (
    "test_seeds.py", "test_traps.py", "test_step_rules.py", "test_scale_visible.py", "test_sum_metrics.py",
    "test_state_and_mask.py", "test_faults_api.py", "test_replicas.py", "test_train_reference.py",
    "test_config.py", "test_data.py", "test_data_order.py", "test_drop_last_divisible.py", "test_faults_input.py",
    "test_nnx.py", "test_mutants.py",
    "test_precision.py::test_bf16_reduce_dtype_halves_the_allreduce_bytes",
    "test_precision.py::test_bad_dtypes_are_refused_in_one_sentence",
    "test_nonfinite.py::test_nan_batch_is_skipped_and_counted",
    "test_model_dp.py::test_cnn_sync_batchnorm_equals_one_device_and_local_does_not",
    "test_model_precision.py::test_bad_dtype_is_a_one_sentence_error_naming_it",
    "test_model_precision.py::test_cnn_bf16_train_call_keeps_batch_stats_float32",
    "test_model_precision.py::test_remat_is_in_the_jaxpr_and_fused_attention_builds_no_mask",
    "test_linen.py::test_one_sentence_errors", "test_linen.py::test_bridge_equals_the_linen_loop_and_hands_back",
    "test_linen.py::test_batchnorm_mistakes_are_one_sentence",
    "test_cli.py::test_train_logs_checkpoints_plots_and_resumes",
    "test_multiprocess.py::test_two_processes_equal_one",
    "test_workdir_files.py::test_a_symlinked_file_in_the_workdir_is_refused_and_its_target_untouched",
    "test_workdir_files.py::test_rotation_deletes_only_checkpoints_jdp_provably_wrote",
    "test_precision_train.py::test_bad_values_are_one_sentence_naming_the_key",
    "test_precision_train.py::test_resume_with_another_precision_is_refused_and_the_checkpoint_kept",
    "test_zero.py::test_accumulation_and_psum_variant", "test_zero.py::test_refusals_name_the_problem",
    "test_zero.py::test_config_key_and_its_refusal",
    "test_docs.py::test_every_file_the_pages_name_exists",
    "test_docs.py::test_config_reference_names_every_field_with_its_rule",
    "test_config_schema.py::test_cli_prints_the_schema", "test_papercuts.py::test_version_flag_prints_the_package_version",
    "test_papercuts.py::test_explain_tables_fit_80_columns_when_piped",
    "test_fsdp.py::test_params_and_optimizer_state_are_one_nth_per_device", "test_fsdp.py::test_refusals_and_config_key",
    "test_data_sources.py::test_a_mid_epoch_state_resumes_exactly",
    "test_data_sources.py::test_a_random_transform_is_seeded_from_seed_epoch_and_index",
    "test_tokens_train.py::test_a_bad_token_config_exits_2",
)


def pytest_collection_modifyitems(config, items):
    """Mark the quick tier; an entry of QUICK naming a test its file does not define is an error
    (checked against the file's module, so that running a single test id never trips it)."""
    modules = {item.path.name: item.module for item in items if getattr(item, "module", None) is not None}
    for item in items:
        node = f"{item.path.name}::{item.originalname}"
        if any(entry in (item.path.name, node) for entry in QUICK):
            item.add_marker(pytest.mark.quick)
    stale = [e for e in QUICK if "::" in e and e.split("::")[0] in modules
             and not hasattr(modules[e.split("::")[0]], e.split("::")[1])]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py QUICK names tests that do not exist: {stale}")
