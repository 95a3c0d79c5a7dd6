# SPDX-License-Identifier: Apache-2.0
"""Two Python processes on a host without RDMA, as a newcomer tries it first: one serves a numpy
pool over tcp (or shm), the other writes into it and reads it back (issue 33, the README's
"Without RDMA")."""
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import rdmakit

TARGET = textwrap.dedent("""
    import sys
    import numpy as np
    import rdmakit
    t = rdmakit.Engine(name="kv", listen="127.0.0.1:0", transports=sys.argv[1:])
    pool = np.zeros(1 << 20, dtype=np.uint8)
    t.expose("pool", t.register(pool), "rw")
    print(t.port, flush=True)
    sys.stdin.readline()               # the client says it wrote
    print(int(pool[:4096].sum()), flush=True)
    sys.stdin.readline()
""")


def linked_buffers(e, peer, address, n):
    """Peer `peer` at `address` added to engine e, its segment "pool", and two registered arrays
    of n bytes: 0..n-1 to write from, zeros to read into."""
    e.add_peer(peer, address)
    seg = e.segment(peer, "pool")
    src = np.arange(n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    e.register(src)
    e.register(dst)
    return seg, src, dst


@pytest.mark.parametrize("transport,shm_copy,shm_map",
                         [("tcp", "auto", True), ("shm", "auto", True), ("shm", "ring", False)])
def test_a_transfer_between_two_processes_without_rdma(transport, shm_copy, shm_map):
    target = subprocess.Popen([sys.executable, "-c", TARGET, transport], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(target.stdout.readline())
        e = rdmakit.Engine(name="client", listen="", transports=[transport], shm_copy=shm_copy,
                           shm_map=shm_map)
        seg, src, dst = linked_buffers(e, "kv", f"127.0.0.1:{port}", 4096)
        e.submit([rdmakit.write(src, seg)]).wait(10.0)
        target.stdin.write("wrote\n")
        target.stdin.flush()
        assert int(target.stdout.readline()) == int(src.sum())   # the bytes are in the target's pool
        e.submit([rdmakit.read(dst, seg)]).wait(10.0)
        assert np.array_equal(dst, src)
        peer = e.peers()[0]
        assert peer["transport"] == transport and "first choice" in peer["transport_reason"]
        if transport == "shm":
            assert ("shared ring" in peer["transport_reason"]) == (shm_copy == "ring"), peer["transport_reason"]
            assert ("shm_map is off" in peer["transport_reason"]) == (not shm_map), peer["transport_reason"]
        # numpy's memory, registered: never mapped by the peer (only what the engine allocates is).
        assert e.counters()["shm_mapped_bytes"] == 0
        assert e.info()["transports"] == [transport]
        e.close()
    finally:
        target.stdin.write("done\n")
        target.stdin.flush()
        target.wait(10)


def test_an_engine_without_rdma_or_transports_says_how_to_run():
    try:
        rdmakit.Engine(name="x", listen="").close()
        pytest.skip("this host has an RDMA device")
    except rdmakit.Error as e:
        assert "--transport tcp" in str(e) and "transports" in str(e)


@pytest.mark.parametrize("spin", [1.0, 0.0])
def test_a_wait_polls_for_its_transfer_unless_wait_spin_is_zero(spin):
    # Issue 34: Batch.wait() polls the worker itself (counters()["waits_spun"]); wait_spin=0
    # sleeps at once and the worker ends the batch. The bytes are right either way.
    with rdmakit.Engine(name="t", listen="127.0.0.1:0", transports=["tcp"]) as t, \
            rdmakit.Engine(name="c", listen="", transports=["tcp"], wait_spin=spin) as c:
        pool = np.zeros(4096, dtype=np.uint8)
        t.expose("pool", t.register(pool), "rw")
        seg, src, dst = linked_buffers(c, "t", f"127.0.0.1:{t.port}", 64)
        for _ in range(50):
            c.submit([rdmakit.write(src, seg)]).wait(10.0)
            c.submit([rdmakit.read(dst, seg)]).wait(10.0)
        assert np.array_equal(dst, src) and np.array_equal(pool[:64], src)
        n = c.counters()
        assert (n["waits_spun"] > 0) == (spin > 0), n
    with pytest.raises(ValueError, match="wait_spin"):
        rdmakit.Engine(name="x", listen="", transports=["tcp"], wait_spin=2.0)


def test_workers_are_pinned_to_the_cpus_given():
    import os
    import time
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    e = rdmakit.Engine(name="pinned", listen="", transports=["tcp"], workers=2, worker_cpus=[cpus[1], cpus[0]])
    try:
        want = {"rdmakit-w0": {cpus[1]}, "rdmakit-w1": {cpus[0]}}
        got = {}
        until = time.monotonic() + 5
        while len(got) < len(want) and time.monotonic() < until:   # a thread names itself as it starts
            for task in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{task}/comm") as f:
                    name = f.read().strip()
                if name in want:
                    got[name] = os.sched_getaffinity(int(task))
            time.sleep(0.01)
        assert got == want
    finally:
        e.close()
    with pytest.raises(rdmakit.Error, match="worker_cpus with workers = 0"):
        rdmakit.Engine(name="none", listen="", transports=["tcp"], workers=0, worker_cpus=[cpus[0]])


def test_a_batch_not_done_in_time_says_how_far_it_got():
    # The target process stopped (SIGSTOP) once the link is up: none of a batch's writes can be
    # acknowledged, and the TimeoutError says how many of them had ended and how many had not.
    target = subprocess.Popen([sys.executable, "-c", TARGET, "tcp"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    e = None
    try:
        port = int(target.stdout.readline())
        e = rdmakit.Engine(name="client", listen="", transports=["tcp"])
        seg, src, dst = linked_buffers(e, "kv", f"127.0.0.1:{port}", 1 << 20)
        e.submit([rdmakit.write(src[:4096], seg)]).wait(10.0)   # the link is up
        target.send_signal(signal.SIGSTOP)
        batch = e.submit([rdmakit.write(src[k << 12:(k + 1) << 12], seg, remote_offset=k << 12)
                          for k in range(256)])
        with pytest.raises(rdmakit.TimeoutError) as raised:
            batch.wait(0.2)
        m = re.search(r"the batch of 256 transfers was not done within 0\.2 s: (\d+) of 256 ended "
                      r"\(0 failed(; ended ok on path: tcp \d+)?\), (\d+) had not: transfers? "
                      r"(\d+(?:-\d+)?(?:, \d+(?:-\d+)?)*)( and \d+ more runs?)?", str(raised.value))
        assert m is not None, str(raised.value)
        assert int(m.group(1)) + int(m.group(3)) == 256 and int(m.group(3)) > 0, str(raised.value)
        # Which: the runs of indices not ended (the first four), as many as said when that is all.
        runs = [r.split("-") for r in m.group(4).split(", ")]
        shown = sum(int(r[-1]) - int(r[0]) + 1 for r in runs)
        assert shown == int(m.group(3)) if m.group(5) is None else shown < int(m.group(3)), str(raised.value)
        # The same words from the batch itself, while the target is still stopped.
        assert re.fullmatch(r"\d+ of 256 ended \(0 failed(; ended ok on path: tcp \d+)?\), \d+ had not: transfers? .+",
                            batch.describe_progress()), batch.describe_progress()
        target.send_signal(signal.SIGCONT)
        batch.wait(30.0)                                           # and then it ends, every write
    finally:
        target.send_signal(signal.SIGCONT)
        if e is not None:
            e.close()
        target.kill()
        target.wait()
