"""Counters and queues of the serving engine (serve/engine.py), driven with sequences long enough to tell a counter
that resets from one that does not, and a bound from its neighbours:

- the failed-forward counter: ``MAX_FAILED_FORWARDS`` failures *in a row* stop the engine; a success in between
  resets the count (fail, fail, succeed, repeated, never stops it), and the next run of that many does;
- the waiting queue: ``max_queue`` requests beyond the free batch rows are taken, one more is refused
  (:class:`QueueFull`); the bound moves with the free rows; requests cancelled at shutdown leave the count.

Surviving mutants of this file's own set: none.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.serve import Engine, QueueFull, Request, SamplingParams
from expertcache.serve.engine import MAX_FAILED_FORWARDS


@pytest.fixture(scope="module")
def runtime():
    torch.set_num_threads(1)
    rt = OffloadedModel.from_pretrained("granular", OffloadConfig(io="cached", capacity=8))
    yield rt
    rt.close()


class Flaky:
    """The model, failing the forwards whose turn in ``plan`` is True (then succeeding once the plan runs out)."""

    def __init__(self, model, plan: list[bool]) -> None:
        self.model, self.plan, self.calls = model, list(plan), 0

    def __call__(self, *a, **kw):
        self.calls += 1
        if self.plan and self.plan.pop(0):
            raise RuntimeError("flaky device")
        return self.model(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _run_one(engine: Engine, prompt=(5, 6, 7), timeout: float = 120.0) -> tuple[str, object]:
    """Submit one request (one token: its prefill forward only) and wait for its final event."""
    done = threading.Event()
    got = []

    def on_event(kind, payload):
        if kind in ("done", "error"):
            got.append((kind, payload))
            done.set()

    engine.submit(Request(list(prompt), SamplingParams(max_tokens=1, temperature=0.0), on_event))
    assert done.wait(timeout), "no final event (a hang)"
    return got[0]


def test_a_success_resets_the_failed_forward_count(runtime):
    engine = Engine(runtime, None, max_batch=1)
    real = runtime.model
    n = MAX_FAILED_FORWARDS
    # (n - 1) failures, a success, three times over: never n in a row
    plan = ([True] * (n - 1) + [False]) * 3
    flaky = runtime.model = Flaky(real, plan)
    engine.start()
    try:
        outcomes = [_run_one(engine)[0] for _ in plan]
        assert outcomes == ["error" if f else "done" for f in plan]
        assert engine.error is None and engine.accepting
        assert engine.totals["failed"] == plan.count(True)
        # now n in a row: the engine stops on the last of them, and every later submit is refused
        flaky.plan = [True] * n
        for i in range(n):
            kind, (status, msg) = _run_one(engine)
            assert kind == "error" and status == 500 and "flaky device" in msg
        t0 = time.monotonic()
        while engine.error is None and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        assert engine.error is not None and not engine.accepting
    finally:
        runtime.model = real
        engine.shutdown(0)


def test_failures_below_the_limit_leave_the_engine_running(runtime):
    engine = Engine(runtime, None, max_batch=1)
    real = runtime.model
    runtime.model = Flaky(real, [True] * (MAX_FAILED_FORWARDS - 1))
    engine.start()
    try:
        for _ in range(MAX_FAILED_FORWARDS - 1):
            assert _run_one(engine)[0] == "error"
        assert _run_one(engine)[0] == "done"  # the next forward succeeds: the engine went on
        assert engine.error is None
    finally:
        runtime.model = real
        engine.shutdown(0)


@pytest.mark.parametrize("max_batch,max_queue", [(1, 0), (2, 3), (4, 1)])
def test_the_waiting_queue_takes_max_queue_beyond_the_free_rows(runtime, max_batch, max_queue):
    """Not started: nothing is admitted, every submit waits. Free rows = max_batch (no row runs)."""
    engine = Engine(runtime, None, max_batch=max_batch, max_queue=max_queue, rowwise_attention=False)
    bound = max_queue + max_batch
    events = []

    def record(kind, payload):
        events.append((kind, payload[0]))

    for i in range(bound):
        engine.submit(Request([5, 6], SamplingParams(max_tokens=1), record))
        assert engine.queue_length() == i + 1
    with pytest.raises(QueueFull):
        engine.submit(Request([5, 6], SamplingParams(max_tokens=1), record))
    assert engine.queue_length() == bound
    # shutdown cancels every waiting request: the count falls to 0 and each got a 503
    assert engine.begin_shutdown(0) == bound
    assert engine.queue_length() == 0 and events == [("error", 503)] * bound
