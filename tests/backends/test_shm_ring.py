"""The persistent shared-memory ring that hands captured states from vLLM's worker to the runner
(`ShmRingHandoff`): zero-copy reads, reuse, overflow, and no leftovers. The engine around it is
covered in test_vllm_target.py."""

import os
import subprocess
import sys

import pytest
import torch

from eagle_ray.backends.vllm.handoff import (
    ShmRingHandoff,
    handoff_from_config,
    handoff_key,
    ring_name,
    sweep_dead_rings,
)

PREFIX = handoff_key("testengine", "")


@pytest.fixture
def ring(tmp_path):
    """(reader, writer) over one ring of 64 KiB, as the runner and the connector hold it."""
    reader = ShmRingHandoff(str(tmp_path / ring_name(PREFIX)), 64 * 1024, create=True)
    writer = handoff_from_config(reader.to_config())
    return reader, writer


def states(seed, tokens=16, dtype=torch.bfloat16):
    """[tokens, 4, 64] states: 8 KiB in bf16."""
    return torch.randn(tokens, 4, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)


def offset_of(reader, view):
    return view.data_ptr() - reader._buffer.ctypes.data


def test_taken_states_are_views_of_the_ring_and_their_stretch_is_reused(ring):
    reader, writer = ring
    sent = {f"{PREFIX}{i}": states(i) for i in range(3)}
    for key, value in sent.items():
        writer.publish(key, value)
    taken = {key: reader.take(key, tuple(v.shape), v.dtype) for key, v in
             reversed(sent.items())}  # out of order
    for key, value in sent.items():
        assert torch.equal(taken[key], value)
        assert 0 <= offset_of(reader, taken[key]) < reader.capacity, "a view of the ring"
    assert reader.take(f"{PREFIX}0", (16, 4, 64), torch.bfloat16) is None, "taken once"
    first = offset_of(reader, taken[f"{PREFIX}0"])
    del taken, value
    assert reader.keys(f"{PREFIX}0") == [], "dropping the views frees their records"
    writer.publish(f"{PREFIX}9", states(9))
    assert offset_of(reader, reader.take(f"{PREFIX}9", (16, 4, 64), torch.bfloat16)) == first


def test_a_derived_view_keeps_its_stretch_until_it_is_dropped(ring):
    reader, writer = ring
    writer.publish(f"{PREFIX}0", states(0))
    view = reader.take(f"{PREFIX}0", (16, 4, 64), torch.bfloat16)
    part = view[:, :3]
    del view
    assert reader.keys(f"{PREFIX}0") == [f"{PREFIX}0.taken"], "still read through `part`"
    del part
    assert reader.keys(f"{PREFIX}0") == []


def test_a_full_ring_overflows_to_a_file_instead_of_waiting(ring):
    reader, writer = ring
    held = []
    for i in range(8):  # 8 x 8 KiB fill the 64 KiB ring
        writer.publish(f"{PREFIX}{i}", states(i))
        held.append(reader.take(f"{PREFIX}{i}", (16, 4, 64), torch.bfloat16))
    writer.publish(f"{PREFIX}full", states(8))
    assert sorted(reader.keys(f"{PREFIX}full")) == [f"{PREFIX}full", f"{PREFIX}full.data"]
    big = states(9, tokens=300)  # larger than the whole ring
    writer.publish(f"{PREFIX}big", big)
    assert torch.equal(reader.take(f"{PREFIX}full", (16, 4, 64), torch.bfloat16), states(8))
    assert torch.equal(reader.take(f"{PREFIX}big", tuple(big.shape), big.dtype), big)
    assert reader.keys(f"{PREFIX}full") == reader.keys(f"{PREFIX}big") == []
    held.pop(0)  # the oldest stretch comes free: the next one fits there again (wrap-around)
    writer.publish(f"{PREFIX}again", states(10))
    again = reader.take(f"{PREFIX}again", (16, 4, 64), torch.bfloat16)
    assert offset_of(reader, again) == 0 and torch.equal(again, states(10))


