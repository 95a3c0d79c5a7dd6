# SPDX-License-Identifier: Apache-2.0
"""What rdmakit makes of Python objects' memory, and its exceptions: no device needed."""
import builtins
import mmap
import os
import pathlib

import numpy as np
import pytest
import torch

import rdmakit


def test_buffer_protocol_objects_are_taken_as_they_are():
    b = bytearray(b"x" * 100)
    m = rdmakit.memory_of(b)
    assert m["nbytes"] == 100 and not m["readonly"] and m["memory"] == "host"
    # A memoryview of part of it: the same memory, offset.
    sub = rdmakit.memory_of(memoryview(b)[10:20])
    assert sub["address"] == m["address"] + 10 and sub["nbytes"] == 10
    arr = np.arange(64, dtype=np.uint32)
    assert rdmakit.memory_of(arr)["address"] == arr.ctypes.data
    assert rdmakit.memory_of(arr)["nbytes"] == 256
    with mmap.mmap(-1, 8192) as mm:
        assert rdmakit.memory_of(mm)["nbytes"] == 8192


def test_read_only_memory_is_reported_read_only():
    assert rdmakit.memory_of(b"abc")["readonly"]
    arr = np.zeros(8)
    arr.flags.writeable = False
    assert rdmakit.memory_of(arr)["readonly"]


def test_torch_tensors_through_dlpack_or_their_pointer():
    t = torch.arange(100, dtype=torch.float32)
    m = rdmakit.memory_of(t)
    assert m["address"] == t.data_ptr() and m["nbytes"] == 400 and m["memory"] == "host"
    view = t[10:20]
    assert rdmakit.memory_of(view)["address"] == t.data_ptr() + 40


@pytest.mark.parametrize("make", [
    lambda: np.zeros((16, 16))[:, 3],
    lambda: torch.zeros((16, 16))[:, 3],
    lambda: memoryview(bytearray(64))[::2],
])
def test_non_contiguous_memory_is_refused_with_the_reason(make):
    with pytest.raises(rdmakit.BufferError) as e:
        rdmakit.memory_of(make())
    assert "not contiguous" in str(e.value)
    assert e.value.errno == 22 and e.value.hint  # EINVAL, and what to do
    # One exception, two families: rdmakit's and Python's own BufferError.
    assert isinstance(e.value, rdmakit.Error) and isinstance(e.value, builtins.BufferError)


def test_objects_without_memory_are_refused():
    with pytest.raises(rdmakit.BufferError, match="neither the buffer protocol nor __dlpack__"):
        rdmakit.memory_of(42)


def test_exception_classes_fit_both_hierarchies():
    assert issubclass(rdmakit.TimeoutError, builtins.TimeoutError)
    assert issubclass(rdmakit.PeerLostError, builtins.ConnectionError)
    for cls in (rdmakit.BufferError, rdmakit.TimeoutError, rdmakit.PeerLostError,
                rdmakit.PostError, rdmakit.TransferError):
        assert issubclass(cls, rdmakit.Error)
    assert issubclass(rdmakit.Error, RuntimeError)


def test_an_engine_without_a_device_says_which_verb_failed():
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has RDMA devices (the rxe tests cover engines)")
    with pytest.raises(rdmakit.Error) as e:
        rdmakit.Engine(name="x")
    assert e.value.verb.startswith("ibv_") and e.value.hint


def test_the_type_stubs_name_every_public_name():
    stub = (pathlib.Path(rdmakit.__file__).parent / "_rdmakit.pyi").read_text()
    for name in rdmakit.__all__:
        if name == "__version__":
            continue
        assert f"class {name}" in stub or f"def {name}(" in stub, name
