"""The compute device of a command or an adapter: ``--device {auto,cpu,cuda,cuda:N}`` resolved to a
``torch.device`` (one declaration, read by the CLI, the lm-eval adapter and the benchmarks)."""

from __future__ import annotations

__all__ = ["DEVICE_CHOICES", "on_host", "parse_device", "resolve_device", "to_device", "to_host", "to_host_many"]

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def parse_device(text: str) -> str:
    """The canonical spelling of a device name (``auto``, ``cpu``, ``cuda``, ``cuda:N``); ValueError otherwise.
    Syntax only: whether the device exists is :func:`resolve_device`'s check."""
    t = str(text).strip().lower()
    if t in ("auto", "cpu", "cuda"):
        return t
    if t.startswith("cuda:") and t[5:].isdigit():
        return f"cuda:{int(t[5:])}"
    raise ValueError(f"--device {text}: not a device; choose {DEVICE_CHOICES}")


def resolve_device(spec=None):
    """The ``torch.device`` of a device name (None = ``auto``: ``cuda:0`` when torch sees a CUDA device, else
    ``cpu``). A CUDA device this torch build or machine does not have is a ValueError naming ``--device`` (the
    CLI prints it as one line and exits 2)."""
    import torch

    spec = parse_device(str(spec) if spec is not None else "auto")
    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if torch.version.cuda is None:
        raise ValueError(f"--device {spec}: this torch build ({torch.__version__}) has no CUDA; use --device cpu or "
                         "install a CUDA build of torch")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ValueError(f"--device {spec}: torch sees no CUDA device (CUDA_VISIBLE_DEVICES, driver?); use "
                         "--device cpu")
    dev = torch.device("cuda:0" if spec == "cuda" else spec)
    if dev.index >= n:
        raise ValueError(f"--device {spec}: only {n} CUDA device(s) visible (cuda:0..cuda:{n - 1})")
    return dev


def on_host(device) -> bool:
    """Whether ``device`` is the host itself (``cpu``): no copy between it and the host. A CUDA device, or the
    test proxy's ``cpu:0`` (``tests/device_proxy.py``: CPU memory standing for a device), is not."""
    if isinstance(device, str):
        import torch

        device = torch.device(device)
    return device.type == "cpu" and device.index is None


def to_device(t, device):
    """``t`` (host memory) on ``device`` without the host waiting: staged in page-locked memory and copied
    with ``non_blocking=True`` (torch's pinned allocator keeps the staging block until the copy has run, so
    it is never overwritten early). ``t`` itself when ``device`` is the host; ``t.to(device)`` when ``t`` is in
    device memory already."""
    if not on_host(t.device):
        return t.to(device)
    if on_host(device):
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t):
    """``t`` (device memory) in host memory: one copy into a page-locked buffer and one wait for it (the
    device→host transfer a step allows itself). ``t`` itself when it is on the host already."""
    import torch

    if on_host(t.device):
        return t
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t, non_blocking=True)
    if t.device.type == "cuda":  # pragma: no cover - GPU only
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))
        done.synchronize()
    return buf


def to_host_many(*tensors):
    """The ``tensors`` (device memory) in host memory with ONE transfer: flattened, packed as float32 (exact
    for float16/bfloat16/float32 values and for integers below 2**24 -- expert ids, token masks), copied
    (:func:`to_host`) and unpacked to their own shapes and dtypes. The tensors themselves on the host."""
    import torch

    if not tensors or on_host(tensors[0].device):
        return tensors
    if len(tensors) == 1 or any(t.dtype == torch.float64 for t in tensors):  # (float64 would not pack exactly)
        return tuple(to_host(t) for t in tensors)
    flat = to_host(torch.cat([t.reshape(-1).float() for t in tensors]))
    out, at = [], 0
    for t in tensors:
        n = t.numel()
        out.append(flat[at:at + n].to(t.dtype).reshape(t.shape))
        at += n
    return tuple(out)
