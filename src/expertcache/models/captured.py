"""The captured decode step (issue 35): one token of a batch-1 decode against a static KV cache, compiled as ONE
graph per token, the host's decisions as opaque calls inside it.

Letter legend: D hidden, V vocabulary, M the static cache's length (positions), P the token's position, K experts
per token.

A decoder layer of the supported layout (:func:`unsupported_reason`: ``input_layernorm``, ``self_attn``,
``post_attention_layernorm``, ``mlp``; full attention, no sliding window, no attention sinks) is written as::

    h = h + moe_prev                       # the previous layer's MoE output joins the residual
    x = input_layernorm(h)
    h = h + self_attn(x, rope(P), mask_M, static cache)
    moe = mlp(post_attention_layernorm(h)) # the MoE block's own code, traced (see below)

and the token's whole step (embedding, rotary tables and mask, every layer, final norm) is one ``torch.compile``
graph; ``lm_head`` runs eagerly after it (a weight-bound product: aten's matrix-vector kernel beats inductor's
code for it on a CPU, and inside the graph large one-row products stay aten's as well,
:data:`~expertcache.offload.experts.OPAQUE_MATVEC_ELEMENTS`).

**The MoE blocks.** With an ``owner`` (the offloaded runtime) the family's block is traced -- its router call, its
shared experts, its combine -- and the owner's two seams call custom operators when traced: the router's
``expertcache::route`` (the routing policy's host decisions: ids and weights) and the experts'
``expertcache::cache_step`` (the cache step: which slot holds each routed expert, the reads, the next layer's
guess; the graph then computes the experts from those slots) or ``expertcache::experts`` (the eager expert
products, where the graph cannot compute them). A token thus costs one entry into compiled code and a few
operator calls per layer instead of ~40 eager tensor operations around an eager MoE block. Without an owner,
or where a MoE block carries a forward hook (it would be traced, its state baked in), each block is one opaque
``expertcache::moe_block`` whose implementation is ``layer.mlp`` run eagerly. With the runtime's next-layer
prefetch on, ``expertcache::guess_first`` starts the first MoE layer's guess from the hidden state entering it,
as the eager path's forward pre-hook does.

- **Static shapes**: the cache is transformers' ``StaticCache`` of M positions (every layer's keys and values
  allocated once, written in place at the token's position, read whole with the mask hiding positions > P),
  so one graph serves every token of a generation. M is a multiple of :data:`BUCKET` (fewer compilations
  across prompts of different lengths).
- **One code object per (model, M, dtype, device, owner's key)**: torch.compile keeps its graphs per code object and checks
  their guards one after the other; each key gets its own copy of the step's code, so it holds exactly one
  graph, and once that graph exists the decode runs with guard evaluation skipped (``skip_guard_eval_unsafe``):
  safe here because the key fixes every shape, dtype and module the graph was traced with (batch 1, one token,
  M, this model). The first token of a new key compiles (seconds; transformers' code is traced once).
- **CUDA**: ``mode="reduce-overhead"``: CUDA graphs over the parts between MoE blocks (the custom operators are
  tagged ``cudagraph_unsafe``, so inductor's graph partitioning replays the parts between them, the in-graph
  expert products included). Not yet run on a GPU. On the CPU the wrapper's size and alignment assertions are
  off (:data:`_CPU_OPTIONS`).

Contract (``tests/test_captured.py``): the logits of a generation equal the eager runtime's within the dtype's
rounding, the routing decisions and cache counters are the eager ones (the operators run the same host code;
only sums -- the dense part's, the in-graph expert products' -- may round differently), and the cache's length is
never exceeded
(:class:`CapturedDecode` refuses a generation longer than M).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import types
from typing import Callable

import torch
from torch import nn

from expertcache.models.cachearg import CACHE_ARG, cache_kw  # CACHE_ARG read once: a constant in the step's graph

__all__ = ["BUCKET", "CapturedDecode", "compile_dense", "missing_compiler", "unsupported_reason"]

#: the static cache's length is rounded up to a multiple of this many positions
BUCKET = 256


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the captured step (None: it can): a decoder layer without the four parts, a
    sliding-window or sink attention, an attention implementation other than sdpa/eager."""
    cfg = model.config
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model.model, "rotary_emb") or not hasattr(model.model, "norm"):
        return "no model.model.layers / rotary_emb / norm"
    for i, layer in enumerate(layers):
        for part in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, part):
                return f"decoder layer {i} has no {part}"
        if hasattr(layer.self_attn, "sinks"):
            return "attention sinks"
    types_ = getattr(cfg, "layer_types", None)
    if types_ is not None:
        if any(t != "full_attention" for t in types_):
            return "sliding-window layers"
    elif getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) is not False:
        return "sliding-window attention"  # the step's mask is the full causal one
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {cfg._attn_implementation}"
    return None


