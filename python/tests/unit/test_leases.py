# SPDX-License-Identifier: Apache-2.0
"""Leases from Python, on the host over tcp (the lab runs the C++ cases over rxe,
tests/rxe/lease_test.cpp): the prefill side grants the decode side a lease on the blocks of a
request; the decode side reads them while it lasts, renews it, and is refused once it ended."""
import time

import numpy as np
import pytest

import rdmakit


def engine(name, **kw):
    return rdmakit.Engine(name=name, listen="127.0.0.1:0", transports=["tcp"], **kw)


def next_end(e, timeout=5.0):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        end = e.next_lease_end()
        if end is not None:
            return end
        time.sleep(0.005)
    return None


@pytest.fixture
def pair():
    prefill, decode = engine("prefill"), engine("decode")
    blocks = ((np.arange(64)[:, None] * 7 + np.arange(1024)) % 251).astype(np.uint8)
    prefill.expose_leased("kv", prefill.register(blocks), "r")
    decode.add_peer("prefill", f"127.0.0.1:{prefill.port}")
    yield prefill, decode, blocks
    decode.close()
    prefill.close()


def test_a_lease_gives_its_blocks_while_it_lasts(pair):
    prefill, decode, blocks = pair
    seg = decode.segment("prefill", "kv")
    dst = np.zeros(1024, dtype=np.uint8)
    decode.register(dst)
    with pytest.raises(rdmakit.TransferError, match="no_segment"):  # nobody's until granted
        decode.submit([rdmakit.read(dst, seg, remote_offset=0)]).wait(10.0)
    lease = prefill.grant("decode", [("kv", 4 * 1024, 4 * 1024), ("kv", 20 * 1024, 1024)], "r", ttl=0.5)
    held = decode.lease("prefill", lease, wait=5.0)
    assert held is not None and not held["ended"]
    assert held["ranges"] == [("kv", 4096, 4096), ("kv", 20480, 1024)]
    assert 0 < held["expires_in"] <= 0.5
    decode.submit([rdmakit.read(dst, seg, remote_offset=20 * 1024)]).wait(10.0)
    assert np.array_equal(dst, blocks[20])
    with pytest.raises(rdmakit.TransferError, match="no_segment"):  # not in it
        decode.submit([rdmakit.read(dst, seg, remote_offset=0)]).wait(10.0)
    for _ in range(6):  # renewed, it outlives its ttl
        decode.renew("prefill", lease, ttl=0.5)
        time.sleep(0.15)
    decode.submit([rdmakit.read(dst, seg, remote_offset=5 * 1024)]).wait(10.0)
    assert np.array_equal(dst, blocks[5])
    assert prefill.next_lease_end() is None
    end = next_end(prefill, 2.0)                        # not renewed: it expires
    assert end is not None and (end["lease"], end["peer"], end["cause"]) == (lease, "decode", "expired")
    blocks[:] = 0xEE                                    # reused the moment it is told
    dst[:] = 1
    b = decode.submit([rdmakit.read(dst, seg, remote_offset=5 * 1024)])
    with pytest.raises(rdmakit.TransferError):
        b.wait(10.0)
    status, reason = b.result(0)
    assert status == "lease_expired" and str(lease) in reason
    assert (dst == 1).all()
    assert decode.lease("prefill", lease)["ended"]


def test_release_and_end_lease_and_what_grant_refuses(pair):
    prefill, decode, _ = pair
    lease = prefill.grant("decode", [("kv", 0, 1024)], "r", ttl=60)
    assert decode.lease("prefill", lease, wait=5.0) is not None
    decode.release("prefill", lease)
    end = next_end(prefill)
    assert end is not None and end["cause"] == "released"
    lease = prefill.grant("decode", [("kv", 0, 1024)], ttl=60)
    assert prefill.end_lease(lease) and not prefill.end_lease(lease)
    assert next_end(prefill)["cause"] == "revoked"
    with pytest.raises(rdmakit.Error, match="no segment 'nope'"):
        prefill.grant("decode", [("kv", 0, 1024), ("nope", 0, 1)], ttl=1)
    with pytest.raises(rdmakit.Error, match="descriptor 1"):
        prefill.grant("decode", [("kv", 0, 8), ("kv", 0)], ttl=1)
    with pytest.raises(rdmakit.Error, match="allows"):
        prefill.grant("decode", [("kv", 0, 1024)], "w", ttl=1)
    assert decode.lease("prefill", 999, wait=0.2) is None
