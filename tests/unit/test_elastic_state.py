"""One-process checks of elastic state: commits, rollback, and how ElasticSampler
folds the progress of every rank into the epoch and reshards the rest."""
import numpy as np
import pytest

import ringsync as rs
from ringsync import elastic


class Counter:
    """A value restored through state_dict(), like a sampler or an LR scheduler."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_restore_rolls_back_to_the_last_commit_without_sharing_arrays():
    state = elastic.ObjectState(step=0, w=np.zeros(3), history=[], counter=Counter())
    state.step, state.w[:] = 4, 1.0
    state.history.append("a")
    state.counter.n = 7
    state.commit()
    state.step, state.w[:] = 9, 2.0
    state.history.append("b")
    state.counter.n = 8
    state.restore()
    assert (state.step, state.w.tolist(), state.history, state.counter.n) == (4, [1.0] * 3, ["a"], 7)
    state.w[:] = 5.0  # changing the live state leaves the commit alone
    state.restore()
    assert state.w.tolist() == [1.0] * 3


def test_two_newest_commits_are_kept():
    state = elastic.ObjectState(step=0)
    for step in range(1, 4):
        state.step = step
        state.commit()
    assert state.commit_id == 3
    state.restore(2)
    assert (state.step, state.commit_id) == (2, 2)
    with pytest.raises(rs.UsageError, match=r"commit 1 is not held .* holds \[2\]"):
        state.restore(1)


def test_reset_callbacks_run_in_order():
    calls = []
    state = elastic.ObjectState()
    state.register_reset_callbacks([lambda: calls.append(1), lambda: calls.append(2)])
    state.on_reset()
    assert calls == [1, 2]


def test_run_needs_init_first():
    @elastic.run
    def train(state):
        raise AssertionError("not reached")

    with pytest.raises(rs.NotInitializedError, match=r"init\(\)"):
        train(elastic.ObjectState())


torch = pytest.importorskip("torch")


def test_sampler_has_horovods_attributes_and_counts_processed_num():
    from ringsync.torch.elastic import ElasticSampler
    sampler = ElasticSampler(list(range(23)), shuffle=True, seed=5)
    order = list(sampler)
    assert sorted(order) == list(range(23)) and order != list(range(23))
    assert (sampler.num_replicas, sampler.rank, sampler.epoch, sampler.processed_num) == \
        (1, 0, 0, 0)
    assert (sampler.num_samples, sampler.total_size, len(sampler)) == (23, 23, 23)
    assert sampler.remaining_indices == order and sampler.indices == order
    assert sampler.get_indices(1, 4) == order[4:8] and sampler.get_indices(5, 4) == order[20:]
    sampler.record_batch(0, 4)
    sampler.record_batch(1, 4)
    assert sampler.processed_num == 8 and sampler.state_dict()["processed_num"] == 8
    sampler.reset()  # what is left: the rest of the epoch's order
    assert sampler.remaining_indices == order[8:] and list(sampler) == order[8:]
    assert (sampler.num_samples, sampler.total_size) == (15, 15)


def test_sampler_loads_horovods_state_dict_and_reshards_the_rest():
    """Shards are strided, so what 3 ranks did (4 samples each) is the first 12 of the
    order: Horovod's processed_num = 12 leaves exactly the others."""
    from ringsync.torch.elastic import ElasticSampler
    sampler = ElasticSampler(list(range(23)), shuffle=True, seed=5)
    order = list(sampler)
    done = {i for r in range(3) for i in ElasticSampler._shard(order, 3, r)[:4]}
    assert done == set(order[:12])
    sampler.load_state_dict({"epoch": 0, "processed_num": 12})  # (Horovod's keys only)
    assert list(sampler) == order[12:] and len(sampler) == 11
    sampler.load_state_dict({"epoch": 3, "processed_num": 0})
    assert sampler.epoch == 3 and sorted(sampler) == list(range(23)) and list(sampler) != order


def test_sampler_record_indices_leaves_them_out():
    from ringsync.torch.elastic import ElasticSampler
    sampler = ElasticSampler(list(range(10)), shuffle=False)
    sampler.record_indices([3, 7])
    sampler.reset()
    assert list(sampler) == [0, 1, 2, 4, 5, 6, 8, 9] and sampler.processed_indices == {3, 7}
    copy = ElasticSampler(list(range(10)), shuffle=False)
    copy.load_state_dict(sampler.state_dict())
    assert list(copy) == list(sampler)


def test_sampler_shards_are_equal_and_cover_everything():
    from ringsync.torch.elastic import ElasticSampler
    remaining = list(range(10))
    shards = [ElasticSampler._shard(remaining, 4, r) for r in range(4)]
    assert {len(s) for s in shards} == {3}
    assert set().union(*shards) == set(remaining)