_COMPILER_OK: dict[tuple, str | None] = {}  # (compiler, temporary folder) -> missing_compiler()'s answer


def missing_compiler() -> str | None:
    """Why ``torch.compile`` cannot build code on this machine (None: it can). Inductor writes C++ (the CPU's
    kernels, CUDA's launchers) into a folder under the temporary folder (``$TMPDIR``, or
    ``$TORCHINDUCTOR_CACHE_DIR``) and builds it with ``$CXX`` or ``g++``. Finding a compiler on PATH is not enough
    (``CXX=/bin/false`` was found, and the first compiled call failed minutes later with a traceback; so did a
    full ``$TMPDIR``): a one-line C++ file is written there and built, up front (~0.2 s, once per process)."""
    import shlex
    import subprocess
    import tempfile

    cxx = os.environ.get("CXX", "").strip()
    names = [cxx] if cxx else ["g++", "c++", "clang++"]
    found = next((n for n in names if shutil.which(shlex.split(n)[0] if n.strip() else n)), None)
    if found is None:
        return f"--compile needs a C++ compiler for torch.compile, and none was found ({' / '.join(names)} on PATH)"
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "").strip() or tempfile.gettempdir()
    key = (found, where)
    if key in _COMPILER_OK:
        return _COMPILER_OK[key]
    why = None
    try:
        os.makedirs(where, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="expertcache-cxx-check.", dir=where) as d:
            src = os.path.join(d, "check.cpp")
            with open(src, "w") as f:
                f.write("int expertcache_check(int x) { return x + 1; }\n")
            r = subprocess.run([*shlex.split(found), "-shared", "-fPIC", "-o", os.path.join(d, "check.so"), src],
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1][:160]
                why = (f"--compile needs a working C++ compiler for torch.compile: {found} failed to build a one-line "
                       f"test file ({last}); set CXX to a working compiler")
    except subprocess.TimeoutExpired:
        why = f"--compile needs a working C++ compiler for torch.compile: {found} took over 120 s on a one-line file"
    except OSError as exc:
        why = (f"--compile needs room for torch.compile's C++ code in {where} ($TMPDIR / $TORCHINDUCTOR_CACHE_DIR): "
               f"{exc.strerror or exc}")
    _COMPILER_OK[key] = why
    return why


def compile_dense(model: nn.Module) -> None:
    """``torch.compile`` the dense part of every decoder layer of ``model`` in place: its attention and its
    norms (``dynamic=True``: one graph for every KV length). The MoE blocks, routers and the step around them
    stay eager. Each layer's attention is its own graph (its ``layer_idx`` is a constant of the cache
    update), so the recompile limit is raised to cover every layer. Each wrapped module keeps its plain forward (:func:`_eager`)."""
    decoder = model.model.layers
    limit = max(getattr(torch._dynamo.config, "recompile_limit", 8), 4 * len(decoder))
    torch._dynamo.config.recompile_limit = limit
    for layer in decoder:
        for name in ("self_attn", "input_layernorm", "post_attention_layernorm"):
            mod = getattr(layer, name, None)
            if mod is not None and not hasattr(mod, "_eager_forward"):
                mod._eager_forward = mod.forward  # the captured decode step traces the plain code
                mod.forward = torch.compile(mod.forward, dynamic=True)


@contextlib.contextmanager
def _plain_forwards(root: nn.Module):
    """Within: every module under ``root`` that :func:`compile_dense` wrapped runs its plain forward."""
    wrapped = [m for m in root.modules() if "_eager_forward" in m.__dict__]
    compiled = [m.forward for m in wrapped]
    for m in wrapped:
        m.forward = m._eager_forward
    try:
        yield
    finally:
        for m, f in zip(wrapped, compiled):
            m.forward = f


def _eager(mod: nn.Module) -> Callable:
    """``mod``'s forward as it was before :func:`compile_dense` wrapped it (the step's
    graph traces the plain code, not a second compiled region)."""
    return getattr(mod, "_eager_forward", None) or mod.forward


