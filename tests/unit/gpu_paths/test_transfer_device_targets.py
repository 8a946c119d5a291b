"""GPU-only bug, tested on CPU: a healer's host-resident state must not be handed to NCCL as a receive buffer.

AdamW keeps its `step` counters on the host even when the parameters live on the GPU. GroupTransport used
to receive into every own tensor whose path, shape and dtype matched, so over NCCL it passed a CPU tensor to
`recv` and the heal failed ("Tensors must be CUDA"). The group device is stood in for by `meta` here: any
device other than the tensor's own shows the rule.
"""

from __future__ import annotations

import torch

from regent.ft.transfer import _targets, flatten_state, own_tensors


def _state(device: str) -> dict:
    return {
        "model": {"w": torch.zeros(4, 3, device=device)},
        "optimizer": {"state": {"w": {"step": torch.tensor(5.0), "exp_avg": torch.zeros(4, 3, device=device)}}},
        "step": 5,
    }


def test_group_receive_never_targets_a_tensor_on_another_device() -> None:
    donor_meta, _ = flatten_state(_state("cpu"), step=5)
    into = _state("cpu")
    group_device = torch.device("meta")
    targets = _targets(donor_meta, own_tensors(into), group_device, same_device=True)
    assert [t.device for t in targets] == [group_device] * 3
    assert all(t.data_ptr() != into["model"]["w"].data_ptr() for t in targets)


def test_own_tensors_on_the_group_device_are_received_in_place() -> None:
    donor_meta, _ = flatten_state(_state("cpu"), step=5)
    into = _state("cpu")
    targets = _targets(donor_meta, own_tensors(into), torch.device("cpu"), same_device=True)
    own = [into["model"]["w"], into["optimizer"]["state"]["w"]["step"], into["optimizer"]["state"]["w"]["exp_avg"]]
    assert [t.data_ptr() for t in targets] == [t.data_ptr() for t in own]


def test_stream_fallback_keeps_staging_into_own_tensors_of_any_device() -> None:
    # The TCP fallback receives into host buffers and copies into the healer's tensors wherever they live.
    donor_meta, _ = flatten_state(_state("cpu"), step=5)
    into = _state("cpu")
    targets = _targets(donor_meta, own_tensors(into), torch.device("meta"))
    assert targets[0].data_ptr() == into["model"]["w"].data_ptr()


def test_small_tensors_arrive_packed_so_own_host_tensors_serve_in_place() -> None:
    # Tensors under `packed_below` are copied out of one device buffer, so a host-resident step counter is
    # filled in place while large tensors still never target another device.
    donor_meta, _ = flatten_state(_state("cpu"), step=5)
    into = _state("cpu")
    targets = _targets(donor_meta, own_tensors(into), torch.device("meta"), same_device=True, packed_below=16)
    step = into["optimizer"]["state"]["w"]["step"]
    assert [t.device for t in targets] == [torch.device("meta"), step.device, torch.device("meta")]
    assert targets[1].data_ptr() == step.data_ptr()
