# SPDX-License-Identifier: Apache-2.0
"""A KV connector's calls through the engine, on the host over tcp (the lab runs the same calls
over rxe in C++, tests/rxe/serving_test.cpp): a pull-mode read whose notification frees the
prefill side's blocks, with a request id; a notification on its own, awaited; telemetry; and
cancel() of what waits for a peer that never answers."""
import asyncio
import socket
import time

import numpy as np
import pytest

import rdmakit


def engine(name, **kw):
    return rdmakit.Engine(name=name, listen="127.0.0.1:0", transports=["tcp"], **kw)


def next_note(e, timeout=10.0):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        n = e.next_notification()
        if n is not None:
            return n
        time.sleep(0.001)
    return None


@pytest.fixture
def pair():
    prefill, decode = engine("prefill"), engine("decode")
    blocks = np.zeros((64, 1024), dtype=np.uint8)
    prefill.expose("kv", prefill.register(blocks), "rw")
    decode.add_peer("prefill", f"127.0.0.1:{prefill.port}")
    yield prefill, decode, blocks
    decode.close()
    prefill.close()


def test_a_pull_reads_notification_comes_after_its_reads_with_its_request_id(pair):
    prefill, decode, blocks = pair
    seg = decode.segment("prefill", "kv")
    dst = np.zeros((4, 1024), dtype=np.uint8)
    decode.register(dst)
    for rnd in range(50):
        blocks[:] = (np.arange(64, dtype=np.uint8)[:, None] + rnd)
        chosen = [(rnd * 3 + k * 7) % 64 for k in range(4)]
        reads = [rdmakit.read(dst[k], seg, remote_offset=b * 1024) for k, b in enumerate(chosen)]
        batch = decode.submit(reads, notify=b"free", request_id=f"req-{rnd}")
        note = next_note(prefill)
        assert note is not None, batch.describe_failures()
        blocks[:] = 255                                 # freed: reused at once
        assert (note.peer, note.message, note.request_id) == ("decode", b"free", f"req-{rnd}")
        batch.wait(10.0)
        assert np.array_equal(dst, blocks_before(chosen, rnd)), f"round {rnd}: the notification overtook a read"
        t = batch.telemetry()
        assert t["request_id"] == f"req-{rnd}" and t["bytes"] == 4096 and t["transfers"] == 4 and t["failed"] == 0
        assert t["submitted"] <= t["posted"] <= t["ended"] <= time.monotonic()
        assert 0 < t["total_time"] < 10
        assert t["paths"] == [{"transport": "tcp", "device": "tcp", "bytes": 4096, "transfers": 4}]


def blocks_before(chosen, rnd):
    return np.stack([np.full(1024, (b + rnd) % 256, dtype=np.uint8) for b in chosen])


def test_a_notification_on_its_own_is_awaited(pair):
    prefill, decode, _ = pair

    async def main():
        batch = decode.notify("prefill", b"heartbeat", request_id="r7")
        await batch
        assert batch.result(0) == ("ok", "")
        async for note in prefill.notifications():
            return note

    note = asyncio.run(asyncio.wait_for(main(), 10.0))
    assert (note.peer, note.message, note.request_id) == ("decode", b"heartbeat", "r7")
    with pytest.raises(rdmakit.Error):
        decode.notify("nobody", b"x")
    with pytest.raises(rdmakit.Error):
        decode.notify("prefill", b"x", request_id="r" * 65)


def test_cancel_ends_what_waits_for_a_peer_that_never_answers():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)                                    # takes the connection, never answers
    e = engine("a", handshake_timeout=20.0)
    try:
        e.add_peer("s", f"127.0.0.1:{silent.getsockname()[1]}")
        src = np.ones(8192, dtype=np.uint8)
        buf = e.register(src)
        batch = e.submit([rdmakit.write(src[:4096], e.segment("s", "kv")),
                          rdmakit.write(src[4096:], e.segment("s", "kv"))])
        time.sleep(0.2)
        assert not batch.done()
        start = time.monotonic()
        batch.cancel()
        assert batch.done() and batch.results() == [("cancelled", batch.result(0)[1])] * 2
        e.unregister(buf, timeout=1.0)                  # nothing of it in flight
        assert time.monotonic() - start < 1.0
        with pytest.raises(rdmakit.TransferError):
            batch.check()
    finally:
        e.close()
        silent.close()


def test_descriptor_lists_move_selections_by_index(pair):
    prefill, decode, blocks = pair
    # The decode side's cache: 2 layers x 32 blocks of 1 KiB, one array; the prefill side's 64 blocks.
    cache = np.zeros((2, 32, 1024), dtype=np.uint8)
    decode.register(cache)
    local = decode.prepare_local([cache[layer, b] for layer in range(2) for b in range(32)])
    seg = decode.segment("prefill", "kv")
    remote = decode.prepare_remote([(seg, b * 1024, 1024) for b in range(64)])
    assert (len(local), local.remote, len(remote), remote.remote) == (64, False, 64, True)
    blocks[:] = np.arange(64, dtype=np.uint8)[:, None]
    rng = np.random.default_rng(35)
    li = rng.permutation(64)[:20].astype(np.uint32)
    ri = rng.permutation(64)[:20]                       # a list of ints works too
    batch = decode.submit_indexed("read", local, li, remote, list(ri), notify=b"done", request_id="kv-1")
    batch.wait(10.0)
    flat = cache.reshape(64, 1024)
    for k in range(20):
        assert (flat[li[k]] == ri[k]).all(), f"position {k}"
    note = next_note(prefill)
    assert (note.message, note.request_id) == (b"done", "kv-1")
    assert batch.telemetry()["bytes"] == 20 * 1024
    # Written back by index, the other way round.
    flat[:] = 200
    decode.submit_indexed(rdmakit.TransferOp.write, local, [5, 6], remote, [60, 61]).wait(10.0)
    assert (blocks[60] == 200).all() and (blocks[61] == 200).all() and (blocks[59] == 59).all()
    with pytest.raises(rdmakit.Error, match="position 1: local index 64"):
        decode.submit_indexed("read", local, [0, 64], remote, [0, 1])
    with pytest.raises(ValueError):
        decode.submit_indexed("swap", local, [0], remote, [0])
    with pytest.raises(rdmakit.Error, match="descriptor 0: 0 bytes"):
        decode.prepare_remote([(seg, 0, 0)])
    ro = np.full(1024, 7, dtype=np.uint8)
    ro.flags.writeable = False
    decode.register(ro)
    frozen = decode.prepare_local([ro])
    with pytest.raises(BufferError):
        decode.submit_indexed("read", frozen, [0], remote, [0])
    decode.submit_indexed("write", frozen, [0], remote, [0]).wait(10.0)
    assert (blocks[0] == 7).all()
    # Indices are integers in 0 .. 2**32-1, never wrapped or truncated.
    for bad, what in (([-1], "position 0: local index -1"), (np.array([3, 2**32]), "position 1: local index 4294967296"),
                      ([0.5], "position 0: a local index is an integer")):
        with pytest.raises(rdmakit.Error, match=what):
            decode.submit_indexed("read", local, bad, remote, [0] * len(bad))
    with pytest.raises(rdmakit.Error, match="descriptor 1: "):
        decode.prepare_local([cache[0, 0], (cache, 0, 10**9)])
    with pytest.raises(rdmakit.Error, match="descriptor 0: an entry is"):
        decode.prepare_remote([(seg, 0)])