# -- the MoE blocks as opaque operators ---------------------------------------------------------------------

#: the step running on this thread (its MoE blocks and guess): the operators' implementations call into it, so a
#: graph holds only layer indices and is the same for every model of one configuration (inductor's cache hits)
_running = threading.local()


def _moe_block(x: torch.Tensor, layer: int) -> torch.Tensor:
    # runs inside the step's graph, where guard evaluation is skipped: nothing here may call a compiled function
    # (the MoE block's modules are never wrapped by compile_dense)
    step = _running.step
    return torch.zeros_like(x) if step._dry else step._blocks[layer](x)


def _guess_first_op(h: torch.Tensor, layer: int) -> torch.Tensor:
    # the guess normalises with the layer's post-attention norm, which compile_dense may have wrapped: it runs
    # the plain code here (no compiled function may run under the step's skipped guards, and none compiles
    # during a decode)
    step = _running.step
    if not step._dry:
        with _plain_forwards(step._guess_layer):
            step._guess_fn(step._guess_layer, h)
    return h.clone()  # the step goes on from this output: the call stays in the graph, in its place


def _route_op(x: torch.Tensor, z: torch.Tensor, w0: torch.Tensor, ids0: torch.Tensor, layer: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    step = _running.step
    if step._dry:  # the compiling call: the stock route, nothing committed
        return w0.clone(), ids0.clone()
    return step.owner.captured_route(x, z, w0, ids0, layer)


def _cache_step_op(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, layer: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    step = _running.step
    if step._dry:  # the compiling call: no expert computed in the graph, nothing loaded
        return torch.full((ids.numel(),), -1, dtype=torch.long, device=x.device), torch.zeros_like(x)
    return step.owner.captured_cache_step(x, ids, w, layer)


def _experts_op(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, layer: int) -> torch.Tensor:
    step = _running.step
    if step._dry:
        return torch.zeros_like(x)
    return step.owner.captured_experts(x, ids, w, layer)


_LIB = torch.library.Library("expertcache", "FRAGMENT")
_UNSAFE = (torch.Tag.cudagraph_unsafe,)  # host decisions: never inside a CUDA graph
_LIB.define("moe_block(Tensor x, int layer) -> Tensor", tags=_UNSAFE)
_LIB.define("guess_first(Tensor h, int layer) -> Tensor", tags=_UNSAFE)
_LIB.define("route(Tensor x, Tensor z, Tensor w0, Tensor ids0, int layer) -> (Tensor, Tensor)", tags=_UNSAFE)
_LIB.define("cache_step(Tensor x, Tensor ids, Tensor w, int layer) -> (Tensor, Tensor)", tags=_UNSAFE)
_LIB.define("experts(Tensor x, Tensor ids, Tensor w, int layer) -> Tensor", tags=_UNSAFE)
for _name, _fn in (("moe_block", _moe_block), ("guess_first", _guess_first_op), ("route", _route_op),
                   ("cache_step", _cache_step_op), ("experts", _experts_op)):
    _LIB.impl(_name, _fn, "CompositeExplicitAutograd")
torch.library.register_fake("expertcache::moe_block", lambda x, layer: torch.empty_like(x), lib=_LIB)
torch.library.register_fake("expertcache::guess_first", lambda h, layer: torch.empty_like(h), lib=_LIB)
torch.library.register_fake("expertcache::route", lambda x, z, w0, ids0, layer: (torch.empty_like(w0),
                                                                                torch.empty_like(ids0)), lib=_LIB)
torch.library.register_fake("expertcache::cache_step", lambda x, ids, w, layer: (
    ids.new_empty(ids.numel()), torch.empty_like(x)), lib=_LIB)
torch.library.register_fake("expertcache::experts", lambda x, ids, w, layer: torch.empty_like(x), lib=_LIB)


def _step(model: nn.Module, tok_11: torch.Tensor, pos_1: torch.Tensor, cache, length: int,
          guess_at: int, traced: bool) -> torch.Tensor:
    """The final hidden state [1, 1, D] of token ``tok_11`` at position ``pos_1`` (see the module docstring); ``guess_at``: the
    decoder layer before whose attention the first MoE layer's guess is made (-1: none); ``traced``: the MoE
    blocks' own code is traced (their owner's router and experts seams, :class:`CapturedDecode`), else each is
    one opaque ``expertcache::moe_block``."""
    m = model.model
    h = m.embed_tokens(tok_11)
    rope = m.rotary_emb(h, pos_1[None])  # (cos, sin); DeepSeek-V2: its complex frequencies
    keep_M = torch.arange(length, device=pos_1.device) <= pos_1
    mask_111M = torch.where(keep_M, 0.0, torch.finfo(h.dtype).min).to(h.dtype)[None, None, None, :]
    moe = torch.zeros_like(h)
    for i, layer in enumerate(m.layers):
        h = h + moe
        if i == guess_at:
            h = torch.ops.expertcache.guess_first(h, i)
        a, _ = _eager(layer.self_attn)(hidden_states=_eager(layer.input_layernorm)(h), position_embeddings=rope,
                                       attention_mask=mask_111M, **{CACHE_ARG: cache}, cache_position=pos_1)
        h = h + a
        x = _eager(layer.post_attention_layernorm)(h)
        moe = layer.mlp(x) if traced else torch.ops.expertcache.moe_block(x, i)
    return m.norm(h + moe)  # lm_head: eager, after the graph (a weight-bound product; aten's mv is the fast one)


def _hooked(block: nn.Module) -> bool:
    """Whether a forward hook (pre or post, of ``block`` or a module under it) would run with its forward."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in block.modules())


#: inductor options of the CPU step: no size, stride or alignment assertions in the generated wrapper (~300 per
#: token at 16 layers, each a Python call); indirect-indexing bounds checks stay (a slot index out of range fails)
_CPU_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


def _own_code(fn: Callable, name: str) -> Callable:
    """A copy of function ``fn`` with its own code object (torch.compile's graphs are kept per code object)."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)


class CapturedDecode:
    """Batch-1 decoding of ``model`` (a transformers causal LM whose MoE blocks are the runtime's) against a
    static cache of ``length`` positions (rounded up to :data:`BUCKET`). ``guess_first``: (decoder layer index,
    ``fn(decoder_layer, h_11D)``) called before that layer's attention with the hidden state entering it (the
    runtime's first-layer guess), or None. :meth:`prefill` then :meth:`step` per token.

    ``owner``: the object whose seams the MoE blocks' traced code calls (the offloaded runtime), or None: then
    each MoE block is one opaque ``expertcache::moe_block``. With an owner the graph traces each block's own code
    (``layer.mlp``: the family's router call and combine, shared experts included) and the owner's router and
    experts seams call, when traced (``torch.compiler.is_compiling()``), the operators ``expertcache::route``
    (``owner.captured_route(x, z, w0, ids0, layer) -> (w, ids)``: the routing policy) and either
    ``expertcache::cache_step`` (``owner.captured_cache_step(x, ids, w, layer) -> (slot_K, rest)``: the cache
    step; the graph computes the experts of the slots >= 0, ``rest`` is the sum of those computed eagerly) or
    ``expertcache::experts`` (``owner.captured_experts(x, ids, w, layer) -> out``). ``owner.captured_key()``
    names what the traced code baked in (part of the graph's key); ``owner.capturing`` is True while the step
    runs (the seams take their traced branch only then: a model compiled otherwise traces their eager code)."""

    def __init__(self, model: nn.Module, length: int, guess_first: tuple[int, Callable] | None = None,
                 owner=None) -> None:
        from transformers import StaticCache

        why = unsupported_reason(model)
        if why is not None:
            raise ValueError(f"the captured decode step does not take this model: {why}")
        self.model = model
        self.length = -(-max(1, length) // BUCKET) * BUCKET
        self.cache = StaticCache(config=model.config, max_cache_len=self.length)
        self.pos = 0
        self.device, self.dtype = model.device, model.dtype  # (an --quant-dense embedding has no .weight)
        self._blocks = [layer.mlp for layer in model.model.layers]
        self.owner = owner
        # a hook on a block would be traced into the graph (and its state baked in): such blocks stay opaque
        self._traced = owner is not None and not any(_hooked(b) for b in self._blocks)
        self._dry = False  # the compiling call: every operator answers without committing anything
        self._guess_at, self._guess_fn, self._guess_layer = -1, None, None
        if guess_first is not None:
            self._guess_at, self._guess_fn = guess_first
            self._guess_layer = model.model.layers[self._guess_at]
        kept = model.__dict__.setdefault("_expertcache_captured", {})  # graphs bake in this model's constants
        self._key = (self.length, self.dtype, str(self.device), self._guess_at,
                     owner.captured_key() if self._traced else None)
        fn = kept.get(self._key)
        if fn is None:
            step = _own_code(_step, f"_step_{len(kept)}")
            if self.device.type == "cuda":  # pragma: no cover - GPU only
                fn = torch.compile(step, dynamic=False, mode="reduce-overhead")
            else:  # the wrapper's per-call checks of every input's and extern output's sizes: fixed by the key
                fn = torch.compile(step, dynamic=False, options=_CPU_OPTIONS)
            kept[self._key] = fn
        self._fn = fn
        # guards are skipped only once the graph exists (compiling under that stance is refused)
        self._warm = model.__dict__.setdefault("_expertcache_captured_warm", set())
        self.compile_s = 0.0  # seconds :meth:`prefill` spent compiling the step (0: this key's graph existed)
        # the graph's inputs live in fixed buffers: the same shapes, strides and addresses on every call (a
        # token sliced out of a wider tensor has other strides, which the skipped guards would not notice)
        self._tok_11 = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._pos_1 = torch.zeros(1, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill(self, ids_1S: torch.Tensor, on_compile: Callable[[], None] | None = None) -> torch.Tensor:
        """Logits [1, V] of the prompt's last position (the stock forward, eager -- modules that
        ``compile_dense`` wrapped run their plain code: one prompt does not pay a compilation -- filling the
        static cache); then the step's graph is compiled if this key has none yet (:attr:`compile_s`), after a
        call of ``on_compile()`` (a caller's notice: it takes seconds to a minute)."""
        if ids_1S.shape[0] != 1:
            raise ValueError(f"the captured decode step takes one row, got {ids_1S.shape[0]}")
        self._check(ids_1S.shape[1])
        with _plain_forwards(self.model):
            out = self.model(input_ids=ids_1S.to(self.device), **cache_kw(self.cache), use_cache=True)
        self.pos = ids_1S.shape[1]
        if self._key not in self._warm and self.pos < self.length:
            if on_compile is not None:
                on_compile()
            self._compile()
        return out.logits[:, -1]

    def _compile(self) -> None:
        """Trace and compile the step's graph now, by one call at the next position whose operators answer
        without committing anything (the stock route; no cache step, no read, no counter moves; every MoE output
        zero) and whose cache writes are undone (the position
        counters restored; the keys and values written there are overwritten by the real step)."""
        import time

        t0 = time.perf_counter()
        counters = [layer.cumulative_length.clone() for layer in self.cache.layers]
        self._dry = True
        try:
            self._call(torch.zeros(1, 1, dtype=torch.long), skip_guards=False)
        finally:
            self._dry = False
            for layer, c in zip(self.cache.layers, counters):
                layer.cumulative_length.copy_(c)
        self._warm.add(self._key)
        self.compile_s = time.perf_counter() - t0

    def _check(self, n: int) -> None:
        if self.pos + n > self.length:
            raise ValueError(f"the static cache holds {self.length} positions; {self.pos + n} asked")

    @torch.inference_mode()
    def step(self, tok_11: torch.Tensor) -> torch.Tensor:
        """Logits [1, V] after token ``tok_11`` [1, 1] at the next position."""
        self._check(1)
        logits = self._call(tok_11, skip_guards=self._key in self._warm)  # (warm from the prefill on)
        self.pos += 1
        return logits[:, -1]

    def _call(self, tok_11: torch.Tensor, skip_guards: bool) -> torch.Tensor:
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            torch.compiler.cudagraph_mark_step_begin()
        src = tok_11.reshape(1, 1)
        if src.device != self.device and self.device.type == "cuda":  # pragma: no cover - GPU only
            src = src.pin_memory()  # staged: the copy does not block the host
        self._tok_11.copy_(src, non_blocking=True)
        self._pos_1.fill_(self.pos)
        _running.step = self
        if self._traced:
            self.owner.capturing = True  # its seams take their traced branch (and no other compilation's)
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip_guards):
                h_11D = self._fn(self.model, self._tok_11, self._pos_1, self.cache, self.length, self._guess_at,
                                 self._traced)
        finally:
            _running.step = None
            if self._traced:
                self.owner.capturing = False
        return self.model.lm_head(h_11D)
