"""The live view's event-stream response (:class:`TimedStream`): every write bounded in time."""

import asyncio

from starlette.responses import Response

from expertcache.serve.broker import STALL_S, Subscriber

__all__ = ["TimedStream"]


class TimedStream(Response):
    """A server-sent-event response for the live view: each write waits ``send_timeout`` seconds at most (a
    client that stopped reading fills the socket, then is cut off: uvicorn closes the connection), and the
    subscriber ``sub`` is marked stalled then."""

    def __init__(self, chunks, sub: Subscriber, send_timeout: float = STALL_S) -> None:
        super().__init__(media_type="text/event-stream")
        self.chunks, self.sub, self.send_timeout = chunks, sub, send_timeout

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        try:
            async for chunk in self.chunks:
                try:
                    await asyncio.wait_for(send({"type": "http.response.body", "body": chunk.encode(),
                                                 "more_body": True}), self.send_timeout)
                except asyncio.TimeoutError:
                    self.sub.stalled = True
                    return  # incomplete: the server drops the connection
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.chunks.aclose()