def test_sampler_set_epoch_starts_over_and_ignores_the_current_epoch():
    from ringsync.torch.elastic import ElasticSampler
    sampler = ElasticSampler(list(range(8)), shuffle=True, seed=1)
    sampler.record_batch(0, 4)
    sampler.set_epoch(0)  # the current epoch: progress kept
    assert sampler.processed_num == 4
    first = list(sampler)
    sampler.set_epoch(1)
    assert sampler.processed_num == 0 and sampler.processed_indices == set()
    assert sorted(sampler) == list(range(8)) and list(sampler) != first


class HorovodStyleState(elastic.State):
    """A State subclass written for Horovod: save/restore/sync/reset, its own copies."""

    def __init__(self, value):
        super().__init__(bcast_object=rs.broadcast_object, get_rank=rs.rank)
        self.value, self.saved, self.calls = value, value, []

    def save(self):
        self.calls.append("save")
        self.saved = self.value

    def restore(self):
        self.calls.append("restore")
        self.value = self.saved

    def sync(self):
        self.calls.append("sync")

    def reset(self):
        self.calls.append("reset")


def test_a_horovod_style_subclass_gets_its_own_hooks_called():
    state = HorovodStyleState(1)
    assert state.calls == []  # no snapshot() of ours taken behind its back
    state.value = 2
    state.commit()
    assert state.calls == ["save"] and state.commit_id == 1
    state.value = 3
    state._roll_back(1)  # what recovery does: the subclass's own restore()
    assert state.value == 2 and state.calls[-1] == "restore"
    order = []
    state.register_reset_callbacks([lambda: order.append(state.calls[-1])])
    state.on_reset()
    assert order == ["reset"]  # reset() first, then the callbacks


def test_object_state_takes_horovods_positional_arguments():
    state = elastic.ObjectState(rs.broadcast_object, rs.rank, epoch=3)
    state.epoch = 5
    state.restore()
    assert state.epoch == 3


def test_discovered_hosts_are_parsed_and_planned():
    assert elastic.parse_hosts("a:2\n# comment\n\nb:3\nc\n") == {"a": 2, "b": 3, "c": 1}
    with pytest.raises(ValueError, match="bad host line"):
        elastic.parse_hosts("a:-1\n")
    now = ["a", "a", "b", "b"]
    plan = elastic.host_plan(now, {"a": 2, "b": 2})
    assert (plan.leaving, plan.adding) == ([], {})
    plan = elastic.host_plan(now, {"a": 2, "b": 2, "c": 2})
    assert (plan.leaving, plan.adding) == ([], {"c": 2})
    plan = elastic.host_plan(now, {"a": 2, "b": 2, "c": 2}, max_np=5)  # capped
    assert plan.adding == {"c": 1}
    plan = elastic.host_plan(now, {"a": 2})  # b went away: its ranks leave
    assert (plan.leaving, plan.adding) == ([2, 3], {})
    plan = elastic.host_plan(now, {"a": 1, "b": 3})  # fewer slots on a, more on b
    assert (plan.leaving, plan.adding) == ([1], {"b": 1})


def test_host_discovery_keeps_the_last_answer_when_the_script_fails(tmp_path, capsys):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\ncat " + str(tmp_path / "hosts") + "\n")
    script.chmod(0o755)
    (tmp_path / "hosts").write_text("a:2\n")
    found = elastic.HostDiscovery(str(script), interval=0)
    assert found.poll() == {"a": 2}
    (tmp_path / "hosts").unlink()  # cat fails now
    assert found.poll() == {"a": 2}
    assert "failed" in capsys.readouterr().err
    slow = elastic.HostDiscovery(str(script), interval=3600)
    (tmp_path / "hosts").write_text("b:1\n")
    assert slow.poll() == {"b": 1}
    (tmp_path / "hosts").write_text("c:1\n")
    assert slow.poll() == {"b": 1}  # not due again yet


def test_judging_a_failure_does_not_start_mpi_in_a_rank_without_it():
    """A rank started without mpirun (the store) asks whether an error is a lost rank:
    the answer must not import mpi4py.MPI, which initialises MPI as a singleton job
    (its segments were left in /dev/shm by ranks killed later, in benchmarks/chaos.py)."""
    import subprocess
    import sys
    code = ("import sys; from ringsync import elastic; "
            "assert not elastic._is_rank_failure(ValueError('wrapped'), None); "
            "print('mpi4py.MPI' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", done.stdout + done.stderr
