"""The controller's fault hook and its standby ReplicaActors (`OrchestrationManager._fault_hook`): a standby's
death, warm or still warming, starts another standby and never reaches the hook that ends the run (DESIGN.md
invariant 6). Pure: the manager is a namespace with the attributes the hook reads."""

from __future__ import annotations

from types import SimpleNamespace

from regent.orchestrate.run import OrchestrationManager


class _Loop:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.calls.append((fn, args))


def _manager(standbys: list, warm) -> SimpleNamespace:
    m = SimpleNamespace(_replicas=None, _loop=_Loop(), _lh_actors=[], _lh_killed=[], _lighthouse=None,
                        _standbys=standbys, _standby=warm)
    m._standby_lost = lambda pair: None
    m._lighthouse_crashed = lambda: None
    return m


def _hook(m: SimpleNamespace, ended: list) -> object:
    return OrchestrationManager._fault_hook(m, ended.append)


def test_a_warming_standby_that_dies_starts_another_and_does_not_end_the_run():
    warming, warm = (object(), object()), (object(), object())
    m = _manager([warm, warming], warm)
    ended: list = []
    hook = _hook(m, ended)
    hook(SimpleNamespace(mesh=warming[1], crashed_ranks=[0]))  # not yet the warm one: still known
    hook(SimpleNamespace(mesh=warm[0], crashed_ranks=[0]))
    assert ended == []
    assert [args[0] for _, args in m._loop.calls] == [warming, warm]


def test_another_mesh_still_reaches_the_previous_hook():
    m = _manager([], None)
    ended: list = []
    failure = SimpleNamespace(mesh=object(), crashed_ranks=[0])
    _hook(m, ended)(failure)
    assert ended == [failure]


def test_a_lost_standby_is_forgotten_and_replaced():
    pair, other = (object(), object()), (object(), object())
    kept: list = []
    m = SimpleNamespace(_standbys=[pair, other], _standby=pair, _keep_standby=kept.append)
    OrchestrationManager._standby_lost(m, pair)
    assert m._standbys == [other] and m._standby is None and len(kept) == 1
