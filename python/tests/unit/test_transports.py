"""Two Python processes on a host without RDMA, as a newcomer tries it first: one serves a numpy
pool over tcp (or shm), the other writes into it and reads it back (issue 33, the README's
"Without RDMA")."""
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


@pytest.mark.parametrize("transport,shm_copy", [("tcp", "auto"), ("shm", "auto"), ("shm", "ring")])
def test_a_transfer_between_two_processes_without_rdma(transport, shm_copy):
    target = subprocess.Popen([sys.executable, "-c", TARGET, transport], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(target.stdout.readline())
        e = rdmakit.Engine(name="client", listen="", transports=[transport], shm_copy=shm_copy)
        e.add_peer("kv", f"127.0.0.1:{port}")
        seg = e.segment("kv", "pool")
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, dtype=np.uint8)
        e.register(src)
        e.register(dst)
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
