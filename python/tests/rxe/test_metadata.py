# SPDX-License-Identifier: Apache-2.0
"""Engines from Python finding each other by name through a real Redis server (started here, in
the lab VM): the metadata keywords, add_peer by name, directory(), and the store's errors."""
import socket
import subprocess
import time

import numpy as np
import pytest

import rdmakit


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis(tmp_path):
    port = free_port()
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", str(tmp_path)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                p.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}"
    p.kill()
    p.wait()


def test_engines_find_each_other_by_name(redis):
    pool = np.zeros(1 << 20, dtype=np.uint8)
    with rdmakit.Engine(name="target", listen="127.0.0.1:0", metadata=redis, cluster="py",
                        lease=2.0) as target, \
         rdmakit.Engine(name="init", listen="", metadata=redis, cluster="py", lease=2.0) as init:
        target.expose("pool", target.register(pool), "rw")
        assert 'published as "target"' in target.info()["metadata"]
        src = np.random.default_rng(5).integers(0, 256, 64 << 10, dtype=np.uint8)
        init.register(src)
        init.submit([rdmakit.write(src, init.segment("target", "pool"))]).wait(10.0)
        assert np.array_equal(pool[:64 << 10], src)
        assert init.peers()[0]["address"] == f"127.0.0.1:{target.port}"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            d = init.directory()
            if d and d[0]["segments"]:
                break
            time.sleep(0.1)
        assert d[0]["name"] == "target" and d[0]["epoch"] == target.info()["epoch"]
        assert d[0]["segments"] == [{"name": "pool", "length": 1 << 20, "memory": "host"}]
        with pytest.raises(rdmakit.Error, match="nobody") as e:
            init.add_peer("nobody")
        assert redis in str(e.value)


def test_a_name_alone_needs_a_store():
    with rdmakit.Engine(name="lonely", listen="") as e:
        assert e.info()["metadata"].startswith("p2p")
        assert e.directory() == []
        with pytest.raises(rdmakit.Error, match="no metadata store"):
            e.add_peer("someone")
    with pytest.raises(rdmakit.Error, match="cluster"):
        rdmakit.Engine(name="x", metadata="redis://127.0.0.1:1", cluster="a/b")
