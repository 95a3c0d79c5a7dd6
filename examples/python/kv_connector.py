#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A KV connector's calls in pull mode, between a prefill engine and a decode engine.

The shape of vLLM's NixlConnector and MooncakeConnector: both sides register each layer's KV
cache once (32 layers x K/V x 256 blocks); the decode side prepares its descriptor lists once;
per request the prefill side computes the blocks and grants the decode side a lease on them,
the decode side READs them by index with a notification (start_load_kv), checks every block,
and releases the lease; the prefill side frees the blocks when the lease has ended
(get_finished), by which time no read of them can land. A read on a released lease is refused.

    kv_connector.py prefill --listen 0.0.0.0:7670 --decode HOST:7671 [--requests 8]
    kv_connector.py decode --listen 0.0.0.0:7671 --prefill HOST:7670 [--requests 8]
    (--transport tcp on both: the same without RDMA)

The decode side prints the time of the last request's load (all 256 blocks of every layer) and
the bytes it moved; the lab compares it with engine-bench in the same run (docs/performance.md).
"""
import argparse
import sys
import time

import numpy as np

import rdmakit

LAYERS, BLOCKS, BLOCK_BYTES = 32, 256, 2048
TIMEOUT = 30.0


def content(req, layer, kv, block):
    """What block `block` of layer `layer` (K: kv 0, V: 1) holds once request `req` is computed."""
    seed = (req * 1_000_003 + layer * 7919 + kv * 104_729 + block * 31) & 0xFFFFFFFF
    return ((np.arange(BLOCK_BYTES, dtype=np.uint64) * 2654435761 + seed) >> 7).astype(np.uint8)


def blocks_of(req):
    """The blocks of request `req`: 16 scattered ones, and the last request all 256."""
    if req < 0:
        return list(range(BLOCKS))
    rng = np.random.default_rng(req)
    return sorted(int(b) for b in rng.choice(BLOCKS, 16, replace=False))


def next_note(engine, timeout=TIMEOUT):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        note = engine.next_notification()
        if note is not None:
            return note
        time.sleep(0.0005)
    raise TimeoutError("no notification")


class PrefillConnector:
    def __init__(self, engine):
        self.engine = engine
        self.caches = []
        self.leases = {}  # lease id -> request
        self.finished = set()

    def register_kv_caches(self, caches):
        for layer, cache in enumerate(caches):  # cache: (2, BLOCKS, BLOCK_BYTES), K then V
            self.engine.expose_leased(f"L{layer}", self.engine.register(cache), "r")
        self.caches = caches

    def compute(self, req, blocks):
        for layer, cache in enumerate(self.caches):
            for kv in (0, 1):
                for b in blocks:
                    cache[kv, b] = content(req, layer, kv, b)

    def grant(self, req, blocks, ttl):
        ranges = [(f"L{layer}", (kv * BLOCKS + b) * BLOCK_BYTES, BLOCK_BYTES)
                  for layer in range(LAYERS) for kv in (0, 1) for b in blocks]
        lease = self.engine.grant("decode", ranges, "r", ttl=ttl)
        self.leases[lease] = req
        return lease

    def get_finished(self):
        """Requests whose blocks may be reused: their lease ended (its windows are gone)."""
        while (end := self.engine.next_lease_end()) is not None:
            req = self.leases.pop(end["lease"])
            self.finished.add(req)
            for layer, cache in enumerate(self.caches):  # reused at once
                cache[:, blocks_of(req)] = 0xEE
        return self.finished


class DecodeConnector:
    def __init__(self, engine):
        self.engine = engine

    def register_kv_caches(self, caches):
        self.caches = caches
        for cache in caches:
            self.engine.register(cache)
        # Descriptor lists once: every block of every layer, both sides, in one order.
        self.local = self.engine.prepare_local(
            [cache[kv, b] for cache in caches for kv in (0, 1) for b in range(BLOCKS)])
        segs = [self.engine.segment("prefill", f"L{layer}") for layer in range(LAYERS)]
        self.remote = self.engine.prepare_remote(
            [(segs[layer], (kv * BLOCKS + b) * BLOCK_BYTES, BLOCK_BYTES)
             for layer in range(LAYERS) for kv in (0, 1) for b in range(BLOCKS)])

    @staticmethod
    def indices(blocks):
        return np.array([(layer * 2 + kv) * BLOCKS + b
                         for layer in range(LAYERS) for kv in (0, 1) for b in blocks], dtype=np.uint32)

    def start_load_kv(self, req, lease, blocks):
        held = self.engine.lease("prefill", lease, wait=TIMEOUT)
        assert held is not None and not held["ended"], f"request {req}: lease {lease} not held"
        idx = self.indices(blocks)
        return self.engine.submit_indexed("read", self.local, idx, self.remote, idx,
                                          notify=f"loaded {req}".encode(), request_id=f"req-{req}")


def prefill(args):
    engine = rdmakit.Engine(name="prefill", listen=args.listen, transports=[args.transport])
    conn = PrefillConnector(engine)
    conn.register_kv_caches([np.zeros((2, BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(LAYERS)])
    engine.add_peer("decode", args.decode)
    print(f"prefill: {LAYERS} layers x K/V x {BLOCKS} blocks of {BLOCK_BYTES} bytes on port {engine.port}",
          flush=True)
    for req in list(range(args.requests - 1)) + [-1]:
        ask = next_note(engine)                       # the decode side asks for request `req`
        assert ask.message == f"want {req}".encode(), ask.message
        blocks = blocks_of(req)
        conn.compute(req, blocks)
        lease = conn.grant(req, blocks, ttl=10.0)
        engine.notify("decode", f"lease {req} {lease}".encode()).wait(TIMEOUT)
        done = next_note(engine)                      # its load's notification: the reads are in
        assert done.message == f"loaded {req}".encode() and done.request_id == f"req-{req}", done.message
        until = time.monotonic() + TIMEOUT
        while req not in conn.get_finished():         # the decode side releases the lease
            assert time.monotonic() < until, f"request {req}: its lease never ended"
            time.sleep(0.001)
    bye = next_note(engine)                           # the decode side's checks after the last release are done
    assert bye.message == b"bye", bye.message
    print(f"prefill: {len(conn.finished)} requests finished, every lease ended before its blocks were reused",
          flush=True)
    engine.close()
    return 0


def decode(args):
    engine = rdmakit.Engine(name="decode", listen=args.listen, transports=[args.transport])
    conn = DecodeConnector(engine)
    engine.add_peer("prefill", args.prefill)
    for _ in range(100):                              # the prefill side starts at the same moment
        try:
            engine.connect("prefill", 1.0)
            break
        except rdmakit.Error:
            time.sleep(0.3)
    conn.register_kv_caches([np.zeros((2, BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(LAYERS)])
    bad = 0
    for req in list(range(args.requests - 1)) + [-1]:
        engine.notify("prefill", f"want {req}".encode()).wait(TIMEOUT)
        note = next_note(engine)
        _, r, lease = note.message.decode().split()
        assert int(r) == req
        lease = int(lease)
        blocks = blocks_of(req)
        start = time.perf_counter()
        batch = conn.start_load_kv(req, lease, blocks)  # waits for the lease's windows first
        engine.renew("prefill", lease, ttl=10.0)      # the heartbeat a long load would send
        batch.wait(TIMEOUT)
        took = time.perf_counter() - start
        for layer, cache in enumerate(conn.caches):   # every block, K and V
            for kv in (0, 1):
                for b in blocks:
                    if not np.array_equal(cache[kv, b], content(req, layer, kv, b)):
                        bad += 1
        engine.release("prefill", lease)
        late = engine.submit_indexed("read", conn.local, conn.indices(blocks[:1]), conn.remote,
                                     conn.indices(blocks[:1]))
        try:
            late.wait(TIMEOUT)
            print(f"decode: request {req}: a read after release was NOT refused", flush=True)
            bad += 1
        except rdmakit.TransferError:
            assert late.result(0)[0] == "lease_expired", late.result(0)
        t = batch.telemetry()
        moved = len(blocks) * LAYERS * 2 * BLOCK_BYTES
        print(f"decode: request {req}: {len(blocks)} blocks x {LAYERS} layers x K/V, {moved} bytes: load "
              f"{t['total_time'] * 1e3:.2f} ms ({moved / t['total_time'] / 1e9:.2f} GB/s, {t['transfers']} reads, "
              f"posted in {t['post_time'] * 1e3:.2f} ms), with the lease's arrival {took * 1e3:.2f} ms; "
              f"a read after release refused", flush=True)
    engine.notify("prefill", b"bye").wait(TIMEOUT)    # its last read after release is refused: it may go
    print(f"decode: {args.requests} requests, {'every block intact' if not bad else f'{bad} WRONG'}", flush=True)
    engine.close()
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    a = sub.add_parser("prefill")
    a.add_argument("--listen", default="0.0.0.0:7670")  # no key: every address must be named
    a.add_argument("--decode", required=True)
    a.add_argument("--requests", type=int, default=8)
    b = sub.add_parser("decode")
    b.add_argument("--listen", default="0.0.0.0:7671")
    b.add_argument("--prefill", required=True)
    b.add_argument("--requests", type=int, default=8)
    for q in (a, b):
        q.add_argument("--transport", default="rdma", help="rdma, or tcp (any host), shm (one host)")
    args = p.parse_args()
    return prefill(args) if args.role == "prefill" else decode(args)


if __name__ == "__main__":
    sys.exit(main())
