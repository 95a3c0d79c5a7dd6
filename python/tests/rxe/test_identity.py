# SPDX-License-Identifier: Apache-2.0
"""Engine identities and access from Python (issue 31): an identity file made by
generate_identity, a peer's key given to add_peer, a target that revokes and allows a client,
and a segment exposed for one peer only. Two or more engines in one process, in a lab VM."""
import os
import tempfile

import pytest

import rdmakit

PSK = bytes(range(32))


def write_once(engine, peer, segment, data=b"x" * 64):
    src = bytearray(data)
    engine.register(src)
    batch = engine.submit([rdmakit.write(src, engine.segment(peer, segment))])
    try:
        batch.wait(20.0)
    except (rdmakit.TransferError, rdmakit.PeerLostError):
        pass  # the result says which
    return batch.result(0)


def test_identity_file_key_given_and_an_impostor_refused():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kv0.id")
        key = rdmakit.generate_identity(path)
        assert key.startswith("ed25519:") and len(key) == 51
        assert open(path + ".pub").read() == key + "\n"
        assert os.stat(path).st_mode & 0o777 == 0o600
        with pytest.raises(rdmakit.Error, match="exists already"):
            rdmakit.generate_identity(path)
        kv0 = rdmakit.Engine(name="kv-0", listen="127.0.0.1:0", psk=PSK, identity=path)
        assert kv0.info()["public_key"] == key
        kv0.expose("kv", kv0.register(bytearray(4096)))
        port = kv0.port
        client = rdmakit.Engine(name="client", listen="", psk=PSK)
        client.add_peer("kv-0", f"127.0.0.1:{port}", public_key=key)
        assert write_once(client, "kv-0", "kv")[0] == "ok"
        peer = client.peers()[0]
        assert peer["public_key"] == key and peer["key_source"] == "given"
        kv0.close()
        # Another engine under kv-0's name, with another key (a 32-byte seed), on its port.
        impostor = rdmakit.Engine(name="kv-0", listen=f"127.0.0.1:{port}", psk=PSK, identity=bytes(32))
        pool = bytearray(4096)
        impostor.expose("kv", impostor.register(pool))
        for _ in range(3):
            status, reason = write_once(client, "kv-0", "kv")[:2]
            assert status == "connect_failed", reason
            assert "where its key " + key in reason, reason
        assert pool == bytearray(4096)
        with pytest.raises(rdmakit.Error, match="without a pre-shared key"):
            rdmakit.Engine(name="lonely", listen="", identity=path)
        with pytest.raises(rdmakit.Error, match="is not a public key"):
            client.add_peer("other", "127.0.0.1:1", public_key="ed25519:nope")
        impostor.close()
        client.close()


def test_revoke_allow_and_a_segment_for_one_peer():
    target = rdmakit.Engine(name="t", listen="127.0.0.1:0", psk=PSK, allowed_peers=["a", "b"])
    pool = bytearray(8192)
    buf = target.register(pool)
    target.expose("kv", buf, "rw", length=4096)
    target.expose("for-a", buf, "rw", offset=4096, peers=["a"])
    engines = {n: rdmakit.Engine(name=n, listen="", psk=PSK) for n in ("a", "b", "x")}
    for e in engines.values():
        e.add_peer("t", f"127.0.0.1:{target.port}")
    assert write_once(engines["a"], "t", "for-a")[0] == "ok"
    assert write_once(engines["b"], "t", "for-a")[0] == "no_segment"
    status, reason = write_once(engines["x"], "t", "kv")[:2]
    assert status == "connect_failed" and "is not among the peers engine 't' allows" in reason, reason
    assert write_once(engines["b"], "t", "kv")[0] == "ok"
    target.revoke("b")
    for _ in range(5):
        status, reason = write_once(engines["b"], "t", "kv")[:2]
        if status == "connect_failed":
            break
    assert status == "connect_failed" and "revoked by engine 't'" in reason, reason
    target.allow("b")
    assert write_once(engines["b"], "t", "kv")[0] == "ok"
    with pytest.raises(rdmakit.Error, match="is not a peer"):
        target.revoke("bad\tname")
    for e in engines.values():
        e.close()
    target.close()
