# SPDX-License-Identifier: Apache-2.0
"""The target side of the two-VM tests: exposes a pool, and for every notification "check OFF LEN
SHA256" verifies its own bytes; exits 0 when "bye" comes and every check passed (60 s deadline).
Usage: target.py PORT"""
import asyncio
import hashlib
import sys

import numpy as np

import rdmakit


async def main(port):
    eng = rdmakit.Engine(name="target", listen=f"0.0.0.0:{port}")
    pool = np.zeros(16 << 20, dtype=np.uint8)
    eng.expose("pool", eng.register(pool), "rw")
    print(f"target: serving 16 MiB on port {eng.port}", flush=True)
    checks = bad = 0

    async def serve():
        nonlocal checks, bad
        async for note in eng.notifications():
            words = note.message.decode().split()
            if words[0] == "bye":
                return
            off, length, digest = int(words[1]), int(words[2]), words[3]
            checks += 1
            if hashlib.sha256(pool[off:off + length].tobytes()).hexdigest() != digest:
                bad += 1
                print(f"target: bytes at {off}+{length} differ from what {note.peer} wrote")

    await asyncio.wait_for(serve(), 60)
    eng.close()
    print(f"target: {checks} checks, {bad} bad")
    return 0 if checks > 0 and bad == 0 else 1


sys.exit(asyncio.run(main(int(sys.argv[1]))))
