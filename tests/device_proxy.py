"""The tracked-tensor proxy (issue 35): a decode step's device work and host waits counted on the CPU.

No GPU is needed to see what a step would make a GPU do. :class:`DeviceProxy` is a ``TorchFunctionMode`` that
treats chosen tensors as "on the device" (:data:`PROXY`, ``cpu:0``: a device the runtime can be built on
whose tensors are ordinary CPU memory) and follows them through every torch call: a call with a device
tensor among its inputs is a **launch** (view and metadata calls excepted: no kernel runs for them) and its
tensor outputs are device tensors. It counts, per call:

- **device→host waits** (the host stops until the device has caught up): ``.item()``, ``.tolist()``,
  ``.numpy()``, ``bool()``/``int()``/``float()`` of a device tensor, ``.cpu()``, ``.to('cpu')``, a copy
  into host memory, and the calls whose output size depends on the data (``nonzero``, ``masked_select``,
  ``unique``, boolean-mask indexing);
- **blocking host→device copies**: ``.to(device)``/``copy_`` of host memory into device memory unless the
  host tensor is pinned and the copy ``non_blocking`` (on CUDA the others end in a stream synchronize), and
  ``torch.tensor(data, device=...)``;
- **mixed** calls: a device tensor and a host tensor (not a 0-dim scalar) in one call -- on CUDA an error.

Pinned memory is emulated (``pin_memory=True``, ``.pin_memory()``, ``.is_pinned()``): the tensor stays
ordinary memory and is remembered as pinned. The mode is thread-local: reads run by reader threads (the copy
stream's work on a GPU) are not counted -- which is why the proxy runs use one reader thread.

:func:`track_runtime` marks a runtime's weights, buffers and slots as device tensors;
:func:`count_decode` counts one decode token, launches inside the MoE blocks apart.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

PROXY = torch.device("cpu", 0)

#: calls that run no kernel (views, metadata): not launches, even with a device tensor in them
_NO_LAUNCH = {"view", "view_as", "reshape", "t", "T", "transpose", "permute", "unsqueeze", "squeeze", "expand",
              "expand_as", "chunk", "split", "unbind", "narrow", "select", "detach", "size", "dim", "numel",
              "stride", "is_contiguous", "element_size", "data_ptr", "flatten", "unflatten", "movedim",
              "storage_offset", "untyped_storage", "__len__", "__format__", "__repr__", "empty", "empty_like",
              "new_empty", "is_floating_point", "is_complex", "get_device", "__hash__", "requires_grad_",
              "__setstate__", "__reduce_ex__", "as_strided", "_is_view", "nelement", "ndimension", "type"}
#: calls that need the data on the host (a device→host wait)
_TO_HOST = {"tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__", "cpu"}
#: calls whose output size depends on the data: the host waits for it
_DATA_SHAPE = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere", "nonzero_static"}


def _name(func) -> str:
    own = getattr(func, "__self__", None)
    if getattr(func, "__name__", None) == "__get__" and own is not None:
        return getattr(own, "__name__", str(own))
    return getattr(func, "__name__", str(func))


def _is_proxy(d) -> bool:
    if isinstance(d, str):
        d = torch.device(d)
    return isinstance(d, torch.device) and d.type != "cpu" or d == PROXY


class DeviceProxy(TorchFunctionMode):
    """See the module docstring. ``launches`` (Counter by call), ``d2h``/``h2d_blocking``/``mixed`` (lists of
    (call, caller frames)), ``h2d_async`` (count); ``moe_launches`` counts the launches made while
    :attr:`in_moe` (set by :func:`count_decode`'s hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.dev = WeakIdKeyDictionary()
        self.pinned = WeakIdKeyDictionary()
        self.in_moe = False
        self.reset()

    def reset(self) -> None:
        self.launches: Counter = Counter()
        self.moe_launches: Counter = Counter()
        self.d2h: list = []
        self.h2d_blocking: list = []
        self.h2d_async = 0
        self.mixed: list = []

    def track(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.dev[t] = True

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.dev

    # -- counting --------------------------------------------------------------------------------

    def _launch(self, name: str) -> None:
        self.launches[name] += 1
        if self.in_moe:
            self.moe_launches[name] += 1

    def _h2d(self, name: str, src: torch.Tensor, non_blocking: bool) -> None:
        if non_blocking and src in self.pinned:
            self.h2d_async += 1
        else:
            self.h2d_blocking.append((name, _where()))

    def _mark(self, out):
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.dev[t] = True
        return out

    def _fresh(self, out, src):
        """``out`` as a tensor object other than ``src`` (``.to`` on the CPU may return its input)."""
        if out is src:
            with torch._C.DisableTorchFunction():
                out = src.detach().clone() if not src.requires_grad else src.clone()
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = _name(func)
        self0 = args[0] if args else None
        if name == "device" and self.on_device(self0):
            return PROXY
        if name == "is_pinned" and isinstance(self0, torch.Tensor):
            return self0 in self.pinned
        if name == "pin_memory" and isinstance(self0, torch.Tensor):
            with torch._C.DisableTorchFunction():
                out = self0.detach().clone()
            self.pinned[out] = True
            return out
        pin = kwargs.pop("pin_memory", False)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on = [t for t in tensors if t in self.dev]
        if name in ("to", "cuda", "cpu", "copy_"):
            return self._transfer(func, name, args, kwargs, on)
        dev_kw = kwargs.get("device")
        out = func(*args, **kwargs)
        if pin and isinstance(out, torch.Tensor):
            self.pinned[out] = True
        if dev_kw is not None and _is_proxy(dev_kw):  # a factory on the device
            if name == "tensor" or name == "as_tensor":
                self.h2d_blocking.append((name, _where()))
            elif name not in _NO_LAUNCH:
                self._launch(name)
            return self._mark(out)
        if not on:
            return out
        if name in _TO_HOST:
            self.d2h.append((name, _where()))
            return out
        if name in ("shape", "dtype", "is_cuda", "layout", "ndim", "names", "requires_grad", "grad_fn",
                    "is_leaf", "data", "_base", "is_meta", "is_sparse", "is_quantized", "grad", "real", "imag",
                    "mT", "H", "mH", "output_nr", "_version", "itemsize", "nbytes"):
            if name == "data" and isinstance(out, torch.Tensor):
                self.dev[out] = True
            return out
        big_host = [t for t in tensors if t not in self.dev and t.dim() > 0]
        if big_host:
            self.mixed.append((name, _where()))
        if name in _DATA_SHAPE or (name == "__getitem__" and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_leaves(args[1:]))):
            self.d2h.append((name, _where()))
        if name == "__getitem__":
            if any(isinstance(t, torch.Tensor) for t in tree_leaves(args[1:])):
                self._launch(name)
        elif name == "contiguous":
            if not self0.is_contiguous():
                self._launch(name)
        elif name not in _NO_LAUNCH and not name.startswith("__get"):
            self._launch(name)
        return self._mark(out)

    def _transfer(self, func, name, args, kwargs, on):
        src = args[0]
        if name == "copy_":
            dest, src = args[0], args[1]
            out = func(*args, **kwargs)
            d_on, s_on = dest in self.dev, isinstance(src, torch.Tensor) and src in self.dev
            nb = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            if d_on and s_on:
                self._launch(name)
            elif d_on:
                self._h2d(name, src, nb)
            elif s_on:
                self.d2h.append((name, _where()))
            return out
        target, nb = None, bool(kwargs.get("non_blocking", False))
        if name == "cpu":
            target = torch.device("cpu")
        elif name == "cuda":
            target = PROXY
        else:
            for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
                if isinstance(a, (str, torch.device)):
                    target = torch.device(a)
                elif isinstance(a, torch.Tensor):
                    target = PROXY if a in self.dev else torch.device("cpu")
                elif isinstance(a, bool) and a:
                    nb = True
        src_on = src in self.dev
        out = func(*args, **{k: v for k, v in kwargs.items()})
        if target is None:  # a dtype change where the tensor is
            if src_on:
                if out is not src:
                    self._launch(name)
                self._mark(out)
            return out
        if _is_proxy(target):
            if src_on:
                if out is not src:
                    self._launch(name)
                return self._mark(out)
            self._h2d(name, src, nb)
            return self._mark(self._fresh(out, src))
        if src_on:  # to the host
            self.d2h.append((name, _where()))
            out = self._fresh(out, src)
            self.dev.pop(out, None)
        return out


def _where() -> list[str]:
    frames = [f for f in traceback.extract_stack() if ("expertcache" in f.filename or "transformers" in f.filename)
              and not f.filename.endswith("device_proxy.py")]
    return [f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[-3:]]


def track_runtime(proxy: DeviceProxy, rt) -> None:
    """Mark the device-resident tensors of an offloaded runtime built on :data:`PROXY`: the model's
    parameters and buffers and every slot of the arena."""
    proxy.track(*rt.model.parameters(), *rt.model.buffers())
    for m in rt.model.modules():  # rotary tables kept as plain attributes
        for v in vars(m).values():
            if isinstance(v, torch.Tensor):
                proxy.track(v)
    proxy.track(rt.arena.buffer)


def count_decode(rt, proxy: DeviceProxy, prompt_BS: torch.Tensor, tokens: int, warm: int = 2) -> dict:
    """Per decoded token of ``rt.generate`` (greedy, under ``proxy``, after ``warm`` tokens that are not
    counted): ``launches``, ``moe_launches`` (per MoE layer), ``d2h`` and ``h2d_blocking`` of the forward
    calls, ``d2h_sampling`` (the choice of the next token, outside the forward), ``mixed`` (calls), and
    ``where`` (the callers of each wait and blocking copy)."""
    L = len(rt.layers)
    marks: list[tuple] = []

    def snap():
        return (sum(proxy.launches.values()), sum(proxy.moe_launches.values()), len(proxy.d2h),
                len(proxy.h2d_blocking))

    def on(mod, args):
        proxy.in_moe = True

    def off(mod, args, out):
        proxy.in_moe = False

    hooks = [h for m in rt.layers for h in (m.block.register_forward_pre_hook(on), m.block.register_forward_hook(off))]
    prefill, decode = rt.prefill, rt.decode_one_token
    seen = [0]

    def counted_prefill(*a, **k):
        out = prefill(*a, **k)
        proxy.reset()
        return out

    def counted_decode(*a, **k):
        seen[0] += 1
        if seen[0] == warm + 1:
            proxy.reset()
        before = snap()
        out = decode(*a, **k)
        if seen[0] > warm:
            marks.append((before, snap()))
        return out

    rt.prefill, rt.decode_one_token = counted_prefill, counted_decode
    try:
        with torch.inference_mode(), proxy:
            rt.generate(prompt_BS, warm + tokens + 1)
    finally:
        del rt.prefill, rt.decode_one_token
        for h in hooks:
            h.remove()
    assert len(marks) == tokens
    fwd = [sum(b[i] - a[i] for a, b in marks) for i in range(4)]
    return dict(launches=fwd[0] / tokens, moe_launches=fwd[1] / tokens / L, d2h=fwd[2] / tokens / L,
                h2d_blocking=fwd[3] / tokens / L, d2h_sampling=(len(proxy.d2h) - fwd[2]) / tokens,
                h2d_blocking_sampling=(len(proxy.h2d_blocking) - fwd[3]) / tokens, mixed=len(proxy.mixed),
                where=Counter(tuple(w) for _, w in proxy.d2h + proxy.h2d_blocking + proxy.mixed))
