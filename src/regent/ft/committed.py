"""Committed-state recovery: a restarted replica must not train on from less than the run has committed.

Two halves. `recovery_plan` is the pure rule: given the run's committed watermark (from the Lighthouse), the
live holders of it and the newest durable backstop, where this replica's committed state comes from ("none",
"early" copy from a live holder, "keep" its own, "restore" the backstop, or "fatal"). `CommittedStateRecovery`
carries it out for the Manager (a base class of `regent.ft.manager.Manager`, so these are the Manager's own
methods): serving this replica's committed state to restarted peers between syncs (`serve_committed`,
`publish_committed`, `withdraw_committed`), and `recover_committed`, where group rank 0 decides and every
group rank follows through the group store. Every loss is counted (`state_lost` events) and reported to the
Lighthouse, never hidden.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import torch

from regent.ft.manager_server import _rpc_error
from regent.ft.proto import torchft_pb2, torchft_pb2_grpc
from regent.ft.quorum import group_name
from regent.ft.transfer import ANY_STEP, StreamTransport

if TYPE_CHECKING:
    import torch.distributed as dist

    from regent.ft.manager_server import ManagerServer
    from regent.ft.rpc_security import Security

logger = logging.getLogger(__name__)


class StateLostError(RuntimeError):
    """No live replica and no durable backstop holds the committed state: training cannot go on without
    silently losing it."""


def recovery_plan(*, watermark: int, lineage: int, holders: list[tuple[str, str]], replica_id: str,
                  own_step: int, can_fetch: bool, give_up: bool, backstop: tuple[int, str] | None,
                  backstop_root: str | None) -> dict[str, Any] | None:
    """Where a replica's committed state comes from (pure; `Manager.recover_committed` carries it out).

    `holders`: (replica id, address) of the live replicas at the run's committed `watermark`, as the
    Lighthouse names them (address "" when a restarted Lighthouse has not learned it yet). None: no holder is
    known yet, ask again (until `give_up`). Otherwise a plan whose "kind" is:
    - "none": nothing to do (this replica holds the watermark), or a live holder heals it at the next quorum
      (no early copy here, or no address to copy from yet): the state is alive, nothing is lost;
    - "early": copy it now from "donor" at "address";
    - "keep": every holder is gone and this replica's own committed state is at least as new as the newest
      `backstop` (step, path): go on from it, a counted loss;
    - "restore": every holder is gone: restore the backstop, a counted loss;
    - "fatal": every holder is gone and there is no backstop.
    """
    if watermark <= own_step:
        return {"kind": "none"}
    mine = group_name(replica_id)
    others = [(rid, address) for rid, address in holders if group_name(rid) != mine and rid != replica_id]
    reachable = [(rid, address) for rid, address in others if address]
    if others and (not can_fetch or not reachable):
        return {"kind": "none"}
    if others:
        donor, address = reachable[0]
        return {"kind": "early", "watermark": watermark, "donor": donor, "address": address}
    if not give_up:
        return None
    reason = f"no live replica holds committed step {watermark} (lineage {lineage}): every holder is gone"
    if backstop is None:
        where = f" and the backstop at {backstop_root} has none" if backstop_root is not None else ""
        return {"kind": "fatal", "watermark": watermark, "lineage": lineage,
                "reason": f"{reason}{where}; committed training would be lost. Restart from a checkpoint "
                          "(regent train --recovery restart) or enable the durable backstop "
                          "(regent train: ft.backstop_every_s; library: Manager(backstop=Backstop(...)))"}
    step, path = backstop
    if own_step >= step:
        # going back to the backstop would lose more than the dead holders took with them
        return {"kind": "keep", "watermark": watermark, "lineage": lineage,
                "reason": f"{reason}; going on from this replica's own committed step {own_step} (the newest "
                          f"backstop is step {step})"}
    return {"kind": "restore", "watermark": watermark, "lineage": lineage, "path": path, "step": step,
            "reason": f"{reason}; restoring the durable backstop of step {step}"}


# How long a restarted replica looks for a live holder of the committed state before it concludes that none
# is left (a restarted Lighthouse learns who holds what from the next heartbeats, 0.1 s apart by default).
HOLDER_GRACE_S = 6.0
RECOVER_ATTEMPTS = 4


def state_nbytes(state: Any) -> int:
    """Bytes of the tensors in a state tree (for the heal events' `bytes`)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0


class CommittedStateRecovery:
    """The Manager's committed-state methods (see the module docstring). It is a base class of the Manager, not
    an object of its own: it reads the Manager's step, server, group store and event callback, which the
    Manager's constructor sets (the attributes annotated below)."""

    # set by Manager.__init__
    group_rank: int
    group_world_size: int
    replica_id: str
    timeout: float
    connect_timeout: float
    backstop: Any
    lost_state: str
    _step: int
    _server: ManagerServer | None
    _security: Security
    _hostname: str
    _group_store: dist.TCPStore
    _committed_fns: tuple[Callable[[], Any], Callable[[Any], None]] | None
    _committed_transport: StreamTransport | None
    _committed_live: bool
    _recover_calls: int
    _behind_calls: int
    _before_withdraw: list[Callable[[], Any]]

    # provided by the Manager
    def state_dict(self) -> dict[str, int]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise NotImplementedError

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _emit(self, kind: str, **details: Any) -> None:
        raise NotImplementedError

    def serve_committed(self, save: Callable[[], Any], load: Callable[[Any], None], live: bool = False) -> None:
        """Serve this replica's committed state to restarted replicas while it keeps computing.

        `save()` returns the committed state (tensors that do not change between two commits, e.g. DiLoCo's
        last global parameters and outer optimizer); `load(state)` applies a peer's on a restarted replica.
        Call `publish_committed()` after each commit and `withdraw_committed()` before the tensors change.

        `live=True` (per-step training): the committed state is the live training state between two optimizer
        steps, published after every step; a healer takes whatever step the holder serves when it asks (at
        least the committed step it was told of), and a heal applied by a quorum is withdrawn and republished
        here."""
        self._committed_fns = (save, load)
        self._committed_live = live
        if self._committed_transport is None:
            self._committed_transport = StreamTransport(host=self._hostname or "127.0.0.1", timeout=self.timeout)

    def committed_state(self) -> dict[str, Any]:
        """The committed state as a healer receives it (and a backstop of it holds): the `serve_committed`
        tree under "user", the Manager's own state and lineage under "regent"."""
        assert self._committed_fns is not None
        lineage = self._server.lineage if self._server is not None else 0
        return {"user": self._committed_fns[0](), "regent": {**self.state_dict(), "lineage": lineage}}

    def publish_committed(self) -> None:
        if self._committed_transport is not None:
            # served in place: no device-to-host copy of the committed state at every sync (see StreamTransport);
            # live state (published at every step) is also described only when a healer asks
            self._committed_transport.send_checkpoint([], self._step, self.committed_state(), self.timeout,
                                                      copy_to_host=False, lazy=self._committed_live)

    def before_committed_change(self, fn: Callable[[], Any]) -> None:
        """Call `fn` before the committed state changes (e.g. wait for a backstop copy of it to finish)."""
        self._before_withdraw.append(fn)

    def withdraw_committed(self) -> None:
        for fn in self._before_withdraw:
            fn()
        if self._committed_transport is not None:
            self._committed_transport.disallow_checkpoint(cut_readers=self._committed_live)

    def recover_committed(self) -> str:
        """Make sure this replica will not train on from less than the run has committed.

        Called by a restarted replica before its first quorum, and after a quorum reported that no member holds
        the committed watermark. Every group rank calls it at the same point; group rank 0 decides and the
        others follow through the group store. Returns what happened:
        - "none": nothing to do (nothing committed yet, this replica holds it, or the next quorum heals it);
        - "early": pulled the committed state from a live holder now (`serve_committed` on both sides), without
          waiting for the holders' next sync: the window in which only the holders have it closes here;
        - "restored": no live replica holds it: restored the newest durable backstop, counted as a lineage
          reset (`state_lost` event with what was lost); the Lighthouse is told, so the quorum goes on from it;
        - "accepted" also when no live replica holds it but this replica's own committed state is at least as
          new as the newest backstop: it goes on from that (`state_lost`, cause "own_state");
        - when no backstop exists either: with `lost_state="raise"` raises `StateLostError` (`state_lost` with
          fatal=True); with "accept" (the default, TorchFT's behaviour) goes on from what this replica holds,
          counted as a lineage reset (`state_lost`, cause "no_holder") and logged as an error: "accepted".
        """
        self._recover_calls += 1
        for attempt in range(RECOVER_ATTEMPTS * 2 if self._committed_live else RECOVER_ATTEMPTS):
            key = f"regent/recover/{self._recover_calls}/{attempt}"
            plan = self._share(f"{key}/plan", self._recover_plan if self.group_rank == 0 else None)
            kind = plan["kind"]
            if kind == "none":
                return "none"
            if kind == "keep":
                if self._server is not None:
                    self._server.accepted = (int(plan["watermark"]), int(plan["lineage"]))
                    self._server.heartbeat_now()  # the Lighthouse counts the reset and lowers its watermark
                self._emit("state_lost", lost_step=plan["watermark"], restored_step=self._step, source="own",
                           fatal=False, cause="own_state", reason=plan["reason"])
                return "accepted"
            if kind == "fatal" and self.lost_state == "accept":
                logger.error("%s; going on from step %d (lost_state='accept'; pass lost_state='raise' to stop "
                             "instead)", plan["reason"], self._step)
                if self._server is not None:
                    self._server.accepted = (int(plan["watermark"]), int(plan["lineage"]))
                    self._server.heartbeat_now()  # the Lighthouse counts the reset and lowers its watermark
                self._emit("state_lost", lost_step=plan["watermark"], restored_step=self._step, source=None,
                           fatal=False, cause="no_holder", reason=plan["reason"])
                return "accepted"
            if kind == "fatal":
                self._emit("state_lost", lost_step=plan["watermark"], restored_step=None, source=None,
                           fatal=True, reason=plan["reason"])
                raise StateLostError(plan["reason"])
            start = time.monotonic()
            try:
                state = self._fetch_early(plan) if kind == "early" else self.backstop.load(plan["path"],
                                                                                            self.group_rank)
                error = ""
            except Exception as err:  # noqa: BLE001 - reported below; every rank agrees before anything is applied
                state, error = None, f"{type(err).__name__}: {err}"
            errors = self._gather(f"{key}/ok", error)
            if any(errors):
                logger.warning("recovering the committed state (%s, attempt %d) failed: %s", kind, attempt + 1,
                               [e for e in errors if e])
                self._emit("recover_failed", how=kind, attempt=attempt + 1, errors=[e for e in errors if e])
                # a live holder refuses or cuts a read while it takes its optimizer step (tens of ms): ask again soon
                time.sleep(min(1.0, 0.05 * 2 ** attempt) if self._committed_live else min(2.0, 0.25 * 2 ** attempt))
                continue
            if kind == "early":
                self._committed_fns[1](state["user"])
                self.load_state_dict(state["regent"])
                if self._server is not None:
                    self._server.lineage = int(state["regent"].get("lineage", 0))
                self._emit("early_heal_done", donor=plan["donor"], manager_step=self._step,
                           seconds=round(time.monotonic() - start, 4), bytes=state_nbytes(state))
                return "early"
            if state.get("committed"):  # a backstop of the committed state alone (DiLoCo: see the session)
                self._committed_fns[1](state["user"])
                self.load_state_dict(state["regent"])
                if self._server is not None:
                    self._server.lineage = int(state["regent"].get("lineage", 0))
            else:
                self.load_full_state_dict(state)
            if self._server is not None:
                self._server.accepted = (int(plan["watermark"]), int(plan["lineage"]))
                self._server.heartbeat_now()  # the Lighthouse lowers its watermark before our next quorum
            self._emit("state_lost", lost_step=plan["watermark"], restored_step=self._step, source=plan["path"],
                       fatal=False, cause="backstop_restore", seconds=round(time.monotonic() - start, 4), reason=plan["reason"])
            return "restored"
        logger.warning("could not recover the committed state early; the next quorum heals this replica")
        return "none"

    def left_behind(self) -> bool:
        """Whether the run has committed a step past this replica's own without it: a quorum went on without this
        live replica (it was late for the sync, `regent.ft.quorum.late_members`), and its next quorum would only
        heal it after the others' next sync. Every group rank calls it at the same point; group rank 0 asks the
        Lighthouse (`holders`) and the others follow. False when that cannot be told (the Lighthouse does not
        answer within a second: the quorum decides, as without this check)."""
        self._behind_calls += 1

        def decide() -> dict[str, Any]:
            assert self._server is not None
            try:
                watermark, _, holders = self._server.lighthouse_client.holders(
                    self.replica_id, timeout=min(1.0, self.connect_timeout))
            except Exception as err:  # noqa: BLE001 - reported; the quorum then heals this replica if it is behind
                logger.info("could not ask the Lighthouse whether the run committed past step %d: %s", self._step,
                            err)
                return {"behind": False}
            return {"behind": bool(watermark > self._step and holders)}

        behind = bool(self._share(f"regent/behind/{self._behind_calls}",
                                  decide if self.group_rank == 0 else None)["behind"])
        if self.group_rank == 0 and self.group_world_size > 1 and self._behind_calls > 2:
            # asked every few inner steps for the whole run: the store keeps only the last two decisions (every
            # rank read the one before the last: it trained the inner steps since, in lockstep with this rank)
            with contextlib.suppress(Exception):  # a key already gone costs nothing; the next call tries again
                self._group_store.delete_key(f"regent/behind/{self._behind_calls - 2}")
        return behind

    def report_event(self, kind: str, **details: Any) -> None:
        """An event of this replica's fault-tolerance (`on_event`), from the layers built on the Manager."""
        self._emit(kind, **details)

    def accept_loss(self, source: str) -> None:
        """This replica went back to older state on purpose (a checkpoint restart): if that is less than the
        run has committed, count it (`state_lost`) and tell the Lighthouse, so the quorum goes on from here."""
        if self._server is None:
            return
        watermark, lineage, _ = self._server.lighthouse_client.holders(self.replica_id, timeout=self.connect_timeout)
        if watermark <= self._step:
            return
        self._server.accepted = (watermark, lineage)
        self._server.heartbeat_now()
        self._emit("state_lost", lost_step=watermark, restored_step=self._step, source=source, fatal=False,
                   cause="checkpoint_restart", reason=f"restarted from {source}")

    def _recover_plan(self) -> dict[str, Any]:
        """Group rank 0: where the committed state comes from (see `recover_committed` and `recovery_plan`)."""
        assert self._server is not None
        client = self._server.lighthouse_client
        deadline = time.monotonic() + HOLDER_GRACE_S
        while True:
            watermark, lineage, holders = client.holders(self.replica_id, timeout=self.connect_timeout)
            give_up = time.monotonic() >= deadline
            latest = self.backstop.latest() if self.backstop is not None and give_up else None
            plan = recovery_plan(
                watermark=watermark, lineage=lineage, holders=[(h.replica_id, h.address) for h in holders],
                replica_id=self.replica_id, own_step=self._step, can_fetch=self._committed_transport is not None,
                give_up=give_up, backstop=latest,
                backstop_root=str(self.backstop.root) if self.backstop is not None else None)
            if plan is not None:
                return plan
            time.sleep(0.5)

    def _fetch_early(self, plan: dict[str, Any]) -> Any:
        assert self._committed_transport is not None
        with self._security.channel(plan["address"]) as channel:
            stub = torchft_pb2_grpc.ManagerServiceStub(channel)
            try:
                reply = stub.CheckpointMetadata(
                    torchft_pb2.CheckpointMetadataRequest(rank=self.group_rank), timeout=self.connect_timeout)
            except grpc.RpcError as err:
                raise _rpc_error("committed-state address", plan["address"], err) from None
        if not reply.regent_committed_metadata:
            raise RuntimeError(f"holder {plan['donor']} serves no committed state for group rank {self.group_rank}")
        if not self._committed_live:
            return self._committed_transport.recv_checkpoint(
                0, reply.regent_committed_metadata, int(plan["watermark"]), self.timeout, into=self.committed_state())
        # live (per-step) state: the holder has moved on since the Lighthouse named it; take what it serves now,
        # provided it is at least the committed step we were told of (a holder between its commit vote and its
        # optimizer step still serves the step before: the next attempt gets the newer one)
        state = self._committed_transport.recv_checkpoint(
            0, reply.regent_committed_metadata, ANY_STEP, self.timeout, into=self.committed_state())
        served = int(state["regent"].get("step", -1))
        if served < int(plan["watermark"]):
            raise RuntimeError(f"holder {plan['donor']} serves step {served}, behind committed step {plan['watermark']}")
        return state

    def group_agree(self, key: str, decide: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Group rank 0's `decide()`, the same on every rank of this replica (through the group store; `key` must
        be new for each decision). For decisions that read a clock or a race, which the ranks of one replica
        would otherwise make differently and then wait for each other in different places."""
        return self._share(key, decide if self.group_rank == 0 else None)

    def _share(self, key: str, decide: Callable[[], Any] | None) -> Any:
        """Group rank 0's decision, seen by every group rank (through the group store)."""
        if self.group_world_size == 1:
            assert decide is not None
            return decide()
        if decide is not None:
            try:
                value = decide()
            except Exception as err:  # the others must not wait for a decision that will never come
                self._group_store.set(key, json.dumps({"kind": "error", "error": repr(err)}))
                raise
            self._group_store.set(key, json.dumps(value))
            return value
        value = json.loads(self._group_store.get(key).decode())
        if value.get("kind") == "error":
            raise RuntimeError(f"group rank 0 could not plan the recovery: {value['error']}")
        return value

    def _gather(self, key: str, error: str) -> list[str]:
        """Every group rank's outcome (empty string: ok)."""
        if self.group_world_size == 1:
            return [error]
        self._group_store.set(f"{key}/{self.group_rank}", error or "ok")
        out = [self._group_store.get(f"{key}/{r}").decode() for r in range(self.group_world_size)]
        return ["" if e == "ok" else e for e in out]
