# SPDX-License-Identifier: Apache-2.0
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

import atexit as _atexit
import logging as _logging
import os as _os
import threading as _threading

from . import _rdmakit as _native
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


def _pump_logs(stop):
    # The library's log lines (a listener without a key, a peer refused, a rail down) go to the
    # "rdmakit" logger: queued by whichever thread said them, logged from this one.
    log = _logging.getLogger("rdmakit")
    while not stop.is_set():
        lines = _native._log_lines(1.0)
        if lines is None:
            return  # stopped: the exit hook ran
        for line in lines:
            try:
                log.warning("%s", line)
            except Exception:  # noqa: BLE001 - a handler or filter of the application's failed
                pass


_log_lock = _threading.Lock()
_log_pump = None
_log_stop = None
_log_closed = False


def _start_log_pump():
    """Started by the first engine or connection (and again in a forked child that makes one);
    never after the exit hook has run."""
    global _log_pump, _log_stop
    with _log_lock:
        if _log_closed or (_log_pump is not None and _log_pump.is_alive()):
            return
        _log_stop = _threading.Event()
        _log_pump = _threading.Thread(target=_pump_logs, args=(_log_stop,), name="rdmakit-log", daemon=True)
        _log_pump.start()


def _drain_logs():
    # Before the interpreter finalizes: the pump stops waiting and ends (a daemon thread taking
    # the GIL back during finalization would abort the process), then what is left is logged;
    # lines said after this go to stderr.
    global _log_closed
    with _log_lock:
        _log_closed = True
        pump, stop = _log_pump, _log_stop
    if stop is not None:
        stop.set()
    _native._log_stop()
    if pump is not None and pump.is_alive():
        pump.join(2.0)
    for line in _native._log_lines(0.0) or []:
        try:
            _logging.getLogger("rdmakit").warning("%s", line)
        except Exception:  # noqa: BLE001
            pass


def _after_fork_in_child():
    # The parent's pump thread is not in the child (nor, maybe, its lock's holder): start afresh.
    global _log_pump, _log_lock
    _log_lock = _threading.Lock()
    _log_pump = None


_atexit.register(_drain_logs)
_os.register_at_fork(after_in_child=_after_fork_in_child)
