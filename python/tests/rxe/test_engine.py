# SPDX-License-Identifier: Apache-2.0
"""The engine from Python against rxe, two engines in one process (run inside a lab VM):
every byte checked at both ends, since both are here."""
import asyncio
import gc
import mmap
import os
import socket
import tempfile
import threading
import time

import numpy as np
import pytest

import rdmakit

POOL = 2 << 20


@pytest.fixture
def pair():
    """A target exposing a 2 MiB numpy pool (read, write, atomics) and an initiator that knows it."""
    target = rdmakit.Engine(name="target", listen=":0")
    pool = np.zeros(POOL, dtype=np.uint8)
    target.expose("pool", target.register(pool), "rwa")
    init = rdmakit.Engine(name="init", listen="")
    init.add_peer("target", f"127.0.0.1:{target.port}")
    yield target, pool, init, init.segment("target", "pool")
    init.close()
    target.close()


def random_bytes(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def vgem_dmabuf(nbytes):
    """A dma-buf of nbytes from vgem (the lab's stand-in for an accelerator), by DRM's ioctls."""
    import fcntl
    import struct
    for card in sorted(os.listdir("/sys/class/drm")):
        # vgem's cards are its platform device's: /sys/devices/platform/vgem/drm/cardN.
        if not card.startswith("card") or "-" in card or "/vgem/" not in os.path.realpath(f"/sys/class/drm/{card}"):
            continue
        dri = os.open(f"/dev/dri/{card}", os.O_RDWR)
        iowr = lambda nr, size: (3 << 30) | (size << 16) | (ord("d") << 8) | nr  # noqa: E731
        # drm_mode_create_dumb: height, width, bpp, flags; out: handle, pitch, size.
        dumb = bytearray(struct.pack("=IIIIIIQ", nbytes // 4096, 1024, 32, 0, 0, 0, 0))
        fcntl.ioctl(dri, iowr(0xB2, 32), dumb)
        handle = struct.unpack_from("=I", dumb, 16)[0]
        prime = bytearray(struct.pack("=IIi", handle, os.O_CLOEXEC | os.O_RDWR, -1))
        fcntl.ioctl(dri, iowr(0x2D, 12), prime)   # DRM_IOCTL_PRIME_HANDLE_TO_FD
        return dri, struct.unpack_from("=i", prime, 8)[0]
    pytest.skip("no vgem in this VM")


def test_a_dmabuf_through_its_bounce_buffer(pair):
    target, pool, init, seg = pair
    dri, fd = vgem_dmabuf(1 << 20)
    try:
        buf = init.register_dmabuf(fd, 0, 1 << 20)
        assert buf.memory == "dmabuf" and buf.obj is None and buf.nbytes == 1 << 20
        paths = init.registration(buf)
        assert [p["path"] for p in paths] == ["bounce"] * len(init.info()["devices"]), paths
        assert "EOPNOTSUPP" in paths[0]["detail"], paths
        assert [p["path"] for p in init.registration(init.register(np.zeros(64)))] == ["host_mr"] * len(paths)
        with mmap.mmap(fd, 1 << 20) as m:
            want = random_bytes(1 << 20, 9)
            m[:] = want.tobytes()
            init.stage_in(buf)
            init.submit([rdmakit.write(buf, seg)]).wait(10.0)
            assert np.array_equal(pool[:1 << 20], want)
            pool[:1 << 20] = 5
            init.submit([rdmakit.read(buf, seg)]).wait(10.0)
            init.stage_out(buf, 0, 4096)
            assert m[:4096] == b"\x05" * 4096 and m[4096:8192] == want[4096:8192].tobytes()
        init.unregister(buf)
    finally:
        os.close(fd)
        os.close(dri)


def test_children_forked_mid_transfer_change_nothing(pair):
    """os.fork() children that overwrite their copy of the registered arrays, and subprocesses
    (fork + exec), while transfers are in flight: every byte checked, each round."""
    import subprocess
    target, pool, init, seg = pair
    src = np.zeros(1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    init.register(src)
    init.register(dst)
    stop = threading.Event()
    runs = []

    def spawn():
        while not stop.is_set():
            pid = os.fork()
            if pid == 0:
                src[:] = 0xEE                        # the child's copy only
                dst[:] = 0xDD
                os._exit(0)
            runs.append(os.waitpid(pid, 0)[1])
            runs.append(subprocess.run(["true"]).returncode)

    t = threading.Thread(target=spawn)
    t.start()
    try:
        until = time.monotonic() + 3
        rnd = 0
        while rnd < 40 or time.monotonic() < until:
            rnd += 1
            src[:] = random_bytes(1 << 20, rnd)        # the parent writes its pages after forks
            init.submit([rdmakit.write(src, seg)]).wait(10.0)
            assert np.array_equal(pool[:1 << 20], src), f"round {rnd}"
            dst[:] = 0
            init.submit([rdmakit.read(dst, seg)]).wait(10.0)
            assert np.array_equal(dst, src), f"round {rnd}"
    finally:
        stop.set()
        t.join()
    assert len(runs) > 5 and set(runs) == {0}, runs


def test_numpy_write_then_read_back(pair):
    target, pool, init, seg = pair
    src = random_bytes(256 << 10, 1)
    dst = np.zeros(256 << 10, dtype=np.uint8)
    init.register(src)
    init.register(dst)
    init.submit([rdmakit.write(src, seg, remote_offset=4096)]).wait(10.0)
    assert np.array_equal(pool[4096:4096 + (256 << 10)], src)
    init.submit([rdmakit.read(dst, seg, remote_offset=4096)]).wait(10.0)
    assert np.array_equal(dst, src)
    c = init.counters()
    assert c["bytes"] == 512 << 10 and c["transfers"] == 2 and c["transfers_failed"] == 0


@pytest.mark.torch
def test_torch_tensors_and_their_views(pair):
    import torch
    target, pool, init, seg = pair
    blocks = torch.arange(64 * 1024, dtype=torch.int32).reshape(64, 1024)  # 64 blocks of 4 KiB
    init.register(blocks)
    # Views of the registered tensor resolve to offsets inside it: no registration of their own.
    batch = init.submit([rdmakit.write(blocks[b], seg, remote_offset=k * 4096)
                         for k, b in enumerate((3, 7, 9))])
    batch.wait(10.0)
    got = torch.from_numpy(pool[:3 * 4096].copy().view(np.int32)).reshape(3, 1024)
    assert torch.equal(got, blocks[[3, 7, 9]])
    back = torch.zeros(3, 1024, dtype=torch.int32)
    init.register(back)
    init.submit([rdmakit.read(back, seg)]).wait(10.0)
    assert torch.equal(back, blocks[[3, 7, 9]])


def test_bytearray_and_mmap_sources(pair):
    target, pool, init, seg = pair
    ba = bytearray(os.urandom(65536))
    anon = mmap.mmap(-1, 65536)
    anon.write(os.urandom(65536))
    with tempfile.TemporaryFile() as f:
        f.write(os.urandom(65536))
        f.flush()
        filemap = mmap.mmap(f.fileno(), 65536)
        for obj in (ba, anon, filemap):
            init.register(obj)
        init.submit([rdmakit.write(ba, seg, remote_offset=0),
                     rdmakit.write(anon, seg, remote_offset=65536),
                     rdmakit.write(filemap, seg, remote_offset=131072)]).wait(10.0)
        assert pool[:65536].tobytes() == bytes(ba)
        assert pool[65536:131072].tobytes() == anon[:]
        assert pool[131072:196608].tobytes() == filemap[:]
        init.close()  # releases the registrations before the maps close
        filemap.close()
    anon.close()


def test_atomics_return_the_old_value(pair):
    target, pool, init, seg = pair
    words = pool[:16].view(np.uint64)
    words[0] = 40
    old = np.zeros(2, dtype=np.uint64)
    init.register(old)
    init.submit([rdmakit.fetch_add(old, seg, 2, remote_offset=0)]).wait(10.0)
    assert old[0] == 40 and words[0] == 42
    init.submit([rdmakit.compare_swap(old, seg, 42, 7, local_offset=8)]).wait(10.0)
    assert old[1] == 42 and words[0] == 7


def test_a_hundred_batches_awaited_together_and_notifications_by_async_for(pair):
    target, pool, init, seg = pair
    src = random_bytes(100 * 4096, 2)
    init.register(src)

    async def run():
        batches = [init.submit([rdmakit.write(src[i * 4096:(i + 1) * 4096], seg,
                                              remote_offset=i * 4096)],
                               notify=b"block %d" % i)
                   for i in range(100)]
        done = await asyncio.wait_for(asyncio.gather(*batches), 20)
        assert all(b.done() and b.failed == 0 for b in done)
        seen = set()

        async def consume():
            async for note in target.notifications():
                assert note.peer == "init"
                seen.add(int(note.message.split()[1]))
                if len(seen) == 100:
                    return

        await asyncio.wait_for(consume(), 20)
        assert seen == set(range(100))

    asyncio.run(run())
    assert np.array_equal(pool[:100 * 4096], src)


@pytest.mark.torch
def test_the_source_deleted_in_flight_still_arrives_intact(pair):
    import torch
    target, pool, init, seg = pair
    src = torch.from_numpy(random_bytes(POOL, 3))
    expected = src.numpy().copy()
    init.register(src)
    batch = init.submit([rdmakit.write(src[i * 65536:(i + 1) * 65536], seg,
                                       remote_offset=i * 65536) for i in range(POOL // 65536)])
    del src  # the registration holds the tensor until the engine closes
    gc.collect()
    batch.wait(20.0)
    assert np.array_equal(pool, expected)


def test_bad_input_raises_clearly_and_the_engine_keeps_working(pair):
    target, pool, init, seg = pair
    with pytest.raises(rdmakit.BufferError, match="not contiguous"):
        init.register(np.zeros((64, 64))[:, 1])
    with pytest.raises(rdmakit.BufferError, match="not registered"):
        init.submit([rdmakit.write(np.zeros(64, dtype=np.uint8), seg)])
    ro = init.register(b"read-only bytes!")
    with pytest.raises(rdmakit.BufferError, match="read-only"):
        init.submit([rdmakit.read(ro, seg)])
    with pytest.raises(rdmakit.BufferError, match="read-only"):
        init.expose("ro", ro, "rw")
    with rdmakit.Engine(name="other", listen="") as other:
        theirs = other.register(bytearray(64))
        with pytest.raises(rdmakit.BufferError, match="another engine"):
            init.submit([rdmakit.write(theirs, seg)])
    with pytest.raises(rdmakit.BufferError, match="overlaps"):
        init.register(memoryview(ro.obj))  # the same bytes again
    with pytest.raises(rdmakit.Error, match="nobody"):
        init.segment("nobody", "pool")
    with pytest.raises(rdmakit.Error):
        init.expose("bad", ro, "rx")
    # A segment the peer does not have: the batch fails with the reason, as data and raised.
    missing = init.segment("target", "no-such-segment")
    batch = init.submit([rdmakit.write(ro, missing)])
    with pytest.raises(rdmakit.TransferError) as e:
        batch.wait(10.0)
    assert e.value.failures[0][:2] == (0, "no_segment")
    assert batch.result(0)[0] == "no_segment"
    # And it still works: a read-only source may be written from.
    init.submit([rdmakit.write(ro, seg, remote_offset=100)]).wait(10.0)
    assert pool[100:116].tobytes() == b"read-only bytes!"


def test_a_lost_peer_is_a_peer_lost_error(pair):
    target, pool, init, seg = pair
    src = init.register(bytearray(4096))
    init.submit([rdmakit.write(src, seg)]).wait(10.0)
    target.close()
    with pytest.raises(rdmakit.PeerLostError):
        for _ in range(50):  # until the initiator has noticed the link is gone
            init.submit([rdmakit.write(src, seg)]).wait(10.0)
            time.sleep(0.1)


def test_the_gil_is_released_while_waiting():
    """A thread keeps counting while another waits on a handshake nobody answers."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts TCP, never speaks: the handshake waits out its deadline
    eng = rdmakit.Engine(name="lonely", listen="", handshake_timeout=1.0)
    eng.add_peer("silent", f"127.0.0.1:{silent.getsockname()[1]}")
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=count)
    t.start()
    time.sleep(0.05)
    before = ticks
    with pytest.raises(rdmakit.PeerLostError, match="silent"):
        eng.connect("silent", timeout=5.0)
    during = ticks - before
    stop.set()
    t.join()
    eng.close()
    silent.close()
    # The counting thread ran all along (with the GIL held by the waiter it could not).
    assert during > 10000, during


def test_a_plan_is_resolved_once_and_submitted_many_times(pair):
    target, pool, init, seg = pair
    src = random_bytes(128 * 64, 4)
    init.register(src)
    plan = init.prepare([rdmakit.write(src[i * 64:(i + 1) * 64], seg, remote_offset=i * 64)
                         for i in range(128)])
    assert len(plan) == 128
    for _ in range(5):
        init.submit(plan).wait(10.0)
    assert np.array_equal(pool[:128 * 64], src)
    assert init.counters()["transfers"] == 5 * 128


def test_info_peers_and_closing():
    with rdmakit.Engine(name="solo", listen=":0") as eng:
        info = eng.info()
        assert info["name"] == "solo" and info["port"] == eng.port and info["devices"]
        assert info["memory_windows"]  # rxe has type-2 windows
        eng.add_peer("p", "127.0.0.1:1")
        assert [p["name"] for p in eng.peers()] == ["p"]
    with pytest.raises(rdmakit.Error, match="closed"):
        eng.info()


def test_one_event_loop_at_a_time_and_a_new_one_once_it_closed(pair):
    target, pool, init, seg = pair

    async def next_note():
        return await init.notifications().__anext__()

    first = asyncio.new_event_loop()
    with pytest.raises(asyncio.TimeoutError):  # nothing was sent: the reader waits in `first`
        first.run_until_complete(asyncio.wait_for(next_note(), 0.05))
    with pytest.raises(rdmakit.Error, match="another event loop"):
        asyncio.run(next_note())
    first.close()
    src = init.register(bytearray(b"after the first loop closed"))
    init.submit([rdmakit.write(src, seg, remote_offset=4096)], notify=b"hello").wait(10.0)

    async def on_target():
        return await asyncio.wait_for(target.notifications().__anext__(), 10)

    assert asyncio.run(on_target()).message == b"hello"
    # And the initiator's engine serves a new loop now that `first` is closed.
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(next_note(), 0.05))
    asyncio.run(asyncio.wait_for(_await_write(init, src, seg), 10))
    assert pool[:27].tobytes() == b"after the first loop closed"


async def _await_write(eng, src, seg):
    await eng.submit([rdmakit.write(src, seg)])


def test_gathering_futures_and_awaiting_a_failed_batch(pair):
    target, pool, init, seg = pair
    src = random_bytes(64 * 512, 6)
    init.register(src)

    async def run():
        futs = [init.submit([rdmakit.write(src[i * 512:(i + 1) * 512], seg,
                                           remote_offset=i * 512)]).future() for i in range(64)]
        assert all(isinstance(f, asyncio.Future) for f in futs)
        done = await asyncio.wait_for(asyncio.gather(*futs), 20)
        assert all(b.failed == 0 for b in done)
        bad = init.submit([rdmakit.write(src, init.segment("target", "missing"))])
        with pytest.raises(rdmakit.TransferError) as e:
            await asyncio.wait_for(bad, 20)
        assert e.value.failures[0][1] == "no_segment"

    asyncio.run(run())
    assert np.array_equal(pool[:64 * 512], src)


def test_unregister_lets_go_and_refuses_later_use(pair):
    target, pool, init, seg = pair
    src = random_bytes(64 << 10, 11)
    buf = init.register(src)
    init.submit([rdmakit.write(buf, seg)]).wait(10.0)
    init.unregister(buf)
    assert np.array_equal(pool[:64 << 10], src)
    with pytest.raises(BufferError):
        init.submit([rdmakit.write(src, seg)])
    with pytest.raises(BufferError):
        init.unregister(buf)
    init.register(src)  # the same memory may be registered again
    init.submit([rdmakit.write(src, seg)]).wait(10.0)
