"""The live view's bounded fan-out: a :class:`Broker` hands every frame to each :class:`Subscriber` (one per open
event stream), each with its own bounded queue, so the engine thread that publishes never waits on a page."""

import asyncio
import collections
import threading
import time

__all__ = ["Broker", "Subscriber", "MAX_SUBSCRIBERS", "STALL_S", "sorted_ids"]

#: event-stream subscribers at once (more get 429): each costs the engine thread a put per forward
MAX_SUBSCRIBERS = 16
#: a subscriber whose queue is full and that has not taken a frame for this long is dropped (its stream ends)
STALL_S = 10.0


def sorted_ids(x) -> list[int]:
    """Expert ids as sorted plain ints (a frame's lists)."""
    return sorted(int(e) for e in x)


class Subscriber:
    """One event-stream client: a bounded deque filled by the engine thread, drained by the event loop.
    Full → the oldest frame is dropped (``dropped`` counts them); still dropping ``stall_s`` seconds after the
    first drop with no read between → the subscriber is ``stalled`` (the broker stops feeding it, its stream
    ends)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, maxlen: int, stall_s: float = STALL_S) -> None:
        self.loop = loop
        self.frames: collections.deque = collections.deque(maxlen=maxlen)
        self.lock = threading.Lock()
        self.dropped = 0
        self.delivered = 0
        self.ready = asyncio.Event()
        self._wake_pending = False
        self.stall_s = stall_s
        self.full_since: float | None = None  # when the queue first overflowed since the last take
        self.stalled = False
        self.closed = False  # its client's socket closed (set by the stream): no more frames

    def put(self, frame: dict) -> None:
        """Engine thread: never blocks (beyond a short lock), never grows past ``maxlen``."""
        with self.lock:
            if len(self.frames) == self.frames.maxlen:
                self.dropped += 1
                now = time.monotonic()
                if self.full_since is None:
                    self.full_since = now
                elif now - self.full_since > self.stall_s:
                    self.stalled = True
            self.frames.append(frame)
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self.ready.set)
        except RuntimeError:  # the loop is closed: nobody reads any more
            pass

    def take(self) -> list[dict]:
        with self.lock:
            out = list(self.frames)
            self.frames.clear()
            self._wake_pending = False
            self.ready.clear()
            self.delivered += len(out)
            self.full_since = None
        return out


class Broker:
    """Fan-out of frames to subscribers, each with its own bounded queue (``maxlen`` frames)."""

    def __init__(self, maxlen: int = 64, max_subscribers: int = MAX_SUBSCRIBERS, stall_s: float = STALL_S) -> None:
        self.maxlen, self.max_subscribers, self.stall_s = maxlen, max_subscribers, stall_s
        self._subs: list[Subscriber] = []
        self._lock = threading.Lock()
        self.published = 0
        self.stalled = 0  # subscribers dropped for not reading

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> Subscriber | None:
        """A new subscriber, or None when ``max_subscribers`` already are."""
        s = Subscriber(loop, self.maxlen, self.stall_s)
        with self._lock:
            if len(self._subs) >= self.max_subscribers:
                return None
            self._subs = self._subs + [s]
        return s

    def unsubscribe(self, s: Subscriber) -> None:
        with self._lock:
            self._subs = [x for x in self._subs if x is not s]

    @property
    def subscribers(self) -> list[Subscriber]:
        return self._subs

    def publish(self, frame: dict) -> None:
        self.published += 1
        stalled = []
        for s in self._subs:  # a copy-on-write list: no lock needed to iterate
            s.put(frame)
            if s.stalled:
                stalled.append(s)
            elif s.closed:
                self.unsubscribe(s)
        for s in stalled:  # fell behind a full queue for stall_s: no more frames; its stream ends
            self.unsubscribe(s)
            self.stalled += 1
            try:
                s.loop.call_soon_threadsafe(s.ready.set)
            except RuntimeError:
                pass
