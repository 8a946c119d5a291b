"""One trainer rank's fault-tolerant training: Trainer + Manager + (DiLoCo | per-step allreduce).

No actor code here: the TrainerActor drives a TrainingSession step by step, and tests can drive one from a
plain process.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from regent import settings
from regent.integrity import file_sha256
from regent.orchestrate.config import constant_batch_choice
from regent.train.coverage import LEDGER_FILE

logger = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised inside the training loop by the `exception` fault kind."""


class TrainingSession:
    def __init__(
        self,
        cfg: Any,
        *,
        replica_index: int,
        rank: int,
        world_size: int,
        generation: int,
        lighthouse_addr: str,
        on_event: Callable[[str, dict], None] | None = None,
        resume_from: str | None = None,
        on_ready: Callable[[TrainingSession], None] | None = None,
    ) -> None:
        # where a (re)start's build time goes, reported by the trainer actor ("trainer_built")
        self.build_marks: list[tuple[str, float]] = [("start", time.time())]
        from regent.ft.manager import Manager
        from regent.train.trainer import Trainer

        self.cfg = cfg
        self.replica_index = replica_index
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.on_event = on_event or (lambda kind, d: None)
        # Per-step mode: the replicated group was rebuilt for a new quorum since the last commit (a replica joined,
        # healed from a donor, or left). Its first commit is voted on (`vote_due`): a healer's copy is then judged
        # against the other replicas one step after it was made, not up to `vote_every` commits later.
        self._new_quorum = False
        torch.set_num_threads(settings.REGENT_TORCH_THREADS.get())
        if world_size > 1 and not dist.is_initialized():
            from regent import platform

            dist.init_process_group(backend=platform.backend(), rank=rank, world_size=world_size)
        train_cfg = cfg.train
        ckpt_root = os.path.join(cfg.run_dir, "checkpoints", f"replica_{replica_index}")
        self.ckpt_root = ckpt_root
        if getattr(cfg, "trainer", ""):  # the user's own trainer (regent.orchestrate.user_trainer)
            self.trainer = build_user_trainer(cfg, rank=rank, world_size=world_size, replica_index=replica_index)
        else:
            self.trainer = Trainer(
                train_cfg,
                rank=rank,
                world_size=world_size,
                replica_index=replica_index,
                num_replicas=cfg.replicas,
            )
        self.build_marks.append(("trainer", time.time()))
        ft = cfg.ft
        self.mode = ft.mode
        self.backstop: Any = None
        if ft.backstop_every_s > 0 and cfg.recovery == "peer":
            from regent.ft.backstop import Backstop

            self.backstop = Backstop(os.path.join(cfg.run_dir, "backstop"), rank=rank, world_size=world_size,
                                     every_s=ft.backstop_every_s, keep=ft.backstop_keep,
                                     on_event=lambda kind, d: self._manager_event(kind, d),
                                     require_vouched=ft.vote_interval() > 0)
        self.manager = Manager(
            pg=replicated_group(ft),
            load_state_dict=self._load_peer_state,
            state_dict=self._peer_state,
            min_replica_size=ft.min_replica_size,
            use_async_quorum=(ft.mode == "ddp"),
            timeout=ft.timeout_s,
            quorum_timeout=ft.quorum_timeout_s,
            connect_timeout=ft.connect_timeout_s,
            group_rank=rank,
            group_world_size=world_size,
            store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            store_port=settings.REGENT_FT_STORE_PORT.get(),
            lighthouse_addr=lighthouse_addr,
            replica_id=f"replica_{replica_index}",
            init_sync=ft.init_sync,
            max_retries=ft.max_retries,
            on_event=self._manager_event,
            backstop=self.backstop,
            lost_state="raise",  # regent train keeps a backstop; with none, stopping beats a silent reset
            quorum_reuse=ft.quorum_reuse,
        )
        self.build_marks.append(("manager", time.time()))
        self.diloco: Any = None
        self.grad_sync: Any = None  # ddp mode, unsharded: gradients averaged while backward runs
        self.constant_batch = constant_batch_choice(cfg)[0]
        if self.constant_batch and not callable(getattr(getattr(self.trainer, "dataloader", None), "shard_batch",
                                                        None)):
            raise ValueError("ft.constant_batch needs a data loader that can read any shard's batch "
                             "(the built-in trainer's); this trainer's cannot: drop --ft.constant-batch")
        self._ledger_path = os.path.join(cfg.run_dir, LEDGER_FILE) if cfg.run_dir else None
        # DiLoCo's sample ledger, per fragment (one in plain DiLoCo): (global batch, replica-shards) of each inner
        # step since that fragment's last sync, the global batches whose effect a sync of it that did not commit
        # dropped (Streaming DiLoCo: recorded as skipped at its next commit; plain DiLoCo trains them again), and
        # the last sync seen (`DiLoCo.last_sync`, a new record per sync)
        self._fragments = max(1, int(getattr(ft, "fragments", 1) or 1)) if ft.mode == "diloco" else 1
        self._covers: list[list[tuple[int, list[int]]]] = [[] for _ in range(self._fragments)]
        self._skip_note = False  # the step in progress healed: its batch is not noted (`_clear_covers`)
        self._failed: list[list[list[int]]] = [[] for _ in range(self._fragments)]
        self._seen_sync: Any = None
        self._ledger_writer: bool | None = None  # `_ledger_on`, decided once
        if ft.mode == "diloco":
            from regent.ft.local_sgd import DiLoCo, model_fragments

            # Streaming DiLoCo (`ft.fragments` > 1): the model's parameters in that many contiguous groups of about
            # equal size, each with its own outer optimizer, synced in turn
            fragments = model_fragments(self.trainer.model, self._fragments)
            outers = [torch.optim.SGD(f.parameters(), lr=ft.outer_lr, momentum=ft.outer_momentum, nesterov=True)
                      for f in fragments]
            self.diloco = DiLoCo(
                self.manager,
                fragments,
                self.trainer.optimizer,
                outers if len(outers) > 1 else outers[0],
                sync_every=ft.sync_every,
                fragment_sync_delay=ft.fragment_sync_delay,
                fragment_update_alpha=ft.fragment_update_alpha,
                sync_retries=ft.sync_retries,
                early_heal=ft.early_heal,
                hook_optimizer=False,  # driven by the step's owner below
                committed_extra=self._committed_extra,
                load_committed_extra=self._load_committed_extra,
                round_step=lambda: self.trainer.step + int(self._in_step),
                on_contributor_step=self._align_step,
                # with a constant global batch the round's members cover a restarted replica's shard for the whole
                # round: it joins at the round's sync (training its shard too would consume those samples twice)
                join_mid_round=not self.constant_batch,
                on_round_failed=self._give_back_round,
                exactly_once=True,  # Streaming DiLoCo's per-fragment ledger needs a healer's windows its own
                # a Lighthouse that leaves late members out of a sync: a replica left out catches up at once
                rejoin_left_behind=ft.early_heal and cfg.lighthouse.late_member_ms > 0,
            )
        else:
            if ft.bucket_mb > 0 and not self.trainer.sharded:
                from regent.ft.grad_sync import OverlappedAllreduce

                self.grad_sync = OverlappedAllreduce(self.manager, self.trainer.model.parameters(),
                                                     bucket_bytes=int(ft.bucket_mb * 1024 * 1024))
        # The one owner of a step's fault-tolerance rules (regent.ft.step): the trainer's step runs under it.
        from regent.ft.step import FaultTolerantStep

        self.ft_step = FaultTolerantStep(
            self.manager,
            per_step=self.diloco is None,
            sync=self.diloco,
            overlapped=self.grad_sync,
            serve_live=(self._peer_state, self._load_peer_state) if ft.early_heal and self.diloco is None else None,
            backstop=self.backstop,
            early_heal=ft.early_heal,
            constant_batch=(cfg.replicas, _cover(cfg.replicas, per_step=self.diloco is None))
            if self.constant_batch else None,
        )
        self._backstop_state: Any = None
        if self.backstop is not None:
            # what the backstop copies (FaultTolerantStep.backstop_copies says why, and who waits for the copy)
            self._backstop_state = ((lambda: {"committed": True, **self.manager.committed_state()})
                                    if self.ft_step.backstop_copies == "committed" else self.manager.full_state_dict)
        if resume_from:
            self._resume(resume_from)
            self.manager.accept_loss(f"checkpoint restart from {resume_from}")
        self.stop_at: int | None = None
        self.inject_exception = False
        self.inject_bitflip = False
        self.witness_requests: set[int] = set()  # committed steps the controller asked this rank to digest
        # DiLoCo: the parts of `agreed_state` that move on during a round (the trainer's step, schedule and data
        # position; the Manager's counters, at the next sync's vote), as they were at the last sync's boundary:
        # (committed step, trainer extra, Manager state). A witness digest is of that sync's state.
        self._held_sync: tuple[int, dict[str, Any], dict[str, Any]] | None = None
        self._held_quorum: int | None = None  # the quorum id when `_held_sync` was taken
        # (step, digest) of the committed state last replaced after a quorum change: a request about it that
        # arrives after the change (a heal in a round's last moments) is still answered (`_before_committed_change`)
        self._replaced: tuple[int, str] | None = None
        if self.diloco is not None:
            # the last moment the committed state of that sync is still whole, on the training thread
            self.manager.before_committed_change(self._before_committed_change)
        self.vote_every = ft.vote_interval()
        self._voted_step: int | None = None
        self._digest_cache: tuple[int, str, dict[str, str]] | None = None
        self.build_marks.append(("wrap", time.time()))
        if on_ready is not None:
            on_ready(self)  # built and ready; what follows is waiting for the other replicas
        # Never train on from less than the run has committed: pull it from a live holder now (DiLoCo's early
        # heal), or restore the durable backstop when no holder is left (a counted lineage reset).
        self.ft_step.recover()
        if self.diloco is not None:
            # Join the replicas' sync round right away instead of after `sync_every` local steps: a fresh
            # replica waits for the others' next sync boundary, heals there from a donor, takes part in the
            # same allreduce, and then runs its local steps in phase with everyone. (At the very start of
            # training this is the initial weight sync.)
            # A commit boundary like any other, and at the start of a run the first one: the initial weight
            # sync. Without a backstop of it, a soak lost the run when the only replica that had committed it
            # (the others still starting) died before its first sync round ended.
            if self.stop_at is not None and self.trainer.step >= self.stop_at:
                # healed at the end of the run (a late bitflip, run.py's final vote): the peers have stopped at
                # this sync and join no further round; the pulled committed state is the final one
                return
            joined = self.ft_step.join_round()
            if self.diloco.joined_mid_round is not None:
                # training again now, in the round in progress (its first commit comes at the round's end)
                self.on_event("round_joined", {"manager_step": self.manager.current_step(),
                                               **self.diloco.joined_mid_round})
            self._after_commit(joined)
            # the sync it joined is a commit like any other: it votes there too (without this, every replica
            # rejoining at a vote's sync left it, and a flip was found a vote late in a run with many restarts)
            self._maybe_vote(joined)
            self._clear_covers()  # a sync it sat out, or a round joined in progress: nothing of its own yet
            self._seen_sync = self.diloco.last_sync

    # -- the state a healer receives ------------------------------------------------------------------
    @property
    def _in_step(self) -> bool:
        """Inside the optimizer step's update (`FaultTolerantStep.in_step`): the trainer's step counter has not
        moved yet. False while the session is being built."""
        ft_step = getattr(self, "ft_step", None)
        return bool(ft_step is not None and ft_step.in_step)

    def _peer_state(self) -> dict[str, Any]:
        """The trainer's state, marked with whether it was taken inside the update (DiLoCo syncs and heals happen
        right after the optimizer step, in `FaultTolerantStep.update`, before the trainer counts the step)."""
        sd = self.trainer.state_dict()
        sd["mid_step"] = self._in_step
        return sd

    def _committed_extra(self) -> dict[str, Any]:
        """The trainer's part of DiLoCo's committed state, taken at the commit (inside optimizer.step())."""
        return {**self.trainer.extra_state(), "mid_step": self._in_step}

    def _load_committed_extra(self, extra: dict[str, Any]) -> None:
        delta = int(bool(extra.get("mid_step", False))) - int(self._in_step)
        self.trainer.load_extra_state(extra)
        self.trainer.advance(delta)
        self.trainer.skip_batches(delta)  # the data position is a step boundary's: it follows the step
        self._clear_covers()  # the batches trained before are not this state's: they count for nothing

    def _align_step(self, step: int) -> None:
        """A replica that sat out a round takes the contributors' step count, schedule position and data
        position: the batches of its shard for that round are skipped, as every contributor's were consumed."""
        delta = step - int(self._in_step) - self.trainer.step
        if delta > 0:
            self.trainer.advance(delta)
            self.trainer.skip_batches(delta)
            self._clear_covers()

    def _load_peer_state(self, sd: dict[str, Any]) -> None:
        sd = dict(sd)
        # The step counter and the schedule must end up where the donor's will be once both finish the
        # current step: correct by one when exactly one side is inside optimizer.step().
        delta = int(bool(sd.pop("mid_step", False))) - int(self._in_step)
        self.trainer.load_state_dict(sd)
        self.trainer.advance(delta)
        self.trainer.skip_batches(delta)  # the data position is a step boundary's: it follows the step
        self._clear_covers()  # a healer's batches of this round were not its donor's: they count for nothing

    def _give_back_round(self, steps: int) -> None:
        """Plain DiLoCo, a sync that did not commit (`regent.ft.local_sgd.steps_given_back`): the parameters went
        back to the last global ones, so the step count, the schedule and the data position go back `steps` inner
        steps too, to the round's first batch, and the round's samples are trained again (and count once, in the
        round that commits them). Called inside the update of the round's last inner step, which the trainer
        counts after it, so the step in progress lands on the round's first step.

        Every replica of that sync gives back the same steps from the same position, so their positions stay
        equal. A replica for which the sync failed while it committed for the others (it missed the vote's
        answer) gives its round back alone; at the next quorum it is behind and heals from a donor, taking the
        donor's position (its batches trained meanwhile count for nothing, `_load_peer_state`), so positions
        never differ past one round. Its samples of the round were committed by the others' sync (its
        pseudo-gradient was in their average) but it writes no line of them, not knowing: `regent check` then
        reports that round's gap rather than pass over it (a known false alarm of this rare split vote, never a
        sample counted twice). A replica that joined mid-round gives back the steps it skipped to line up
        with the others too (`DiLoCo` counts them in the round's steps): it lands on the same first batch."""
        self.trainer.advance(-steps)
        self.trainer.skip_batches(-steps)

    def _clear_covers(self) -> None:
        """Forget the batches noted since each fragment's last sync: this replica's state is no longer the one
        they trained. Inside a step (a heal in its quorum) that step's batch is not noted either: it trained the
        state just replaced."""
        for cover in self._covers:
            cover.clear()
        self._skip_note = self._in_step

    # -- events from the Manager ----------------------------------------------------------------------
    def _manager_event(self, kind: str, details: dict) -> None:
        if kind == "quorum":
            self._new_quorum = True
        details = dict(details)
        details.setdefault("quorum_id", self.manager.quorum_id() if hasattr(self, "manager") else None)
        self.on_event(kind, details)
        if kind == "early_heal_done":
            step = details.get("manager_step", details.get("step"))
            if self.diloco is not None and step is not None:  # it holds that sync's boundary state now
                self._hold_sync(int(step))
            self._report_heal_digest(step)

    def _report_heal_digest(self, step: int | None) -> None:
        """Right after an early heal, this rank's digest of the state it copied, committed step `step`. The
        controller compares it with the vote of that step, or at a step with no vote with the digests it asks the
        holders for (`answer_witness_requests`): a checked copy is a witness in the next vote, and a tie between
        a flipped replica and a correct one with its copy becomes a majority (`vote.StateVotes.verified`). Without
        it such a tie restored the backstop (a counted lineage reset)."""
        if not self.vote_every or step is None or (self.diloco is None and step % self.vote_every):
            return  # no vote to compare with, and per-step mode's holders cannot be asked (`_check_copy`)
        t0 = time.perf_counter()
        digest, _ = self.state_digest()
        self.on_event("heal_digest", {"manager_step": step, "digest": digest, "ranks": self.world_size,
                                      "seconds": round(time.perf_counter() - t0, 6)})

    # -- the sample ledger -----------------------------------------------------------------------------
    def _ledger_on(self) -> bool:
        if self._ledger_writer is None:
            self._ledger_writer = self._ledger_applies()
        return self._ledger_writer

    def _ledger_applies(self) -> bool:
        """Whether this rank writes the sample ledger: rank 0 of a replica, with Regent's own loaders (their batch
        n of shard k is the sample range the ledger names; a spec's or user trainer's own data path has its own
        numbering, which the ledger cannot vouch for). DiLoCo: with no sync delay (plain or Streaming DiLoCo).
        A delayed sync (`ft.fragment_sync_delay` > 0) applies the average of pseudo-gradients taken `delay`
        inner steps before it and then sets the fragment to the new global parameters: the samples of those
        `delay` steps changed the fragment locally and their effect is dropped (with `fragment_update_alpha` > 0,
        part of it is mixed back without ever being averaged), so no sync commits them exactly once."""
        from regent.train.data import HFStreamBatches, ShardedBatches

        loader = getattr(self.trainer, "dataloader", None)
        if (self.rank != 0 or self._ledger_path is None or not isinstance(loader, (ShardedBatches, HFStreamBatches))
                or not hasattr(self.trainer, "last_coverage")):
            return False
        return self.diloco is None or self.cfg.ft.fragment_sync_delay == 0

    def _record_samples(self) -> None:
        """After a committed step, rank 0 of each participating replica appends the global sample ranges it
        covered to RUN_DIR/ledger.jsonl (`ledger_line`): written by the trainers themselves, so the ledger
        survives controller loss and restarts; `regent check` proves from it that no sample was consumed twice
        in committed steps and none skipped without a record."""
        if not self._ledger_on():
            return
        loader = self.trainer.dataloader
        try:
            if not self.manager.is_participating():
                return
            participants = self.manager.num_participants()
        except Exception:  # noqa: BLE001 - the step committed, so the quorum did not fail; never stop training
            return
        batch, shards = self.trainer.last_coverage
        line = ledger_line(step=self.manager.current_step(), batch=batch, replica=self.replica_index,
                           generation=self.generation, shards=shards, participants=participants,
                           replicas=self.cfg.replicas, ranks=self.world_size, batch_size=int(loader.batch_size),
                           constant_batch=self.constant_batch)
        append_line(self._ledger_path, line)

    def _record_round(self) -> None:
        """DiLoCo, after every inner step: note the batch it covered, for every fragment; at a sync, the samples
        since the synced fragment's last sync go to the ledger when it committed (`round_ledger_line`, Streaming
        DiLoCo: `fragment_ledger_line`). What "committed" means: the sync committed and averaged this replica's
        pseudo-gradient (weight > 0); a replica that sat the sync out (just restarted, or healed in its quorum)
        writes nothing of it. A sync that did not commit: plain DiLoCo gives the round back and trains it again
        (`_give_back_round`), so its batches are simply noted again; Streaming DiLoCo records them as skipped for
        that fragment at this replica's next commit of it (`round_outcome`)."""
        if not self._ledger_on():
            return
        batch, shards = self.trainer.last_coverage
        if self._skip_note:
            self._skip_note = False
        else:
            for cover in self._covers:
                cover.append((batch, list(shards)))
        sync = self.diloco.last_sync
        if sync is self._seen_sync or not sync:
            return
        self._seen_sync = sync
        fragment = int(sync.get("fragment") or 0)
        cover, self._covers[fragment] = self._covers[fragment], []
        skipped_batches, self._failed[fragment] = round_outcome(cover, sync, self._failed[fragment])
        sat_out = False
        if skipped_batches is None and self._fragments > 1 and sync.get("committed") and cover:
            # Streaming DiLoCo: it sat this committed sync out though it trained in the window (it joined inside
            # it, `DiLoCo._restart_fragments`): nobody committed its batches. A line without samples says where
            # the window ends, so that the checker counts it as skipped; with no contributor at all there would
            # be no line of this sync, and the window's samples would vanish without a record
            skipped_batches, self._failed[fragment], sat_out = self._failed[fragment], [], True
        if skipped_batches is None:
            return
        common = dict(step=int(sync["step"]), cover=cover, replica=self.replica_index, generation=self.generation,
                      contributors=int(sync.get("contributors") or 0), weight_sum=float(sync.get("weight_sum") or 0.0),
                      replicas=self.cfg.replicas, ranks=self.world_size,
                      batch_size=int(self.trainer.dataloader.batch_size), skipped_batches=skipped_batches)
        if self._fragments > 1:
            line = fragment_ledger_line(fragment=fragment, fragments=self._fragments, sat_out=sat_out, **common)
        else:
            line = round_ledger_line(period=self.cfg.ft.sync_every, **common)
        append_line(self._ledger_path, line)

    # -- the loop --------------------------------------------------------------------------------------
    def at_boundary(self) -> bool:
        """Replicas are bit-identical only right after a sync: every step in ddp mode, every H in DiLoCo."""
        if self.diloco is None:
            return True
        return self.diloco.local_step == 0

    def should_stop(self) -> bool:
        return self.stop_at is not None and self.trainer.step >= self.stop_at and self.at_boundary()

    def step(self) -> dict[str, Any]:
        if self.inject_exception:
            self.inject_exception = False
            raise InjectedFault(f"injected exception in replica {self.replica_index} rank {self.rank}")
        if self.witness_requests:  # before a flip injected at the same moment: the state as committed
            self.answer_witness_requests()
        if self.inject_bitflip:  # between two steps, on the training thread: nothing else writes the state now
            self.inject_bitflip = False
            self._flip_a_bit()
        self.ft_step.start()
        t0 = time.time()
        record = self.trainer.train_step(self.ft_step)
        record.update(
            time=time.time(),
            replica=self.replica_index,
            generation=self.generation,
            rank=self.rank,
            quorum_id=self.manager.quorum_id(),
            manager_step=self.manager.current_step(),
            # the quorum this replica's state was committed in (None but on group rank 0): with manager_step, what
            # the controller hands a Lighthouse it restarts (`regent.ft.quorum.seed_watermark`)
            lineage=self.manager.lineage(),
            wall_s=time.time() - t0,
            rss_mb=_rss_mb(),
        )
        if self.mode == "ddp" and not self._participated():
            # healing in this step: its loss is of the state it held before the heal (a restarted replica's
            # fresh or backstop weights), and its gradient counted as zeros. The step commits on it all the same
            # (it now holds the committed state), but the loss is not training's: reports leave it out.
            record["participating"] = False
        if self.diloco is not None and self.at_boundary():
            self._hold_sync(self.manager.current_step())
        if self.mode == "ddp" and record.get("committed", True):
            self._record_samples()
        elif self.diloco is not None:
            self._record_round()
        self._after_commit(record.get("committed", True))
        self._maybe_vote(record.get("committed", True))
        if self.cfg.recovery == "restart" and self.at_boundary() and record.get("committed", True):
            every = self.cfg.checkpoint_every
            if every and self.trainer.step % every == 0 and self.trainer.step > 0:
                self._checkpoint()
        return record

    def _participated(self) -> bool:
        """Whether this replica's gradient counted in the step just run (False: it was healing)."""
        try:
            return bool(self.manager.is_participating())
        except Exception:  # noqa: BLE001 - the quorum failed: the step did not commit, which its record says
            return True

    # -- state votes (regent.ft.digest) -----------------------------------------------------------------
    def agreed_state(self, at_sync: tuple[int, dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
        """What every replica that committed the same steps holds bit for bit, on this rank: in per-step mode the
        whole training state (model, optimizer, schedule, data position, step) and the Manager's counters; in
        DiLoCo the committed global state (global parameters, outer optimizer, and schedule, data position and
        step at the sync). DiLoCo's inner optimizer state is each replica's own and is left out. `at_sync`
        (DiLoCo, mid-round): the parts the round has moved on from, as held at the sync (`_held_sync`)."""
        if self.diloco is not None:
            committed = self.diloco._committed_state()
            committed.pop("round", None)  # the holder's round clock: not state, never the same on two replicas
            extra = committed["extra"] if at_sync is None else at_sync[1]
            committed["extra"] = {k: v for k, v in extra.items() if k != "mid_step"}
            return {"committed": committed,
                    "regent": self.manager.state_dict() if at_sync is None else dict(at_sync[2])}
        sd = self.trainer.state_dict()
        return {"trainer": sd, "regent": self.manager.state_dict()}

    def state_digest(self, at_sync: tuple[int, dict[str, Any], dict[str, Any]] | None = None
                     ) -> tuple[str, dict[str, str]]:
        """(digest of this rank's agreed state, digests of its parts: where two replicas differ); `at_sync` as in
        `agreed_state`."""
        from regent.ft.digest import digest_with_parts

        return digest_with_parts(self.agreed_state(at_sync=at_sync), depth=3)

    def _maybe_vote(self, committed: bool) -> None:
        """Every `vote_every` commits, at a sync boundary, and in per-step mode at the first commit of a new
        quorum: report this rank's digest; the controller compares the replicas' (OrchestrationManager._vote)."""
        step = self.manager.current_step()
        new_quorum = self._new_quorum and self.diloco is None
        if not committed or not vote_due(step, self.vote_every, new_quorum=new_quorum, voted_step=self._voted_step,
                                         at_boundary=self.at_boundary()):
            return
        self._new_quorum = False
        self._voted_step = step
        t0 = time.perf_counter()
        digest, parts = self._digest_at(step)
        self.on_event("state_digest", {"manager_step": step, "digest": digest, "parts": parts,
                                       "ranks": self.world_size, "seconds": round(time.perf_counter() - t0, 6)})

    def _hold_sync(self, step: int) -> None:
        """The committed state is `step`'s from here until it next changes. A request still pending is answered at
        the next step's start if it asks about `step`; one about the state replaced came too late (dropped)."""
        self._held_sync = (step, self.trainer.extra_state(), self.manager.state_dict())
        self._held_quorum = self.manager.quorum_id()

    def _before_committed_change(self) -> None:
        """Answer the requests about the committed state that is about to change; until the next boundary holds
        the new one (`_hold_sync`), nothing is answered from it (a Streaming DiLoCo fragment sync changes it
        mid-round). When the quorum changed since that state was taken (a healed replica joined the sync, or
        one left), its digest is kept first: a replica that healed in the round's last moments is asked about it
        only after this sync (in soaks about one check in ten went unanswered so); in a steady quorum nothing
        is computed."""
        if self.witness_requests:
            self.answer_witness_requests()
        held = self._held_sync
        if held is not None and self.manager.quorum_id() != self._held_quorum:
            self._replaced = (held[0], self.state_digest(at_sync=held)[0])
        self._held_sync = None

    def answer_witness_requests(self) -> None:
        """Another replica copied the committed state of a step with no vote; the controller asks every holder for
        its digest of that step to check the copy (`vote.StateVotes.witnessed`). DiLoCo keeps its committed
        global state unchanged until the next sync's outer step, so a holder answers at its next inner step or,
        at the latest, right before that outer step (`Manager.before_committed_change`; a holder waiting in the
        sync's quorum answers there), from the global state and the parts held at the last boundary
        (`_held_sync`), or from the digest kept when a quorum change replaced it (`_replaced`). Otherwise a
        holder that committed a newer step before it was asked cannot answer: it says so at once (`declined`), and
        the check goes on without it instead of waiting out its timeout. A request about a step this holder has
        not reached yet (it is still in that sync) waits for it. Per-step mode commits every step, so the
        controller asks only in DiLoCo."""
        later: set[int] = set()
        while self.witness_requests:
            step = self.witness_requests.pop()  # atomic: the actor's event loop adds to it meanwhile
            held, replaced = self._held_sync, self._replaced
            t0 = time.perf_counter()
            if self.diloco is not None and held is not None and held[0] == step:
                digest, _ = self.state_digest(at_sync=held)
            elif self.diloco is not None and replaced is not None and replaced[0] == step:
                digest = replaced[1]
            elif witness_answer(step, held_step=held[0] if held is not None else None,
                                current_step=self.manager.current_step()) == "wait":
                later.add(step)
                continue
            else:
                self.on_event("witness_digest", {"manager_step": step, "digest": "", "declined": True,
                                                 "ranks": self.world_size})
                continue
            self.on_event("witness_digest", {"manager_step": step, "digest": digest, "ranks": self.world_size,
                                             "seconds": round(time.perf_counter() - t0, 6)})
        self.witness_requests.update(later)

    def _digest_at(self, step: int) -> tuple[str, dict[str, str]]:
        """This rank's digest of its agreed state at committed step `step`, computed once per step: the vote and
        the backstop saved at the same boundary (which records it, to be vouched for) share it."""
        if self._digest_cache is None or self._digest_cache[0] != step:
            self._digest_cache = (step, *self.state_digest())
        return self._digest_cache[1], self._digest_cache[2]

    def _flip_a_bit(self) -> None:
        """The `bitflip` fault: one bit of one element of one tensor the replicas agree on, in place on its device
        (a parameter or an optimizer moment; in DiLoCo a global parameter or the outer momentum)."""
        import random

        from regent.ft.digest import FLIP_BITS, flip_bit

        tensors: list[tuple[str, torch.Tensor]] = []

        def walk(tree: Any, path: str) -> None:
            if isinstance(tree, torch.Tensor):
                t = tree.to_local() if callable(getattr(tree, "to_local", None)) else tree
                if t.is_floating_point() and t.numel() > 0 and t.is_contiguous() and t.element_size() in FLIP_BITS:
                    tensors.append((path, tree))
            elif isinstance(tree, dict):
                for k, v in tree.items():
                    walk(v, f"{path}/{k}")

        if self.backstop is not None:
            self.backstop.wait_copied()  # a save in flight copies the state it vouched for, not the flipped one
        state = self.agreed_state()
        walk(state.get("committed", state.get("trainer")), "")
        if not tensors:
            logger.warning("replica %d rank %d: bitflip: no tensor to flip", self.replica_index, self.rank)
            return
        rng = random.Random()
        name, t = rng.choice(tensors)
        local = t.to_local() if callable(getattr(t, "to_local", None)) else t
        index = rng.randrange(local.numel())
        bit = rng.choice(list(FLIP_BITS[local.element_size()]))
        flip_bit(t, index, bit)
        self.on_event("bitflip_applied", {"manager_step": self.manager.current_step(), "tensor": name,
                                          "index": index, "bit": bit})

    # -- the durable backstop -------------------------------------------------------------------------
    def _after_commit(self, committed: bool) -> None:
        """At a commit boundary: a backstop save if one is due."""
        if committed and self.backstop is not None and self.at_boundary():
            self._maybe_backstop()

    def _maybe_backstop(self) -> None:
        """At a commit boundary: the writing replica (the first up-to-date replica of the quorum) saves the
        committed state when the interval is up. Group rank 0 decides for all ranks, so they save the same
        step."""
        if self.manager.participating_rank() != 0:
            return
        step = self.manager.current_step()
        voting = bool(self.vote_every) and self.backstop.require_vouched
        due = self.backstop.due()
        if due and voting and step % self.vote_every:
            due = not self.backstop.any_saved()  # saves fall on vote steps to be vouched for; the first cannot wait
        if self.world_size > 1:
            store, key = self.manager.group_store, f"regent/backstop/{step}"
            if self.rank == 0:
                store.set(key, "1" if due else "0")
            else:
                due = store.get(key) == b"1"
        if due:
            digest = self._digest_at(step)[0] if voting and step % self.vote_every == 0 else None
            self.backstop.maybe_save(step, self._backstop_state, force=True, digest=digest)

    # -- checkpoint-restart baseline ------------------------------------------------------------------
    def _full_state(self) -> dict[str, Any]:
        return self.manager.full_state_dict()

    def _checkpoint(self) -> None:
        """rank{r}.pt and its manifest rank{r}.pt.json (step, sha256 of the file): a restart verifies the file
        before loading it, so a torn or damaged checkpoint is refused by name instead of unpickled."""
        step = self.trainer.step
        path = os.path.join(self.ckpt_root, f"step-{step:08d}", f"rank{self.rank}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        torch.save(self._full_state(), tmp)
        manifest = {"step": step, "replica": self.replica_index, "rank": self.rank, "sha256": file_sha256(tmp)[0],
                    "lineage": self.manager.lineage()}
        with open(path + ".json.tmp", "w") as f:
            json.dump(manifest, f)
        os.replace(tmp, path)
        os.replace(path + ".json.tmp", path + ".json")  # last: a checkpoint counts once its manifest exists

    def _resume(self, root: str) -> None:
        # Every replica resumes from the same step: a replica killed between two replicas' saves of one boundary
        # would otherwise come back a sync round behind the others and stay out of step for the rest of the run.
        step = common_checkpoint_step(root, self.cfg.replicas, self.cfg.procs_per_replica)
        if step is None:
            logger.warning("replica %d rank %d: no checkpoint every replica has under %s, starting fresh",
                           self.replica_index, self.rank, root)
            return
        path = os.path.join(root, f"replica_{self.replica_index}", step, f"rank{self.rank}.pt")
        verify_checkpoint_file(path)
        check_same_lineage(root, step, self.cfg.replicas)
        self.manager.load_full_state_dict(torch.load(path, weights_only=False))
        logger.info("replica %d rank %d resumed from %s", self.replica_index, self.rank, path)

    def param_hash(self) -> str:
        return self.trainer.param_hash()

    def close(self) -> None:
        if self.backstop is not None:
            self.backstop.wait(timeout=60)
        if self.diloco is not None:
            try:
                self.diloco.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001 - reported; the manager below is still shut down
                logger.warning("replica %d rank %d: closing DiLoCo failed: %r", self.replica_index, self.rank, exc)
        self.manager.shutdown(wait=False)


def ledger_line(*, step: int, batch: int, replica: int, generation: int, shards: list[int], participants: int,
                replicas: int, ranks: int, batch_size: int, constant_batch: bool) -> dict[str, Any]:
    """One line of the sample ledger: replica `replica` covered `shards` of global batch `batch` in committed
    step `step`, as sample ranges [lo, hi). `skipped` counts the replica-shards of that batch that nobody in the
    quorum covered (replicas - participants without a constant global batch; 0 with it): the skip record."""
    from regent.train.coverage import step_sample_ranges

    ranges = step_sample_ranges(batch, shards, replicas=replicas, ranks=ranks, batch_size=batch_size)
    return {"time": time.time(), "step": step, "batch": batch, "replica": replica, "generation": generation,
            "shards": list(shards), "participants": participants, "replicas": replicas, "ranks": ranks,
            "batch_size": batch_size, "samples": [list(r) for r in ranges],
            "skipped": 0 if constant_batch else replicas - participants}


def round_outcome(cover: list[tuple[int, list[int]]], sync: dict[str, Any], failed: list[list[int]]
                  ) -> tuple[list[list[int]] | None, list[list[int]]]:
    """What a DiLoCo sync makes of the batches trained since its fragment's last sync (`cover`), for the ledger:
    (the `skipped_batches` of the line to write, or None to write none; the batches still to record as skipped).

    A sync that did not commit and gave its round back (plain DiLoCo, `given_back` > 0) records nothing: the
    round is trained again and its samples count in the round that commits them. One that did not commit and
    gave nothing back (Streaming DiLoCo: only this fragment lost the samples' effect) adds those batches to the
    ones to record as skipped for this fragment. One that committed and averaged this replica's pseudo-gradient
    (weight > 0) writes a line carrying them all; a committed one it sat out (or trained nothing in) writes none
    and keeps them for its next."""
    if not sync.get("committed"):
        if not cover or int(sync.get("given_back") or 0) > 0:
            return None, failed
        return None, [*failed, [min(n for n, _ in cover), max(n for n, _ in cover) + 1]]
    if not cover or float(sync.get("weight") or 0.0) <= 0.0:
        return None, failed
    return list(failed), []


def round_ledger_line(*, step: int, cover: list[tuple[int, list[int]]], replica: int, generation: int,
                      contributors: int, weight_sum: float, period: int, replicas: int, ranks: int, batch_size: int,
                      skipped_batches: list[list[int]]) -> dict[str, Any]:
    """One DiLoCo line of the sample ledger: replica `replica` covered the (global batch, replica-shards) of
    `cover`, its inner steps since the last sync, in the round committed as step `step`.

    `round` is the round's global batches [lo, hi): the `period` batches ending with this replica's last (every
    contributor ends the round at the same batch; one that joined mid-round covers its tail only).
    `skipped_samples` are the round's samples no contributor covered, from the sum of the contributors' weights
    (`contributors` of them): the replicas that died in the round or joined it late. `skipped_batches` are global
    batches of rounds whose sync did not commit, all their samples skipped."""
    from regent.train.coverage import round_sample_ranges, round_skipped_samples

    last = max(n for n, _ in cover)
    ranges = round_sample_ranges(cover, replicas=replicas, ranks=ranks, batch_size=batch_size)
    return {"time": time.time(), "step": step, "round": [last + 1 - period, last + 1],
            "batches": [min(n for n, _ in cover), last + 1], "replica": replica, "generation": generation,
            "micro_batches": sum(len(shards) for _, shards in cover), "participants": contributors,
            "replicas": replicas, "ranks": ranks, "batch_size": batch_size, "samples": [list(r) for r in ranges],
            "skipped_samples": round_skipped_samples(weight_sum, replicas=replicas, period=period, ranks=ranks,
                                                     batch_size=batch_size),
            "skipped_batches": [list(b) for b in skipped_batches]}


def fragment_ledger_line(*, step: int, fragment: int, fragments: int, cover: list[tuple[int, list[int]]], replica: int,
                         generation: int, contributors: int, weight_sum: float, replicas: int, ranks: int,
                         batch_size: int, skipped_batches: list[list[int]], sat_out: bool = False) -> dict[str, Any]:
    """One Streaming DiLoCo line of the sample ledger: replica `replica` covered the (global batch, replica-shards)
    of `cover`, its inner steps since fragment `fragment`'s last sync, and the sync of that fragment committed as
    step `step` averaged their effect on it.

    A fragment's sync commits, on that fragment, the samples trained since its previous sync, so exactly-once is
    per fragment: each fragment's committed lines cover every sample once, or a record says it was skipped. The
    line does not name the window it closes (a replica that joined since cannot know where it starts): the
    checker takes it from the fragment's previous committed sync (`regent.orchestrate.invariants`), and the
    samples no contributor covered from `weight_sum` (a whole contributor's weight is 1, a late joiner's the
    share of a window it trained). `skipped_batches` are batches whose effect on this fragment a sync of it that
    did not commit dropped. `sat_out`: this replica trained `cover` but sat the sync out (it joined inside the
    window): the line commits no samples (`samples` empty) and only says where the window ends."""
    from regent.train.coverage import round_sample_ranges

    ranges = [] if sat_out else round_sample_ranges(cover, replicas=replicas, ranks=ranks, batch_size=batch_size)
    return {"time": time.time(), "step": step, "fragment": fragment, "fragments": fragments,
            "batches": [min(n for n, _ in cover), max(n for n, _ in cover) + 1], "replica": replica,
            "generation": generation, "micro_batches": sum(len(shards) for _, shards in cover),
            "participants": contributors, "weight_sum": weight_sum, "replicas": replicas, "ranks": ranks,
            "batch_size": batch_size, "samples": [list(r) for r in ranges],
            "skipped_batches": [list(b) for b in skipped_batches], "sat_out": sat_out}


def append_line(path: str, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write on an O_APPEND descriptor: lines from several replicas'
    processes never interleave, and a killed writer leaves at most its own torn last line."""
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def witness_answer(step: int, *, held_step: int | None, current_step: int) -> str:
    """A DiLoCo holder asked for its digest of committed step `step`, holding no state of it (neither the
    boundary state `held_step` nor a kept digest): "wait" when it has not committed `step` yet (asked while
    still in that sync: it answers once it holds it), else "decline" (it moved past `step`: that state is gone).
    Holding no boundary state at all (inside a sync, between the old state's release and the new one's), it
    waits unless its Manager is past `step` already: a late decline costs a step, a wrong one an answer."""
    if held_step is not None:
        return "wait" if held_step < step else "decline"
    return "wait" if current_step <= step else "decline"


def vote_due(step: int, vote_every: int, *, new_quorum: bool, voted_step: int | None, at_boundary: bool) -> bool:
    """Whether a replica reports its digest after committing `step`: every `vote_every` commits, and at the first
    commit of a new quorum (per-step mode; the caller says which). Every member of a quorum learns of it in the
    same step, so they all vote at the same commit.

    Why the new quorum: a heal copies a donor's state, and a copy is no witness until a vote judged it
    (`vote.decide`). Voted on only `vote_every` commits later, a bit flipped on a third replica in between tied
    the copy and its donor's single ballot against the flipped one, and every replica went back to the backstop
    (a counted lineage reset, seen in DiLoCo soaks before its copy check). Voted on at once, the copy is judged
    against the replicas that did not take part in it, and is a witness from then on."""
    if not vote_every or step == voted_step or not at_boundary:
        return False
    return new_quorum or step % vote_every == 0


def _cover(replicas: int, *, per_step: bool = True) -> Callable[[int, int, int], tuple[list[int], float]]:
    """A constant global batch of `replicas` replica-shards: what quorum member `rank` of `participants` covers of
    batch `index`, and the factor on its summed gradients (`regent.train.coverage`: per-step mode scales for the
    cross-replica average; a DiLoCo inner step takes the mean of its micro-batches)."""
    from regent.train.coverage import gradient_scale, inner_step_scale, micro_batch_shards

    def cover(index: int, rank: int, participants: int) -> tuple[list[int], float]:
        shards = micro_batch_shards(rank, participants, replicas, index)
        return shards, (gradient_scale(participants, replicas) if per_step else inner_step_scale(shards))

    return cover


def build_user_trainer(cfg: Any, *, rank: int, world_size: int, replica_index: int) -> Any:
    """`cfg.trainer` ("module:factory") called with this process's TrainerContext, wrapped for the session."""
    from regent import platform
    from regent.orchestrate.user_trainer import ExternalTrainer, TrainerContext, load_factory

    device = platform.device_for_local_rank(int(os.environ.get("LOCAL_RANK", rank)))
    ctx = TrainerContext(rank=rank, world_size=world_size, replica_index=replica_index, num_replicas=cfg.replicas,
                         device=device, seed=cfg.train.seed, run_dir=cfg.run_dir, options=dict(cfg.trainer_options))
    torch.manual_seed(cfg.train.seed)  # the same initial weights in every replica unless the factory says otherwise
    return ExternalTrainer(load_factory(cfg.trainer)(ctx), ctx)


def _rss_mb() -> float | None:
    """This process's resident memory (for the invariant checker's unbounded-growth check)."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):  # not Linux: the check is skipped
        return None


def verify_checkpoint_file(path: str) -> None:
    """Refuse (ValueError naming the file) a checkpoint whose bytes are not the ones its manifest recorded."""
    try:
        with open(path + ".json") as f:
            manifest = json.load(f)
        recorded = manifest["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint {path}: its manifest {path}.json is missing or unreadable ({exc})") from exc
    actual, _ = file_sha256(path)
    if actual != recorded:
        raise ValueError(f"checkpoint {path} is damaged: sha256 {actual[:16]}... but its manifest recorded "
                         f"{str(recorded)[:16]}...; delete that step-N directory to restart from the one before")


def check_same_lineage(root: str, step: str, replicas: int) -> None:
    """Every replica resumes `step`: refuse (ValueError) when their checkpoints of it were committed in
    different lineages (different histories of the run; mixing them would silently diverge the replicas)."""
    seen: dict[int, int] = {}
    for replica in range(replicas):
        try:
            with open(os.path.join(root, f"replica_{replica}", step, "rank0.pt.json")) as f:
                lineage = json.load(f).get("lineage")
        except (OSError, ValueError) as exc:
            raise ValueError(f"checkpoint {step} of replica {replica}: manifest unreadable ({exc})") from exc
        if lineage is not None:
            seen[replica] = int(lineage)
    if len(set(seen.values())) > 1:
        raise ValueError(f"checkpoints {step} under {root} belong to different lineages {seen} (replica: lineage); "
                         "they are not one state of the run: delete the newer step-N directories of the replicas "
                         "that differ to restart from an older common step")


def common_checkpoint_step(root: str, replicas: int, ranks: int) -> str | None:
    """The newest `step-N` directory that every replica and rank has saved (file and manifest) under `root`."""
    def saved(replica: int) -> set[str]:
        base = os.path.join(root, f"replica_{replica}")
        steps = [d for d in os.listdir(base) if d.startswith("step-")] if os.path.isdir(base) else []
        return {d for d in steps if all(os.path.exists(os.path.join(base, d, f"rank{k}.pt.json"))
                                        and os.path.exists(os.path.join(base, d, f"rank{k}.pt")) for k in range(ranks))}

    common = set.intersection(*(saved(r) for r in range(replicas))) if replicas > 0 else set()
    return max(common) if common else None


def replicated_group(ft: Any) -> Any:
    """The Manager's cross-replica group on `--ft.backend` (Gloo lets replicas share a GPU, where NCCL refuses two
    ranks on one device; rccl is torch's "nccl" on ROCm), else the platform's: NCCL/RCCL on GPUs, Gloo on CPU.
    Timeouts as the Manager reads them (the environment wins, as in TorchFT)."""
    from regent.ft.config import env_timeout
    from regent.ft.process_group import ReplicatedGroup

    backend = None if ft.backend is None else ("nccl" if ft.backend in ("nccl", "rccl") else ft.backend)
    return ReplicatedGroup(backend=backend, timeout=env_timeout("timeout", ft.timeout_s),
                           connect_timeout=env_timeout("connect_timeout", ft.connect_timeout_s))
