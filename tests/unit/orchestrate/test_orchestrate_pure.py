"""Pure parts of the orchestration layer: config, restart policy, fault schedule, summary, report."""

from __future__ import annotations

import json

import pytest

from regent.orchestrate.commands import parse_train_argv
from regent.orchestrate.config import ConfigError, parse_duration
from regent.orchestrate.events import JsonlWriter, make_event, read_jsonl
from regent.orchestrate.faults import PlannedFault, RandomFaultSchedule, ReplayFaultSchedule
from regent.orchestrate.policy import Action, RestartPolicy
from regent.orchestrate.report import active_replicas_series, write_report
from regent.orchestrate.summary import compute_summary, percentile, recovery_breakdowns, trained_loss


def test_durations():
    assert parse_duration("180s") == 180
    assert parse_duration("3m") == 180
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90") == 90
    with pytest.raises(ConfigError, match="180s"):
        parse_duration("soon")


def test_defaults_are_the_demo(tmp_path):
    cfg = parse_train_argv(["--run-dir", str(tmp_path / "r")])
    assert (cfg.replicas, cfg.procs_per_replica, cfg.train.model) == (4, 2, "debug")
    assert cfg.ft.mode == "diloco" and cfg.ft.sync_every == 20
    assert cfg.faults.enabled and cfg.faults.every == 30
    assert cfg.duration == 180 and cfg.steps is None


