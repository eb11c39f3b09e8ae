"""Continuous batching over one :class:`~expertcache.offload.OffloadedModel`, in one engine thread.

Letter legend: B rows of the running batch, L cached columns (left-padded), P prompt tokens, V vocabulary.

The model is not thread-safe, so exactly one thread (:meth:`Engine.run`) touches it. Other threads (the HTTP
server's event loop) only call :meth:`Engine.submit` / :meth:`Request.cancel` and read events.

One engine iteration:

1. **admit**: move waiting requests into prefill while ``running + prefilling < max_batch``;
2. **prefill** (at most ``prefill_chunk`` prompt tokens per iteration, the stall bound): the oldest
   admitted requests run their next chunk alone (batch 1, each its own ``DynamicCache``), as many as fit the
   token budget; after its last chunk a request's first token is sampled and its row is merged into the
   running batch (:func:`~expertcache.serve.kv.merge_row`);
3. **decode**: one forward over all B running rows ([B, 1] tokens, the left-padded [B, L + 1] mask and
   per-row position ids), one token sampled per row;
4. **retire**: rows that finished (stop, length, cancelled: a client that went away) leave the batch
   (:func:`~expertcache.serve.kv.drop_rows` frees their KV).

So a running row waits for at most ``prefill_chunk`` prompt tokens of prefill between two of its tokens.
Every MoE layer of the decode forward is one step of the runtime's **shared** expert cache: the union of the B rows' experts, ordered by
total router weight (see ``docs/SERVE.md``).

**Per-row routing.** A request with ``SamplingParams.routing = "original"`` has its tokens routed with
original top-K inside the shared forward while the other rows follow the server's policy: the engine is the
runtime's row router (:meth:`OffloadedModel.set_row_router`) and, for each forward, picks per token between the
policy's selection and the original one (:meth:`Engine._route_rows`). Such a row's tokens depend on its own prompt and
seed only (not on the cache other requests fill), so they are reproducible; the cache it hits is still shared.

Statistics per request: each forward's hits, misses and bytes read (deltas of ``OffloadedModel.stats()``)
are charged to the rows of that forward in equal shares (a prefill chunk: all to its request), so the sums
over requests equal the runtime's totals.
"""

from __future__ import annotations

import collections
import contextlib
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from expertcache.device import to_device
from expertcache.models.cachearg import cache_kw, out_cache
from expertcache.serve.kv import BatchKV

__all__ = ["Engine", "Request", "SamplingParams", "QueueFull", "ShuttingDown", "sample_next"]


