# SPDX-License-Identifier: Apache-2.0
"""The engine's figures for Prometheus from Python, on the host over tcp: metrics() after a
batch names its peer and path, health(), and serve_metrics()'s HTTP endpoint (/metrics,
/health), stopped by stop_metrics() and by close()."""
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import rdmakit


def engine(name, **kw):
    return rdmakit.Engine(name=name, listen="127.0.0.1:0", transports=["tcp"], **kw)


def sample(text, series):
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def test_metrics_name_the_peer_and_path_and_the_endpoint_serves_them():
    target, initiator = engine("target"), engine("initiator")
    try:
        kv = np.zeros(1 << 16, dtype=np.uint8)
        target.expose("kv", target.register(kv), "rw")
        initiator.add_peer("target", f"127.0.0.1:{target.port}")
        src = np.full(1 << 16, 7, dtype=np.uint8)
        initiator.register(src)
        seg = initiator.segment("target", "kv")
        b = initiator.submit([rdmakit.write(src, seg)])
        b.wait(10.0)
        series = 'rdmakit_peer_bytes_total{engine="initiator",peer="target"}'
        until = time.monotonic() + 2
        text = initiator.metrics()
        while sample(text, series) != 65536 and time.monotonic() < until:  # one poll behind at most
            time.sleep(0.001)
            text = initiator.metrics()
        assert sample(text, series) == 65536, text
        assert sample(text, 'rdmakit_path_bytes_total{engine="initiator",path="tcp",transport="tcp"}') == 65536
        assert sample(initiator.metrics(top_peers=0), 'rdmakit_peer_bytes_total{engine="initiator"}') == 65536
        assert target.health() == {"ok": True, "reason": ""}

        address = target.serve_metrics("127.0.0.1:0")
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            assert r.status == 200
            assert sample(r.read().decode(), 'rdmakit_accepts_total{engine="target"}') == 1
        with urllib.request.urlopen(f"http://{address}/health", timeout=5) as r:
            h = json.loads(r.read())
            assert h["status"] == "ok" and h["engine"] == "target"
        target.stop_metrics()
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://{address}/health", timeout=5)
        address = target.serve_metrics("127.0.0.1:0")
    finally:
        initiator.close()
        target.close()
    with pytest.raises(urllib.error.URLError):  # close() stopped it, before the engine went
        urllib.request.urlopen(f"http://{address}/health", timeout=5)
