# SPDX-License-Identifier: Apache-2.0
"""Wall time per batch through the Python binding (the twin of rdmakit_engine_batch_time): a
batch of B 8-byte WRITEs to a peer engine in the same process, ROUNDS times after a warm-up.

  python_batch_time.py ROUNDS BATCH MODE [INFLIGHT]     prints "us_per_batch <float>"
    MODE: wait     submit(plan) + Batch.wait()      (the plan resolved once: Engine.prepare)
          await    submit(plan) + await, in an asyncio loop
          future   as await, with INFLIGHT > 1: asyncio.gather of the batches' future()s
          list     submit([Transfer, ...]) + wait() (each transfer resolved at every submit)
    INFLIGHT: per round, submit that many batches, then wait for them all (await: gather).
"""
import asyncio
import sys
import time

import numpy as np

import rdmakit


def main(rounds, batch, mode, inflight):
    target = rdmakit.Engine(name="target", listen=":0")
    pool = np.zeros(1 << 20, dtype=np.uint8)
    target.expose("pool", target.register(pool), "w")
    init = rdmakit.Engine(name="init", listen="")
    init.add_peer("target", f"127.0.0.1:{target.port}")
    src = np.zeros(1 << 20, dtype=np.uint8)
    buf = init.register(src)
    seg = init.segment("target", "pool")
    transfers = [rdmakit.write(buf, seg, local_offset=i * 8, length=8, remote_offset=i * 8)
                 for i in range(batch)]
    plan = init.prepare(transfers)

    if mode in ("await", "future"):
        async def run(n):
            for _ in range(n):
                if inflight == 1:
                    await init.submit(plan)
                elif mode == "future":
                    await asyncio.gather(*[init.submit(plan).future() for _ in range(inflight)])
                else:
                    await asyncio.gather(*[init.submit(plan) for _ in range(inflight)])

        asyncio.run(run(200 // inflight + 1))
        t0 = time.perf_counter()
        asyncio.run(run(rounds))
    else:
        what = plan if mode == "wait" else transfers

        def run(n):
            for _ in range(n):
                for b in [init.submit(what) for _ in range(inflight)]:
                    b.wait(10.0)

        run(200 // inflight + 1)
        t0 = time.perf_counter()
        run(rounds)
    us = (time.perf_counter() - t0) * 1e6 / (rounds * inflight)
    print(f"us_per_batch {us:.2f}")
    init.close()
    target.close()


main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 1)