def test_flags_toml_and_dotted_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('replicas = 3\n[ft]\nsync_every = 10\nmode = "ddp"\n[train]\nlr = 0.001\n')
    cfg = parse_train_argv(
        ["--config", str(toml), "--replicas", "2", "--steps", "50", "--fault-kinds", "kill,comm",
         "--ft.sync-every", "5", "--faults.warmup", "3s", "--train.batch-size=4"]
    )
    assert cfg.replicas == 2  # flag beats file
    assert cfg.ft.mode == "ddp" and cfg.ft.sync_every == 5  # dotted beats file
    assert cfg.train.lr == pytest.approx(0.001)
    assert cfg.faults.kinds == ["kill", "comm"] and cfg.faults.warmup == 3.0
    assert cfg.train.batch_size == 4
    assert cfg.steps == 50 and cfg.duration is None


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--replicas", "0"], "--replicas"),
        (["--fault-kinds", "kill,meteor"], "meteor"),
        (["--model", "huge"], "--model"),
        (["--ft.mode", "allgather"], "ft.mode"),
        (["--ft.nope", "1"], "unknown option"),
        (["--bogus.key", "1"], "unknown config section"),
        (["--train.lr", "fast"], "expected float"),
        (["--no-ft", "--replicas", "2"], "--replicas 1"),
        (["--faults-file", "/nonexistent/file"], "does not exist"),
    ],
)
def test_bad_config_refused_before_launch(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_train_argv(argv)


def test_cli_bad_args_exit_2(capsys):
    from regent.cli import main

    assert main(["train", "--replicas", "-1", "--no-live"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, match",
    [
        (b'replicas = \n[ft\n', "is not valid TOML"),
        (b"replicas = 2\n\xff\xfe\n", "is not UTF-8 text"),
        (b'replicas = "many"\n', "expected int"),
    ],
)
def test_bad_config_file_is_one_error_line_naming_the_file(tmp_path, capsys, content, match):
    from regent.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_bytes(content)
    assert main(["train", "--config", str(bad), "--no-live"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert str(bad) in lines[0] and match in lines[0] and "Traceback" not in lines[0]


def test_config_file_that_cannot_be_read_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} cannot be read"):
        parse_train_argv(["--config", str(tmp_path)])


def test_restart_policy_generations_and_reallocation():
    p = RestartPolicy(in_place_restarts=2, crash_loop_starts=5)
    assert p.on_failure(0) is Action.RESTART_IN_PLACE  # generation 0 never made progress: failed start 1
    assert p.on_failure(0) is Action.IGNORE  # second dying rank of the same mesh
    assert p.restart_finished() == 1
    assert p.on_failure(0) is Action.IGNORE  # late event from the old generation
    assert p.on_failure(1) is Action.REALLOCATE  # 2 consecutive failed starts: the host may be bad
    p.restart_finished()
    p.on_progress(2)
    # a replica that recovers and trains between faults stays on its host, however often it is hit
    for _ in range(10):
        assert p.on_failure(p.generation) is Action.RESTART_IN_PLACE
        p.restart_finished()
        p.on_progress(p.generation)
    every = RestartPolicy(in_place_restarts=0)
    for _ in range(3):
        every.on_progress(every.generation)
        assert every.on_failure(every.generation) is Action.REALLOCATE
        every.restart_finished()


def test_restart_policy_never_gives_up_on_a_replica_that_recovers():
    """1,000 faults over a long run, each after the replica recovered: no budget runs out."""
    p = RestartPolicy(in_place_restarts=3, crash_loop_starts=5)
    for _ in range(1000):
        p.on_progress(p.generation)
        assert p.on_failure(p.generation) in (Action.RESTART_IN_PLACE, Action.REALLOCATE)
        assert p.backoff() == 0.0
        p.restart_finished()
    assert p.attempts == 1000 and not p.gave_up


def test_restart_policy_gives_up_on_a_crash_loop_with_backoff():
    p = RestartPolicy(crash_loop_starts=4, backoff_s=1.0, max_backoff_s=3.0)
    backoffs = []
    p.on_progress(0)
    p.on_failure(0)  # a healthy generation failed: not a failed start
    backoffs.append(p.backoff())
    p.restart_finished()
    actions = []
    for _ in range(4):  # every later start fails before making progress
        actions.append(p.on_failure(p.generation))
        backoffs.append(p.backoff())
        if actions[-1] is not Action.GIVE_UP:
            p.restart_finished()
    assert actions[-1] is Action.GIVE_UP and Action.GIVE_UP not in actions[:-1]
    assert backoffs[:4] == [0.0, 0.0, 1.0, 2.0]
    assert "crash loop" in p.give_up_reason() and "4 consecutive" in p.give_up_reason()
    # a progress report between failed starts resets the count
    q = RestartPolicy(crash_loop_starts=2)
    for _ in range(10):
        assert q.on_failure(q.generation) is not Action.GIVE_UP
        q.restart_finished()
        q.on_progress(q.generation)


def test_random_schedule_is_seeded_and_respects_holdoff():
    def run(seed):
        s = RandomFaultSchedule(["kill", "comm"], every=10, warmup=5, holdoff=8, procs_per_replica=2, seed=seed)
        out = []
        for t in range(0, 60):
            if s.due(t):
                f = s.pick(t, {0: 0.0, 1: 0.0, 2: 50.0})
                if f:
                    out.append(f)
        return out

    a, b = run(1), run(1)
    assert a == b and len(a) >= 4
    assert a[0].at == 8  # warm-up 5 s, but every replica is inside its 8 s hold-off until t=8
    assert all(f.replica != 2 or f.at >= 58 for f in a)


def test_replay_schedule(tmp_path):
    p = tmp_path / "faults.jsonl"
    p.write_text('{"at": 2, "replica": 1, "kind": "kill", "rank": 1}\n# comment\n{"at": 1, "replica": 0, "kind": "comm"}\n')
    s = ReplayFaultSchedule.from_file(p)
    assert not s.due(0.5)
    assert s.pick(1.5, {}) == PlannedFault(1.0, 0, "comm", 0)
    assert s.pick(3, {}) == PlannedFault(2.0, 1, "kill", 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"replica": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        ReplayFaultSchedule.from_file(bad)


def _story():
    ev = [
        make_event("run_started", t=0.0),
        make_event("quorum", replica=0, generation=0, quorum_id=1, participants=["a", "b", "c"], t=1.0),
        make_event("fault_injected", replica=0, generation=0, fault_kind="kill", t=10.0),
        make_event("failure_detected", replica=0, generation=0, step=40, t=10.5, traceback="Traceback..."),
        make_event("quorum", replica=1, generation=0, quorum_id=2, participants=["b", "c"], t=11.0),
        make_event("restart_started", replica=0, generation=0, t=10.6),
        make_event("restart_done", replica=0, generation=1, t=12.0, warm_spare=True),
        make_event("quorum", replica=0, generation=1, quorum_id=3, participants=["a2", "b", "c"], t=13.0),
        make_event("heal_done", replica=0, generation=1, donor=1, bytes=1000, seconds=0.5, t=13.5),
        make_event("commit", replica=0, generation=1, step=60, committed=True, t=14.0),
        make_event("run_finished", t=20.0),
    ]
    metrics = [
        {"time": float(t), "replica": r, "step": t, "loss": 5.0 - 0.1 * t, "committed": True}
        for r in range(3) for t in range(1, 10)
    ] + [{"time": 15.0 + i, "replica": r, "step": 60 + i, "loss": 3.0, "committed": True}
         for r in range(3) for i in range(5)]
    return ev, metrics


def test_recovery_breakdown_and_summary():
    ev, metrics = _story()
    (rec,) = recovery_breakdowns(ev)
    assert rec["detect"] == pytest.approx(0.5)
    assert rec["respawn"] == pytest.approx(1.5)
    assert rec["rejoin_quorum"] == pytest.approx(1.0)
    assert rec["transfer"] == pytest.approx(0.5)
    assert rec["first_commit"] == pytest.approx(0.5)
    assert rec["total"] == pytest.approx(4.0)
    s = compute_summary(ev, metrics, replicas=3, replicas_consistent=True)
    assert s["faults_injected"] == 1 and s["failures_detected"] == 1 and s["recoveries"] == 1
    assert s["max_quorum_id"] == 3 and s["full_restarts"] == 0
    assert s["recovery_seconds"] == {"p50": pytest.approx(4.0), "max": pytest.approx(4.0), "open": 0}
    assert s["initial_loss"] > s["final_loss"]
    assert s["goodput"] is None and s["goodput_estimate"] > 0  # no baseline: an estimate, never goodput
    assert percentile([1, 2, 3, 4], 0.5) == 2.5


def test_a_healing_step_s_loss_is_not_training_s():
    # A replica restarted near the end heals in the last step: it commits that step with the loss of its fresh
    # weights (here 11.0). Counted, it set the run's final loss and drew a spike at every recovery.
    ev, metrics = _story()
    clean = compute_summary(ev, metrics, replicas=3, replicas_consistent=True)["final_loss"]
    healing = {"time": 21.0, "replica": 1, "step": 65, "loss": 11.0, "committed": True, "participating": False}
    s = compute_summary(ev, metrics + [healing], replicas=3, replicas_consistent=True)
    assert s["final_loss"] == pytest.approx(clean) == pytest.approx(3.0)
    assert not trained_loss(healing) and trained_loss(metrics[0])
    assert not trained_loss({**metrics[0], "committed": False})


def test_report_written(tmp_path):
    ev, metrics = _story()
    w = JsonlWriter(tmp_path / "events.jsonl")
    for e in ev:
        w.write(e)
    w.close()
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for m in metrics:
            f.write(json.dumps(m) + "\n")
        f.write('{"torn": ')  # a killed run can leave a torn line
    assert len(list(read_jsonl(tmp_path / "metrics.jsonl"))) == len(metrics)
    assert active_replicas_series(ev) == [(1.0, 3), (11.0, 2), (13.0, 3)]
    out = write_report(tmp_path)
    page = out.read_text()
    for png in ("active_replicas.png", "loss.png", "quorum_ids.png", "recovery.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert png in page
    assert "failure_detected" in page and "Traceback" in page


def test_restart_resumes_every_replica_from_the_newest_common_checkpoint(tmp_path):
    from regent.orchestrate.session import common_checkpoint_step

    def save(replica: int, step: int, ranks: tuple[int, ...] = (0, 1)) -> None:
        for k in ranks:
            path = tmp_path / f"replica_{replica}" / f"step-{step:08d}" / f"rank{k}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
            path.with_name(path.name + ".json").write_text("{}")  # the manifest: written last, it completes it

    assert common_checkpoint_step(str(tmp_path), 2, 2) is None
    save(0, 5), save(1, 5), save(0, 10), save(0, 100)
    save(1, 10, ranks=(0,))  # replica 1 was killed between its ranks' saves of step 10
    assert common_checkpoint_step(str(tmp_path), 2, 2) == "step-00000005"
    save(1, 10, ranks=(1,))
    assert common_checkpoint_step(str(tmp_path), 2, 2) == "step-00000010"  # not replica 0's newer step 100
    assert common_checkpoint_step(str(tmp_path), 3, 2) is None  # a replica with none
    (tmp_path / "replica_1" / "step-00000010" / "rank1.pt.json").unlink()  # torn: file without manifest
    assert common_checkpoint_step(str(tmp_path), 2, 2) == "step-00000005"


def test_checkpoint_restart_refuses_a_damaged_file(tmp_path):
    import hashlib
    import json

    from regent.orchestrate.session import verify_checkpoint_file

    path = tmp_path / "rank0.pt"
    path.write_bytes(b"weights" * 100)
    with pytest.raises(ValueError, match="manifest .* missing"):
        verify_checkpoint_file(str(path))
    path.with_name("rank0.pt.json").write_text(json.dumps({"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}))
    verify_checkpoint_file(str(path))
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is damaged: sha256"):
        verify_checkpoint_file(str(path))


def test_live_feed_shows_a_failed_group_once_per_replica_and_build():
    from regent.orchestrate.events import make_event
    from regent.orchestrate.live import RunView

    view = RunView(replicas=2)
    lines = [view.on_event(make_event("group_failed", replica=1, quorum_id=4, rank=rank, group="4/s10f0",
                                      error="RuntimeError: injected")) for rank in (0, 1)]
    assert lines[0] == "replica 1 lost its group of quorum 4: RuntimeError: injected" and lines[1] is None
    again = view.on_event(make_event("group_failed", replica=1, quorum_id=4, rank=0, group="4/s10f1", error="x"))
    assert again is not None  # the next build of the group under the same quorum id is news
    told = view.on_event(make_event("peer_abort", replica=0, quorum_id=4, peer="replica_1:abc"))
    assert told == "replica 0 dropped its collective with failed peer replica_1:abc"


def test_a_replica_that_gave_up_stays_so_when_its_last_restart_reports_late():
    from regent.orchestrate.events import make_event
    from regent.orchestrate.live import RunView

    view = RunView(replicas=1)
    view.on_event(make_event("restart_started", replica=0, action="restart_in_place"))
    view.on_event(make_event("gave_up", replica=0, attempts=1))
    line = view.on_event(make_event("restart_done", replica=0, generation=1, seconds=3.4))
    assert line.startswith("replica 0 restarted") and view.reps[0].status == "gave up"
    assert view.reps[0].generation == 1  # the late event's facts are kept, only the verdict stays


def test_training_thread_priority_is_lowered_for_that_thread_only():
    import os
    import threading

    from regent.orchestrate.trainer_actor import lower_thread_priority

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, int | None] = {}

    def training() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        seen["want"] = min(19, before + 3) - before  # capped at 19 (when the tests themselves run niced)
        seen["returned"] = lower_thread_priority(3)
        seen["delta"] = os.getpriority(os.PRIO_PROCESS, tid) - before
        child: dict[str, int] = {}
        t = threading.Thread(target=lambda: child.update(nice=os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        t.start()
        t.join()
        seen["child"] = child["nice"] - before  # threads the loop starts later (Gloo's) inherit it
        seen["off"] = lower_thread_priority(0)

    t = threading.Thread(target=training)
    t.start()
    t.join()
    assert seen["delta"] == seen["want"] and seen["child"] == seen["want"] and seen["off"] is None
    assert seen["returned"] == min(19, main_before + 3)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before


@pytest.mark.parametrize("value", ["-1", "20"])
def test_training_nice_out_of_range_is_refused(value):
    with pytest.raises(ConfigError, match="--training-nice"):
        parse_train_argv(["--training-nice", value, "--no-faults"])


def test_every_event_the_ft_layer_emits_is_forwarded_or_explicitly_not():
    """A kind the Manager or the backstop emits but the trainer does not forward never reaches events.jsonl: it
    must be a decision (NOT_FORWARDED_KINDS), never an omission. Forwarded kinds must be known event kinds."""
    import re
    from pathlib import Path

    import regent.ft
    from regent.orchestrate.events import EVENT_KINDS
    from regent.orchestrate.trainer_actor import FORWARDED_KINDS, NOT_FORWARDED_KINDS

    root = Path(regent.ft.__file__).parent
    emitted = {m for f in root.rglob("*.py")
               for m in re.findall(r'(?:_emit|_on_event|on_event)\("([a-z_]+)"', f.read_text())}
    assert {"state_lost", "backstop_corrupt", "early_heal_done"} <= emitted  # the scan finds them
    assert emitted <= FORWARDED_KINDS | NOT_FORWARDED_KINDS, emitted - FORWARDED_KINDS - NOT_FORWARDED_KINDS
    assert set(EVENT_KINDS) >= FORWARDED_KINDS, FORWARDED_KINDS - set(EVENT_KINDS)


def test_checkpoint_restart_refuses_replicas_of_different_lineages(tmp_path):
    import json

    from regent.orchestrate.session import check_same_lineage

    for replica, lineage in ((0, 7), (1, 7), (2, None)):  # None: saved without a Lighthouse, not compared
        d = tmp_path / f"replica_{replica}" / "step-00000010"
        d.mkdir(parents=True)
        (d / "rank0.pt.json").write_text(json.dumps({"step": 10, "lineage": lineage}))
    check_same_lineage(str(tmp_path), "step-00000010", 3)
    (tmp_path / "replica_1" / "step-00000010" / "rank0.pt.json").write_text(json.dumps({"lineage": 9}))
    with pytest.raises(ValueError, match="different lineages"):
        check_same_lineage(str(tmp_path), "step-00000010", 3)


def test_first_random_fault_waits_for_every_replica_to_train_bounded():
    from regent.orchestrate.faults import FIRST_FAULT_GRACE_S

    s = RandomFaultSchedule(["kill"], every=10, warmup=5, holdoff=0, procs_per_replica=1, seed=0)
    # replica 0 trains, 1 and 2 are still starting: hitting 0 now would test start-up luck, not recovery
    assert s.pick(6, {0: 0.0, 1: None, 2: None}) is None
    f = s.pick(7, {0: 0.0, 1: 6.5, 2: 6.9})
    assert f is not None
    # later faults do not wait for everyone (restarting replicas are simply not eligible)
    assert s.pick(17, {0: 0.0, 1: None, 2: 6.9}) is not None
    # and the wait is bounded: a replica that never starts does not stop the faults
    s2 = RandomFaultSchedule(["kill"], every=10, warmup=5, holdoff=0, procs_per_replica=1, seed=0)
    assert s2.pick(5 + FIRST_FAULT_GRACE_S - 1, {0: 0.0, 1: None}) is None
    assert s2.pick(5 + FIRST_FAULT_GRACE_S, {0: 0.0, 1: None}).replica == 0


def test_left_behind_waits_for_the_grace_then_names_each_pending_replica_once():
    """The end of a run: once a replica has reported its final state for the grace, the ones still without one
    missed the last sync and are caught up, each once."""
    from regent.orchestrate.policy import left_behind

    assert left_behind({}, [0, 1], now=100.0, grace_s=30.0, caught_up=set()) == []  # nobody has finished
    assert left_behind({0: 80.0}, [1, 2], now=100.0, grace_s=30.0, caught_up=set()) == []  # within the grace
    assert left_behind({0: 80.0, 2: 60.0}, [3, 1], now=100.0, grace_s=30.0, caught_up=set()) == [1, 3]
    assert left_behind({0: 60.0}, [1, 3], now=100.0, grace_s=30.0, caught_up={1}) == [3]
