# SPDX-License-Identifier: Apache-2.0
"""The initiator side of the two-VM tests (target.py runs on the other VM): numpy, torch,
bytearray and mmap sources written to the other VM's engine, read back and compared here, and
each write's bytes checked there (its SHA-256 travels in the batch's notification)."""
import hashlib
import mmap
import os
import time

import numpy as np
import pytest
import torch

import rdmakit

PEER = os.environ.get("RDMAKIT_TEST_PEER", "")
pytestmark = pytest.mark.skipif(not PEER, reason="RDMAKIT_TEST_PEER (host:port of target.py)")


@pytest.fixture(scope="module")
def engine():
    eng = rdmakit.Engine(name="initiator", listen="")
    eng.add_peer("target", PEER)
    deadline = time.monotonic() + 30
    while True:  # target.py starts at the same moment and may not be listening yet
        try:
            eng.connect("target", timeout=5.0)
            break
        except rdmakit.PeerLostError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    yield eng
    eng.submit([rdmakit.write(eng.register(bytearray(1)), eng.segment("target", "pool"),
                              remote_offset=(16 << 20) - 1)], notify=b"bye").wait(10.0)
    eng.close()


def round_trip(eng, src, offset):
    """Writes src at offset (asking the target to check it), reads it back, returns the copy."""
    seg = eng.segment("target", "pool")
    n = rdmakit.memory_of(src)["nbytes"]
    digest = hashlib.sha256(memoryview(src).cast("B") if not isinstance(src, torch.Tensor)
                            else src.numpy().tobytes()).hexdigest()
    eng.submit([rdmakit.write(src, seg, remote_offset=offset)],
               notify=f"check {offset} {n} {digest}".encode()).wait(20.0)
    back = np.zeros(n, dtype=np.uint8)
    eng.register(back)
    eng.submit([rdmakit.read(back, seg, remote_offset=offset)]).wait(20.0)
    return back


def test_numpy_across_vms(engine):
    src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    engine.register(src)
    assert np.array_equal(round_trip(engine, src, 0), src)


def test_torch_across_vms(engine):
    src = torch.randn(1 << 18)  # 1 MiB of float32
    engine.register(src)
    back = round_trip(engine, src, 4 << 20)
    assert np.array_equal(back, src.numpy().view(np.uint8))


def test_bytearray_and_mmap_across_vms(engine):
    ba = bytearray(os.urandom(256 << 10))
    engine.register(ba)
    assert round_trip(engine, ba, 8 << 20).tobytes() == bytes(ba)
    mm = mmap.mmap(-1, 256 << 10)
    mm.write(os.urandom(256 << 10))
    engine.register(mm)
    assert round_trip(engine, mm, 9 << 20).tobytes() == mm[:]
