"""Shared pytest setup.

ringsync's pytest plugin gives ``@pytest.mark.ranks(n)`` (a test function that runs on n
ranks; it is skipped where no mpirun is installed). Its entry point registers it when
ringsync is installed; naming it here also covers PYTHONPATH=. without installing and
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1.

The ``requires_mpirun`` marker skips other tests that start mpirun themselves (through
ringsync.testing.run_mpi or the launcher) where none is installed, instead of failing them.

The ``slow`` marker: ``python -m pytest -m "not slow"`` is the fast tier (run it before
every commit); plain ``python -m pytest`` runs everything (CI). Tests are marked slow
here, in the SLOW lists below, not in their files: one place shows what the fast tier
leaves out and why. Every test file keeps at least its quickest tests in the fast tier,
so that a change to any module is exercised; a run of the whole suite (no paths given)
fails at collection if a file loses its last fast test or a pattern matches no test.
"""

import os
import re

import pytest

pytest_plugins = ["ringsync.pytest_plugin"]

# Open MPI's libfabric transport (btl ofi) probes for fabric providers in every MPI_Init:
# about a second per job on a machine that has none (measured: `mpirun -np 2 python -c
# "import mpi4py.MPI"` 1.2 s, 0.2 s without it), and the suite starts hundreds of jobs.
# ringsync's data never goes through MPI's transports; MPI keeps shared memory and TCP.
os.environ.setdefault("OMPI_MCA_btl", "^ofi")
# Open MPI's ranks spin while they wait (MPI_Init, MPI's exchanges in a rendezvous,
# MPI_Finalize) unless they know they share cores, which they cannot when a job's hosts are
# namespaces of this machine given many slots: 128 ranks on 2 cores took 3 times as long.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

# Node-id patterns of slow tests; ``*`` matches anything (brackets are literal, so a
# parametrized id is written as pytest shows it). Grouped by why they are slow.

# mpirun jobs whose ranks import PyTorch or TensorFlow (seconds per rank, on every rank).
SLOW_FRAMEWORKS = [
    "tests/mpi/test_launchers.py::test_torchrun_without_a_secret_meets_at_torchruns_store",
    "tests/mpi/test_launchers.py::test_slurm_variables_alone",
    "tests/hosts/test_pods.py::test_pods_with_pytorchjob_variables_alone",
    "tests/faults/test_store_elastic.py::test_a_replacement_joins_at_the_next_commit",
    "tests/mpi/test_torch.py::test_torch[2]",
    "tests/mpi/test_torch_distributed.py::test_collective_matrix_under_torchrun[ringsync-3]",
    "tests/mpi/test_torch_distributed.py::test_collective_matrix_under_torchrun[gloo-2]",
    "tests/mpi/test_torch_distributed.py::test_collective_matrix_under_mpirun[*",
    "tests/mpi/test_torch_distributed.py::test_collective_matrix_under_torchrun[ringsync-1]",
    "tests/mpi/test_torch_distributed.py::test_a_late_rank_is_a_dist_backend_error_*",
    "tests/mpi/test_torch_distributed.py::test_different_collectives_fail_on_every_*",
    "tests/mpi/test_torch_distributed.py::test_the_ddp_example_learns_alike_*",
    "tests/mpi/test_torch_distributed.py::test_user_code_ends_where_gloo_does",
    "tests/mpi/test_torch_distributed.py::test_a_two_by_two_mesh[gloo]",
    "tests/mpi/test_torch_distributed.py::test_a_script_that_never_destroys_its_group_*",
    "tests/mpi/test_launcher.py::test_a_plain_ddp_script_runs_under_ringsync_run_as_*",
    "tests/mpi/test_mixed_frameworks.py::test_torch_and_keras_ranks_train_one_model_over_one_ring[4-*",
    "tests/mpi/test_mixed_frameworks.py::test_torch_and_keras_ranks_train_one_model_over_one_ring[3-*",
    "tests/mpi/test_torch.py::test_torch[3]",
    "tests/mpi/test_jax.py::*[1]",
    "tests/mpi/test_jax.py::test_jitted_collective_matrix_through_python_callbacks",
    "tests/mpi/test_jax.py::test_unordered_collectives_pair_up_with_xlas_own_threads",
    "tests/mpi/test_jax.py::test_jax_ranks_join_torch_tensorflow_and_numpy_ranks",
    "tests/mpi/test_torch.py::test_pytorch_examples_learn",
    "tests/mpi/test_horovod_tensorflow.py::test_horovod_tensorflow_api[3]",
    "tests/mpi/test_keras.py::test_horovods_tensorflow2_examples_learn",
    "tests/mpi/test_sharded.py::test_sharded_optimizer[3]",
    "tests/faults/test_hardening.py::test_dropped_torch_handles_keep_their_host_copies",
    "tests/faults/test_mismatch_under_load.py::*[ringsync.torch]",
    "tests/faults/test_elastic.py::test_torch_state_after_a_kill_mid_allreduce",
    "tests/faults/test_elastic.py::test_elastic_sampler_covers_the_epoch_after_a_kill",
    "tests/faults/test_elastic.py::test_keras_*",
    "tests/faults/test_elastic.py::test_elastic_torch_example_survives_a_kill",
]

