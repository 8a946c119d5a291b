"""Peer state transfer speed: a full training state moved donor -> healer by Regent, against raw point-to-point.

    python benchmarks/gpu/peer_transfer.py --shape 1b,8b --http-shapes 1b

Two workers, one accelerator each (rank 0 the donor, rank 1 the healer). For each --shape:

* The state is the real `Trainer.state_dict()` of that model: fp32 master parameters (what the bf16
  mixed-precision Trainer keeps), both fp32 AdamW moments, the per-parameter `step` counters (host tensors),
  the scheduler, dataloader and step. 1b: ~18 GB; 8b: ~96 GB, which fits on one 141 GB H200 because nothing
  else (gradients, activations) is allocated here. The donor's moments are filled with random values so the
  state is not mostly zeros; the healer's whole state is poisoned (NaN) first, and after each transfer the
  per-tensor float64 checksums of both sides must be identical.
* `group`: Regent's `GroupTransport` over a freshly configured `ReplicatedGroup` (NCCL on GPU, RCCL on ROCm,
  Gloo on CPU), received in place into the healer's tensors, then `Trainer.load_state_dict`. Timed on the
  healer from before the receive until the state is loaded and the device synchronized.
* `p2p`: plain `send`/`recv` of one large byte buffer on the benchmark's own default group -- the ceiling
  (370 GB/s measured on nvidia-h200-x2 by the issue; we measure it again in the same run), and the same on
  the ReplicatedGroup's communicator, which separates per-tensor overhead from communicator differences.
* `http` (--http-shapes): Regent's TCP streaming fallback (`StreamTransport`, parallel chunks), TorchFT's
  HTTP-transport design: the donor stages to host memory, the healer fetches over loopback and copies to
  the device. Reported as fetch-only and as staging + fetch.

Ratios reported: group GB/s / p2p GB/s (target >= 0.8), median over --repeats transfers after a first one that
is reported apart (it includes NCCL's lazy set-up of the pair's channels and the donor describing its layout for
the first time; a donor keeps that description while its buffers stay put).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1b", help="model shape(s) whose training state moves: debug|150m|1b|8b")
    parser.add_argument("--layouts", default="contiguous,apart",
                        help="trainer state layouts to move: contiguous (one buffer per parameter set and "
                             "moment, the default) and/or apart (one allocation per tensor)")
    parser.add_argument("--repeats", type=int, default=3, help="timed transfers per shape (median reported)")
    parser.add_argument("--p2p-gb", type=float, default=4.0, help="size of the raw point-to-point buffer, GB")
    parser.add_argument("--http-shapes", default="", help="shapes to also move over the TCP fallback (slow)")
    parser.add_argument("--http-chunks", type=int, default=8, help="parallel connections of the TCP fallback")
    parser.add_argument("--timeout", type=float, default=1500)
    _common.add_common_args(parser)
    return parser.parse_args(argv)


def _fill(state_tensors, donor: bool) -> None:
    import torch

    gen = torch.Generator(device=state_tensors[0].device).manual_seed(1234)
    for t in state_tensors:
        if not t.is_floating_point():
            continue
        if donor:
            if t.dim() > 0:
                t.normal_(0.0, 0.02, generator=gen) if t.device.type != "cpu" else t.normal_(0.0, 0.02)
            else:
                t.fill_(7.0)
        else:
            t.fill_(float("nan"))


def _checksums(tensors, device):
    import torch

    return torch.stack([t.to(device).sum(dtype=torch.float64) if t.numel() else torch.zeros((), dtype=torch.float64,
                        device=device) for t in tensors])


def _same_state(tensors, device, dist) -> bool:
    """Bit-level agreement of donor and healer (per-tensor float64 sums, same kernels on both sides)."""
    import torch

    mine = _checksums(tensors, device)
    theirs = mine.clone()
    dist.broadcast(theirs, src=0)
    agree = torch.tensor([1 if torch.equal(mine, theirs) else 0], device=device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    return bool(agree.item())


def _p2p(dist, buffer, rank: int, group=None, repeats: int = 5) -> list[float]:
    times = []
    for _ in range(repeats + 1):  # the first one sets up the peer connection
        dist.barrier()
        _common.sync(buffer.device)
        start = time.perf_counter()
        if group is None:
            (dist.send if rank == 0 else dist.recv)(buffer, 1 - rank)
        else:
            (group.send if rank == 0 else group.recv)([buffer], 1 - rank)
        _common.sync(buffer.device)
        times.append(time.perf_counter() - start)
    return times[1:]


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from regent import platform
    from regent.ft.process_group import ReplicatedGroup
    from regent.ft.transfer import GroupTransport, StreamTransport, flatten_state
    from regent.train.config import TrainConfig
    from regent.train.trainer import Trainer

    rank = args.worker_rank
    _common.setup_logging(f"peer_transfer {rank}")
    device = _common.init_default_group(rank, 2, args.rendezvous)
    info = _common.machine_info() if rank == 0 else {}
    base = {"bench": "peer_transfer", **info}

    # Raw point-to-point on the default group: the ceiling, measured in this run.
    p2p_bytes = int(args.p2p_gb * 1e9)
    buffer = torch.empty(p2p_bytes, dtype=torch.uint8, device=device)
    buffer.fill_(rank + 1)
    times = _p2p(dist, buffer, rank)
    p2p_gbps = p2p_bytes / statistics.median(times) / 1e9
    if rank == 0:
        _common.append_result(args.out, {**base, "what": "p2p_default_group", "bytes": p2p_bytes,
                                         "seconds": times, "gbps_median": p2p_gbps})

    # Regent's replicated group (the communicator GroupTransport uses), rendezvous on a store rank 0 hosts.
    store = None
    port = [0]
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = [store.port]
    dist.broadcast_object_list(port, src=0)
    group = ReplicatedGroup(backend=platform.backend(), timeout=600, connect_timeout=120)
    group.configure(f"127.0.0.1:{port[0]}/regent/bench/0", f"bench{rank}", rank, 2)
    times = _p2p(dist, buffer, rank, group=group)
    group_p2p_gbps = p2p_bytes / statistics.median(times) / 1e9
    if rank == 0:
        _common.append_result(args.out, {**base, "what": "p2p_replicated_group", "bytes": p2p_bytes,
                                         "seconds": times, "gbps_median": group_p2p_gbps})
    del buffer
    if device.type == "cuda":
        torch.cuda.empty_cache()

    http_shapes = set(_common.parse_list(args.http_shapes, str))
    for shape, layout in [(s, lay) for s in _common.parse_list(args.shape, str)
                          for lay in _common.parse_list(args.layouts, str)]:
        if layout not in ("contiguous", "apart"):
            raise SystemExit(f"--layouts: unknown layout {layout!r}; use contiguous and/or apart")
        cfg = TrainConfig(model=shape, seq_len=128, batch_size=1, data_max_bytes=1_000_000, seed=rank,
                          contiguous_state=layout == "contiguous")
        trainer = Trainer(cfg, rank=0, world_size=1, device=device)
        state = trainer.state_dict()
        meta, tensors = flatten_state(state, step=0)
        nbytes = sum(m.nbytes for m in meta.tensors)
        with torch.no_grad():
            _fill(tensors, donor=rank == 0)
        step = 1000
        trainer.step = step
        record = {**base, "shape": shape, "layout": layout, "bytes": nbytes, "tensors": len(tensors), "num_params": trainer.num_params,
                  "representation": "fp32 params + fp32 AdamW exp_avg/exp_avg_sq + host step counters"}

        transport = GroupTransport(group)
        runs = []
        for attempt in range(args.repeats + 1):
            if rank == 1:
                with torch.no_grad():
                    _fill(tensors, donor=False)
            dist.barrier()
            _common.sync(device)
            start = time.perf_counter()
            in_place = None
            if rank == 0:
                transport.send_checkpoint([1], step, trainer.state_dict(), timeout=600)
            else:
                received = transport.recv_checkpoint(0, transport.metadata(), step, timeout=600,
                                                     into=trainer.state_dict())
                loading = time.perf_counter()
                trainer.load_state_dict(received)
            _common.sync(device)
            elapsed = time.perf_counter() - start
            loaded = time.perf_counter() - loading if rank == 1 else 0.0
            if rank == 1:  # bookkeeping of the benchmark, outside the timed region
                _, got = flatten_state(received, step)
                in_place = sum(m.nbytes for m, a, b in zip(meta.tensors, got, tensors) if a.data_ptr() == b.data_ptr())
                del received, got
            phases = dict(transport.last_timing)
            if rank == 1:
                phases["load_state_dict"] = loaded
                phases["described_alike"] = float(transport.last_described_alike)
            ok = _same_state(tensors, device, dist)
            runs.append({"seconds": elapsed, "ok": ok, "in_place_bytes": in_place, "phases": phases})
            if not ok:
                print(f"rank {rank}: {shape}: healer state differs from donor after transfer {attempt}",
                      file=sys.stderr, flush=True)
        healer = [None, None]
        dist.all_gather_object(healer, runs)
        donor_phases = healer[0][-1]["phases"]
        if rank == 0:
            timed = healer[1][1:] if len(healer[1]) > 1 else healer[1]
            median = statistics.median(r["seconds"] for r in timed)
            gbps = nbytes / median / 1e9
            _common.append_result(args.out, {
                **record, "what": "group_transport", "runs_healer": healer[1], "first_seconds": healer[1][0]["seconds"],
                "seconds_median": median, "gbps_median": gbps, "p2p_gbps": p2p_gbps,
                "messages": transport.last_messages, "donor_phases_last": donor_phases, "ratio_to_p2p": gbps / p2p_gbps,
                "all_ok": all(r["ok"] for r in healer[1]),
            })
            print(f"{shape} ({layout}): {nbytes / 1e9:.1f} GB by GroupTransport in {median * 1000:.0f} ms = {gbps:.0f} GB/s "
                  f"(first transfer {healer[1][0]['seconds'] * 1000:.0f} ms) "
                  f"({100 * gbps / p2p_gbps:.0f}% of p2p {p2p_gbps:.0f} GB/s), {transport.last_messages} messages; in place "
                  f"{healer[1][-1]['in_place_bytes'] / nbytes:.1%}; correct={all(r['ok'] for r in healer[1])}",
                  flush=True)
            ms = ", ".join(f"{k} {v * 1000:.1f}" for k, v in healer[1][-1]["phases"].items())
            print(f"  last run, ms: healer {ms}; donor "
                  + ", ".join(f"{k} {v * 1000:.1f}" for k, v in donor_phases.items()), flush=True)

        if shape in http_shapes and layout == _common.parse_list(args.layouts, str)[0]:
            stream = StreamTransport(num_chunks=args.http_chunks, timeout=600) if rank == 0 else None
            address = [stream.metadata() if stream else None]
            dist.broadcast_object_list(address, src=0)
            if rank == 1:
                with torch.no_grad():
                    _fill(tensors, donor=False)
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                stream.send_checkpoint([1], step, trainer.state_dict(), timeout=600)
            stage = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            if rank == 1:
                received = _fetch(address[0], step, trainer, args.http_chunks)
                trainer.load_state_dict(received)
                _common.sync(device)
            fetch = time.perf_counter() - start
            dist.barrier()
            ok = _same_state(tensors, device, dist)
            times = [None, None]
            dist.all_gather_object(times, {"stage": stage, "fetch": fetch})
            if rank == 0:
                stream.disallow_checkpoint()
                stream.shutdown()
                stage_s, fetch_s = times[0]["stage"], times[1]["fetch"]
                _common.append_result(args.out, {
                    **record, "what": "http_fallback", "chunks": args.http_chunks, "stage_seconds": stage_s,
                    "fetch_seconds": fetch_s, "gbps_fetch": nbytes / fetch_s / 1e9,
                    "gbps_end_to_end": nbytes / (stage_s + fetch_s) / 1e9, "ok": ok,
                })
                print(f"{shape}: TCP fallback: stage {stage_s:.1f} s + fetch {fetch_s:.1f} s = "
                      f"{nbytes / (stage_s + fetch_s) / 1e9:.2f} GB/s end to end (fetch alone "
                      f"{nbytes / fetch_s / 1e9:.2f} GB/s); correct={ok}", flush=True)
            del stream

        trainer.close()
        del trainer, state, tensors, transport
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    group.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _fetch(address: str, step: int, trainer, chunks: int):
    """The healer side of the TCP fallback (a client object; it serves nothing)."""
    from regent.ft.transfer import StreamTransport

    client = StreamTransport(num_chunks=chunks, timeout=600)
    try:
        return client.recv_checkpoint(0, address, step, timeout=600, into=trainer.state_dict())
    finally:
        client.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_rank is not None:
        return worker(args)
    return _common.launch_workers(__file__, list(sys.argv[1:] if argv is None else argv), 2, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
