"""The compute device of a command or an adapter: ``--device {auto,cpu,cuda,cuda:N}`` resolved to a
``torch.device`` (one declaration, read by the CLI, the lm-eval adapter and the benchmarks)."""

from __future__ import annotations

__all__ = ["DEVICE_CHOICES", "parse_device", "resolve_device"]

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
