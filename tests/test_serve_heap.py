"""The server process's heap and the garbage collector (serve/server.py's ``freeze_heap``, issue 43): a full
collection holds the GIL while it walks every tracked object, so with the loaded model's objects in it each one
stopped the event loop and the engine thread for 0.25-0.7 s under a connection flood (the running stream's
largest gaps). ``serve_forever`` must take the startup heap out of the collector's reach before it serves.

Observed through the interpreter, not the server: ``gc.get_objects()`` lists what a collection walks; an object
alive before ``serve_forever`` must not be in it while the server runs, an object made while it runs must be."""

from __future__ import annotations

import gc
import sys

import pytest

pytest.importorskip("uvicorn")

from expertcache.serve import server as server_mod  # noqa: E402


def test_serve_forever_takes_the_startup_heap_out_of_collections(monkeypatch):
    startup = [object() for _ in range(3)]  # containers are tracked: the list is in gc.get_objects() until frozen
    assert any(o is startup for o in gc.get_objects())
    seen = {}

    class Stub:
        def run(self, sockets=None):
            later = [object()]
            walked = gc.get_objects()
            seen["startup_walked"] = any(o is startup for o in walked)
            seen["later_walked"] = any(o is later for o in walked)

    monkeypatch.setattr(server_mod, "_server", lambda app, **kw: Stub())
    switch = sys.getswitchinterval()
    try:
        server_mod.serve_forever(object(), None)
    finally:
        gc.unfreeze()  # this test process's heap and thread switching back to normal
        sys.setswitchinterval(switch)
    assert seen == {"startup_walked": False, "later_walked": True}
