"""Fault-tolerance settings, as one dataclass (loadable from TOML / CLI by `regent.cli`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from regent import settings

VOTE_STEPS = 30  # the default vote interval, in training steps (FTConfig.vote_every)


@dataclass
class FTConfig:
    """How replicas are kept in sync and how long to wait for each other.

    mode: "diloco" syncs pseudo-gradients every `sync_every` inner steps (fragments > 1 = Streaming
    DiLoCo); "ddp" averages gradients every step.
    Timeouts are seconds; environment variables override them (see `resolve_timeouts`).
    """

    enabled: bool = True
    mode: Literal["diloco", "ddp"] = "diloco"
    sync_every: int = 20
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    min_replica_size: int = 1
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 60.0
    lighthouse: str = ""
    backend: Literal["gloo", "nccl", "rccl"] | None = None  # None: regent.platform decides (nccl/rccl on GPU, gloo on CPU)
    init_sync: bool = True
    max_retries: int | None = None
    # ddp mode: gradients are averaged in buckets of this many MiB while backward runs (0: all at once after
    # backward). FSDP-sharded replicas always reduce after backward.
    bucket_mb: float = 100.0
    # A constant global batch. ddp mode: a step whose quorum has fewer replicas than configured still averages
    # over the configured global batch: the survivors take the missing replicas' micro-batches (gradient
    # accumulation, regent.train.coverage), and no shard's samples are skipped; only a step's last micro-batch
    # starts the bucketed allreduce (bucket_mb still applies). DiLoCo (one fragment, no sync delay): the inner
    # steps of a round cover every replica-shard of their batches; the members of the quorum that opened the
    # round take the missing replicas' micro-batches, and the pseudo-gradients are weighted by the micro-batches
    # they covered; a replica restarted mid-round joins at the round's sync instead of mid-round. Costs extra
    # micro-batches per step while replicas are down (counted: summary.json `extra_micro_batches`).
    # None (the default) lets `regent train` choose (`regent.orchestrate.config.constant_batch_choice`): on in
    # per-step mode where the data path can read any replica's shard, off in DiLoCo, where a restarted replica
    # joining the round in progress saves more than covering its shard would. True or False forces it.
    constant_batch: bool | None = None
    # The durable backstop (regent.ft.backstop): committed state saved to disk this often, asynchronously, and
    # restored only when no live replica holds it. 0 turns it off (then losing every replica stops the run).
    backstop_every_s: float = 120.0
    backstop_keep: int = 2
    # DiLoCo: a restarted replica pulls the committed state from a live holder as soon as it is up, instead of
    # at the holders' next sync (closes the window in which only the holders have it).
    early_heal: bool = True
    # While the Lighthouse is unreachable (killed, restarting, its host down), the members of the last quorum may
    # agree among themselves to keep it for the next step (regent.ft.quorum_reuse): only when nothing changed
    # (the same groups, all at the step they just committed together) and only if every member agrees, else
    # they wait for the Lighthouse as TorchFT does. A new replica still needs the Lighthouse to join.
    quorum_reuse: bool = True
    # DiLoCo: a sync that fails because a replica died is retried at once with the survivors (this many times)
    # instead of rolling every replica back to the last global parameters.
    sync_retries: int = 2
    # Replicas vote on their state (regent.ft.digest) every this many commits: a replica whose digest differs
    # from the majority's is stopped and healed from a majority member. None: every VOTE_STEPS training steps,
    # rounded down to commits (30 in ddp mode, every DiLoCo sync of 20 steps): a digest of `1b`'s whole 18 GB state
    # costs 0.28 of a step on an H200, so a vote every 20-30 steps costs 1-1.4% (benchmarks/RESULTS.md).
    # 0 turns voting off.
    vote_every: int | None = None
    # Who may call the control plane (regent.ft.rpc_security). rpc_auth: every gRPC call to the Lighthouse and
    # the ManagerServers proves the job secret that `regent train` gives each process (False: calls go
    # unauthenticated, e.g. for tools without the secret). tls_*: PEM files (same as $REGENT_FT_TLS_CERT,
    # _KEY, _CA, _SERVER_NAME): servers present cert/key, a CA makes them require client certificates
    # signed by it, clients verify servers against the CA and check `tls_server_name` when set (one
    # certificate for every host). Unset: no TLS.
    rpc_auth: bool = True
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None

    def vote_interval(self) -> int:
        """Commits between two state votes (0: no votes)."""
        if self.vote_every is not None:
            return int(self.vote_every)
        steps_per_commit = 1 if self.mode == "ddp" else max(1, self.sync_every // max(1, self.fragments))
        # at least every VOTE_STEPS steps: DiLoCo's rounds of 20 vote at every sync, so a replica that heals
        # copies a state its step's vote can vouch for (`vote.StateVotes.verified`)
        return max(1, VOTE_STEPS // steps_per_commit)

    def rpc_env(self) -> dict[str, str]:
        """The environment that carries `rpc_auth` and the TLS files to the processes `regent train` starts
        (the Lighthouse and every trainer read it through `rpc_security.Security.resolve`)."""
        from regent.ft import rpc_security

        env = {rpc_security.RPC_AUTH_ENV: "1" if self.rpc_auth else "0"}
        for name, path in ((rpc_security.TLS_CERT_ENV, self.tls_cert), (rpc_security.TLS_KEY_ENV, self.tls_key),
                           (rpc_security.TLS_CA_ENV, self.tls_ca)):
            if path:
                env[name] = os.path.abspath(os.path.expanduser(path))
        if self.tls_server_name:
            env[rpc_security.TLS_SERVER_NAME_ENV] = self.tls_server_name
        return env

    def validate(self) -> None:
        """Fail before launch with a message that names the fix."""
        if self.mode not in ("diloco", "ddp"):
            raise ValueError(f"ft.mode={self.mode!r}: use 'diloco' or 'ddp'")
        if self.backstop_every_s < 0:
            raise ValueError(f"ft.backstop_every_s={self.backstop_every_s}: must be >= 0 (0 turns it off)")
        if self.backstop_keep < 1:
            raise ValueError(f"ft.backstop_keep={self.backstop_keep}: must be >= 1")
        if self.sync_retries < 0:
            raise ValueError(f"ft.sync_retries={self.sync_retries}: must be >= 0")
        if self.vote_every is not None and self.vote_every < 0:
            raise ValueError(f"ft.vote_every={self.vote_every}: must be >= 0 (0 turns state votes off)")
        if self.fragments < 1:
            raise ValueError(f"ft.fragments={self.fragments}: must be >= 1")
        if self.mode == "diloco":
            if self.sync_every < self.fragments or self.sync_every % self.fragments:
                raise ValueError(
                    f"ft.sync_every={self.sync_every} must be a multiple of ft.fragments={self.fragments}"
                )
            period = self.sync_every // self.fragments
            if not 0 <= self.fragment_sync_delay < period:
                raise ValueError(
                    f"ft.fragment_sync_delay={self.fragment_sync_delay} must be in [0, sync_every/fragments="
                    f"{period})"
                )
        if not 0.0 <= self.fragment_update_alpha <= 1.0:
            raise ValueError(f"ft.fragment_update_alpha={self.fragment_update_alpha} must be in [0, 1]")
        if self.constant_batch and self.mode == "diloco" and (self.fragments != 1 or self.fragment_sync_delay):
            raise ValueError(f"ft.constant_batch in DiLoCo needs ft.fragments=1 and ft.fragment_sync_delay=0 (got "
                             f"{self.fragments} and {self.fragment_sync_delay}: Streaming DiLoCo commits a round "
                             "fragment by fragment); drop --ft.constant-batch or use plain DiLoCo")
        if self.bucket_mb < 0:
            raise ValueError(f"ft.bucket_mb={self.bucket_mb}: must be >= 0 (0 reduces after backward)")
        if self.min_replica_size < 1:
            raise ValueError(f"ft.min_replica_size={self.min_replica_size}: must be >= 1")
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ft.{name} must be > 0 seconds")
        if self.backend not in (None, "gloo", "nccl", "rccl"):
            raise ValueError(f"ft.backend={self.backend!r}: use gloo, nccl, rccl or leave unset")
        from regent.ft.rpc_security import TLSFiles

        paths = [os.path.expanduser(p) if p else None for p in (self.tls_cert, self.tls_key, self.tls_ca)]
        try:
            TLSFiles(*paths).validate()
        except ValueError as err:
            raise ValueError(f"ft.tls_*: {err}") from None


_ENV = {  # each also reads TorchFT's name (TORCHFT_TIMEOUT_SEC, ...) when Regent's is unset
    "timeout": settings.REGENT_FT_TIMEOUT_SEC,
    "quorum_timeout": settings.REGENT_FT_QUORUM_TIMEOUT_SEC,
    "connect_timeout": settings.REGENT_FT_CONNECT_TIMEOUT_SEC,
}


def env_timeout(kind: str, default: float, environ: dict[str, str] | None = None) -> float:
    """Timeout `kind` ('timeout'|'quorum_timeout'|'connect_timeout'): env wins over the argument (as in
    TorchFT, because launchers like torchtitan cannot reach the Manager's arguments)."""
    value = _ENV[kind].get(environ)
    return float(default) if value is None else value
