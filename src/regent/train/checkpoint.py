"""Persistent checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, optionally async.

Layout of a finished checkpoint directory `<path>/`:
  .metadata, __<rank>_<n>.distcp   DCP's files (sharded tensors are resharded on load)
  regent_checkpoint.json            model args, step, lineage, layout, a sha256 of every DCP file, and a
                                    sha256 of the manifest itself

Atomicity: everything is written to `<path>.tmp` and renamed to `<path>` only after all ranks finished and
the manifest is written, so a crash mid-save never leaves a directory that looks complete. On load the
manifest is checked first (missing -> incomplete/not ours; its own digest differs -> corrupt; a step other
than the one its directory (`step-N`) or the caller expects, or another lineage -> mismatch; model args differ
-> mismatch; file hash differs -> corrupt), so a bad checkpoint gives an error naming the cause instead of
silently loading garbage. The lineage (the quorum id of the state under fault tolerance; see
`regent.ft.recovery.state_version`) is recorded when the caller knows it (`save(..., lineage=)`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from regent.integrity import file_sha256, self_digest

log = logging.getLogger(__name__)

MANIFEST = "regent_checkpoint.json"
FORMAT_VERSION = 2  # 2: the manifest carries its own sha256 and the lineage (1 is still read)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not match the model being loaded."""


def _data_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)


def _my_share(names: list[str], group: dist.ProcessGroup | None) -> list[str]:
    """This rank's slice of the files to hash: hashing is spread over the ranks (a big model has many GB)."""
    if not dist.is_initialized():
        return names
    return names[dist.get_rank(group)::dist.get_world_size(group)]


def _digests(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: {"sha256": file_sha256(directory / name)[0], "bytes": (directory / name).stat().st_size}
            for name in names}


def _gather_dicts(part: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    if not dist.is_initialized():
        return part
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, part, group=group)
    merged: dict[str, Any] = {}
    for item in parts:
        merged.update(item)
    return merged


