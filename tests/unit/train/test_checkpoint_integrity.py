"""A checkpoint's manifest carries the step, the lineage, every file's sha256 and a sha256 of itself: a damaged,
edited, moved or mismatched checkpoint is refused with a clear error before anything is loaded. Real files
(DCP without a process group)."""

from __future__ import annotations

import json

import pytest
import torch

from regent.train.checkpoint import MANIFEST, Checkpointer, CheckpointError, manifest_digest


def _saved(tmp_path, step: int = 4, lineage: int | None = 7):
    ckpt = Checkpointer()
    path = tmp_path / f"step-{step}"
    state = {"model": {"w": torch.arange(64, dtype=torch.float32)}, "trainer": {"step": step}}
    ckpt.save(state, str(path), {"step": step, "model": "tiny"}, lineage=lineage)
    return ckpt, path


def test_manifest_records_step_lineage_and_its_own_digest(tmp_path):
    ckpt, path = _saved(tmp_path)
    manifest = ckpt.read_manifest(str(path))
    assert manifest["step"] == 4 and manifest["lineage"] == 7 and manifest["format_version"] == 2
    assert manifest["manifest_sha256"] == manifest_digest(manifest)
    ckpt.verify(str(path), manifest)
    ckpt.check_identity(str(path), manifest, step=4, lineage=7)
    state = {"model": {"w": torch.zeros(64)}, "trainer": {"step": 0}}
    ckpt.load(state, str(path))
    assert torch.equal(state["model"]["w"], torch.arange(64, dtype=torch.float32))


def test_mismatched_step_or_lineage_is_refused(tmp_path):
    ckpt, path = _saved(tmp_path)
    manifest = ckpt.read_manifest(str(path))
    with pytest.raises(CheckpointError, match="expected step 5"):
        ckpt.check_identity(str(path), manifest, step=5)
    with pytest.raises(CheckpointError, match="lineage 7"):
        ckpt.check_identity(str(path), manifest, lineage=8)
    # moved under another step's name
    moved = path.rename(tmp_path / "step-9")
    with pytest.raises(CheckpointError, match="mismatched"):
        ckpt.read_manifest(str(moved))


def test_edited_or_damaged_checkpoints_are_refused(tmp_path):
    ckpt, path = _saved(tmp_path)
    manifest_path = path / MANIFEST
    original = manifest_path.read_text()
    edited = json.loads(original)
    edited["lineage"] = 8  # an edit that keeps the JSON valid
    manifest_path.write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match="own sha256"):
        ckpt.read_manifest(str(path))
    manifest_path.write_bytes(b"\xff\xfe{")
    with pytest.raises(CheckpointError, match="corrupt"):
        ckpt.read_manifest(str(path))
    manifest_path.write_text(original)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        ckpt.verify(str(path), ckpt.read_manifest(str(path)))


def test_a_format_1_manifest_is_still_read(tmp_path):
    ckpt, path = _saved(tmp_path, lineage=None)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["lineage"] is None
    del manifest["manifest_sha256"], manifest["lineage"]
    manifest["format_version"] = 1
    (path / MANIFEST).write_text(json.dumps(manifest))
    ckpt.verify(str(path), ckpt.read_manifest(str(path)))
    # but a format-2 manifest without its digest is not
    manifest["format_version"] = 2
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="lacks its digest"):
        ckpt.read_manifest(str(path))
