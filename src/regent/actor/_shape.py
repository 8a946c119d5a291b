"""Shapes of meshes: labelled dimensions over a strided set of global ranks.

A mesh (of hosts, procs, actors or values) is a view onto the ranks of the mesh it was created as. The view
is an `Extent` (labels and sizes) plus a `Slice` (offset and strides into the root's linear rank space), so
slicing never copies per-rank data and a slice always knows which root ranks it covers: that is what makes
"a slice containing a failed rank is poisoned" a set intersection.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any


class Extent(Mapping):
    """Labelled sizes, e.g. `{hosts: 2, gpus: 4}`; a Mapping from label to size."""

    __slots__ = ("_labels", "_sizes")

    def __init__(self, labels: Sequence[str], sizes: Sequence[int]) -> None:
        labels = list(labels)
        sizes = [int(s) for s in sizes]
        if len(labels) != len(sizes):
            raise ValueError(f"Extent needs one size per label, got labels={labels} sizes={sizes}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"Extent labels must be unique, got {labels}")
        for label, size in zip(labels, sizes):
            if size < 0:
                raise ValueError(f"Extent size of {label!r} must be >= 0, got {size}")
        self._labels = labels
        self._sizes = sizes

    @property
    def labels(self) -> list[str]:
        return list(self._labels)

    @property
    def sizes(self) -> list[int]:
        return list(self._sizes)

    @property
    def nelements(self) -> int:
        return math.prod(self._sizes)

    @property
    def region(self) -> Extent:
        return self

    def __getitem__(self, label: str) -> int:
        try:
            return self._sizes[self._labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._labels)

    def __len__(self) -> int:
        return len(self._labels)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Extent):
            return self._labels == other._labels and self._sizes == other._sizes
        return super().__eq__(other)

    def __hash__(self) -> int:
        return hash((tuple(self._labels), tuple(self._sizes)))

    def __str__(self) -> str:
        return "{" + ", ".join(f"{label}: {size}" for label, size in zip(self._labels, self._sizes)) + "}"

    def __repr__(self) -> str:
        return f"Extent({self._labels!r}, {self._sizes!r})"

    def __reduce__(self):
        return (Extent, (self._labels, self._sizes))


def coordinates_of(rank: int, sizes: Sequence[int]) -> list[int]:
    """Row-major coordinates of a linear `rank` within `sizes`."""
    coords = [0] * len(sizes)
    for i in range(len(sizes) - 1, -1, -1):
        size = sizes[i]
        coords[i] = rank % size if size else 0
        rank = rank // size if size else 0
    return coords


class Point(Mapping):
    """A rank within an extent; a Mapping from label to coordinate. `str()` is `{'hosts': 0/1, 'gpus': 1/2}`."""

    __slots__ = ("_rank", "_extent", "_coords")

    def __init__(self, rank: int, extent: Extent) -> None:
        if not 0 <= rank < max(extent.nelements, 1):
            raise IndexError(f"rank {rank} out of range for extent {extent}")
        self._rank = int(rank)
        self._extent = extent
        self._coords = coordinates_of(self._rank, extent.sizes)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def extent(self) -> Extent:
        return self._extent

    def size(self, label: str) -> int:
        return self._extent[label]

    def __getitem__(self, label: str) -> int:
        try:
            return self._coords[self._extent.labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._extent.labels)

    def __len__(self) -> int:
        return len(self._coords)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Point):
            return self._rank == other._rank and self._extent == other._extent
        return super().__eq__(other)

    def __hash__(self) -> int:
        return hash((self._rank, self._extent))

    def __str__(self) -> str:
        parts = [f"'{label}': {c}/{s}" for label, c, s in zip(self._extent.labels, self._coords, self._extent.sizes)]
        return "{" + ", ".join(parts) + "}"

    __repr__ = __str__

    def __reduce__(self):
        return (Point, (self._rank, self._extent))


class Slice:
    """Offset, sizes and strides into a linear rank space (an n-dimensional strided view)."""

    __slots__ = ("offset", "sizes", "strides")

    def __init__(self, offset: int, sizes: Sequence[int], strides: Sequence[int]) -> None:
        self.offset = int(offset)
        self.sizes = [int(s) for s in sizes]
        self.strides = [int(s) for s in strides]
        if len(self.sizes) != len(self.strides):
            raise ValueError("Slice needs one stride per size")

    @staticmethod
    def new_row_major(sizes: Sequence[int]) -> Slice:
        strides = []
        acc = 1
        for size in reversed(list(sizes)):
            strides.append(acc)
            acc *= size
        return Slice(0, sizes, list(reversed(strides)))

    def __len__(self) -> int:
        return math.prod(self.sizes)

    def ranks(self) -> list[int]:
        out = [self.offset]
        for size, stride in zip(self.sizes, self.strides):
            out = [base + i * stride for base in out for i in range(size)]
        return out

    def is_dense(self) -> bool:
        """True when the view is contiguous in row-major order (so it can be flattened)."""
        expected = 1
        for size, stride in zip(reversed(self.sizes), reversed(self.strides)):
            if size > 1 and stride != expected:
                return False
            expected *= size
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Slice) and (self.offset, self.sizes, self.strides) == (
            other.offset,
            other.sizes,
            other.strides,
        )

    def __hash__(self) -> int:
        return hash((self.offset, tuple(self.sizes), tuple(self.strides)))

    def __repr__(self) -> str:
        return f"Slice(offset={self.offset}, sizes={self.sizes}, strides={self.strides})"

    def __reduce__(self):
        return (Slice, (self.offset, self.sizes, self.strides))


class Shape:
    """Labels over a `Slice`: the addressing of a (possibly sliced) mesh."""

    __slots__ = ("labels", "ndslice")

    def __init__(self, labels: Sequence[str], slice: Slice | None = None, *,  # noqa: A002 - Monarch's keyword
                 ndslice: Slice | None = None) -> None:
        if (slice is None) == (ndslice is None):
            raise TypeError("Shape(labels, slice) needs exactly one Slice (keyword `slice=`, or `ndslice=`)")
        ndslice = slice if slice is not None else ndslice
        self.labels = list(labels)
        self.ndslice = ndslice
        if len(self.labels) != len(ndslice.sizes):
            raise ValueError(f"Shape needs one label per dimension, got {self.labels} for {ndslice}")

    @staticmethod
    def from_extent(extent: Extent) -> Shape:
        return Shape(extent.labels, Slice.new_row_major(extent.sizes))

    @property
    def extent(self) -> Extent:
        return Extent(self.labels, self.ndslice.sizes)

    @property
    def region(self) -> Extent:
        return self.extent

    def __len__(self) -> int:
        return len(self.ndslice)

    def ranks(self) -> list[int]:
        return self.ndslice.ranks()

    def _dim(self, label: str) -> int:
        try:
            return self.labels.index(label)
        except ValueError:
            raise TypeError(f"mesh has no dimension {label!r}; dimensions are {self.labels}") from None

    def at(self, label: str, index: int) -> Shape:
        """The shape with dimension `label` fixed at `index` (and removed). As Monarch's: an unknown label
        or an index past the end raises ValueError, a negative index OverflowError (Monarch's index is
        unsigned, so programs written against it catch OverflowError there)."""
        if label not in self.labels:
            raise ValueError(f"Shape has no dimension {label!r}; dimensions are {self.labels}")
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"index for {label!r} must be an int, got {type(index).__name__}")
        if index < 0:
            raise OverflowError("can't convert negative int to unsigned")
        size = self.ndslice.sizes[self.labels.index(label)]
        if not 0 <= index < size:
            raise ValueError(f"index {index} out of range for dimension {label!r} of size {size}")
        return self.select(label, index)

    def select(self, label: str, index: int | slice) -> Shape:
        dim = self._dim(label)
        size = self.ndslice.sizes[dim]
        stride = self.ndslice.strides[dim]
        sizes = list(self.ndslice.sizes)
        strides = list(self.ndslice.strides)
        labels = list(self.labels)
        if isinstance(index, slice):
            start, stop, step = index.indices(size)
            if step <= 0:
                raise ValueError(f"slice step must be positive for dimension {label!r}, got {step}")
            count = len(range(start, stop, step))
            offset = self.ndslice.offset + start * stride
            sizes[dim] = count
            strides[dim] = stride * step
            return Shape(labels, Slice(offset, sizes, strides))
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index for {label!r} must be an int or a slice, got {type(index).__name__}")
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(f"index {index} out of range for dimension {label!r} of size {size}")
        offset = self.ndslice.offset + index * stride
        del sizes[dim], strides[dim], labels[dim]
        return Shape(labels, Slice(offset, sizes, strides))

    def slice(self, **kwargs: int | slice) -> Shape:
        shape = self
        for label, index in kwargs.items():
            shape = shape.select(label, index)
        return shape

    def flatten(self, name: str) -> Shape:
        if not self.ndslice.is_dense():
            raise ValueError(f"cannot flatten a non-dense mesh view ({self.ndslice}); slice with step 1 first")
        step = self.ndslice.strides[-1] if self.ndslice.sizes and self.ndslice.sizes[-1] > 1 else 1
        if not self.ndslice.sizes:
            step = 1
        return Shape([name], Slice(self.ndslice.offset, [len(self)], [step]))

    def rename(self, **names: str) -> Shape:
        for old in names:
            self._dim(old)
        return Shape([names.get(label, label) for label in self.labels], self.ndslice)

    def split(self, **kwargs: Any) -> Shape:
        """`split(host=("dp", "pp"), pp=16)`: split dimension `host` into `dp` x `pp`, one size may be inferred."""
        splits = {k: v for k, v in kwargs.items() if isinstance(v, (tuple, list))}
        given = {k: v for k, v in kwargs.items() if not isinstance(v, (tuple, list))}
        labels, sizes, strides = [], [], []
        for label, size, stride in zip(self.labels, self.ndslice.sizes, self.ndslice.strides):
            if label not in splits:
                labels.append(label)
                sizes.append(size)
                strides.append(stride)
                continue
            new_labels = list(splits[label])
            known = [given.get(n) for n in new_labels]
            missing = [i for i, s in enumerate(known) if s is None]
            if len(missing) > 1:
                raise ValueError(f"split of {label!r} into {new_labels} needs all but one size, got {given}")
            prod_known = math.prod(s for s in known if s is not None)
            if missing:
                if prod_known == 0 or size % prod_known:
                    raise ValueError(f"cannot split {label!r} of size {size} by {prod_known}")
                known[missing[0]] = size // prod_known
            if math.prod(known) != size:
                raise ValueError(f"split sizes {known} of {label!r} do not multiply to {size}")
            acc = stride
            new_strides = []
            for s in reversed(known):
                new_strides.append(acc)
                acc *= s
            labels.extend(new_labels)
            sizes.extend(known)
            strides.extend(reversed(new_strides))
        for label in splits:
            self._dim(label)
        for label in given:
            if not any(label in v for v in splits.values()):
                raise TypeError(f"split size given for {label!r}, which is not a new dimension")
        return Shape(labels, Slice(self.ndslice.offset, sizes, strides))

    def local_rank(self, global_rank: int) -> int:
        """Index of `global_rank` within this view (row-major), or -1 if the view does not contain it."""
        try:
            return self.ranks().index(global_rank)
        except ValueError:
            return -1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shape) and self.labels == other.labels and self.ndslice == other.ndslice

    def __hash__(self) -> int:
        return hash((tuple(self.labels), self.ndslice))

    def __repr__(self) -> str:
        return f"Shape({self.labels!r}, {self.ndslice!r})"

    def __reduce__(self):
        return (Shape, (self.labels, self.ndslice))


class MeshTrait:
    """Slicing and size methods shared by every mesh type; subclasses provide `_shape` and `_new_with_shape`."""

    _shape: Shape

    def _new_with_shape(self, shape: Shape) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def slice(self, **kwargs: int | slice) -> Any:
        return self._new_with_shape(self._shape.slice(**kwargs))

    def flatten(self, name: str) -> Any:
        return self._new_with_shape(self._shape.flatten(name))

    def rename(self, **kwargs: str) -> Any:
        return self._new_with_shape(self._shape.rename(**kwargs))

    def split(self, **kwargs: Any) -> Any:
        return self._new_with_shape(self._shape.split(**kwargs))

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        extent = self._shape.extent
        if dim is None:
            return extent.nelements
        if isinstance(dim, str):
            return extent[dim]
        return math.prod(extent[d] for d in dim)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._shape.extent)

    @property
    def extent(self) -> Extent:
        return self._shape.extent

    def __len__(self) -> int:
        return len(self._shape)
