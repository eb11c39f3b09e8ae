"""The I/O queue: reader threads that move expert bytes, apart from what to load (policy, prediction) and
from computing with it (:mod:`expertcache.offload.step`).

A job is any callable returning the bytes it moved (a tier's ``read`` bound to one expert and one slot).
:meth:`IOQueue.submit` returns a :class:`Ticket` at once; the job runs on one of ``readers`` threads
(``os.preadv`` and torch copies release the GIL, so reads overlap with the compute thread and with each
other). ``readers=0`` runs every job inline in ``submit`` (serial, the pre-queue behaviour).

Contracts:

- every ticket completes: its event is set whatever the job does (exception included), so a waiter never
  hangs on a failed read;
- :meth:`Ticket.wait` re-raises the job's exception in the waiting thread (an ``OSError``/``CheckpointError``
  naming the file: a read error is never a silent wrong answer);
- a ticket submitted with ``done=q`` is put on ``q`` when it completes (success or failure): the caller
  can consume a step's misses in the order they land (``q.get()``), without polling.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

__all__ = ["IOQueue", "Ticket"]


class Ticket:
    """One submitted job: ``tag`` (caller's key, e.g. the expert id), ``nbytes`` read, ``error`` (the
    exception, or None)."""

    __slots__ = ("tag", "nbytes", "error", "_event", "_done")

    def __init__(self, tag, done: "queue.SimpleQueue | None" = None) -> None:
        self.tag = tag
        self.nbytes = 0
        self.error: BaseException | None = None
        self._event = threading.Event()
        self._done = done

    @property
    def ready(self) -> bool:
        return self._event.is_set()

    def join(self) -> "Ticket":
        """Block until the job has finished; its exception, if any, stays in ``error`` (not raised)."""
        self._event.wait()
        return self

    def wait(self) -> "Ticket":
        """Block until the job has finished; re-raise its exception."""
        self._event.wait()
        if self.error is not None:
            raise self.error
        return self

    def _run(self, job: Callable[[], int]) -> None:
        try:
            self.nbytes = job()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, never lost
            self.error = exc
        finally:
            self._event.set()
            if self._done is not None:
                self._done.put(self)


class IOQueue:
    """``readers`` daemon threads serving a FIFO of jobs (0 = run jobs inline)."""

    def __init__(self, readers: int = 4) -> None:
        self.readers = readers
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # the threads hold the job queue, not this object: an unused IOQueue is collected and stops them
        self._threads = [threading.Thread(target=_work, args=(self._jobs,), name=f"expertcache-reader-{i}",
                                          daemon=True) for i in range(readers)]
        for t in self._threads:
            t.start()

    def submit(self, job: Callable[[], int], tag=None, done: "queue.SimpleQueue | None" = None) -> Ticket:
        """Queue ``job``; returns its ticket (already complete when ``readers == 0``)."""
        ticket = Ticket(tag, done)
        if not self._threads:
            ticket._run(job)
        else:
            self._jobs.put((ticket, job))
        return ticket

    def close(self) -> None:
        """Stop the threads after the queued jobs (idempotent)."""
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            for _ in self._threads:
                self._jobs.put(None)
        except Exception:
            pass


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        ticket, job = item
        ticket._run(job)