# mpirun jobs of several ranks: the fast tier keeps the smallest or one per kind.
SLOW_MPIRUN = [
    "tests/mpi/test_collectives.py::test_every_check_through_the_module_api[*",
    "tests/mpi/test_collectives.py::test_point_to_point_through_the_module_api",
    "tests/mpi/test_collectives.py::test_topology_queries[np4]",
    "tests/mpi/test_collectives.py::test_topology_queries[np3]",
    "tests/mpi/test_engine.py::test_engine[2]",
    "tests/mpi/test_engine.py::test_engine[3]",
    "tests/mpi/test_engine.py::test_engine[4]",
    "tests/mpi/test_engine.py::test_same_host_lane[*",
    "tests/mpi/test_engine.py::test_every_mismatch_fails_on_every_rank[3]",
    "tests/mpi/test_engine.py::test_fusion_threshold_does_not_change_results[0]",
    "tests/mpi/test_engine.py::test_fusion_threshold_does_not_change_results[4096]",
    "tests/mpi/test_engine.py::test_fusion_threshold_does_not_change_results[67108864]",
    "tests/mpi/test_engine.py::test_timeline_is_chrome_trace_json[3]",
    "tests/mpi/test_engine.py::test_timeline_is_chrome_trace_json[1]",
    "tests/mpi/test_process_set_agreement.py::*[duplicate]",
    "tests/mpi/test_process_set_agreement.py::*[not_a_member]",
    "tests/mpi/test_testing_helper.py::test_marker_runs_the_test_on_every_rank[np3-value0]",
    "tests/mpi/test_launcher.py::test_horovodrun_options_reach_the_ranks",
    "tests/mpi/test_launcher.py::test_doctor_reports_mpi_and_ulfm",
    "tests/mpi/test_testing_helper.py::test_expected_failure_returns_the_result",
    "tests/mpi/test_testing_helper.py::test_failing_rank_is_reported_with_its_traceback",
    "tests/faults/test_hardening.py::test_ranks_with_different_settings_fail_init[*",
    "tests/faults/test_hardening.py::test_overflowing_sizes_are_usage_errors[np1]",
    "tests/faults/test_hardening.py::test_overflowing_sizes_are_usage_errors[np2]",
    "tests/faults/test_hardening.py::test_overflowing_sizes_are_usage_errors[np3]",
    "tests/faults/test_hardening.py::test_bad_names_and_scale_factors[*",
    "tests/faults/test_hardening.py::test_timeline_refuses_a_planted_symlink",
    "tests/faults/test_hardening.py::test_dropped_handles_keep_their_buffers[*",
    "tests/faults/test_hardening.py::test_a_bad_setting_on_one_rank_fails_init_everywhere",
    "tests/faults/test_hardening.py::test_one_rank_out_of_memory_breaks_the_ring_everywhere[*",
    "tests/faults/test_failed_job_exit.py::*[elastic]",
    "tests/faults/test_failed_job_exit.py::test_every_rank_*",
    "tests/faults/test_failed_job_exit.py::test_one_rank_raising_fails_the_job[plain]",
    "tests/faults/test_failed_job_exit.py::test_elastic_survivors_that_finish_are_a_finished_job",
    "tests/faults/test_failed_job_exit.py::test_without_elastic_a_lost_rank_fails_the_job",
    "tests/faults/test_failed_job_exit.py::test_plain_ulfm_mpirun_fails_through_*",
    "tests/faults/test_killed_rank.py::test_survivors_name_the_killed_rank[0]",
    "tests/faults/test_killed_rank.py::test_plain_mpirun_ends_the_job_when_a_rank_is_killed",
    "tests/faults/test_killed_rank.py::test_killed_rank_fails_pending_handles[*",
    "tests/faults/test_killed_rank.py::test_a_slow_peer_times_out_instead_of_hanging",
    "tests/faults/test_chaos.py::test_chaos_runs_end_finished_or_in_a_clean_error",
    "tests/faults/test_hostile_peer.py::test_ten_thousand_mutated_frames_*",
    "tests/faults/test_launcher_signals.py::*[SIGQUIT]",
    "tests/faults/test_launcher_signals.py::test_ctrl_z_*",
    "tests/faults/test_launcher_signals.py::test_killing_a_stopped_launcher_ends_the_stopped_job",
    "tests/faults/test_peer_shutdown.py::*[exit-vs-*",
    "tests/faults/test_peer_shutdown.py::test_ranks_that_shut_down_at_different_times_end_cleanly",
    "tests/faults/test_rogue_peers.py::test_rogue_clients_neither_stall_nor_fail_init[*",
    "tests/faults/test_rogue_peers.py::test_impostors_without_the_secret_are_refused[*",
    "tests/faults/test_shm_limits.py::test_auto_falls_back_to_tcp_on_every_rank[*",
    "tests/faults/test_shm_limits.py::test_segments_are_sized_by_local_ranks",
    "tests/faults/test_shm_limits.py::test_orphans_of_dead_creators_are_removed",
    # elastic jobs: ranks killed, the survivors recover (ULFM), some respawned
    "tests/faults/test_elastic.py::test_a_killed_rank_leaves_the_survivors_training[*",
    "tests/faults/test_elastic.py::test_a_horovod_style_state_subclass_recovers_unchanged",
    "tests/faults/test_elastic.py::test_a_rank_killed_inside_commit",
    "tests/faults/test_elastic.py::test_a_second_failure_during_recovery",
    "tests/faults/test_elastic.py::test_an_uncaught_exception_is_a_lost_rank",
    "tests/faults/test_elastic.py::test_reset_limit_ends_the_job",
    "tests/faults/test_elastic.py::test_without_ulfm_a_lost_rank_ends_the_job",
    "tests/faults/test_elastic.py::test_respawn_returns_the_job_to_its_size",
    # seeing inside a job: one job per scenario (the plain mpirun hang report stays fast)
    "tests/mpi/test_job_insight.py::test_a_slow_rank_*",
    "tests/mpi/test_job_insight.py::test_*_under_ringsync_run",
    "tests/mpi/test_job_insight.py::test_the_first_ctrl_c_*",
    "tests/mpi/test_job_insight.py::test_sigterm_*",
    "tests/mpi/test_job_insight.py::test_a_killed_rank_*",
    "tests/mpi/test_job_insight.py::test_a_mismatched_collective_*",
]

