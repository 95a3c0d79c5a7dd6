# SPDX-License-Identifier: Apache-2.0
"""How fast this host runs asyncio Python code: N rounds of a future resolved from a descriptor's
readable callback (os.write to a pipe, the loop wakes, the callback reads and resolves, the task
resumes), the shape of `await batch`. Prints the wall time per round; run under callgrind too
(bench/callgrind-python) to turn instructions into time.

  asyncio_rate.py N     prints "us_per_round <float>"
"""
import asyncio
import os
import sys
import time


async def main(n):
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    os.set_blocking(r, False)
    waiting = []

    def readable():
        os.read(r, 8)
        waiting.pop().set_result(None)

    loop.add_reader(r, readable)
    t0 = time.perf_counter()
    for _ in range(n):
        fut = loop.create_future()
        waiting.append(fut)
        os.write(w, b"x")
        await fut
    return time.perf_counter() - t0


dt = asyncio.run(main(int(sys.argv[1])))
print(f"us_per_round {dt * 1e6 / int(sys.argv[1]):.3f}")