#: forwards that may fail in a row before the engine stops (a failure that one request causes fails that request
#: alone; a model that fails every forward is broken)
MAX_FAILED_FORWARDS = 3


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429)."""


class ShuttingDown(Exception):
    """The engine no longer accepts requests (HTTP 503)."""


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep going after the end-of-text token (benchmarks: fixed lengths)
    routing: str | None = None  # "original": this request's rows use original top-K whatever the server's policy


def sample_next(logits_V: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """Greedy for temperature 0; else softmax(logits / T) with nucleus ``top_p`` and the request's generator.
    With top_p = 1 this is exactly :meth:`OffloadedModel.generate`'s draw (same seed → same tokens).
    Numerically safe for every value the server admits (T in (0, 2], top_p in (0, 1]): a T so small that
    logits / T overflows samples from the T -> 0 limit (the largest logits), the nucleus keeps at least the
    most likely token however small top_p is."""
    z_1V = logits_V.float().cpu()[None]
    if p.temperature <= 0:
        return int(z_1V.argmax(dim=-1))
    probs_1V = torch.softmax(z_1V / p.temperature, dim=-1)
    if not bool(torch.isfinite(probs_1V).all()):  # z / T overflowed (T below ~1e-37 in float32): the T -> 0
        # limit, computed where it cannot overflow: 0 at the largest logits, -inf (or very negative) elsewhere
        shifted_1V = (z_1V.double() - z_1V.max()) / p.temperature
        probs_1V = torch.softmax(shifted_1V, dim=-1).float()
    if p.top_p < 1.0:
        sp, si = probs_1V.sort(dim=-1, descending=True)
        keep = (sp.cumsum(dim=-1) - sp) < p.top_p  # smallest prefix whose mass reaches top_p
        keep[:, 0] = True  # >= 1 token even where top_p rounds to 0 in float32 (top_p = 1e-300)
        sp = sp * keep
        choice = torch.multinomial(sp / sp.sum(), 1, generator=gen)
        return int(si[0, int(choice)])
    return int(torch.multinomial(probs_1V, 1, generator=gen))


class Request:
    """One generation request. ``on_event(kind, payload)`` is called from the engine thread with
    ``('text', str)`` pieces, then exactly one ``('done', info)`` or ``('error', (status, message))``."""

    _ids = 0

    def __init__(self, prompt_ids: list[int], params: SamplingParams, on_event: Callable[[str, object], None]) -> None:
        Request._ids += 1
        self.id = Request._ids
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.on_event = on_event
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.gen = torch.Generator().manual_seed(seed)
        self.tokens: list[int] = []
        self.text = ""        # decoded text of ``tokens`` (cut at a stop string)
        self.sent = 0         # characters of ``text`` already sent
        self.finish_reason: str | None = None
        self.cancelled = threading.Event()
        self.stats = dict(hits=0.0, misses=0.0, low_computes=0.0, bytes_read=0.0, forwards=0, shared_steps=0,
                          batch_rows=0)
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        # prefill state
        self.past = None
        self.prefilled = 0
        self.next_token: int | None = None

    def cancel(self) -> None:
        """Thread-safe: the row leaves the batch at the engine's next iteration."""
        self.cancelled.set()

    def info(self) -> dict:
        s = self.stats
        return dict(prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.tokens),
                    finish_reason=self.finish_reason, text=self.text, token_ids=list(self.tokens),
                    hits=s["hits"], misses=s["misses"], low_computes=s["low_computes"], bytes_read=s["bytes_read"],
                    forwards=s["forwards"],
                    mean_batch=(s["batch_rows"] / s["shared_steps"]) if s["shared_steps"] else 1.0,
                    ttft_s=None if self.t_first is None else self.t_first - self.t_submit)


