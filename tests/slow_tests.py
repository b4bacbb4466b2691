"""The tests marked ``slow``: the longest of the suite, which CI's run leaves out
(``python -m pytest -q -n 2 -m "not slow"``, the README's test command) so that it keeps
within the project's 20 minutes on a 2-core machine. The full suite, these included, is
``python -m pytest -q -n 2``; run it before a change is submitted (docs/benchmarks.md
records each run).

Why: on the 2-vCPU VM of sessions 80-81 (an AVX2-only AMD EPYC at 2.45 GHz) the whole suite
took CI 38-41 minutes (2,169 tests run, 4,260 s of test time on two workers); the 100 tests
first named here took 2,460 s of it (``PYTEST_ADDOPTS=--durations=0 bash .ci/run``, session 81, 2026-12-07).
They are the slowest cases of features that keep a faster case in CI (one scheme of a
parametrized compile test stays: the cheapest), and whole tests that compile or spawn most:
torchtitan's stack, tensor and sequence parallelism, DDP compiled whole, the C++ wrapper's
new-process and block-by-block runs, Inductor's cache keys.

Each entry is ``path::test``, which marks every parametrization of the test, or
``path::test[case]``, where ``*`` in ``case`` stands for any characters (the only wildcard:
brackets are the ids' own). conftest.py applies the mark and stops the run if an entry
matches no test of a collected file (a renamed test).
"""

from __future__ import annotations

import re

