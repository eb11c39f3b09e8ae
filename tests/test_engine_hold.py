"""The serving engine's prefill hold (serve/engine.py, ``prefill_delay``, as vLLM's ``scheduler_delay_factor``):
while rows decode, a new prompt waits until it is older than ``prefill_delay`` × the last *prefill's* seconds,
unless the batch would be full with it or the waiting prompts fill a chunk.

Measured here from outside: the time a prompt is held (its submission to the start of its prefill forward, seen
by a forward pre-hook on the model), against the last prefill's seconds as the engine's forward observers report
them; and which batch sizes release a prompt at once. Issue 36's survivors: the hold also scaled by decode steps,
and a prompt held when it would exactly fill the batch.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.serve.engine import Engine, Request, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

PROMPTS = ([5, 17, 301, 44, 9], [12, 800, 7, 66], [91, 3000, 45], [250, 11, 18, 600])


def _runtime():
    return OffloadedModel.from_pretrained("granular", OffloadConfig(io="cached", capacity=8))


class _Client:
    """Submits greedy requests and records when each finished."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.done, self.events = engine, {}, {}

    def submit(self, key, ids, max_tokens: int) -> float:
        self.events[key] = threading.Event()

        def cb(kind, payload):
            if kind in ("done", "error"):
                self.done[key] = (payload, time.perf_counter())
                self.events[key].set()
        t = time.perf_counter()
        self.engine.submit(Request(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), cb))
        return t


def _wait(cond, timeout=60.0, what="condition"):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_prompt_that_would_fill_the_batch_is_not_held():
    """max_batch 2, one row decoding, a huge delay: the prompt that makes the batch full is prefilled at once and
    finishes beside the running row. With max_batch 3 the same prompt is held (the batch would not be full) until a
    second one arrives; both then share one packed prefill. Fails on engine.py's ``len(rows) + len(prefilling) <
    max_batch`` → ``<=`` (the prompt waited for the running row to finish)."""
    for max_batch in (2, 3):
        engine = Engine(_runtime(), None, max_batch=max_batch, prefill_delay=1e6).start()
        c = _Client(engine)
        try:
            c.submit("long", PROMPTS[0], 400)
            _wait(lambda: engine.batch_size() == 1, what="the first row decoding")
            p0, n0 = engine.totals["packed_prefills"], engine.totals["packed_prompts"]
            c.submit("b", PROMPTS[1], 3)
            if max_batch == 2:  # 1 row + 1 prompt = the batch: no reason to wait
                assert c.events["b"].wait(120)
                assert not c.events["long"].is_set(), "the prompt was held until the running row finished"
            else:  # 1 + 1 < 3: held while the row decodes (a decode step or more), released by a second prompt
                time.sleep(0.5)
                assert engine.batch_size() == 1 and not c.events["b"].is_set()
                c.submit("c", PROMPTS[2], 3)
                assert c.events["b"].wait(120) and c.events["c"].wait(120)
                assert not c.events["long"].is_set()
                assert (engine.totals["packed_prefills"] - p0, engine.totals["packed_prompts"] - n0) == (1, 2)
        finally:
            engine.shutdown(0)


def test_a_prompt_is_held_the_delay_times_the_last_prefills_seconds():
    """Prefills are made slow (a pre-hook sleeps 0.6 s before every multi-token forward), decode steps stay fast
    (20 ms, so that the long row still decodes when b's prefill starts, however fast the machine):
    the prompt submitted while a row decodes is held at least ``prefill_delay`` × the last prefill's seconds (as the
    forward observers saw them), and not much longer. Fails on engine.py's ``_after_forward`` recording every
    forward's seconds (decode steps too) as the last prefill's: the prompt was then held a few decode steps only."""
    rt = _runtime()
    delay, sleep_s, step_s = 2.0, 0.6, 0.02
    starts = []

    def slow_prefill(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[-1] > 1:
            starts.append(time.perf_counter())
            time.sleep(sleep_s)
        elif ids is not None:  # a decode step: 400 of them outlast the hold and b's prefill on any machine
            time.sleep(step_s)

    rt.model.register_forward_pre_hook(slow_prefill, with_kwargs=True)
    engine = Engine(rt, None, max_batch=8, prefill_delay=delay)
    forwards = []  # (rows, seconds) of every forward, from the engine's observer
    engine.add_forward_observer(lambda rows, tokens, seconds, delta: forwards.append((rows, seconds)))
    engine.start()
    c = _Client(engine)
    try:
        c.submit("long", PROMPTS[0], 400)
        _wait(lambda: engine.batch_size() == 1 and sum(r > 0 for r, _ in forwards) >= 3, what="rows decoding")
        prefill_s = [s for r, s in forwards if r == 0][-1]
        decode_s = max(s for r, s in forwards if r > 0)
        assert prefill_s >= sleep_s  # the sleep is inside the timed forward
        if decode_s * 3 > sleep_s:  # a machine this loaded cannot tell a decode step's seconds from a prefill's
            pytest.skip(f"decode steps take {decode_s:.2f} s, too close to the {sleep_s} s prefill to tell apart")
        t_sub = c.submit("b", PROMPTS[1], 2)
        assert c.events["b"].wait(120)
        assert not c.events["long"].is_set()
    finally:
        engine.shutdown(0)
    held = starts[-1] - t_sub
    assert held >= delay * prefill_s - 0.01, (held, delay * prefill_s)
    assert held < delay * prefill_s + 30 * decode_s + 1.0, (held, delay * prefill_s)


@pytest.mark.parametrize("max_batch", [1, 2, 3])
def test_the_batch_fills_to_max_batch_and_never_past_it(max_batch):
    """Five requests queued at once: the decode steps run exactly ``max_batch`` rows at the most (reached, never
    exceeded), and every request finishes. Fails on engine.py's admission ``len(rows) + len(prefilling) <
    max_batch`` → ``<=`` (one row too many; found beside issue 36's list)."""
    engine = Engine(_runtime(), None, max_batch=max_batch)
    rows_seen = []
    engine.add_forward_observer(lambda rows, tokens, seconds, delta: rows_seen.append(rows))
    c = _Client(engine)
    for i in range(5):
        c.submit(i, PROMPTS[i % len(PROMPTS)], 4)
    engine.start()
    try:
        for e in c.events.values():
            assert e.wait(120)
    finally:
        engine.shutdown(0)
    assert max(rows_seen) == max_batch, rows_seen
    assert all(c.done[i][0]["completion_tokens"] == 4 for i in range(5))