# Deadlines waited out on purpose (a hang, a stall, a timeout: seconds of nothing).
SLOW_DEADLINES = [
    "tests/unit/test_p2p.py::test_an_unmatched_recv_times_out_naming_its_peer",
    "tests/mpi/test_testing_helper.py::test_hang_times_out_dumps_stacks_and_leaves_no_process",
    "tests/mpi/test_testing_helper.py::test_marker_reports_failures_deadlines_skips_and_refusals",
    "tests/mpi/test_engine.py::test_stall_is_reported_once_naming_the_missing_rank",
    "tests/mpi/test_engine.py::test_a_tensor_one_rank_never_submits_times_out",
    "tests/unit/test_thread_collectives.py::test_a_hang_fails_at_the_deadline_showing_where_*",
    "tests/unit/test_fd_limit.py::test_running_out_of_descriptors_while_connecting_names_the_limit",
    "tests/unit/test_auth.py::test_rank_with_another_secret_fails_at_once_and_is_named",
    "tests/unit/test_auth.py::test_connector_does_not_trust_or_wait_forever_on_a_rogue_listener[*",
]

# Stress and matrices: many rounds, or the bigger part of a matrix (the fast tier keeps
# every check on 1 and 2 thread ranks, and the smaller layouts).
SLOW_STRESS = [
    "tests/faults/test_mismatch_under_load.py::*[engine]",
    "tests/unit/test_mismatch_stress.py::*[shm-2-1200]",
    "tests/unit/test_mismatch_stress.py::*[shm-ring-2-600]",
    "tests/unit/test_mismatch_stress.py::*[tcp-2-600]",
    "tests/unit/test_thread_collectives.py::test_collective[*-2-shm-ring]",
    "tests/unit/test_thread_collectives.py::test_collective[*-3-*]",
    "tests/unit/test_thread_collectives.py::test_collective[*-4-*]",
    "tests/unit/test_thread_collectives.py::test_collective[*-5-*]",
    "tests/unit/test_thread_collectives.py::test_collective[*-7-*]",
    "tests/unit/test_thread_collectives.py::test_mixed_transports_give_the_same_results[4]",
    "tests/unit/test_hierarchical.py::test_allreduce_on_every_layout_is_*[2x2-auto]",
    "tests/unit/test_hierarchical.py::test_allreduce_on_every_layout_is_*[2x2-on]",
    "tests/unit/test_hierarchical.py::test_allreduce_on_every_layout_is_*[2x2-off]",
    "tests/unit/test_hierarchical.py::test_allreduce_on_every_layout_is_*[3x2-on]",
    "tests/unit/test_hierarchical.py::test_allreduce_on_every_layout_is_*[2x3-on]",
    "tests/unit/test_hierarchical.py::test_allreduce_on_every_layout_is_*[uneven-3+1-on]",
    "tests/unit/test_hierarchical.py::test_allreduce_on_every_layout_is_*[1-per-host-on]",
    "tests/unit/test_adasum.py::test_adasum_matches_the_tree_reference_on_every_rank[4-*",
    "tests/unit/test_adasum.py::test_adasum_matches_the_tree_reference_on_every_rank[5-*",
    "tests/unit/test_adasum.py::test_adasum_matches_the_tree_reference_on_every_rank[8-*",
    "tests/unit/test_adasum.py::test_adasum_with_a_joined_rank[5-tcp]",
    # the fast tier keeps 100 cycles and 20 recoveries
    "tests/unit/test_leaks.py::test_init_shutdown_cycles_leave_nothing_behind[1000]",
    "tests/unit/test_leaks.py::test_elastic_recoveries_leave_nothing_behind[100]",
]

