"""asyncio glue: ``await batch`` and ``async for note in engine.notifications()``.

One reader per (engine, event loop) watches the engine's descriptor with ``loop.add_reader``:
when it becomes readable (a batch ended or a notification arrived) the reader re-arms it and
settles the futures whose batches are done, then hands out notifications. No thread, no sleep,
no polling: between events the loop sleeps in its selector.
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
        self._batches = []  # (batch, future) pairs still waiting
        self._notes = collections.deque()  # futures of notifications() iterators
        loop.add_reader(self._fd, self._readable)

    def _readable(self):
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            pass
        self.settle()

    def settle(self):
        if self._batches:
            waiting = []
            for batch, fut in self._batches:
                if fut.done():  # cancelled
                    continue
                if batch.done():
                    self._finish(batch, fut)
                else:
                    waiting.append((batch, fut))
            self._batches = waiting
        engine = self._engine()
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
        # It may have ended since the caller looked (before the reader existed): look again.
        if batch.done():
            self._finish(batch, fut)
        else:
            self._batches.append((batch, fut))
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
        for _, fut in self._batches:
            if not fut.done():
                fut.set_exception(why)
        for fut in self._notes:
            if not fut.done():
                fut.set_exception(why)


def _reader(engine):
    loop = asyncio.get_running_loop()
    last = getattr(engine, "_aio_last", None)  # the common case: one loop per engine
    if last is not None and last[0] is loop:
        return last[1]
    readers = getattr(engine, "_aio_readers", None)
    if readers is None:
        readers = weakref.WeakKeyDictionary()
        engine._aio_readers = readers
    r = readers.get(loop)
    if r is None:
        r = _Reader(engine, loop)
        readers[loop] = r
    engine._aio_last = (loop, r)
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


async def notifications(engine):
    """The engine's notifications, as they arrive (an async generator)."""
    reader = _reader(engine)
    while True:
        note = engine.next_notification()
        if note is None:
            note = await reader.next_note()
        yield note


def detach(engine):
    """At Engine.close(): settles what ended, fails what still waits, removes the readers."""
    readers = getattr(engine, "_aio_readers", None)
    if not readers:
        return
    from ._rdmakit import Error

    for r in list(readers.values()):
        r.settle()
        r.close(Error("the engine was closed"))
    readers.clear()
    engine._aio_last = None