def _is_coordinator(group: dist.ProcessGroup | None) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 a manifest records of itself (canonical JSON of every other field)."""
    return self_digest(manifest, "manifest_sha256")


def _finalize(tmp: Path, final: Path, meta: dict[str, Any], files: dict[str, Any]) -> None:
    """Coordinator only: write the manifest, then swap the finished directory into place."""
    manifest = dict(meta, files=files, saved_at=time.time(), format_version=FORMAT_VERSION)
    manifest.setdefault("lineage", None)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint step %s written to %s", meta.get("step"), final)


class Checkpointer:
    """Saves/loads a DCP state dict atomically; at most one async save in flight."""

    def __init__(self, group: dist.ProcessGroup | None = None, async_group: dist.ProcessGroup | None = None):
        self.group = group
        self.async_group = async_group  # separate gloo group so background collectives never interleave
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is finished and renamed; re-raise its error."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise CheckpointError(f"async checkpoint save failed: {error}") from error

    def save(self, state: dict[str, Any], path: str, meta: dict[str, Any], async_save: bool = False,
             lineage: int | None = None) -> None:
        """Write `state` to `path` atomically, with `meta` (its "step" is checked on load) and `lineage` in the
        manifest."""
        self.wait()
        if lineage is not None:
            meta = dict(meta, lineage=int(lineage))
        final = Path(path)
        tmp = final.with_name(final.name + ".tmp")
        if _is_coordinator(self.group):
            final.parent.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # leftover of a crashed save: never complete, safe to drop
            tmp.mkdir(parents=True)
        _barrier(self.group)
        no_dist = not dist.is_initialized()
        if not async_save:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state, checkpoint_id=str(tmp), process_group=self.group, no_dist=no_dist)
            _barrier(self.group)  # every rank's files are complete before anyone hashes
            files = _gather_dicts(_digests(tmp, _my_share(_data_files(tmp), self.group)), self.group)
            if _is_coordinator(self.group):
                _finalize(tmp, final, meta, files)
            _barrier(self.group)
            return
        group = self.async_group if self.async_group is not None else self.group
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            future: Future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group, no_dist=no_dist)
        coordinator = _is_coordinator(self.group)

        def finish() -> None:
            try:
                future.result()
                if coordinator:  # off the training path: hash everything here, no collectives needed
                    _finalize(tmp, final, meta, _digests(tmp, _data_files(tmp)))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the next wait()/save() on the training thread
                self._pending_error = exc

        self._pending = threading.Thread(target=finish, name="regent-async-checkpoint", daemon=True)
        self._pending.start()

    def read_manifest(self, path: str) -> dict[str, Any]:
        directory = Path(path)
        if not directory.is_dir():
            hint = " (a .tmp directory exists: that save never finished)" if directory.with_name(
                directory.name + ".tmp").exists() else ""
            raise CheckpointError(f"no checkpoint at {path}{hint}; check the path or the checkpoint_dir")
        manifest_path = directory / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(
                f"{path} has no {MANIFEST}: it is not a Regent checkpoint or its save did not finish; "
                "load an earlier step"
            )
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
        except (OSError, ValueError) as exc:  # bad JSON and bad UTF-8 are ValueErrors
            raise CheckpointError(f"{manifest_path} is unreadable ({exc}); the checkpoint is corrupt") from exc
        if type(manifest) is not dict:
            raise CheckpointError(f"{manifest_path} is not a manifest object; the checkpoint is corrupt")
        recorded = manifest.get("manifest_sha256")
        if recorded is None and manifest.get("format_version", 1) >= 2:
            raise CheckpointError(f"{manifest_path} lacks its digest; the checkpoint is corrupt")
        if recorded is not None and recorded != manifest_digest(manifest):
            raise CheckpointError(f"{manifest_path} does not match its own sha256 (damaged or edited); delete the "
                                  "checkpoint and load an earlier step")
        named = re.fullmatch(r"step-0*(\d+)", directory.name)
        step = manifest.get("step")
        if named and step is not None and int(named.group(1)) != step:
            raise CheckpointError(f"checkpoint {path} records step {step} but its directory is {directory.name} "
                                  "(mismatched: moved or copied over); load the directory of the step you want")
        return manifest

    def check_identity(self, path: str, manifest: dict[str, Any], step: int | None = None,
                       lineage: int | None = None) -> None:
        """Refuse a checkpoint of another step or lineage than the caller expects (None: no expectation)."""
        if step is not None and manifest.get("step") != step:
            raise CheckpointError(f"checkpoint {path} is of step {manifest.get('step')}, expected step {step}")
        recorded = manifest.get("lineage")
        if lineage is not None and recorded is not None and recorded != lineage:
            raise CheckpointError(f"checkpoint {path} is of lineage {recorded} (another history of the run), "
                                  f"expected lineage {lineage}")

    def verify(self, path: str, manifest: dict[str, Any]) -> None:
        """Compare every file's size and sha256 with the manifest (each rank checks a slice; verdicts shared)."""
        directory = Path(path)
        problems = []
        for name in _my_share(sorted(manifest.get("files", {})), self.group):
            expected, file = manifest["files"][name], directory / name
            if not file.is_file():
                problems.append(f"file {name} is missing")
            elif file.stat().st_size != expected["bytes"] or file_sha256(file)[0] != expected["sha256"]:
                problems.append(f"file {name} does not match its recorded sha256")
        found = _gather_dicts({str(i): p for i, p in enumerate(problems)} if not dist.is_initialized() else
                              {f"{dist.get_rank(self.group)}.{i}": p for i, p in enumerate(problems)}, self.group)
        if found:
            raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(sorted(found.values()))}; "
                                  "delete it and load an earlier step")

    def load(self, state: dict[str, Any], path: str) -> None:
        """Fill `state` (tensors in place, other values replaced) from the checkpoint at `path`."""
        self.wait()
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, checkpoint_id=path, process_group=self.group, no_dist=not dist.is_initialized())
        except Exception as exc:
            raise CheckpointError(
                f"could not load checkpoint {path}: {type(exc).__name__}: {exc}; it does not match this model/"
                "optimizer layout or is damaged"
            ) from exc