# Jobs across virtual hosts (network namespaces, a launch agent per host; up to 128 ranks).
SLOW_HOSTS = [
    "tests/hosts/test_many_hosts.py::test_collectives_across_hosts[*",
    "tests/hosts/test_many_hosts.py::test_hierarchical_allreduce_sends_the_link_bound",
    "tests/hosts/test_many_hosts.py::test_uneven_hosts_and_transports",
    "tests/hosts/test_many_hosts.py::test_address_that_reaches_the_peers[*",
    "tests/hosts/test_many_hosts.py::test_elastic_job_survives_losing_a_whole_host",
    "tests/hosts/test_many_hosts.py::test_a_link_taken_down_fails_every_rank",
    "tests/hosts/test_many_hosts.py::test_128_ranks_on_8_hosts[*",
    "tests/hosts/test_many_hosts.py::test_hosts_that_come_and_go",
]

SLOW = SLOW_FRAMEWORKS + SLOW_MPIRUN + SLOW_DEADLINES + SLOW_STRESS + SLOW_HOSTS


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_mpirun: starts ranks with mpirun; skipped when none is installed"
    )
    config.addinivalue_line(
        "markers", 'slow: left out of the fast tier (-m "not slow"); see tests/conftest.py SLOW'
    )


def _pattern(text):
    return re.compile("".join(".*" if part == "*" else re.escape(part)
                              for part in re.split(r"(\*)", text)) + r"\Z")


SLOW_PATTERNS = [(text, _pattern(text)) for text in SLOW]


# tryfirst: the marks must be on the items before -m deselects by them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    used = set()
    for item in items:
        for text, pattern in SLOW_PATTERNS:
            if pattern.match(item.nodeid):
                item.add_marker(pytest.mark.slow)
                used.add(text)
    if not config.args or [str(a) for a in config.args] == ["tests"]:
        _check_the_lists(items, used)


def _check_the_lists(items, used):
    """On a run of the whole suite: every file keeps a fast test, no pattern is stale."""
    files = {}
    for item in items:
        fast = files.setdefault(item.nodeid.split("::")[0], [False])
        fast[0] = fast[0] or not item.get_closest_marker("slow")
    problems = ["%s: every test is slow; leave its quickest in the fast tier" % path
                for path, (fast,) in sorted(files.items()) if not fast]
    # A pattern of a file that was not collected here (its framework is missing) is fine.
    problems += ["SLOW pattern %r matches no test" % text for text in SLOW
                 if text not in used and text.split("::")[0] in files]
    if problems:
        raise pytest.UsageError("tests/conftest.py:\n  " + "\n  ".join(problems))


def pytest_runtest_setup(item):
    from ringsync.pytest_plugin import mpirun_path

    if item.get_closest_marker("requires_mpirun") and mpirun_path() is None:
        pytest.skip("no mpirun installed")
