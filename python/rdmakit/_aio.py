# SPDX-License-Identifier: Apache-2.0
"""asyncio glue: ``await batch`` and ``async for note in engine.notifications()``.

A reader in the event loop watches the engine's descriptor with ``loop.add_reader``: when it
becomes readable (a batch ended or a notification arrived) the reader re-arms it, settles the
futures of exactly the awaited batches that ended (each batch's on_done queues its token, on the
engine's worker, before the descriptor is signalled), then hands out notifications. No thread,
no sleep, no polling, no walk over every waiting batch: between events the loop sleeps in its
selector.
"""

import asyncio
import collections
import os
import weakref


class _Reader:
    def __init__(self, engine, loop):
        self._engine = weakref.ref(engine)
        self._loop = loop
        self._fd = engine.fd
        self._batches = {}  # token -> (batch, future) of the batches still waiting
        self._notes = collections.deque()  # futures of notifications() iterators
        loop.add_reader(self._fd, self._readable)

    def _readable(self):
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            pass
        self.settle()

    def settle(self):
        engine = self._engine()
        if engine is not None:
            # Exactly the awaited batches that ended (their on_done queued their tokens; one
            # settled at once by watch() may be there too, and is no longer waited for).
            for token in engine._take_done():
                entry = self._batches.pop(token, None)
                if entry is not None and not entry[1].done():  # not cancelled meanwhile
                    self._finish(*entry)
        while self._notes and engine is not None:
            fut = self._notes[0]
            if fut.done():
                self._notes.popleft()
                continue
            note = engine.next_notification()
            if note is None:
                break
            self._notes.popleft()
            fut.set_result(note)

    def watch(self, batch):
        fut = self._loop.create_future()
        token, done = batch._watch()
        if done:  # it ended since the caller looked
            self._finish(batch, fut)
        else:
            self._batches[token] = (batch, fut)
        return fut

    @staticmethod
    def _finish(batch, fut):
        try:
            batch.check()
            fut.set_result(batch)
        except BaseException as e:  # noqa: B902 - handed to the awaiting task
            fut.set_exception(e)

    def next_note(self):
        fut = self._loop.create_future()
        self._notes.append(fut)
        self.settle()
        return fut

    def close(self, why):
        try:
            self._loop.remove_reader(self._fd)
        except (RuntimeError, ValueError, OSError):  # the loop is closed already
            pass
        if why is None:  # its loop is closed: nothing can await these any more
            return
        for _, fut in self._batches.values():
            if not fut.done():
                fut.set_exception(why)
        for fut in self._notes:
            if not fut.done():
                fut.set_exception(why)


def _reader(engine):
    """The engine's reader in the running loop. The engine has one descriptor, and a reader
    that re-arms it takes the wake-up from any other, so one loop serves an engine at a time:
    another may take over once the first is closed (asyncio.run after asyncio.run)."""
    loop = asyncio.get_running_loop()
    r = getattr(engine, "_aio_reader", None)
    if r is not None and r._loop is loop:
        return r
    if r is not None and not r._loop.is_closed():
        from ._rdmakit import Error

        raise Error("this engine's batches and notifications are awaited in another event loop "
                    "that is still open; await them in that loop (asyncio.run_coroutine_threadsafe)"
                    ", or close it first")
    if r is not None:
        r.close(None)
    r = engine._aio_reader = _Reader(engine, loop)
    return r


def _ready(batch):
    batch.check()
    return batch
    yield  # a generator: `await` gets the batch at once, the loop is not involved


def batch_await(batch):
    """``Batch.__await__``: an iterator that ends with the batch when every transfer ended and
    raises TransferError (PeerLostError when the peer is gone) if any failed. A future's own
    iterator when it must wait, so awaiting costs no coroutine of its own."""
    if batch.done():
        return _ready(batch)
    return _reader(batch._engine).watch(batch).__await__()


def batch_future(batch):
    """``Batch.future()``: an asyncio future of the running loop with the batch's outcome.
    asyncio.gather and asyncio.wait take futures as they are, where any other awaitable gets a
    task of its own: with many batches in flight, gather their futures."""
    if batch.done():
        fut = asyncio.get_running_loop().create_future()
        _Reader._finish(batch, fut)
        return fut
    return _reader(batch._engine).watch(batch)


async def notifications(engine):
    """The engine's notifications, as they arrive (an async generator)."""
    reader = _reader(engine)
    while True:
        note = engine.next_notification()
        if note is None:
            note = await reader.next_note()
        yield note


def detach(engine):
    """At Engine.close(): settles what ended, fails what still waits, removes the reader."""
    r = getattr(engine, "_aio_reader", None)
    if r is None:
        return
    from ._rdmakit import Error

    r.settle()
    r.close(Error("the engine was closed"))
    engine._aio_reader = None
