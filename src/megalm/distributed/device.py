"""The torch device a run or a command asks for by name, checked against what this machine has.

One resolver for the trainer (trainer.device) and the commands that load a run (--device of
generate, evaluate, serve), so that every one accepts the same names and says the same thing
when CUDA is asked for and absent.
"""

from __future__ import annotations

import torch

from megalm.errors import ConfigError, DeviceError


def resolve_device(name: str, option: str = "trainer.device") -> torch.device:
    """The device `name` names: "auto" is CUDA where a GPU is visible, else the CPU; "cpu", "cuda",
    "cuda:N" as torch reads them. `option` is the setting it came from, as the user wrote it
    ("trainer.device", "--device"), for the messages: ConfigError for a name that is no device,
    DeviceError for CUDA where none is visible."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{option}={name!r} is not a device: allowed: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"{option}={name} but no CUDA device is visible: use {option}=cpu or auto")
    return device
