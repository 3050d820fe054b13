"""Test setup: 8 fake CPU devices, configured before any JAX computation, and a persistent
compilation cache shared by the test workers (and the scripts the tests start), so a train
step that several tests compile alike is compiled once. The cache changes no result: a hit
loads the executable that compiling the same program gives."""
import importlib.metadata
import os
import tempfile

os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                      os.path.join(tempfile.gettempdir(), 'loopmoe_jax_test_xla_cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.2')
# a size bound turns on eviction, and with it the file lock that keeps a worker from reading
# an entry another one is still writing
os.environ.setdefault('JAX_COMPILATION_CACHE_MAX_SIZE', str(1 << 30))

# Tests compile many small programs and run each briefly: XLA:CPU's LLVM optimisation and its
# MLIR fusion emitters are most of their compile time and little of their run time, so the
# suite (and the scripts it starts, which inherit the environment) compiles without them
# (fusions then go through XLA:CPU's older elemental emitter: 40% less compile time for the
# trainer's step, measured). Results are the same programs' up to float rounding. GPU runs
# (scripts/gpu_check.sh) skip this file. XLA aborts on a flag it does not know, so the
# emitter flag is given only to the jaxlib release checked here to have it (0.10); with
# another, the suite compiles with the emitters (slower, not wrong).
_JAXLIB = tuple(int(p) for p in importlib.metadata.version('jaxlib').split('.')[:2])
os.environ['XLA_FLAGS'] = ' '.join(filter(None, [
    os.environ.get('XLA_FLAGS', ''), '--xla_backend_optimization_level=0',
    '--xla_llvm_disable_expensive_passes=true',
    '--xla_cpu_use_fusion_emitters=false' if _JAXLIB == (0, 10) else '']))

import jax  # pylint: disable=wrong-import-position

jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_platforms', 'cpu')


