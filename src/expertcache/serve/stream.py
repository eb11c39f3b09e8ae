"""The live view's event-stream response (:class:`TimedStream`): every write bounded in time."""

import asyncio

from starlette.responses import Response

from expertcache.serve.broker import STALL_S, Subscriber

__all__ = ["TimedStream"]


class TimedStream(Response):
    """A server-sent-event response for the live view: each write waits ``send_timeout`` seconds at most (a
    client that stopped reading fills the socket, then is cut off: uvicorn closes the connection), and the
    subscriber ``sub`` is marked stalled then. The stream ends as soon as the client's socket closes (a watcher
    waits for the disconnect): the subscriber's slot is free at once, frames flowing or not."""

    def __init__(self, chunks, sub: Subscriber, send_timeout: float = STALL_S) -> None:
        super().__init__(media_type="text/event-stream")
        self.chunks, self.sub, self.send_timeout = chunks, sub, send_timeout

    async def _pump(self, send) -> None:
        async for chunk in self.chunks:
            try:
                await asyncio.wait_for(send({"type": "http.response.body", "body": chunk.encode(),
                                             "more_body": True}), self.send_timeout)
            except asyncio.TimeoutError:
                self.sub.stalled = True
                return  # incomplete: the server drops the connection
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _until_disconnect(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(self._until_disconnect(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if gone.done():
                self.sub.closed = True  # the broker drops it at its next frame; the stream's loop ends
            gone.cancel()
            while not pump.done():  # (a cancellation can be lost inside wait_for before Python 3.12: again)
                pump.cancel()
                await asyncio.wait({pump}, timeout=0.5)
            await asyncio.gather(pump, gone, return_exceptions=True)  # the generator's finally has run
            await self.chunks.aclose()