#: node id (``*`` a wildcard in a case) -> its seconds in session 81's run (two workers, the VM above)
SLOW_TESTS = {
    # whole tests: process groups, subprocesses, or many graphs compiled through Inductor
    "tests/e2e/test_distributed.py::test_torchtitans_stack_trains_like_one_process": 220,
    "tests/e2e/test_distributed.py::test_ddp_compiled_whole_splits_its_graph_and_matches_one_process": 89,
    "tests/e2e/test_distributed.py::test_ddp_and_fsdp2_with_resume_match_one_process": 59,
    "tests/e2e/test_distributed.py::test_compiled_ddp_training_frees_its_wrapper_before_destroying_the_group": 28,
    "tests/e2e/test_distributed.py::test_reentrant_checkpoint_of_each_forward_under_fsdp2_trains_like_one_process": 16,
    "tests/e2e/test_tensor_parallel.py::test_tensor_parallelism_with_and_without_sequence_parallelism_trains_like_one_process": 140,
    "tests/e2e/test_tensor_parallel.py::test_sequence_parallelism_under_fsdp2_matches_one_process": 80,
    "tests/compile/test_cpp_wrapper.py::test_blocks_compiled_one_by_one_with_the_cpp_wrapper_match_eager": 100,
    "tests/compile/test_cpp_wrapper.py::test_cpp_wrapper_compiles_matches_eager_and_loads_from_the_caches_in_a_new_process": 66,
    "tests/unit/test_cpp_wrapper_script.py::test_both_wrappers_are_timed_on_the_same_model": 33,
    "tests/unit/test_per_block_scripts.py::test_block_graphs_save_the_depth_state_they_receive": 94,
    "tests/unit/test_launcher_host_script.py::test_the_cpu_run_times_every_case_and_the_summary_sets_labels_side_by_side": 19,
    "tests/e2e/test_cli_inspect.py::test_a_reader_that_stops_early_ends_inspect_without_a_traceback": 88,
    "tests/compile/test_cache_keys.py::test_settings_are_part_of_inductor_cache_keys": 68,
    "tests/compile/test_per_block_compile.py::test_blocks_sharded_with_fsdp2_through_inductor_on_the_cpu_match_eager": 60,
    "tests/compile/test_per_block_compile.py::test_a_hugging_face_model_compiled_layer_by_layer_past_the_recompile_limit": 17,
    "tests/compile/test_backend.py::test_dar_fused_merge_matches_eager_through_inductor": 59,
    "tests/compile/test_dynamic_shapes.py::test_new_sizes_compile_a_symbolic_graph_rewritten_like_the_first": 49,
    "tests/compile/test_dynamic_shapes.py::test_dynamic_from_the_start_through_inductor": 41,
    "tests/compile/test_recompute_partial_sums.py::test_the_merge_saves_no_float32_copy_of_the_phase_one_output": 45,
    "tests/compile/test_recompute_partial_sums.py::test_dar_closing_transport_tagged_saves_no_float32_copy": 25,
    "tests/compile/test_sum_fences.py::test_inductor_through_fences_matches_eager_and_user_passes_run_after_them": 43,
    "tests/compile/test_grad_accumulation.py::test_route_many_calls_of_many_queries_or_keys_keep_their_sums_outside": 35,
    "tests/compile/test_grad_accumulation.py::test_route_many_running_sums_written_in_place_give_the_same_gradients": 16,
    "tests/unit/test_shortcut_error_table.py::test_errors_are_zero_for_one_source_and_smaller_in_fp16_than_in_bf16": 40,
    "tests/unit/test_gradient_accuracy.py::test_the_shortcut_runs_change_the_routing_gradients_compiled_too_and_put_the_op_back": 40,
    "tests/unit/test_pickle.py::test_a_loaded_model_compiles_with_the_backend_and_matches_eager": 33,
    "tests/kernels/test_route_many_triton.py::test_exact_softmax_grad_is_as_accurate_as_the_reference_where_sources_are_nearly_equal": 64,
    "tests/e2e/test_train_compile_mode.py::test_compile_options_reach_the_backend": 19,
    # the token sum's Triton kernel compiled whole (session 81's; its op in a compiled
    # backward is checked in CI by test_with_triton_token_sum_a_compiled_backward_calls_the_op)
    "tests/unit/test_source_logit.py::test_a_bf16_model_compiled_with_the_triton_token_sum_trains_as_with_the_products": 137,
    # the slower cases of parametrized tests whose cheapest case stays in CI
    # (test_routed_schemes_match_eager_through_inductor[mhar] stays)
    "tests/compile/test_backend.py::test_routed_schemes_match_eager_through_inductor[dar]": 40,
    "tests/compile/test_backend.py::test_routed_schemes_match_eager_through_inductor[block_attnres]": 30,
    "tests/compile/test_backend.py::test_routed_schemes_match_eager_through_inductor[wav]": 23,
    "tests/compile/test_backend.py::test_hf_gradient_checkpointing_under_compile_matches_eager": 68,
    "tests/compile/test_backend.py::test_compiled_autograd_compiles_the_routing_backward_and_matches_eager": 55,
    "tests/compile/test_backend.py::test_every_scheme_compiles_fullgraph_and_matches_eager[mhc]": 20,
    "tests/compile/test_backend.py::test_every_scheme_compiles_fullgraph_and_matches_eager[hyperconn]": 12,
    "tests/compile/test_backend.py::test_hinted_graphs_get_their_inductor_defaults[dar-*]": 14,
    "tests/compile/test_backend.py::test_hf_model_compiles_fullgraph_as_called_by_users[eval]": 14,
    "tests/compile/test_grad_accumulation.py::test_inductor_with_accumulation_and_fences_matches_eager": 49,
    "tests/compile/test_grad_accumulation.py::test_running_sums_written_in_place_give_the_same_gradients[dar-*]": 15,
    "tests/compile/test_per_block_compile.py::test_checkpointed_block_calls_compile_fullgraph_with_side_effects_allowed[dar-*]": 32,
    "tests/compile/test_per_block_compile.py::test_more_blocks_than_dynamos_recompile_limit_each_get_their_graph[checkpointed]": 18,
    "tests/compile/test_per_block_compile.py::test_a_block_call_sets_no_attribute_of_the_block[dar-True]": 12,
    "tests/compile/test_recompute_partial_sums.py::test_branch_outputs_recomputed_same_gradients_fewer_saved[dar-*-True-3]": 33,
    "tests/compile/test_recompute_partial_sums.py::test_recomputed_partial_sums_same_gradients_fewer_saved_tensors[dar-*]": 30,
    "tests/compile/test_norm_fusion.py::test_fused_norms_are_no_less_accurate_in_bf16[dar-*]": 14,
    # every scheme on mixtral but attnres (8 s), which stays: 8-14 s each
    **{f"tests/e2e/test_schemes_train_hf.py::test_scheme_trains_on_hf_models[{scheme}-mixtral]": 10
       for scheme in ("mhc", "dar", "rezero", "mhar", "layerscale", "hyperconn", "residual", "wav", "block_attnres",
                      "denseformer")},
    "tests/e2e/test_fsdp2_gather.py::test_shards_of_uneven_rows_gather_in_one_collective_and_their_gradients_reduce_as_fsdp2s[None]": 18,
    "tests/e2e/test_routing_log.py::test_recording_changes_nothing_the_run_trains[True]": 23,
    "tests/unit/test_export.py::test_an_exported_model_with_dynamic_batch_and_length_computes_what_the_model_does[mhc]": 12,
    "tests/unit/test_schemes_baselines.py::test_scheme_trains_and_round_trips_through_state_dict[mhc]": 13,
    "tests/kernels/test_route_many_triton.py::test_running_sums_are_added_to_the_gradients_as_they_are_stored[per_token_chunks-*]": 19,
    "tests/kernels/test_route_many_triton.py::test_running_sums_written_in_place_give_the_new_tensors_bits[tiled_keys_heads]": 16,
    # the widest row (d = 32768; the GPU runs it, and test_shared_memory.py checks its launches)
    "tests/kernels/test_route_many_triton.py::test_route_many_kernels_match_float64[*-32768-*]": 26,
    "tests/kernels/test_shared_memory.py::test_every_launch_fits_gpus_with_less_shared_memory[89]": 12,
    "tests/kernels/test_route_many_triton.py::test_exact_softmax_grad_gives_the_exact_gradients_in_half_precision[*torch.float16]": 30,
}


def is_slow(node_id: str) -> bool:
    """Whether an entry of :data:`SLOW_TESTS` names this test."""
    return any(entry_matches(entry, node_id) for entry in SLOW_TESTS)


def entry_matches(entry: str, node_id: str) -> bool:
    """``path::test`` matches the test and each of its cases; ``path::test[case]`` the cases
    whose id matches ``case`` with ``*`` as any characters."""
    base, _, case = entry.partition("[")
    node_base, _, node_case = node_id.partition("[")
    if base != node_base:
        return False
    if not case:
        return True
    pattern = ".*".join(re.escape(part) for part in case[:-1].split("*"))
    return bool(node_case) and re.fullmatch(pattern, node_case[:-1]) is not None


def stale_entries(node_ids: list[str], whole_paths: list[str]) -> list[str]:
    """The entries that match none of ``node_ids`` although their file was collected whole
    (it lies in one of ``whole_paths``, the run's arguments that name no single test): a
    test renamed or a case gone. Files collected in part are not judged."""
    def collected_whole(path: str) -> bool:
        return any(whole in ("", path) or path.startswith(whole.rstrip("/") + "/") for whole in whole_paths)

    return sorted(entry for entry in SLOW_TESTS
                  if collected_whole(entry.split("::")[0])
                  and not any(entry_matches(entry, node_id) for node_id in node_ids))
