"""Peer process for the replicated-group tests: follows commands on stdin, answers on stdout."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from regent.ft.process_group import ReplicatedGroup

torch.set_num_threads(1)
group = ReplicatedGroup("gloo", timeout=float(sys.argv[1]), connect_timeout=30)
for line in sys.stdin:
    cmd, *rest = line.split()
    if cmd == "configure":
        group.configure(rest[0], "peer", 1, 2)
        print("configured", flush=True)
    elif cmd == "allreduce":
        t = torch.full((4,), 2.0)
        try:
            group.allreduce(t).wait()
            print("result", t[0].item(), flush=True)
        except Exception as err:  # noqa: BLE001 - reported: printed, the test reads it
            print("error", type(err).__name__, flush=True)
    elif cmd == "quit":
        break
