"""Before anything is loaded: the memory plan of an offloaded model from its config and safetensors headers, and the
choices that size it (how big an expert and its slot are, where the one-token products run).

:func:`preflight` refuses a budget or a container that cannot hold the model (``BudgetError``, one line, the
minimum) before any weight is read or any sidecar written; :func:`plan_from` is the plan for given expert sizes
(the runtime's exact plan, once loaded, is the same function of the loaded sizes); :func:`compile_kernels` compiles
the cache and routing kernels before the interpreter's RSS is measured. Functions of the model's skeleton (meta
device), the checkpoint's headers and the :class:`~expertcache.offload.config.OffloadConfig`; no runtime state.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from expertcache.cache import make_cache
from expertcache.container import cgroup_memory_usage
from expertcache.models.adapters import Family, MoELayer
from expertcache.models.captured import unsupported_reason
from expertcache.device import on_host
from expertcache.offload.budget import (AUTO, RUNTIME_OVERHEAD, BudgetError, MemoryPlan, cgroup_memory_limit,
                                        container_limit, kv_cache_bytes, parse_bytes, plan_memory, process_rss)
from expertcache.offload.checkpoint import Checkpoint, ExpertParts
from expertcache.offload.config import EXPERT_PRODUCTS, OffloadConfig
from expertcache.offload.diskembed import DiskEmbedding
from expertcache.offload.experts import OPAQUE_MATVEC_ELEMENTS
from expertcache.offload.fbexperts import slot_copy_bytes
from expertcache.offload.layout import ALIGN, place_expert, slot_bytes_for
from expertcache.offload.lowtier import LOW_MODES, low_tier_bytes
from expertcache.offload.fbgemm import FBGEMM_ROWS, FINISH_TRANSIENT
from expertcache.offload.qlinear import dense_bytes, dense_targets, fbgemm_shapes, int8_kernel
from expertcache.offload import hostnorm, q4moe, q4x8, q8x8
from expertcache.offload.quant import PACK_ROWS, dense_int4_kernel, expert_kernel
from expertcache.offload.store import quant_layout_for
from expertcache.offload.tiers import parse_host_memory
from expertcache.routing import Router, RoutingConfig

__all__ = ["SIDECAR_TRANSIENT", "DENSE_PACK_TRANSIENT", "finish_transient_bytes", "expert_sizes", "graph_products", "expert_product",
           "check_resident_quant", "compile_kernels", "preflight", "plan_from", "interpreter_bytes"]

#: the quantised sidecar's writer holds one expert at a time: its bytes, float32 copies of its largest matrix
#: and their intermediates (quantize_matrix), the packed blob; a bound in units of the expert's stored bytes
#: (measured 4.8-8.9x for a 6 MiB float32 expert, int4 and int8: the heap's free blocks between experts and
#: the packing kernels' code pages on first use included)
SIDECAR_TRANSIENT = 9


#: ``--quant-dense`` packs each matrix a block of PACK_ROWS rows at a time, read straight from the checkpoint:
#: the block's bytes, its float32 copy, the padded copy, the int32 codes and the packed block; a bound in bytes
#: per element of one block (measured 12.9 per element when whole matrices were packed from float32)
DENSE_PACK_TRANSIENT = 13


def finish_transient_bytes(model: nn.Module, mode: str | None, device: torch.device | str, *,
                           compiled: bool = False) -> int:
    """The transient of handing the int8 dense matrices to FBGEMM after loading (``QuantLinear.finish``, one
    matrix at a time): the largest matrix's codes, still held while FBGEMM packs its own copy of them (which the
    plan counts in their place), plus :data:`~expertcache.offload.fbgemm.FINISH_TRANSIENT` copies of one block
    of :data:`~expertcache.offload.fbgemm.FBGEMM_ROWS` rows. 0 where no matrix runs on FBGEMM."""
    return max((codes + FINISH_TRANSIENT * min(n, FBGEMM_ROWS) * k
                for n, k, codes in fbgemm_shapes(model, mode, device, compiled=compiled)), default=0)


def expert_sizes(parts: dict, placement: dict, readers: int) -> tuple[int, int, int]:
    """(expert bytes, slot bytes, reader bounce-buffer bytes) of the experts ``parts`` placed as ``placement``."""
    bounce = [max(n for _, _, n, _, _ in p.spans) for p in placement.values() if p.bounce]
    return (next(iter(parts.values())).nbytes, slot_bytes_for(max(p.nbytes for p in placement.values())),
            (max(bounce) if bounce else 0) * max(1, readers))


def graph_products(o: OffloadConfig, model: nn.Module, parts: ExpertParts, dtype: torch.dtype,
                   device: torch.device) -> bool:
    """Whether the captured decode step computes these experts in its graph (:func:`~expertcache.offload.layout.
    inline_product`): ``compile`` on, a model the step takes, full-precision ``linear`` experts stored in the
    compute dtype, and on a CPU matrices under :data:`~expertcache.offload.experts.OPAQUE_MATVEC_ELEMENTS`
    (larger ones: aten's ``mv`` is faster there). Their disk reads then land at the packed layout (O_DIRECT
    through the bounce buffer: one copy per read), so that every slot holds its expert at one layout."""
    if not o.compile or o.quant or parts.layout != "linear" or parts.dtype != dtype:
        return False
    if on_host(device) and max(math.prod(shape) for _, shape in parts.tensors().values()) >= OPAQUE_MATVEC_ELEMENTS:
        return False
    return unsupported_reason(model) is None


def expert_product(choice: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """The one-token expert product ``choice`` resolves to on ``device`` (None: 'mv', the per-expert products)."""
    if choice not in EXPERT_PRODUCTS:
        raise ValueError(f"expert_product must be one of {', '.join(EXPERT_PRODUCTS)}, got {choice!r}")
    if choice == "auto":
        if device.type != "cuda":
            return None
        capable = hasattr(torch, "_grouped_mm") and dtype == torch.bfloat16 and \
            torch.cuda.get_device_capability(device) >= (9, 0)
        return "grouped_mm" if capable else "bmm"
    return None if choice == "mv" else choice


def check_resident_quant(offload: OffloadConfig, acts: list) -> None:
    """ValueError naming ``--resident-quant`` for a mode it does not take or an expert layout without one."""
    if offload.resident_quant not in LOW_MODES:
        raise ValueError(f"--resident-quant must be one of {', '.join(LOW_MODES)}, got {offload.resident_quant!r}")
    if offload.quant == offload.resident_quant:
        raise ValueError(f"--resident-quant {offload.resident_quant} beside --quant {offload.quant}: the slots "
                         "already hold that precision (use --quant none or int8 for the full-precision slots)")
    if any(a is None for a in acts):
        raise ValueError("--resident-quant needs gate_up/down experts (the 'linear' layout)")


def compile_kernels(family: Family, m: MoELayer, routing: RoutingConfig, eviction: str, gamma: float,
                    offload: OffloadConfig | None = None, device: torch.device | str = "cpu") -> None:
    """Compile (or load from numba's cache) the cache and routing kernels this run uses, and the q4x8 kernel where
    ``offload``'s int4 experts (``quant``) or int4 dense part (``quant_dense``, ``compile``:
    ``quant.dense_int4_kernel``) run on it on ``device`` (and the fused MoE step of q4moe.py with it; q8x8 where an
    int8 dense matrix runs on it: ``qlinear.int8_kernel``), before the interpreter's RSS is measured for the plan:
    compiling holds tens of MiB for the process's life (LLVM), which the first token would otherwise add beyond the
    plan. Nothing else changes: the runtime builds its own cache and router. A policy that needs inputs given later
    (ERAS's profile) or an offline eviction rule (refused by ``OffloadedModel.configure``) is left to its first use."""
    quant, dense, compiled = (offload.quant, offload.quant_dense, offload.compile) if offload else (None, None, False)
    experts = quant == "int4" and torch.device(device).type == "cpu" and expert_kernel(quant, device) == q4x8.KERNEL
    dense8 = dense in ("int8", "int4-head8") and q8x8.KERNEL == int8_kernel(device, compiled=compiled,
                                                                             weight_only=dense == "int4-head8")
    dense = dense in ("int4", "int4-head8") and dense_int4_kernel(device, compiled=compiled) == q4x8.KERNEL
    if experts or dense:
        q4x8.warm()
    if dense8:  # the int8 dense product on q8x8 (qlinear.int8_kernel)
        q8x8.warm()
    if quant == "int4" and q4moe.enabled() and experts:  # $EXPERTCACHE_FUSED_MOE checked for any int4 run
        q4moe.warm()  # the fused one-token MoE step (step.py)
    if offload and offload.quant_dense and torch.device(device).type == "cpu" and not compiled and hostnorm.enabled():
        hostnorm.warm()  # the one-token RMSNorms ($EXPERTCACHE_HOST_NORM checked for any such run)
    n, k = m.num_experts, m.top_k
    try:
        make_cache(eviction, n, k, gamma=gamma, expert_bytes=1).access_step(list(range(k)))
        if routing.policy != "original":
            Router(routing, num_experts=n, k=k, renormalize=True, scoring=family.scoring).rank(
                0, torch.zeros(1, n), torch.zeros(n, dtype=torch.bool), commit=False)
    except (ValueError, TypeError, RuntimeError):
        pass


def preflight(path: Path, model: nn.Module, layers: list[MoELayer], checkpoint: Checkpoint,
              offload: OffloadConfig, dtype: torch.dtype, device: torch.device) -> dict:
    """The memory plan from the config and the safetensors headers alone, before any weight is read or
    any sidecar written: raises BudgetError (one line, the minimum) for a budget or a container that
    cannot hold this model, so a refusal never follows a large allocation. Measures the interpreter's
    RSS now (the process's baseline) and reads the container's limit; returns those process terms for
    the exact plan (``OffloadedModel._plan``), whose slots are never larger than these upper bounds."""
    o = offload
    num_experts, readers = layers[0].num_experts, o.default_readers(device)
    ids = [m.layer_id for m in layers]
    if o.quant:  # the sidecar may not exist yet: its layout's bytes, at the worst file offset
        qlayout = quant_layout_for(checkpoint, ids[0], o.quant, o.group, dtype, device, o.quant_opt)
        nbytes, slot_extra = qlayout.nbytes, slot_copy_bytes(qlayout, device)  # FBGEMM's copy per slot (fbexperts)
        expert_bytes, io_bytes = nbytes, 0
        slot_bytes = slot_bytes_for(nbytes) + (ALIGN if o.tier == "disk" and o.io == "direct" else 0)
    else:
        slot_extra = 0
        io = o.io if o.tier == "disk" else "cached"
        parts = {(m.index, e): checkpoint.expert(m.layer_id, e) for m in layers for e in range(num_experts)}
        packed = graph_products(o, model, next(iter(parts.values())), dtype, device)
        expert_bytes, slot_bytes, io_bytes = expert_sizes(
            parts, {k: place_expert(p, io, packed=packed) for k, p in parts.items()}, readers)
    dense = {} if o.quant_dense in (None, "none") else dense_targets(model)
    packed_keys = {k for name in dense for k in checkpoint.layout.disk_keys(f"{name}.weight")}
    packed_keys |= {m.key for m in model.modules() if isinstance(m, DiskEmbedding)}  # never read whole
    largest = max((t.nbytes for k, t in checkpoint.entries.items()
                   if not checkpoint.is_expert_key(k) and k not in packed_keys), default=0)
    load = largest  # Checkpoint.tensor's read buffer beside the weights it is copied into
    if o.quant or o.resident_quant:  # the sidecar's writer, if it must be written (counted either way: a bound)
        load = max(load, SIDECAR_TRANSIENT * checkpoint.expert(ids[0], 0).nbytes)
    low = 0 if o.resident_quant is None else low_tier_bytes(
        quant_layout_for(checkpoint, ids[0], o.resident_quant, None, dtype, device), len(layers), num_experts)
    if dense:  # packed a block of rows at a time, straight from the checkpoint
        widest = max(m.weight.shape[1] for m in dense.values())
        load = max(load, DENSE_PACK_TRANSIENT * PACK_ROWS * widest,
                   finish_transient_bytes(model, o.quant_dense, device, compiled=o.compile))
    budget = None if o.memory is None else parse_bytes(o.memory)
    root = os.environ.get("EXPERTCACHE_CGROUP_ROOT", "").strip() or "/"  # a fake tree, for tests; "" = unset
    if budget == AUTO:
        limit, source = container_limit(root)
    else:
        limit, source = cgroup_memory_limit(root), "memory cgroup limit"
    process = dict(baseline_bytes=interpreter_bytes(root, limit is not None and source == "memory cgroup limit"),
                   load_bytes=load, overhead_bytes=RUNTIME_OVERHEAD, limit=limit,
                   limit_source=source)
    plan_from(model, o, dtype, process, dense_mode=o.quant_dense, expert_bytes=expert_bytes, slot_bytes=slot_bytes,
              io_bytes=io_bytes, num_layers=len(layers), num_experts=num_experts, top_k=layers[0].top_k,
              readers=readers, host_bytes=parse_host_memory(o.host_memory) if o.tier == "disk" else 0, low_tier_bytes=low,
              slot_extra=slot_extra)
    return process


def interpreter_bytes(root: str | os.PathLike = "/", in_cgroup: bool = False) -> int:
    """The plan's interpreter term: this process's RSS now; inside a memory cgroup (``in_cgroup``) the smaller of
    that and the cgroup's charge (:func:`~expertcache.container.cgroup_memory_usage`), since the limit counts the
    charge: shared-library pages that another cgroup paged in first are resident here but charged there (the
    ``generate`` of docs/OFFLOAD.md, "The process's memory": RSS 510 MiB, charge about 340 MiB at the plan)."""
    rss = process_rss()
    charged = cgroup_memory_usage(root) if in_cgroup else None
    return rss if charged is None or charged <= 0 else min(rss, charged)


def plan_from(model: nn.Module, o: OffloadConfig, dtype: torch.dtype, process: dict, *, dense_mode: str | None,
              expert_bytes: int, slot_bytes: int, io_bytes: int, num_layers: int, num_experts: int, top_k: int,
              readers: int, host_bytes: int, low_tier_bytes: int = 0, slot_extra: int = 0) -> MemoryPlan:
    """The plan of ``model`` under ``o`` with these expert sizes: ``dense_mode`` None for a loaded model
    (its tensors as they are), ``o.quant_dense`` for the meta skeleton (the same bytes, before loading).
    ``slot_extra``: bytes a slot holds beside its expert where every expert is resident (FBGEMM's copy of an int4
    expert: :func:`~expertcache.offload.fbexperts.slot_copy_bytes`): the plan's slot costs ``slot_bytes +
    slot_extra`` if with it C = N still fits, else ``slot_bytes`` (no copies: the slots keep the int4 kernel)."""
    if slot_extra:
        try:
            plan = plan_from(model, o, dtype, process, dense_mode=dense_mode, expert_bytes=expert_bytes,
                             slot_bytes=slot_bytes + slot_extra, io_bytes=io_bytes, num_layers=num_layers,
                             num_experts=num_experts, top_k=top_k, readers=readers, host_bytes=host_bytes,
                             low_tier_bytes=low_tier_bytes)
            if plan.slots >= num_experts:
                return plan
        except BudgetError:
            pass
    non_expert = dense_bytes(model, dense_mode)
    kv = kv_cache_bytes(model.config, o.context, o.batch, torch.empty((), dtype=dtype).element_size())
    budget = None if o.memory is None else parse_bytes(o.memory)
    slots = num_experts if budget is None and o.capacity is None else o.capacity  # both: plan_memory refuses
    buffered = o.tier == "disk" and o.io != "direct"  # reads through the page cache: in flight per reader
    return plan_memory(budget=budget, slots=slots, non_expert_bytes=non_expert, kv_bytes=kv,
                       expert_bytes=expert_bytes, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                       slot_bytes=slot_bytes, extra_slots=1 + o.prefetch, io_bytes=io_bytes,
                       page_cache_bytes=max(1, readers) * slot_bytes if buffered else 0,
                       host_tier_bytes=num_layers * num_experts * expert_bytes if o.tier == "host" else 0,
                       host_bytes=host_bytes, low_tier_bytes=low_tier_bytes, **process)
