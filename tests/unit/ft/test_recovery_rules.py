"""Pure tests of the donor/recovery rules (no processes)."""

from types import SimpleNamespace

import pytest

from regent.ft.recovery import compute_quorum_results


def _quorum(steps, quorum_id=7, commit_failures=None):
    members = [
        SimpleNamespace(
            replica_id=f"replica_{i}",
            address=f"addr_{i}",
            store_address=f"store_{i}",
            step=step,
            world_size=2,
            commit_failures=(commit_failures or [0] * len(steps))[i],
        )
        for i, step in enumerate(steps)
    ]
    # The Lighthouse sorts, but the function must not rely on it.
    return SimpleNamespace(quorum_id=quorum_id, participants=list(reversed(members)))


def test_reference_example_group_rank_0():
    q = _quorum([0, 1, 0, 1, 0])
    r = [compute_quorum_results(f"replica_{i}", 0, q, init_sync=True) for i in range(5)]
    assert [x.recover_src_replica_rank for x in r] == [1, None, 3, None, 1]
    assert r[1].recover_dst_replica_ranks == [0, 4]
    assert r[3].recover_dst_replica_ranks == [2]
    assert r[0].heal and not r[1].heal
    assert r[0].recover_src_manager_address == "addr_1"
    assert all(x.max_step == 1 and x.max_world_size == 2 for x in r)
    assert r[1].max_replica_rank == 0 and r[3].max_replica_rank == 1 and r[0].max_replica_rank is None
    assert r[2].replica_rank == 2 and r[2].replica_world_size == 5
    # Store primary of group rank 0 = first max-step member.
    assert {x.store_address for x in r} == {"store_1"}


def test_reference_example_group_rank_1_offsets_donors():
    q = _quorum([0, 1, 0, 1, 0])
    r = [compute_quorum_results(f"replica_{i}", 1, q, init_sync=True) for i in range(5)]
    assert [x.recover_src_replica_rank for x in r] == [3, None, 1, None, 3]
    assert r[1].recover_dst_replica_ranks == [2]
    assert r[3].recover_dst_replica_ranks == [0, 4]
    assert {x.store_address for x in r} == {"store_3"}


def test_init_sync_at_step_zero_everyone_pulls_the_primary():
    q = _quorum([0, 0, 0])
    r = [compute_quorum_results(f"replica_{i}", 0, q, init_sync=True) for i in range(3)]
    assert [x.recover_src_replica_rank for x in r] == [None, 0, 0]
    assert r[0].recover_dst_replica_ranks == [1, 2]
    # Group rank 1 has a different primary (replica_1), which every other replica pulls from.
    r1 = [compute_quorum_results(f"replica_{i}", 1, q, init_sync=True) for i in range(3)]
    assert [x.recover_src_replica_rank for x in r1] == [1, None, 1]


def test_no_init_sync_means_no_heal_at_step_zero():
    q = _quorum([0, 0, 0])
    r = [compute_quorum_results(f"replica_{i}", 0, q, init_sync=False) for i in range(3)]
    assert all(not x.heal and x.recover_dst_replica_ranks == [] for x in r)


def test_all_equal_steps_nobody_heals_and_commit_failures_is_max():
    q = _quorum([5, 5], commit_failures=[0, 3])
    r = compute_quorum_results("replica_0", 0, q)
    assert not r.heal and r.recover_dst_replica_ranks == []
    assert r.commit_failures == 3
    assert r.quorum_id == 7
    assert r.replica_ids == ["replica_0", "replica_1"]


def test_missing_replica_is_a_clear_error():
    with pytest.raises(ValueError, match="not in quorum"):
        compute_quorum_results("ghost", 0, _quorum([1]))


def test_same_step_different_lineage_heals_the_odd_one_out():
    # Replicas 0 and 1 committed step 5 in quorum 6, replica 2 committed step 5 alone in quorum 7 (it joined that
    # sync round a moment too late): same step, different weights. The newest lineage is the version to keep.
    q = _quorum([5, 5, 5])
    for member, lineage in zip(sorted(q.participants, key=lambda m: m.replica_id), [6, 6, 7]):
        member.data = {"regent_lineage": lineage}
    r = [compute_quorum_results(f"replica_{i}", 0, q, init_sync=True) for i in range(3)]
    assert [x.heal for x in r] == [True, True, False]
    assert r[0].recover_src_replica_rank == 2 and r[1].recover_src_replica_rank == 2
    assert r[2].recover_dst_replica_ranks == [0, 1]
    assert all(x.max_step == 5 and x.max_world_size == 1 for x in r)


def test_members_without_lineage_follow_torchft_rules():
    # TorchFT managers send free-form data without a lineage: the step alone decides, as in TorchFT.
    q = _quorum([5, 5, 4])
    for member in q.participants:
        member.data = {"something": "else"} if member.replica_id != "replica_0" else "not a dict"
    r = [compute_quorum_results(f"replica_{i}", 0, q, init_sync=True) for i in range(3)]
    assert [x.heal for x in r] == [False, False, True]
