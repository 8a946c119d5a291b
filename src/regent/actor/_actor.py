"""Defining actors: `Actor`, `@endpoint`, `@concurrent_endpoint`, and the checks done at spawn time."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from regent.actor._shape import MeshTrait

VALID_PROPAGATE = (None, "cached", "inspect", "mocked")


class EndpointProperty:
    """What `@endpoint` leaves on the class: the function plus how it is called."""

    def __init__(
        self,
        fn: Callable,
        propagate: Any = None,
        explicit_response_port: bool = False,
        instrument: bool = True,
        concurrent: bool = False,
    ) -> None:
        if propagate not in VALID_PROPAGATE and not callable(propagate):
            raise ValueError(f"propagate must be one of {VALID_PROPAGATE} or a callable, got {propagate!r}")
        self.fn = fn
        self.propagate = propagate
        self.explicit_response_port = explicit_response_port
        self.instrument = instrument
        self.concurrent = concurrent
        self.is_async = inspect.iscoroutinefunction(fn)
        self.name = fn.__name__
        functools.update_wrapper(self, fn)
        self._signature: inspect.Signature | None = None
        self._fast_arity: tuple[int, int] | None = None
        self._fast_ready = False

    @property
    def signature(self) -> inspect.Signature:
        if self._signature is None:
            self._signature = inspect.signature(self.fn)
        return self._signature

    def _arity(self) -> tuple[int, int] | None:
        """(min, max) positional arguments when the signature is plain positional, else None."""
        if not self._fast_ready:
            self._fast_ready = True
            params = list(self.signature.parameters.values())[1 + int(self.explicit_response_port):]
            kinds = {p.kind for p in params}
            if kinds <= {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD}:
                required = sum(1 for p in params if p.default is inspect.Parameter.empty)
                self._fast_arity = (required, len(params))
        return self._fast_arity

    def check_args(self, args: tuple, kwargs: dict, mesh_name: str = "") -> None:
        """Raise TypeError in the caller when the arguments do not fit the endpoint's signature."""
        if not kwargs:
            arity = self._arity()
            if arity is not None and arity[0] <= len(args) <= arity[1]:
                return
        try:
            if self.explicit_response_port:
                self.signature.bind(None, None, *args, **kwargs)
            else:
                self.signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            where = f"{mesh_name}.{self.name}" if mesh_name else self.name
            raise TypeError(f"bad arguments for endpoint {where}(): {exc}") from None

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self
        if isinstance(instance, Actor):
            # Inside the actor, `self.method(...)` is a plain local call.
            return self.fn.__get__(instance, owner)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def endpoint(
    method: Callable | None = None,
    *,
    propagate: Any = None,
    explicit_response_port: bool = False,
    instrument: bool = True,
) -> Any:
    """Mark an actor method as remotely callable. Works bare (`@endpoint`) or with arguments."""

    def wrap(fn: Callable) -> EndpointProperty:
        if isinstance(fn, EndpointProperty):
            return fn
        return EndpointProperty(fn, propagate, explicit_response_port, instrument)

    return wrap(method) if method is not None else wrap


def concurrent_endpoint(
    method: Callable | None = None,
    *,
    propagate: Any = None,
    explicit_response_port: bool = False,
    instrument: bool = True,
) -> Any:
    """Like `@endpoint`, but the body runs as its own task so the actor can take the next message at once.

    Only for `async def` methods. Two calls from one sender start in order.
    """

    def wrap(fn: Callable) -> EndpointProperty:
        if isinstance(fn, EndpointProperty):
            raise ValueError("concurrent_endpoint does not wrap @endpoint; use @concurrent_endpoint alone")
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(f"concurrent_endpoint can only wrap async endpoints; {fn.__qualname__} is sync")
        return EndpointProperty(fn, propagate, explicit_response_port, instrument, concurrent=True)

    return wrap(method) if method is not None else wrap


class Actor(MeshTrait):
    """Base class of user actors. `__init__` receives the spawn arguments.

    Optional hooks: `__supervise__(self, failure) -> bool` (an owned mesh failed; truthy means handled),
    `__cleanup__(self, exc)` (runs when the actor stops), both sync or async to match the endpoints.
    """

    @functools.cached_property
    def logger(self) -> logging.Logger:
        log = logging.getLogger(type(self).__qualname__)
        log.setLevel(logging.DEBUG)
        return log

    def _handle_undeliverable_message(self, message: Any) -> bool:
        return False


def endpoints_of(cls: type) -> dict[str, EndpointProperty]:
    out: dict[str, EndpointProperty] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, EndpointProperty):
                out[name] = value
            elif name in out:
                del out[name]
    return out


# Names an endpoint may not use, because they are attributes of the mesh object a user calls it on.
RESERVED_NAMES = frozenset(
    {"stop", "slice", "initialized", "split", "flatten", "rename", "size", "sizes", "extent", "spawn",
     "_name", "_shape", "_new_with_shape"}
)


def validate_actor_class(cls: type) -> bool:
    """Spawn-time checks; returns True when the actor is async. Raises ValueError naming the fix."""
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"{cls!r} is not an Actor subclass")
    eps = endpoints_of(cls)
    kinds = {ep.is_async for ep in eps.values()}
    if len(kinds) > 1:
        raise ValueError(
            f"{cls.__qualname__} mixes both async and sync endpoints; make them all `def` or all `async def`"
        )
    for name in eps:
        if name in RESERVED_NAMES:
            raise ValueError(f"endpoint name {name!r} of {cls.__qualname__} collides with an ActorMesh attribute")
    is_async = kinds == {True}
    cleanup = getattr(cls, "__cleanup__", None)
    if cleanup is not None and eps and inspect.iscoroutinefunction(cleanup) != is_async:
        raise ValueError(
            f"{cls.__qualname__}.__cleanup__ must be {'async' if is_async else 'sync'} like its endpoints"
        )
    if not eps and cleanup is not None:
        is_async = inspect.iscoroutinefunction(cleanup)
    return is_async


def check_constructor_args(cls: type, args: tuple, kwargs: dict) -> None:
    init = cls.__init__
    if init is object.__init__:
        if args or kwargs:
            raise TypeError(f"{cls.__qualname__}() takes no arguments, got {args} {kwargs}")
        return
    try:
        inspect.signature(init).bind(None, *args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"bad arguments for {cls.__qualname__}(): {exc}") from None
