"""Extent, Point, Shape and slicing: pure logic, no processes."""

import pickle

import pytest

from regent.actor import Extent, Point, Shape, Slice, ValueMesh


def test_point_str_is_monarch_format():
    p = Point(1, Extent(["hosts", "gpus"], [1, 2]))
    assert str(p) == "{'hosts': 0/1, 'gpus': 1/2}"
    assert p.rank == 1 and p["gpus"] == 1 and p["hosts"] == 0 and p.size("gpus") == 2
    assert dict(p) == {"hosts": 0, "gpus": 1}


def test_extent_mapping_and_str():
    e = Extent(["hosts", "gpus"], [2, 4])
    assert str(e) == "{hosts: 2, gpus: 4}"
    assert e["gpus"] == 4 and e.nelements == 8 and list(e) == ["hosts", "gpus"]
    with pytest.raises(KeyError):
        e["nope"]
    with pytest.raises(ValueError):
        Extent(["a", "a"], [1, 2])


def test_point_coordinates_row_major():
    e = Extent(["a", "b", "c"], [2, 3, 4])
    p = Point(17, e)  # 17 = 1*12 + 1*4 + 1
    assert (p["a"], p["b"], p["c"]) == (1, 1, 1)
    with pytest.raises(IndexError):
        Point(24, e)


def _shape(**sizes):
    return Shape.from_extent(Extent(list(sizes), list(sizes.values())))


def test_slice_int_drops_dimension_and_slice_keeps_it():
    s = _shape(hosts=2, gpus=4)
    one = s.slice(hosts=1)
    assert one.labels == ["gpus"] and one.ranks() == [4, 5, 6, 7]
    kept = s.slice(gpus=slice(1, 3))
    assert kept.labels == ["hosts", "gpus"] and kept.extent.sizes == [2, 2]
    assert kept.ranks() == [1, 2, 5, 6]
    stepped = s.slice(gpus=slice(0, 4, 2))
    assert stepped.ranks() == [0, 2, 4, 6]
    assert s.slice(hosts=1, gpus=2).ranks() == [6]
    assert s.slice(gpus=-1).ranks() == [3, 7]


def test_slice_errors():
    s = _shape(hosts=2, gpus=4)
    with pytest.raises(TypeError):
        s.slice(nodes=0)
    with pytest.raises(IndexError):
        s.slice(gpus=4)


def test_flatten_rename_split():
    s = _shape(hosts=2, gpus=4)
    flat = s.flatten("all")
    assert flat.labels == ["all"] and flat.ranks() == list(range(8))
    assert s.rename(gpus="devices").labels == ["hosts", "devices"]
    split = _shape(host=32).split(host=("dp", "pp"), pp=16)
    assert split.labels == ["dp", "pp"] and split.extent.sizes == [2, 16]
    assert split.slice(dp=1, pp=0).ranks() == [16]
    with pytest.raises(ValueError):
        s.slice(gpus=slice(0, 4, 2)).flatten("x")
    with pytest.raises(ValueError):
        _shape(host=10).split(host=("a", "b"), b=3)


def test_sliced_views_compose():
    s = _shape(a=4, b=4)
    v = s.slice(a=slice(1, 4), b=slice(0, 4, 2)).slice(a=1)
    assert v.ranks() == [8, 10]
    assert Slice.new_row_major([2, 3]).strides == [3, 1]


def test_value_mesh_access_iteration_slicing_pickling():
    s = _shape(hosts=2, gpus=2)
    vm = ValueMesh(s, [10, 11, 12, 13])
    assert vm.item(hosts=1, gpus=0) == 12
    with pytest.raises(KeyError):
        vm.item(hosts=1, gpus=0, nodes=0)
    assert vm.values() == [10, 11, 12, 13]
    pairs = list(vm)
    assert [str(p) for p, _ in pairs][1] == "{'hosts': 0/2, 'gpus': 1/2}"
    sub = vm.slice(gpus=1)
    assert sub.values() == [11, 13] and len(sub) == 2
    assert [p.rank for p, _ in sub.items()] == [0, 1]
    again = pickle.loads(pickle.dumps(sub))
    assert again.values() == [11, 13] and again.item(hosts=1) == 13
    assert vm.size("gpus") == 2 and vm.sizes == {"hosts": 2, "gpus": 2}
