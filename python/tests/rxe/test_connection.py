# SPDX-License-Identifier: Apache-2.0
"""rdmakit.connect / Listener / Connection against rxe, both ends in one process."""
import os
import threading

import numpy as np
import pytest

import rdmakit


def test_write_read_and_messages_over_one_connection():
    served = np.zeros(1 << 16, dtype=np.uint8)
    listener = rdmakit.Listener(":0", advertise=[(served, "rw")])
    accepted = {}
    t = threading.Thread(target=lambda: accepted.setdefault("c", listener.accept(10.0)))
    t.start()
    mine = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
    back = np.zeros_like(mine)
    with rdmakit.connect(f"127.0.0.1:{listener.port}") as conn:
        t.join()
        server = accepted["c"]
        src = conn.register(mine)
        dst = conn.register(back)
        (region,) = conn.remote_regions
        assert region.length == served.nbytes and "remote_write" in region.access
        conn.write(src, region, wr_id=1)
        c = conn.wait(10.0)
        assert c["ok"] and c["wr_id"] == 1 and c["opcode"] == "RDMA_WRITE"
        assert np.array_equal(served, mine)
        conn.read(dst, region, remote_offset=1024, length=4096, wr_id=2)
        assert conn.wait(10.0)["ok"]
        assert np.array_equal(back[:4096], mine[1024:5120])
        # Out of the advertised range: refused before posting, with the reason.
        with pytest.raises(rdmakit.PostError, match="out_of_bounds|outside"):
            conn.write(src, region, remote_offset=1)
        conn.send_message(b"hello")
        assert server.receive_message(10.0) == b"hello"
        with pytest.raises(rdmakit.TimeoutError):
            conn.wait(0.05)
        server.close()
    listener.close()


def test_fabric_settings_reach_both_ends():
    served = np.zeros(4096, dtype=np.uint8)
    fabric = dict(traffic_class=106, service_level=3, ack_timeout=1.0, retry_count=5)
    listener = rdmakit.Listener(":0", advertise=[(served, "rw")], **fabric)
    accepted = {}
    t = threading.Thread(target=lambda: accepted.setdefault("c", listener.accept(10.0)))
    t.start()
    with rdmakit.connect(f"127.0.0.1:{listener.port}", **fabric) as conn:
        t.join()
        for info in (conn.info, accepted["c"].info):
            assert (info["traffic_class"], info["service_level"], info["pkey_index"], info["retry_count"]) == (106, 3, 0, 5)
            assert abs(info["ack_timeout"] - 1.0737) < 0.001   # 4.096 us x 2^18, the first at least 1 s
        accepted["c"].close()
    listener.close()
    with pytest.raises(rdmakit.Error, match="service_level=16"):
        rdmakit.connect("127.0.0.1:1", service_level=16)


def test_accept_times_out_with_a_timeout_error():
    listener = rdmakit.Listener(":0")
    with pytest.raises(rdmakit.TimeoutError):
        listener.accept(0.1)
    listener.close()


def test_connecting_to_nobody_is_a_peer_lost_error():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(rdmakit.Error) as e:
        rdmakit.connect(f"127.0.0.1:{port}", handshake_timeout=1.0)
    assert e.value.verb and e.value.hint is not None


def test_a_connection_and_an_engine_through_rdma_cm():
    """method="rdma_cm": the CM resolves the VM's own address (not loopback: the CM needs an
    address on an RDMA device's netdev)."""
    ip = os.environ.get("RDMAKIT_LAB_IP", "127.0.0.1")
    served = np.zeros(4096, dtype=np.uint8)
    listener = rdmakit.Listener(f"{ip}:0", advertise=[(served, "rw")], method="rdma_cm")
    accepted = {}
    t = threading.Thread(target=lambda: accepted.setdefault("c", listener.accept(10.0)))
    t.start()
    mine = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    with rdmakit.connect(f"{ip}:{listener.port}", method="rdma_cm") as conn:
        t.join()
        (region,) = conn.remote_regions
        conn.write(conn.register(mine), region, wr_id=1)
        assert conn.wait(10.0)["ok"]
        assert np.array_equal(served, mine)
        accepted["c"].close()
    listener.close()
    with pytest.raises(rdmakit.Error, match="tcp or rdma_cm"):
        rdmakit.connect(f"{ip}:1", method="carrier-pigeon")

    target = rdmakit.Engine(name="t", listen=f"{ip}:0", method="rdma_cm")
    pool = np.zeros(1 << 16, dtype=np.uint8)
    target.expose("pool", target.register(pool), "rw")
    init = rdmakit.Engine(name="i", listen="", method="rdma_cm")
    init.add_peer("t", f"{ip}:{target.port}")
    src = np.random.default_rng(9).integers(0, 256, 1 << 16, dtype=np.uint8)
    batch = init.submit([rdmakit.write(init.register(src), init.segment("t", "pool"))])
    batch.wait(10.0)
    assert np.array_equal(pool, src)
    init.close()
    target.close()
