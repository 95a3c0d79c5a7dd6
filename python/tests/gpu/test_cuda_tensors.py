# SPDX-License-Identifier: Apache-2.0
"""CUDA tensors through the Python package, on a machine with a GPU (tests/gpu/run runs these
there; everywhere else they skip): what memory_of says of device tensors, either way it finds
their memory; registration by device pointer; pinned host tensors moved over tcp and shm
byte-exact; GPU memory refused by name on a link that moves bytes with the CPU, while the engine
goes on serving; and, where the machine has an RDMA device, GPU tensors written and read through
it byte-exact, or a registration refused with the reason (nvidia-peermem)."""
import os

import pytest

torch = pytest.importorskip("torch")
import rdmakit  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

MiB = 1 << 20


def has_rdma():
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


class OnlyDlpack:
    """A tensor seen through DLPack alone, as a CuPy or JAX array is."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, *args, **kwargs):
        return self.t.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_memory_of_a_cuda_tensor_is_its_device_pointer_either_way():
    t = torch.arange(1000, dtype=torch.float32, device="cuda")
    m = rdmakit.memory_of(t)
    assert m == {"address": t.data_ptr(), "nbytes": 4000, "readonly": False, "memory": "cuda",
                 "device": t.device.index}
    assert rdmakit.memory_of(t[10:20])["address"] == t.data_ptr() + 40
    assert rdmakit.memory_of(OnlyDlpack(t)) == m
    with pytest.raises(rdmakit.BufferError, match="not contiguous"):
        rdmakit.memory_of(torch.zeros((16, 16), device="cuda")[:, 3])
    with pytest.raises(rdmakit.BufferError, match="not contiguous"):
        rdmakit.memory_of(OnlyDlpack(torch.zeros((16, 16), device="cuda")[:, 3]))
    # Pinned host memory is the CPU's: host, as DLPack says it.
    p = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    assert rdmakit.memory_of(p)["memory"] == "host" and rdmakit.memory_of(p)["address"] == p.data_ptr()


def soft_pair(transport):
    target = rdmakit.Engine(name="gpu-target", listen="127.0.0.1:0", transports=[transport])
    client = rdmakit.Engine(name="gpu-client", listen="", transports=[transport])
    return target, client


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pinned_tensors_move_and_gpu_tensors_are_refused_by_name(transport):
    target, client = soft_pair(transport)
    try:
        pool = torch.zeros(MiB, dtype=torch.uint8).pin_memory()
        gpu_pool = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
        target.expose("pool", target.register(pool), "rw")
        target.expose("gpu", target.register(gpu_pool), "rw")   # registered; not offered over tcp/shm
        client.add_peer("gpu-target", f"127.0.0.1:{target.port}")
        seg = client.segment("gpu-target", "pool")
        src = torch.randint(0, 256, (MiB,), dtype=torch.uint8).pin_memory()
        dst = torch.zeros(MiB, dtype=torch.uint8).pin_memory()
        gsrc = torch.randint(0, 256, (MiB,), dtype=torch.uint8, device="cuda")
        buf = client.register(gsrc)
        assert buf.memory == "cuda", buf.memory
        assert client.registration(buf) == []          # no RDMA device: the soft transports only
        client.register(src)
        client.register(dst)

        client.submit([rdmakit.write(src, seg)]).wait(10.0)
        assert torch.equal(pool, src)
        client.submit([rdmakit.read(dst, seg)]).wait(10.0)
        assert torch.equal(dst, src)

        # GPU memory as the local side: the CPU cannot reach it, and the error says so.
        with pytest.raises(rdmakit.Error) as e:
            client.submit([rdmakit.write(gsrc, seg)]).wait(10.0)
        print("local GPU tensor over", transport, "->", e.value)
        assert "GPU memory" in str(e.value) and transport in str(e.value)
        # The target's GPU segment is not offered over this link: its transfers end, named.
        gseg = client.segment("gpu-target", "gpu")
        with pytest.raises(rdmakit.Error) as e:
            client.submit([rdmakit.write(src, gseg)]).wait(10.0)
        print("remote GPU segment over", transport, "->", e.value)
        assert "gpu" in str(e.value)
        assert int(gpu_pool.sum()) == 0                        # nothing reached the GPU pool

        # Both engines go on serving.
        src[:4096] = 7
        client.submit([rdmakit.write(src, seg)]).wait(10.0)
        assert torch.equal(pool, src)
    finally:
        client.close()
        target.close()


def test_a_gpu_tensor_whose_last_reference_goes_stays_registered_until_close():
    e = rdmakit.Engine(name="gpu-holder", listen="", transports=["tcp"])
    try:
        t = torch.ones(MiB, dtype=torch.uint8, device="cuda")
        ptr = t.data_ptr()
        e.register(t)
        del t
        torch.cuda.empty_cache()
        # The engine holds the tensor: new allocations do not land on its memory.
        others = [torch.empty(MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
        assert all(o.data_ptr() != ptr for o in others)
    finally:
        e.close()
    del others
    torch.cuda.empty_cache()
    # Closed, the engine let it go: the allocator may hand the memory out again.
    again = [torch.empty(MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
    print("after close, the old pointer came back:", any(a.data_ptr() == ptr for a in again))


@pytest.mark.skipif(not has_rdma(), reason="no RDMA device on this machine")
def test_gpu_tensors_through_an_rdma_device_or_the_reason():
    target = rdmakit.Engine(name="gpu-target", listen="127.0.0.1:0")
    client = rdmakit.Engine(name="gpu-client", listen="")
    try:
        pool = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
        try:
            gbuf = target.register(pool)
        except rdmakit.Error as e:
            # Refused only when both ways were: each named, with what to do.
            print("GPU registration through the RDMA device refused:", e, "| hint:", e.hint)
            assert "device pointer" in str(e) and ("ibv_reg_dmabuf_mr" in str(e) or "cuMemGetHandleForAddressRange" in str(e))
            assert "nvidia-peermem" in e.hint and "dma-buf" in e.hint
            pytest.skip(f"this RDMA device takes GPU memory neither by dma-buf nor by pointer: {e}")
        paths = target.registration(gbuf)
        print("GPU tensor registered:", paths)
        assert paths and all(p["path"] in ("dmabuf_mr", "device_mr") for p in paths), paths
        target.expose("gpu", gbuf, "rw")
        client.add_peer("gpu-target", f"127.0.0.1:{target.port}")
        seg = client.segment("gpu-target", "gpu")
        src = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
        for b in (client.register(src), client.register(dst)):
            assert all(p["path"] in ("dmabuf_mr", "device_mr") for p in client.registration(b))
        torch.cuda.synchronize()                               # randint's kernel is done before the NIC reads
        client.submit([rdmakit.write(src, seg)]).wait(30.0)
        torch.cuda.synchronize()
        assert torch.equal(pool, src)
        client.submit([rdmakit.read(dst[MiB:2 * MiB], seg, remote_offset=3 * MiB)]).wait(30.0)
        assert torch.equal(dst[MiB:2 * MiB], src[3 * MiB:])
    finally:
        client.close()
        target.close()
