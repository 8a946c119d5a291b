"""What a warm spare process does before it is claimed, so that a restarted trainer starts from it faster.

Imported by warm spares (`ReplicaActor`'s PRELOAD): the modules a trainer imports while it builds (measured with
`sys.modules` before and after a TrainingSession build: the gRPC server and channel, the backstop, the model)
and the built-in corpus listing, which every trainer reads. Nothing here depends on the run's configuration.
"""

from __future__ import annotations

import grpc._channel  # imported for the side effect: loaded before a restart needs it
import grpc._server
import grpc.experimental  # noqa: F401

import regent.ft.backstop
import regent.ft.lighthouse_client
import regent.train.models.llama3
import regent.train.parallel  # noqa: F401
from regent.train.data import builtin_corpus_files

builtin_corpus_files()
