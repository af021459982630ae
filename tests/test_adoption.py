"""graphtree.tree.adoption on CPU tensors: when a new object's tensors may move into the storages a
recording keeps, and what moving them does (the class is device-agnostic; the GPU tests run it
inside the tree: tests/gpu/test_adoption_gpu.py)."""

import torch

from graphtree.tree.adoption import Adoption


class Cache:
    def __init__(self, fill: float = 0.0) -> None:
        self.k = torch.full((4, 8), fill)
        self.n = torch.zeros((), dtype=torch.long)


def _leaves(x: torch.Tensor, cache: Cache) -> list:
    return [x, cache.k, cache.n]  # as read_call lays them out: the call's own leaves, then the object's


def _recorded(cache: Cache) -> Adoption:
    a = Adoption.of(_leaves(torch.zeros(8), cache), [1, 2], n_args=1, skip=lambda p: False)
    assert a is not None
    return a


def test_a_new_object_moves_into_the_kept_storages_once_the_old_one_is_dropped():
    old = Cache()
    a = _recorded(old)
    ptrs = [k.ptr for k in a.kept]
    new = Cache(fill=3.0)
    assert not a.fits(_leaves(torch.zeros(8), new))  # the old cache still holds that memory
    del old
    leaves = _leaves(torch.zeros(8), new)
    assert a.fits(leaves)
    assert a.adopt(leaves) == 2
    assert [new.k.data_ptr(), new.n.data_ptr()] == ptrs  # where the graph reads
    assert torch.equal(new.k, torch.full((4, 8), 3.0))  # with the new object's values
    assert a.adopt(_leaves(torch.zeros(8), new)) == 0  # already there: nothing to move
    assert not any(a.keeps_alone(a_ref) for a_ref in _refs(a))  # the new cache holds them now
    del leaves, new
    assert all(a.keeps_alone(a_ref) for a_ref in _refs(a))


def _refs(a: Adoption) -> list[int]:
    from graphtree import _torch

    return [_torch.storage_ref(k.storage) for k in a.kept]


def test_a_tensor_that_shares_its_storage_is_not_moved():
    old = Cache()
    a = _recorded(old)
    del old
    new = Cache()
    view = new.k[1:]  # another tensor on the new storage would be left behind
    assert not a.fits(_leaves(torch.zeros(8), new))
    del view
    assert a.fits(_leaves(torch.zeros(8), new))


def test_another_offset_or_storage_size_is_not_moved():
    old = Cache()
    a = _recorded(old)
    del old
    new = Cache()
    new.k = torch.zeros(5, 8)[1:]  # same shape and strides, offset 8 in a larger storage
    assert not a.fits(_leaves(torch.zeros(8), new))


def test_tensors_sharing_one_storage_make_no_adoption():
    buf = torch.zeros(2, 4, 8)
    leaves = [torch.zeros(8), buf[0], buf[1]]  # keys and values, views of one buffer
    assert Adoption.of(leaves, [1, 2], n_args=1, skip=lambda p: False) is None


def test_parameters_static_marked_the_calls_own_leaves_and_skipped_addresses_are_not_kept():
    p = torch.nn.Parameter(torch.zeros(3))
    own = torch.zeros(3)
    skipped = torch.zeros(3)
    leaves = [own, p, skipped]
    assert Adoption.of(leaves, [0, 1, 2], n_args=1, skip=lambda ptr: ptr == skipped.data_ptr()) is None


def test_inference_tensors_move_too():
    with torch.inference_mode():
        old = Cache()
    a = _recorded(old)
    del old
    with torch.inference_mode():
        new = Cache(fill=2.0)
    leaves = _leaves(torch.zeros(8), new)
    assert a.fits(leaves) and a.adopt(leaves) == 2
    assert new.k.data_ptr() == a.kept[0].ptr and float(new.k.sum()) == 64.0


def test_two_recordings_keeping_one_storage_see_it_alone_once_the_object_is_dropped():
    from graphtree.tree.adoption import adopt_orphans

    first = Cache()
    decode = _recorded(first)  # the decode step's recording keeps the first cache's memory
    kept = [k.ptr for k in decode.kept]
    del first
    fresh = Cache(fill=5.0)  # a new cache met by another call (a prefill): not recorded yet
    assert adopt_orphans(_leaves(torch.zeros(8), fresh), 1, [decode]) == 2
    assert [fresh.k.data_ptr(), fresh.n.data_ptr()] == kept and float(fresh.k.sum()) == 160.0
    prefill = _recorded(fresh)  # recorded on the same memory: both keep it
    assert [k.ptr for k in prefill.kept] == kept
    assert not decode.fits(_leaves(torch.zeros(8), Cache()))  # `fresh` still holds it
    del fresh
    newer = Cache(fill=1.0)
    leaves = _leaves(torch.zeros(8), newer)
    assert prefill.fits(leaves) and decode.fits(leaves)  # held by the two recordings only
    assert prefill.adopt(leaves) == 2 and decode.adopt(leaves) == 0  # one copy serves both
    del prefill
    assert all(decode.keeps_alone(r) for r in _refs(decode)) is False  # `newer` holds it
    del leaves, newer
    assert all(decode.keeps_alone(r) for r in _refs(decode))


def test_orphans_are_not_taken_while_held_nor_across_sizes():
    from graphtree.tree.adoption import adopt_orphans

    old = Cache()
    decode = _recorded(old)
    fresh = Cache()
    assert adopt_orphans(_leaves(torch.zeros(8), fresh), 1, [decode]) == 0  # `old` is alive
    del old
    odd = Cache()
    odd.k = torch.zeros(5, 8)  # another size in the kept place
    assert adopt_orphans(_leaves(torch.zeros(8), odd), 1, [decode]) == 1  # only the counter moves
    assert odd.k.data_ptr() != decode.kept[0].ptr and odd.n.data_ptr() == decode.kept[1].ptr


def test_torch_gives_a_storage_one_python_object_which_the_alone_test_rests_on():
    t = torch.zeros(4)
    kept = t.untyped_storage()
    assert t.untyped_storage() is kept and t[1:].untyped_storage() is kept
    from graphtree import _torch

    assert _torch.storage_use_count(_torch.storage_ref(kept)) == 2  # the tensor and the one object


def test_only_the_newest_orphaned_sets_stay_kept():
    from graphtree.tree.adoption import MAX_ORPHANED, release_oldest_orphans

    caches = [Cache() for _ in range(MAX_ORPHANED + 2)]
    sets = [_recorded(c) for c in caches]
    held = caches[1]  # still held by its caller: not an orphan, stays
    del caches
    assert release_oldest_orphans(sets) == 1  # five orphans: the oldest one goes
    assert not sets[0].kept and not sets[0].orphaned()
    assert all(s.kept for s in sets[1:]) and not sets[1].orphaned()
    fresh = Cache()
    leaves = _leaves(torch.zeros(8), fresh)
    assert sets[0].adopt(leaves) == 0  # a released set moves nothing
    assert release_oldest_orphans(sets) == 0
    del held
    assert release_oldest_orphans(sets) == 1  # now five orphans again