class Engine:
    """Owns the model. A request that fails (its prefill forward, its sampling, its text) fails alone: it gets
    ``('error', (500, message))`` and the engine goes on; a decode forward that raises fails the rows of that
    forward (their KV is dropped). Only :data:`MAX_FAILED_FORWARDS` failed forwards in a row (a broken model or
    device, not a request) stop the engine: then every request in flight gets a 500 and :attr:`error` is set. ``max_batch`` running rows, ``max_queue`` waiting requests (beyond: :class:`QueueFull`),
    ``prefill_chunk`` prompt tokens per iteration at most. ``rowwise_attention`` installs
    :mod:`expertcache.serve.attention` on the runtime's model (batched decode attention per row);
    ``pack_prefill`` prefills several short prompts in one packed forward. ``prefill_delay`` (a factor, as
    vLLM's ``scheduler_delay_factor``): while rows are decoding, a new prompt waits until it is older than
    ``prefill_delay`` × the last prefill's seconds (or the batch is full, or the waiting prompts fill a
    chunk), so that prompts arriving one by one share one packed prefill -- one set of expert loads and one
    forward -- instead of a forward each between decode steps; 0 prefills at once. ``tokenizer`` decodes text (None:
    token ids as text, space separated). ``metrics`` (optional) gets ``on_step(rows, tokens, seconds, delta_stats)`` and
    ``on_queue(n)``."""

    def __init__(self, runtime, tokenizer=None, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 128,
                 metrics=None, rowwise_attention: bool = True, pack_prefill: bool = True,
                 prefill_delay: float = 0.0) -> None:
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1 or not prefill_delay >= 0:
            raise ValueError("max_batch and prefill_chunk must be >= 1, max_queue and prefill_delay >= 0")
        self.rt = runtime
        if rowwise_attention:  # a row decodes bit-identically alone and inside a padded batch (attention.py)
            from expertcache.serve.attention import install_rowwise_attention

            install_rowwise_attention(runtime.model)
        self.tok = tokenizer
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.pack_prefill = pack_prefill and rowwise_attention
        self.prefill_delay = float(prefill_delay)
        self._last_prefill_s = 0.0
        self.metrics = metrics
        self.context = int(getattr(runtime.config, "max_position_embeddings", 0) or 0) or None
        eos = getattr(runtime.config, "eos_token_id", None)
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        self._lock = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._prefilling: list[Request] = []
        self._rows: list[Request] = []
        self._kv = BatchKV()
        self._accepting = True
        self._drain_deadline: float | None = None
        self._thread: threading.Thread | None = None
        self.totals = dict(finished=0, cancelled=0, failed=0, packed_prefills=0, packed_prompts=0)
        self._failed_forwards = 0  # forwards failed in a row (MAX_FAILED_FORWARDS: the model is broken)
        self.error: BaseException | None = None
        self._original_T: torch.Tensor | None = None  # per token of the running forward: route it original
        self._forward_observers: tuple = ()
        runtime.set_row_router(self._route_rows)

    # -- called from other threads -------------------------------------------------------------------

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self.run, name="expertcache-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, req: Request) -> None:
        with self._lock:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - len(self._rows) - len(self._prefilling)):
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
            self._waiting.append(req)
            self._lock.notify()
        self._queue_metric()

    def queue_length(self) -> int:
        return len(self._waiting)

    def batch_size(self) -> int:
        return len(self._rows)

    def run_if_idle(self, fn) -> bool:
        """Call ``fn()`` holding the engine's lock if no request is waiting, prefilling or decoding (so no forward
        starts while it runs); returns whether it ran. The live view applies a control change this way."""
        with self._lock:
            if self._waiting or self._prefilling or self._rows:
                return False
            fn()
            return True

    def in_flight(self) -> int:
        """Requests admitted and not finished (prefilling or decoding)."""
        return len(self._rows) + len(self._prefilling)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def begin_shutdown(self, grace_s: float = 30.0) -> int:
        """Stop accepting (new submits raise :class:`ShuttingDown`); waiting requests are cancelled now (503);
        requests already prefilling or decoding may finish within ``grace_s`` seconds, then are cancelled.
        Non-blocking; returns the number of waiting requests cancelled."""
        with self._lock:
            if not self._accepting and self._drain_deadline is not None:  # already draining: maybe sooner
                self._drain_deadline = min(self._drain_deadline, time.monotonic() + grace_s)
                self._lock.notify()
                return 0
            self._accepting = False
            self._drain_deadline = time.monotonic() + grace_s
            waiting = list(self._waiting)
            self._waiting.clear()
            self._lock.notify()
        for r in waiting:
            r.finish_reason = "cancelled"
            self.totals["cancelled"] += 1
            r.on_event("error", (503, "the server is shutting down; the request was not started"))
        return len(waiting)

    def shutdown(self, grace_s: float = 30.0) -> dict:
        """:meth:`begin_shutdown`, then wait for the engine thread. Returns what happened to the requests."""
        self.begin_shutdown(grace_s)
        if self._thread is not None:
            self._thread.join()
        return dict(finished=self.totals["finished"], cancelled=self.totals["cancelled"])

    # -- the engine thread ----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._waiting or self._prefilling or self._rows or not self._accepting):
                        self._lock.wait()
                    if not self._accepting and not (self._prefilling or self._rows):
                        return
                    while self._waiting and len(self._rows) + len(self._prefilling) < self.max_batch:
                        self._prefilling.append(self._waiting.popleft())
                self._queue_metric()
                if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                    for r in self._prefilling + self._rows:
                        r.cancel()
                self._prefill_some()
                self._decode_step()
                self._retire()
        except BaseException as exc:  # the model failed: every request in flight gets a 500, nothing hangs
            self.error = exc
            with self._lock:
                self._accepting = False
                reqs = list(self._waiting) + self._prefilling + self._rows
                self._waiting.clear()
                self._prefilling, self._rows = [], []
            self._kv = BatchKV()
            for r in reqs:
                r.on_event("error", (500, f"the model failed: {type(exc).__name__}: {exc}"))
            import traceback

            print("expertcache serve: the engine stopped on an error (every request in flight got a 500):",
                  file=sys.stderr)
            traceback.print_exc()

    def _queue_metric(self) -> None:
        if self.metrics is not None:
            self.metrics.on_queue(len(self._waiting), len(self._rows))

    def _route_rows(self, m, z_TE, w0_TK, ids0_TK, *, commit: bool = True):
        """The runtime's row router (:meth:`OffloadedModel.set_row_router`), per token: original top-K for the
        tokens of rows that asked for it (``_original_T``), the server's policy for the others (ranked against
        the same shared residency)."""
        mask_T = self._original_T
        policy = self.rt.route_policy
        if mask_T is None or self.rt.routing.policy == "original" or mask_T.shape[0] != ids0_TK.shape[0]:
            return policy(m, z_TE, w0_TK, ids0_TK, commit=commit)
        if bool(mask_T.all()):
            return w0_TK, ids0_TK
        w_TK, ids_TK = policy(m, z_TE, w0_TK, ids0_TK, commit=commit)
        keep_T1 = mask_T.to(ids_TK.device)[:, None]
        return torch.where(keep_T1, w0_TK, w_TK), torch.where(keep_T1, ids0_TK, ids_TK)

    def add_forward_observer(self, fn) -> None:
        """Call ``fn(rows, tokens, seconds, delta_stats)`` on the engine thread after every forward (after
        ``metrics.on_step``, same arguments: decode rows (0 for a prefill), tokens generated, seconds, the
        runtime's hits/misses/bytes_read delta). Between two forwards: the place to apply a pending change
        (the live view's controls). It must not start a forward; an exception stops the engine."""
        if not callable(fn):
            raise TypeError(f"a forward observer must be callable, got {fn!r}")
        self._forward_observers = self._forward_observers + (fn,)

    def _after_forward(self, rows: int, tokens: int, seconds: float, delta: dict) -> None:
        if rows == 0:  # a prefill: what prefill_delay scales
            self._last_prefill_s = seconds
        if self.metrics is not None:
            self.metrics.on_step(rows, tokens, seconds, delta)
        for fn in self._forward_observers:
            fn(rows, tokens, seconds, delta)

    def _forward(self, ids_BS, past, mask_BL=None, pos_BS=None, original_BS=None):
        """One model forward: (logits [B, S, V], the KV cache, seconds, the runtime's stats delta).
        ``original_BS`` (bool, optional): tokens to route with original top-K (per-request override)."""
        self._original_T = None if original_BS is None or not bool(original_BS.any()) else original_BS.reshape(-1)
        s0 = self.rt.stats()
        t0 = time.perf_counter()
        dev = self.rt.device
        try:
            with torch.inference_mode():
                out = self.rt.model(input_ids=to_device(ids_BS, dev), **cache_kw(past), use_cache=True,
                                    attention_mask=None if mask_BL is None else to_device(mask_BL, dev),
                                    position_ids=None if pos_BS is None else to_device(pos_BS, dev))
            if dev.type == "cuda":  # pragma: no cover - GPU only: the forward's kernels, not their queueing
                torch.cuda.synchronize(dev)
        finally:
            self._original_T = None
        dt = time.perf_counter() - t0
        s1 = self.rt.stats()
        delta = {k: s1[k] - s0[k] for k in ("hits", "misses", "low_computes", "bytes_read")}
        return out.logits, out_cache(out), dt, delta

    def _prefill_some(self) -> None:
        """Prefill at most ``prefill_chunk`` prompt tokens in this iteration. A long prompt (more than the
        budget, or already started) runs its next chunk alone. Otherwise the oldest admitted requests whose
        whole prompts fit the budget are prefilled together in **one packed forward** (one row, prompts end
        to end, positions restarting per prompt, attention per prompt: :func:`packed_segments`), so their
        expert loads are shared by one MoE step per layer; a prompt of ``<= prefill_chunk`` tokens is never
        split, and each computes what its lone prefill (:meth:`OffloadedModel.generate`) computes."""
        budget = self.prefill_chunk
        while self._prefilling and self._prefilling[0].cancelled.is_set():
            r = self._prefilling.pop(0)
            r.past = None
            self._finish(r, "cancelled")
        if not self._prefilling:
            return
        head = self._prefilling[0]
        if self.prefill_delay and self._rows and head.prefilled == 0 and self.pack_prefill \
                and len(self._rows) + len(self._prefilling) < self.max_batch \
                and sum(len(r.prompt_ids) for r in self._prefilling) < budget \
                and time.perf_counter() - head.t_submit < self.prefill_delay * self._last_prefill_s:
            return  # held: prompts arriving meanwhile join its packed prefill; the rows decode on
        if head.prefilled > 0 or len(head.prompt_ids) > budget:
            with self._failing([head]):
                self._prefill_chunk(head, min(len(head.prompt_ids) - head.prefilled, budget))
            return
        group = []
        for r in self._prefilling:
            if r.prefilled > 0 or len(r.prompt_ids) > budget or not self.pack_prefill and group:
                break
            if r.cancelled.is_set():
                continue
            group.append(r)
            budget -= len(r.prompt_ids)
        with self._failing(group):
            if len(group) == 1:
                self._prefill_chunk(group[0], len(group[0].prompt_ids))
            else:
                self._prefill_packed(group)

    def _prefill_packed(self, group: list[Request]) -> None:
        from transformers import DynamicCache

        from expertcache.serve.attention import packed_segments

        lens = [len(r.prompt_ids) for r in group]
        ids_1T = torch.tensor([[t for r in group for t in r.prompt_ids]])
        pos_1T = torch.cat([torch.arange(n) for n in lens])[None]
        orig_1T = torch.tensor([[r.params.routing == "original" for r in group for _ in r.prompt_ids]])
        with packed_segments(lens):
            logits_1TV, kv, dt, delta = self._forward(ids_1T, DynamicCache(config=self.rt.config), pos_BS=pos_1T,
                                                      original_BS=orig_1T)
        self._charge(group, delta, shared=False, weights=lens)
        self.totals["packed_prefills"] += 1
        self.totals["packed_prompts"] += len(group)
        self._after_forward(0, len(group), dt, delta)
        a = 0
        for r, n in zip(group, lens):
            past = DynamicCache(config=self.rt.config)
            for li, layer in enumerate(kv.layers):
                past.update(layer.keys[:, :, a:a + n].contiguous(), layer.values[:, :, a:a + n].contiguous(), li)
            r.prefilled = n
            self._join(r, logits_1TV[0, a + n - 1], past)
            a += n
        for r in group:  # after joining the rows: in_flight() never misses them
            self._prefilling.remove(r)

    def _prefill_chunk(self, r: Request, n: int) -> None:
        from transformers import DynamicCache

        if r.past is None:
            r.past = DynamicCache(config=self.rt.config)
        chunk = r.prompt_ids[r.prefilled:r.prefilled + n]
        orig = torch.full((1, len(chunk)), r.params.routing == "original")
        logits_1SV, r.past, dt, delta = self._forward(torch.tensor([chunk]), r.past, original_BS=orig)
        r.prefilled += len(chunk)
        self._charge([r], delta, shared=False)
        self._after_forward(0, int(r.prefilled >= len(r.prompt_ids)), dt, delta)  # the last chunk: the first token
        if r.prefilled < len(r.prompt_ids):
            return
        self._join(r, logits_1SV[0, -1], r.past)
        r.past = None
        self._prefilling.pop(0)  # after joining the rows: in_flight() never misses it

    def _join(self, r: Request, logits_V: torch.Tensor, past) -> None:
        """A prefilled request: sample its first token; unless that finishes it, its row joins the batch."""
        try:
            tok = sample_next(logits_V, r.params, r.gen)
            if self._accept_token(r, tok):
                return
        except Exception as exc:  # this request's sampling or text failed: it alone
            self._fail(r, exc)
            return
        self._kv.add(past)
        r.next_token = tok
        self._rows.append(r)

    def _decode_step(self) -> None:
        if any(r.cancelled.is_set() or r.finish_reason is not None for r in self._rows):
            self._retire()
        rows = self._rows
        if not rows:
            return
        ids_B1 = torch.tensor([[r.next_token] for r in rows])
        padded = self._kv.padded
        pos_B1 = self._kv.positions_B1() if padded else None
        mask = self._kv.step_mask()  # grows the mask every step; only a padded batch passes it to the model
        # no padding: exactly OffloadedModel.generate's call (positions from the cache length)
        orig_B1 = torch.tensor([[r.params.routing == "original"] for r in rows])
        with self._failing(rows, decode=True):
            logits_B1V, self._kv.cache, dt, delta = self._forward(ids_B1, self._kv.cache, mask if padded else None,
                                                                  pos_B1, orig_B1)
        if self._kv.cache is None or not self._rows:  # the forward failed: its rows failed with it
            return
        self._charge(rows, delta, shared=True)
        for i, r in enumerate(rows):
            try:
                tok = sample_next(logits_B1V[i, -1], r.params, r.gen)
                r.next_token = tok
                self._accept_token(r, tok)
            except Exception as exc:  # this row alone: it leaves the batch at the next retire
                self._fail(r, exc)
        self._after_forward(len(rows), len(rows), dt, delta)

    def _charge(self, rows: list[Request], delta: dict, shared: bool, weights: list[int] | None = None) -> None:
        weights = weights or [1] * len(rows)
        total = sum(weights)
        for r, w in zip(rows, weights):
            for k in ("hits", "misses", "low_computes", "bytes_read"):
                r.stats[k] += delta[k] * w / total
            r.stats["forwards"] += 1
            if shared:
                r.stats["shared_steps"] += 1
                r.stats["batch_rows"] += len(rows)

    def _accept_token(self, r: Request, tok: int) -> bool:
        """Record a sampled token, emit new text, decide whether the request is finished. True if finished."""
        if r.t_first is None:
            r.t_first = time.perf_counter()
        r.tokens.append(tok)
        reason = None
        if tok in self.eos_ids and not r.params.ignore_eos:
            reason = "stop"
            text = self._decode(r.tokens[:-1])
        else:
            text = self._decode(r.tokens)
        hold = 0
        for s in r.params.stop:
            at = text.find(s)
            if at >= 0:
                text, reason = text[:at], "stop"
        if reason is None:
            if len(r.tokens) >= r.params.max_tokens:
                reason = "length"
            else:  # hold back an incomplete character and any tail that may start a stop string
                if text.endswith("\ufffd"):
                    hold = len(text) - len(text.rstrip("\ufffd"))
                for s in r.params.stop:
                    for n in range(min(len(s) - 1, len(text)), 0, -1):
                        if text.endswith(s[:n]):
                            hold = max(hold, n)
                            break
        r.text = text
        upto = len(text) - hold
        if upto > r.sent:
            r.on_event("text", text[r.sent:upto])
            r.sent = upto
        if reason is not None:
            self._finish(r, reason)
            return True
        return False

    def _decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return "".join(f"{i} " for i in ids)
        return self.tok.decode(ids, skip_special_tokens=True)

    @contextlib.contextmanager
    def _failing(self, reqs: list[Request], decode: bool = False):
        """Run a forward for ``reqs``: if it raises, they fail (500 with the error) and leave the engine (a
        decode forward: the batch and its KV are dropped); :data:`MAX_FAILED_FORWARDS` failures in a row
        re-raise (the engine stops). A forward that succeeds resets the count."""
        try:
            yield
        except Exception as exc:
            self._failed_forwards += 1
            if self._failed_forwards >= MAX_FAILED_FORWARDS:
                raise
            print(f"expertcache serve: a forward failed ({type(exc).__name__}: {exc}); its {len(reqs)} request(s) "
                  "got a 500, the engine goes on", file=sys.stderr, flush=True)
            for r in reqs:
                if r.finish_reason is None:
                    self._fail(r, exc)
            if decode:  # ``reqs`` is the whole batch: its KV may be half updated
                self._rows = []
                self._kv = BatchKV()
            else:
                self._prefilling = [r for r in self._prefilling if r not in reqs]
                for r in reqs:
                    r.past = None
            self._queue_metric()
        else:
            self._failed_forwards = 0

    def _fail(self, r: Request, exc: BaseException) -> None:
        """``r`` failed alone: a 500 naming the error; its row (if any) leaves at the next retire."""
        r.finish_reason = "error"
        self.totals["failed"] += 1
        r.on_event("error", (500, f"the request failed: {type(exc).__name__}: {exc}"))

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        if reason == "cancelled":
            self.totals["cancelled"] += 1
            r.on_event("error", (499 if self._accepting else 503,
                                 "the request was cancelled" + ("" if self._accepting else
                                                                 " (server shutting down)")))
        else:
            self.totals["finished"] += 1
            r.on_event("done", r.info())

    def _retire(self) -> None:
        keep, gone = [], []
        for i, r in enumerate(self._rows):
            if r.finish_reason is None and r.cancelled.is_set():
                self._finish(r, "cancelled")
            (gone if r.finish_reason is not None else keep).append(i)
        if gone:
            self._rows = [self._rows[i] for i in keep]
            self._kv.keep(keep)
            self._queue_metric()
