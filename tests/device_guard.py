"""A decode step's tensors and where they live, recorded with a ``TorchDispatchMode`` (shared by
``test_device.py`` on the CPU and ``test_gpu.py`` on CUDA).

:func:`record_step` runs one call under two guards:

- the default device is ``meta`` (``with torch.device('meta')``): a tensor the step creates without naming
  its device (``torch.tensor(...)``, ``torch.zeros(n)``) lands on ``meta`` -- on a GPU that tensor would have
  been on the CPU, next to CUDA operands (issue 23: ``index is on cpu ... (index_add_)``);
- a dispatch mode records, for every aten op, the devices of its tensor inputs and outputs.

So on the CPU an op touching ``meta`` is exactly a tensor that would be on the wrong device on a GPU; on CUDA
an op mixing ``cuda`` and ``cpu`` operands (other than a copy between them, or a CPU scalar) is the bug itself.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_COPIES = ("aten._to_copy", "aten.copy_", "aten._copy_from", "aten.lift_fresh", "aten._local_scalar_dense",
           "aten.detach", "aten.alias", "aten.empty")


class DeviceRecorder(TorchDispatchMode):
    """Records every aten op: ``ops`` (Counter of op names), ``meta`` (ops touching a meta tensor, with the
    caller's frames) and ``mixed`` (ops whose tensor operands sit on more than one device, copies and
    0-dim CPU scalars excepted)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.meta: list[tuple[str, list[str]]] = []
        self.mixed: list[tuple[str, set, list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.ops[name] += 1
        tensors = [t for t in tree_leaves((args, kwargs or {}, out)) if isinstance(t, torch.Tensor)]
        devs = {t.device.type for t in tensors}
        if "meta" in devs:
            self.meta.append((str(func), _where()))
        elif len(devs) > 1 and not name.startswith(_COPIES):
            big = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
            if len(big) > 1:
                self.mixed.append((str(func), devs, _where()))
        return out


def _where() -> list[str]:
    frames = [f for f in traceback.extract_stack()[:-2] if "expertcache" in f.filename or "transformers" in f.filename]
    return [f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[-4:]]


def record_step(fn, *args, **kwargs):
    """(result of ``fn(*args, **kwargs)``, :class:`DeviceRecorder`) with the default device ``meta``."""
    rec = DeviceRecorder()
    with torch.inference_mode(), torch.device("meta"), rec:
        out = fn(*args, **kwargs)
    return out, rec


class OpCounter(TorchDispatchMode):
    """Counts aten ops (by name) while :attr:`active`; :func:`count_moe_ops` switches it on inside MoE blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_moe_ops(blocks, fn, *args, **kwargs):
    """(result of ``fn(*args, **kwargs)``, Counter of the aten ops run inside the modules ``blocks``: the MoE
    blocks -- router, routing policy, cache step, expert compute and combine)."""
    counter = OpCounter()

    def on(mod, args):
        counter.active = True

    def off(mod, args, out):
        counter.active = False

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(on), b.register_forward_hook(off))]
    try:
        with torch.inference_mode(), counter:
            out = fn(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, counter.ops
