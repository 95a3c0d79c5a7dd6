# SPDX-License-Identifier: Apache-2.0
"""Peers added from each other's local_info() (issue 38, item 6): the bytes a serving system
carries over its own side channel. On the host over tcp; across two lab VMs over rdma in
tests/rxe/engine_vms_test.cpp (EngineVms.PeersAddedFromLocalInfo)."""
import json

import numpy as np
import pytest

import rdmakit

PSK = bytes(range(32))


def engine(name, **kw):
    return rdmakit.Engine(name=name, listen="127.0.0.1:0", transports=["tcp"], psk=PSK, **kw)


def test_both_sides_added_from_info_move_bytes_and_prove_the_key_it_names():
    with engine("kv-0", identity=bytes([7]) * 32) as kv0, engine("client") as client:
        pool = np.zeros(4096, dtype=np.uint8)
        kv0.expose("kv", kv0.register(pool), "rw")
        info = kv0.local_info()
        record = json.loads(info)
        assert record["name"] == "kv-0" and record["endpoints"] == [f"127.0.0.1:{kv0.port}"]
        assert record["identity"] == kv0.info()["public_key"] and record["segments"][0][0] == "kv"
        # No memory key or address: the record's fields, and nothing else.
        assert set(record) == {"v", "name", "epoch", "endpoints", "rails", "segments", "transports", "identity"}
        assert str(pool.ctypes.data) not in info.decode()
        client.add_peer("kv-0", bytearray(info))   # any bytes-like object
        peer = client.peers()[0]
        assert peer["key_source"] == "info" and peer["public_key"] == kv0.info()["public_key"]
        src = np.arange(4096, dtype=np.uint8)
        src_buf = client.register(src)
        client.submit([rdmakit.write(src, client.segment("kv-0", "kv"))]).wait(10.0)
        assert np.array_equal(pool, src)
        assert client.peers()[0]["wire_version"] == 7   # both of this release
        # The other way: kv-0 adds the client from its info and reads from it.
        client.expose("src", src_buf, "r")
        kv0.add_peer("client", memoryview(client.local_info()))
        back = np.zeros(4096, dtype=np.uint8)
        kv0.register(back)
        kv0.submit([rdmakit.read(back, kv0.segment("client", "src"))]).wait(10.0)
        assert np.array_equal(back, src)


def test_info_naming_another_key_than_the_engine_at_its_address_is_refused():
    with engine("kv-0", identity=bytes([7]) * 32) as kv0, engine("client") as client:
        pool = np.zeros(64, dtype=np.uint8)
        kv0.expose("kv", kv0.register(pool), "rw")
        record = json.loads(kv0.local_info())
        other = rdmakit.Engine(name="x", listen="", psk=PSK, transports=["tcp"], identity=bytes([8]) * 32)
        record["identity"] = other.info()["public_key"]   # altered on the way
        other.close()
        client.add_peer("kv-0", json.dumps(record).encode())
        src = np.ones(64, dtype=np.uint8)
        client.register(src)
        batch = client.submit([rdmakit.write(src, client.segment("kv-0", "kv"))])
        with pytest.raises((rdmakit.TransferError, rdmakit.PeerLostError)):
            batch.wait(10.0)
        status, reason = batch.result(0)[:2]
        assert status == "connect_failed" and record["identity"] in reason, reason
        assert "named in the info given to add_peer" in reason, reason
        assert not pool.any()


def test_bad_info_is_refused_naming_what_is_wrong():
    with engine("kv-0") as kv0, engine("client") as client:
        info = kv0.local_info()
        with pytest.raises(rdmakit.Error, match='is engine "kv-0"\'s, not "kv-1"\'s'):
            client.add_peer("kv-1", info)
        with pytest.raises(rdmakit.Error, match="not a JSON object"):
            client.add_peer("kv-0", b"\x00garbage")
        newer = json.loads(info)
        newer["v"] = 9
        with pytest.raises(rdmakit.Error, match="format version 9; this rdmakit reads versions 1 and 2"):
            client.add_peer("kv-0", json.dumps(newer).encode())
        with pytest.raises(rdmakit.Error, match="at most"):
            client.add_peer("kv-0", b" " * (3 << 20))
        no_endpoint = json.loads(info)
        no_endpoint["endpoints"] = []
        with pytest.raises(rdmakit.Error, match="lists no endpoint"):
            client.add_peer("kv-0", json.dumps(no_endpoint).encode())
        assert client.peers() == []
        client.add_peer("kv-0", info)   # still serving: the good info is taken
        with pytest.raises(rdmakit.Error, match="exists"):
            client.add_peer("kv-0", info)


def test_an_engine_that_does_not_listen_has_no_info():
    with rdmakit.Engine(name="quiet", listen="", transports=["tcp"]) as e:
        with pytest.raises(rdmakit.Error, match="has no listener"):
            e.local_info()
    with rdmakit.Engine(name="later", listen="127.0.0.1:0", transports=["tcp"], listen_at_start=False) as e:
        with pytest.raises(rdmakit.Error, match="start_listening"):
            e.local_info()
        e.start_listening()
        assert json.loads(e.local_info())["endpoints"] == [f"127.0.0.1:{e.port}"]


def test_a_keyless_engine_given_no_address_listens_on_loopback_only():
    with rdmakit.Engine(name="open", transports=["tcp"]) as e:
        info = e.info()
        assert info["listen"] == f"127.0.0.1:{e.port}"
        assert "127.0.0.1 only" in info["listen_note"]
        assert json.loads(e.local_info())["endpoints"] == [f"127.0.0.1:{e.port}"]
    with rdmakit.Engine(name="keyed", psk=PSK, transports=["tcp"]) as e:
        assert e.info()["listen"] == f":{e.port}" and e.info()["listen_note"] == ""
