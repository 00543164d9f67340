"""What the C library's malloc does with the large blocks a CPU step frees (`trainer.cpu_allocator`).

glibc gives a block above its mmap threshold (32 MiB at most) a mapping of its own and unmaps it when
it is freed, and it hands the top of its heap back to the OS once more than the trim threshold lies
free there. A CPU training step frees and allocates the same large tensors every step (the logits,
their gradient, the activations), so under those defaults it writes into fresh pages each time: one
page fault per 4 KiB page, and zeroing by the kernel. A 64 MiB matmul output measured about 20 ms
slower into a fresh tensor than into a reused one on the 2-core CPU of docs/PERFORMANCE.md ("The
CPU allocator"). PyTorch's CPU allocator calls malloc; it keeps no cache of its own.

`reuse` (the default on CPU) turns off malloc's own mappings and its trimming (glibc's `mallopt`), so
memory freed in a step stays in the process for the next step: the process keeps its peak, as CUDA's
caching allocator does on a GPU. `system` leaves the C library as it is, MALLOC_* environment variables
included. torch's own launcher (`torch.backends.xeon.run_cpu`) reaches the same end by preloading
jemalloc or tcmalloc, which has to happen before the process starts; mallopt is glibc's call for it
from inside a running process.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

CHOICES = ("reuse", "system")

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER = -1  # as M_TRIM_THRESHOLD: trimming off (mallopt(3))


def _glibc() -> Optional[ctypes.CDLL]:
    """This process's C library when it is glibc (mallopt's parameters are glibc's), else None."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):  # glibc alone answers this
            return None
    except (ValueError, OSError, AttributeError):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") else None


def apply_cpu_allocator(choice: str) -> Optional[str]:
    """Set malloc's policy for `choice` in this process; returns why it could not be, or None when done
    (`system` is always done: nothing changes)."""
    if choice not in CHOICES:
        raise ValueError(f"trainer.cpu_allocator={choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "system":
        return None
    libc = _glibc()
    if libc is None:
        return "the C library is not glibc, so its malloc is left as it is"
    # Blocks of any size from the heap (none mapped on their own), and a heap that is never trimmed.
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER)):
        return "glibc's mallopt refused the settings"
    return None


def mapped_bytes() -> int:
    """Bytes glibc's malloc holds in blocks mapped on their own (mallinfo2's hblkhd): what `reuse` keeps at 0
    for blocks allocated after it; -1 off glibc."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return -1

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    return int(libc.mallinfo2().hblkhd)
