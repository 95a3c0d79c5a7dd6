#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A KV-cache-style exchange between two engines.

One process holds a pool of fixed-size blocks and exposes it; another computes some blocks, writes
the ones the first asked for straight into the pool (RDMA WRITE, zero-copy from a numpy array),
and notifies which; the first checks them. Both sides run an asyncio loop: no thread, no polling.

    kv_cache.py serve --listen 0.0.0.0:7660 [--count 1]     # the pool; exits after COUNT deliveries
    kv_cache.py send HOST:7660 --blocks 3,17,42      # writes those blocks and notifies
"""
import argparse
import asyncio
import sys

import numpy as np

import rdmakit

BLOCKS, BLOCK_BYTES = 256, 16384


def block_content(i):
    """What block i holds when the sender has computed it (a deterministic pattern)."""
    return (np.arange(BLOCK_BYTES, dtype=np.uint32) * 2654435761 + i).astype(np.uint8)


async def serve(args):
    engine = rdmakit.Engine(name="kv-pool", listen=args.listen)
    pool = np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    engine.expose("kv", engine.register(pool), "w")
    print(f"pool: {BLOCKS} blocks of {BLOCK_BYTES} bytes on port {engine.port}", flush=True)
    bad = received = 0
    async for note in engine.notifications():
        blocks = [int(b) for b in note.message.decode().split(",")]
        wrong = [b for b in blocks if not np.array_equal(pool[b], block_content(b))]
        bad += len(wrong)
        print(f"pool: {note.peer} delivered blocks {blocks}: "
              f"{'all intact' if not wrong else f'{wrong} WRONG'}", flush=True)
        received += 1
        if received == args.count:
            break
    engine.close()
    return 1 if bad else 0


async def send(args):
    engine = rdmakit.Engine(name="kv-worker", listen="")
    engine.add_peer("kv-pool", args.address)  # the pool's own name: only that engine is linked to
    kv = engine.segment("kv-pool", "kv")
    cache = np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8)  # this side's blocks
    engine.register(cache)  # once; every block is a view of it
    blocks = [int(b) for b in args.blocks.split(",")]
    for b in blocks:
        cache[b] = block_content(b)
    batch = engine.submit([rdmakit.write(cache[b], kv, remote_offset=b * BLOCK_BYTES)
                           for b in blocks],
                          notify=",".join(map(str, blocks)).encode())
    await asyncio.wait_for(batch, 30)  # raises TransferError with the reasons if any failed
    print(f"worker: wrote blocks {blocks} ({len(blocks) * BLOCK_BYTES} bytes)")
    engine.close()
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", default="0.0.0.0:7660")  # no key: every address must be named
    s.add_argument("--count", type=int, default=1, help="deliveries to take before exiting")
    c = sub.add_parser("send")
    c.add_argument("address")
    c.add_argument("--blocks", default="3,17,42")
    args = p.parse_args()
    return asyncio.run(serve(args) if args.cmd == "serve" else send(args))


if __name__ == "__main__":
    sys.exit(main())