def test_discard_and_the_sweep_of_dead_owners_leave_nothing(ring, tmp_path):
    reader, writer = ring
    writer.publish(f"{PREFIX}0", states(0, dtype=torch.float32))
    assert reader.discard(f"{PREFIX}0") == 1
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    orphan_prefix = handoff_key("killedengine", "")
    orphan = ShmRingHandoff(str(tmp_path / ring_name(orphan_prefix, int(dead.stdout))), 4096,
                            create=True)
    orphan.publish(f"{orphan_prefix}7", states(7, tokens=2))
    assert sweep_dead_rings(str(tmp_path)) == [ring_name(orphan_prefix, int(dead.stdout))]
    assert sorted(p.name for p in tmp_path.iterdir()) == [ring_name(PREFIX)], \
        "the live engine's ring stays, the dead one's ring and records go"
    assert reader.discard(PREFIX) == 1 and list(tmp_path.iterdir()) == []


def test_a_stretch_being_written_is_not_reclaimed_and_writers_copy_outside_the_lock(ring):
    """A writer holds the lock only to allocate: while one copies (here: held inside its copy),
    another allocates a different stretch and publishes; both arrive intact."""
    import threading

    reader, writer = ring
    first, second = states(1), states(2)
    copying, release = threading.Event(), threading.Event()
    original = torch.Tensor.copy_

    def slow_copy(self, source, *args, **kwargs):
        if threading.current_thread().name == "first" and not release.is_set():
            copying.set()
            release.wait(10)
        return original(self, source, *args, **kwargs)

    torch.Tensor.copy_ = slow_copy
    try:
        thread = threading.Thread(target=writer.publish, args=(PREFIX + "a", first),
                                  name="first")
        thread.start()
        assert copying.wait(10)
        other = threading.Thread(target=writer.publish, args=(PREFIX + "b", second))
        other.start()
        other.join(30)  # returns at once; a writer waiting on the lock would still be there
        published_while_held = not other.is_alive()  # it would wait if copies held the lock
        release.set()
        thread.join(10)
        other.join(10)
    finally:
        torch.Tensor.copy_ = original
    b = reader.take(PREFIX + "b", tuple(second.shape), second.dtype)
    a = reader.take(PREFIX + "a", tuple(first.shape), first.dtype)
    assert published_while_held
    assert torch.equal(a, first) and torch.equal(b, second)
    assert offset_of(reader, a) != offset_of(reader, b)


def test_the_ring_holds_two_engine_calls_and_refuses_what_shared_memory_cannot_hold(tmp_path):
    from eagle_ray.backends.vllm.ring_files import DEFAULT_CAPACITY, check_room, ring_capacity

    # An 8B engine call at the pool's default: 16,384 tokens x 4 states x 4,096 x 2 B = 512 MiB.
    call = 16384 * 4 * 4096 * 2
    assert ring_capacity(call) == 2 * call > DEFAULT_CAPACITY
    assert ring_capacity(1024) == DEFAULT_CAPACITY  # small targets
    stats = os.statvfs(tmp_path)
    whole, free = stats.f_frsize * stats.f_blocks, stats.f_frsize * stats.f_bavail
    check_room(free // 2, 0, str(tmp_path))  # fits
    with pytest.raises(ValueError, match="max_tokens_per_engine_call.*handoff_ring_bytes"):
        check_room(free + 1, 0, str(tmp_path))  # more than is free now
    # Fits now, but not beside an object store that lives in the same filesystem.
    with pytest.raises(ValueError, match="object store's"):
        check_room(free // 2, whole - free // 4, str(tmp_path))
    check_room(free // 2, whole + 1, str(tmp_path))  # a store larger than it lives elsewhere


def test_a_call_larger_than_the_ring_comes_back_exact_and_counts_its_overflow(ring):
    """What a replica's engine call does to the ring: every request's states published, then
    taken; those that did not fit come through files, exactly, and are counted."""
    reader, writer = ring
    sent = {f"{PREFIX}{i}": states(i) for i in range(12)}  # 12 x 8 KiB into a 64 KiB ring
    for key, value in sent.items():
        writer.publish(key, value)
    taken = [reader.take(key, tuple(v.shape), v.dtype) for key, v in sent.items()]
    assert all(torch.equal(got, value) for got, value in zip(taken, sent.values(), strict=True))
    assert reader.overflows == 4 and reader.overflow_bytes == 4 * 8 * 1024
    del taken
    assert reader.keys(PREFIX) == [ring_name(PREFIX)], "nothing left but the ring"
    writer.publish(f"{PREFIX}next", states(20))  # the next call fits again
    assert torch.equal(reader.take(f"{PREFIX}next", (16, 4, 64), torch.bfloat16), states(20))
    assert reader.overflows == 4