# Tests of 7 s or more each on 2 cores (sums of `pytest --durations=0`'s setup + call; the
# longest of a cold-cache run of the rest added: numerical fits, gate training, exports;
# end-to-end
# training runs, two-process runs, sharded-vs-one-device comparisons, interpreted kernels,
# full-size compiles): marked `slow`, so `pytest -m "not slow"` is a quick check. The README's
# test command (and CI) runs them all.
SLOW = {
    'test_adaptive_depth': ('test_resumed_run_draws_the_same_counts_and_losses', 'test_truncated_backprop_equals_the_stop_gradient_reference', 'test_sampled_counts_on_a_mesh_equal_one_device', 'test_a_draw_below_k_backpropagates_through_all_its_passes'),
    'test_attention_impls': ('test_chunked_equals_xla_outputs_and_gradients',),
    'test_benchmark': ('test_model_benchmark_quick', 'test_kernels_moe_layer_checks_pallas_and_times_every_stage'),
    'test_config': ('test_accounting_equals_init_for_every_config_variant', 'test_accounting_equals_init_for_extra_combos', 'test_flops_and_active_params_brute_force', 'test_kv_per_token_equals_real_cache'),
    'test_decode_kernel': ('test_decode_with_the_kernels_is_the_xla_decode', 'test_batched_greedy_generation_with_the_kernels_is_the_xla_ones', 'test_on_a_mesh_the_kernels_run_per_shard_and_equal_the_xla_decode', 'test_loop_draft_with_the_kernels_is_plain_greedy', 'test_early_exit_and_shared_layouts_with_the_kernels_are_the_xla_decode'),
    'test_diagnostics': ('test_diagnose_end_to_end_on_a_trained_workdir',),
    'test_early_exit': ('test_frozen_token_keeps_its_exit_pass_state', 'test_gate_inference_exits_where_the_cumulative_probability_passes_the_threshold', 'test_gate_training_gradient_reaches_the_gate_and_the_model', 'test_gate_training_loss_matches_slow_reference', 'test_gate_training_run_trains_the_gate', 'test_threshold_that_never_fires_is_the_no_exit_model'),
    'test_export': ('test_export_of_a_trained_workdir_verifies_in_both_formats',),
    'test_gcs': ('test_a_run_on_gs_is_killed_resumed_evaluated_and_exported',
                 'test_a_sweep_on_gs_collects_resumes_and_skips_as_a_local_one'),
    'test_kernels': ('test_gmm_forward_and_vjp_match_numpy_and_ragged_dot', 'test_gmm_groups_stay_isolated_from_non_finite_rows', 'test_mgpu_ws_splits_tiles_between_warpgroups_or_falls_back', 'test_model_trained_with_pallas_matches_reference'),
    'test_kv_sharing': ('test_one_pass_shares_nothing', 'test_reference_decoder_per_pass_is_the_full_forward'),
    'test_launch': ('test_a_restart_loads_its_train_program_from_the_run_compile_cache',),
    'test_lm_eval': ('test_a_workdir_with_a_router_bias_scores_the_same_on_a_mesh', 'test_batched_one_at_a_time_and_passes', 'test_generate_until_equals_generate_cut_at_until', 'test_loglikelihood_equals_the_direct_sum_and_greedy_flag'),
    'test_model': ('test_decode_matches_full_forward', 'test_forward_matches_reference', 'test_scan_equals_unroll', 'test_causality_by_gradients', 'test_decode_with_more_loops_on_tied_model', 'test_generate_greedy_matches_full_forward_loop', 'test_decode_past_the_cache_length_is_an_error', 'test_scale_by_trained_or_executed_passes', 'test_init_is_the_same_under_every_dispatch_and_attention'),
    'test_moe': ('test_load_balance_loss_collapse_costs_more_than_uniform', 'test_load_balance_loss_matches_numpy'),
    'test_multiprocess': ('test_two_processes_match_one', 'test_evaluate_and_export_join_a_two_process_run'),
    'test_options': ('test_remat_gives_the_same_loss_and_gradients', 'test_bfloat16_compute_keeps_float32_params_and_tracks_float32',
                     'test_token_chunks_add_no_forward_where_the_policy_keeps_the_expert_output'),
    'test_permute_kernels': ('test_permute_combine_and_vjps_match_numpy', 'test_combine_of_permute_is_weight_sum'),
    'test_preemption': ('test_a_signal_to_one_or_both_apart_saves_the_same_step_on_both',),
    'test_probes': ('test_probing_off_leaves_logits_bit_identical', 'test_ce_gain_by_domain_against_direct_nll'),
    'test_reliability': ('test_damaged_part_of_the_newest_step_is_set_aside', 'test_failed_background_save_names_its_step', 'test_full_disk_while_logging_is_one_line_and_leaves_no_torn_line', 'test_injected_full_disk_stops_with_one_line', 'test_silently_corrupted_state_is_detected_by_checksum', 'test_too_little_free_space_is_refused_before_writing', 'test_truncated_state_file_is_one_line_not_thousands', 'test_second_trainer_on_a_workdir_is_refused_and_a_dead_holder_is_stale', 'test_checkpoint_without_checksums_restores_and_says_so_once', 'test_divergence_before_any_checkpoint_says_so', 'test_pass_counts_past_the_limit_are_refused_before_computing'),
    'test_reproduce': ('test_loop_laws_report_ranks_the_generating_form', 'test_foil_base_tied_differs_from_base_only_in_attention_tying', 'test_loop_laws_report_names_no_winner_when_forms_tie'),
    'test_router': ('test_resume_gives_the_same_biases_and_losses_and_another_layout_is_refused', 'test_train_step_updates_from_its_own_loads_outside_the_optimizer', 'test_uniform_bias_changes_nothing_and_the_bias_gets_no_gradient', 'test_every_dispatch_and_expert_parallel_agree_with_the_bias', 'test_config_errors_name_the_key_and_the_fix', 'test_a_winning_bias_makes_every_token_pick_its_expert'),
    'test_scaling_laws': ('test_loop_form_recovers_truth_and_ranks_first',),
    'test_scaling_rank': ('test_nested_forms_that_fit_equally_are_not_distinguishable', 'test_paired_intervals_resample_the_same_points_for_every_form', 'test_the_true_form_is_picked_when_the_grid_separates_the_forms'),
    'test_scaling_sweep': ('test_sweep_with_the_trainer_skips_and_resumes', 'test_a_sweep_holds_one_point_of_programs_and_arrays',
                           'test_points_in_child_processes_train_as_in_process'),
    'test_sharding': ('test_checkpoint_saved_on_one_mesh_resumes_on_another', 'test_dry_run_reads_bytes_and_exchanges_from_the_program', 'test_dry_run_counts_the_token_chunks_exchanges', 'test_expert_parallel_program_exchanges_tokens_not_experts', 'test_gradient_reductions_do_not_grow_with_the_passes_and_no_activation_is_gathered', 'test_local_routing_equals_one_device_on_a_skewed_batch', 'test_microbatches_give_the_same_update', 'test_sharded_training_equals_one_device', 'test_replay_reruns_an_overflowing_step_dropless'),
    'test_smelt_analysis': ('test_report_recovers_known_coefficients_within_bootstrap_intervals', 'test_paired_bootstrap_is_narrower_than_independent_resampling'),
    'test_targets': ('test_a_config_that_does_not_fit_says_by_how_much_and_what_to_change',),
    'test_train': ('test_continuation_with_longer_schedule', 'test_corrupt_latest_step_is_skipped', 'test_evaluate_and_sample_from_a_workdir', 'test_kept_steps_survive_keep', 'test_nan_loss_stops_and_keeps_the_good_checkpoint', 'test_non_finite_update_is_never_saved', 'test_resume_from_an_earlier_checkpoint_drops_the_lost_rows', 'test_resume_is_bitwise_identical', 'test_resume_with_another_model_is_an_error_and_loses_nothing', 'test_sigterm_saves_a_restorable_checkpoint', 'test_unreadable_newest_step_is_set_aside_and_written_again', 'test_a_run_directory_from_before_the_run_section_loads_and_resumes', 'test_profile_steps_trace_exactly_those_steps', 'test_a_wandb_run_offline_logs_the_metrics_rows'),
}


def pytest_collection_modifyitems(config, items):
  del config
  import pytest  # pylint: disable=import-outside-toplevel
  for item in items:
    module = item.module.__name__.rsplit('.', 1)[-1] if item.module else ''
    missing = [n for n in SLOW.get(module, ()) if not hasattr(item.module, n)]
    assert not missing, f'tests/conftest.py SLOW names tests {module} lacks: {missing}'
    if getattr(item, 'originalname', item.name) in SLOW.get(module, ()):
      item.add_marker(pytest.mark.slow)
