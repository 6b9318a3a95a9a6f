"""`train.device` to a torch.device, checked: an unknown or absent device is a clear error."""

from __future__ import annotations

import torch

from kiln.errors import KilnError

_HINT = "use auto, cpu, cuda or cuda:N"


def resolve_device(name: str) -> torch.device:
    """'auto': cuda when present, else cpu; otherwise the named device, which must exist here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise KilnError(f"train.device {name!r} is not a device torch knows; {_HINT}") from None
    if device.type == "cpu":
        return device
    if device.type == "meta":
        raise KilnError(f"train.device {name!r}: the meta device holds no data and cannot "
                        f"train; {_HINT}")
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        built = f"torch {torch.__version__}"
        raise KilnError(f"train.device {name!r}: no {device.type} device is available here "
                        f"({built}); {_HINT} (auto picks what is there)")
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise KilnError(f"train.device {name!r}: there {'is' if count == 1 else 'are'} only "
                        f"{count} {device.type} device{'' if count == 1 else 's'} here "
                        f"(indices 0 to {count - 1})")
    return device
