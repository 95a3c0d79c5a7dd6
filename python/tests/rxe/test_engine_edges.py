# SPDX-License-Identifier: Apache-2.0
"""The engine's Python edges against rxe (inside a lab VM): an awaited batch whose engine nobody
else references, registrations racing close(), handles of another engine, bounded
notifications."""
import asyncio
import gc
import socket
import threading
import weakref

import pytest

import rdmakit


def target_with_pool(n=64 << 10):
    t = rdmakit.Engine(name="t", listen="127.0.0.1:0", notification_queue=2)
    pool = bytearray(n)
    t.expose("kv", t.register(pool))
    return t, pool


def test_an_awaited_batch_resolves_with_only_the_batch_referenced():
    # A "peer" that takes the TCP connection and never answers: the batch is in flight until the
    # handshake deadline (1 s), then ends connect_failed, and `await` raises.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]

    def submit_from_a_forgotten_engine():
        a = rdmakit.Engine(name="a", listen="", handshake_timeout=1.0)
        a.add_peer("t", f"127.0.0.1:{port}")
        src = bytearray(4096)
        a.register(src)
        return a.submit([rdmakit.write(src, a.segment("t", "kv"))])  # `a` goes with this frame

    async def run():
        batch = submit_from_a_forgotten_engine()
        gc.collect()
        assert not batch.done()
        # It waited on the reader of a temporary Engine wrapper, which nobody polled: a hang.
        with pytest.raises(rdmakit.PeerLostError):
            await asyncio.wait_for(batch, 10)
        return batch

    batch = asyncio.run(run())
    assert batch.result(0)[0] == "connect_failed"
    batch._engine.close()
    silent.close()


def test_register_racing_close_never_crashes():
    for _ in range(20):
        e = rdmakit.Engine(name="r", listen="")
        start = threading.Barrier(5)
        outcomes = []

        def register_many():
            start.wait()
            for _ in range(20):
                try:
                    e.register(bytearray(4096))
                    outcomes.append("ok")
                except rdmakit.Error as ex:
                    assert "closed" in str(ex)
                    outcomes.append("closed")

        threads = [threading.Thread(target=register_many) for _ in range(4)]
        for th in threads:
            th.start()
        start.wait()
        e.close()
        for th in threads:
            th.join(30)
            assert not th.is_alive()
        assert len(outcomes) == 80


def test_a_segment_of_another_engine_is_invalid():
    t, _ = target_with_pool()
    a1 = rdmakit.Engine(name="a1", listen="")
    a2 = rdmakit.Engine(name="a2", listen="")
    for a in (a1, a2):
        a.add_peer("t", f"127.0.0.1:{t.port}")
    src = bytearray(4096)
    a1.register(src)
    batch = a1.submit([rdmakit.write(src, a2.segment("t", "kv"))])
    batch.wait(10.0, check=False)
    status, reason = batch.result(0)
    assert status == "invalid" and "another engine" in reason
    for e in (a1, a2, t):
        e.close()


def test_notifications_beyond_the_queue_are_refused_and_said():
    t, _ = target_with_pool()
    a = rdmakit.Engine(name="a", listen="")
    a.add_peer("t", f"127.0.0.1:{t.port}")
    src = bytearray(64)
    a.register(src)
    seg = a.segment("t", "kv")
    for i in range(2):
        ok = a.submit([rdmakit.write(src, seg)], notify=bytes([i]))
        ok.wait(10.0)
        assert ok.notifications_failed == 0
    b = a.submit([rdmakit.write(src, seg)], notify=b"x")
    b.wait(10.0)
    assert b.notifications_failed == 1 and "queue of 2" in b.describe_failures()
    assert a.counters()["notifications_refused"] == 1
    got = []
    for _ in range(1000):
        n = t.next_notification()
        if n is not None:
            got.append(n.message)
        elif len(got) == 2:
            break
        else:
            threading.Event().wait(0.01)
    assert got == [b"\x00", b"\x01"]
    a.close()
    t.close()


def test_an_engine_dropped_with_an_abandoned_awaited_batch_is_collected():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    a = rdmakit.Engine(name="a", listen="", handshake_timeout=1.0)
    a.add_peer("t", f"127.0.0.1:{silent.getsockname()[1]}")
    src = bytearray(4096)
    a.register(src)
    seg = a.segment("t", "kv")

    async def run():
        batch = a.submit([rdmakit.write(src, seg)])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(batch, 0.05)  # given up on; its loop closes with it waited for

    asyncio.run(run())
    gone = weakref.ref(a)
    del a, seg
    gc.collect()
    assert gone() is None, "the engine, its reader and the batch it waited for were never freed"
    silent.close()
