"""rdmakit: correct, fast and debuggable RDMA between hosts.

The engine (many peers, memory registered once, batched asynchronous transfers)::

    import numpy as np, rdmakit
    eng = rdmakit.Engine(name="worker-3", listen="")
    eng.add_peer("kv-server", "10.0.0.7:7600")
    kv = eng.segment("kv-server", "kv")
    blocks = np.zeros((128, 4096), dtype=np.uint8)
    eng.register(blocks)
    batch = eng.submit([rdmakit.write(blocks[i], kv, remote_offset=i * 4096) for i in range(8)],
                       notify=b"done")
    batch.wait(10.0)            # or, in a coroutine: await batch

Buffers are anything with the buffer protocol (bytearray, memoryview, mmap, numpy arrays) or
``__dlpack__`` (torch tensors); they are never copied. See docs/python.md.
"""

from ._rdmakit import (  # noqa: F401
    Batch,
    Buffer,
    BufferError,
    Connection,
    DescriptorList,
    Engine,
    Error,
    Listener,
    Notification,
    PeerLostError,
    PostError,
    RemoteRegion,
    RemoteSegment,
    TimeoutError,
    Transfer,
    TransferError,
    TransferOp,
    TransferPlan,
    __version__,
    compare_swap,
    connect,
    fetch_add,
    generate_identity,
    memory_of,
    read,
    write,
)

__all__ = [
    "Batch", "Buffer", "BufferError", "Connection", "DescriptorList", "Engine", "Error", "Listener",
    "Notification", "PeerLostError", "PostError", "RemoteRegion", "RemoteSegment",
    "TimeoutError", "Transfer", "TransferError", "TransferOp", "TransferPlan", "__version__",
    "compare_swap", "connect", "fetch_add", "generate_identity", "memory_of", "read", "write",
]
