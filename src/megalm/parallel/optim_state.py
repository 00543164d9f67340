"""An optimizer's lazy state (Adam's moments), made before its first step so a checkpoint can hold it and a
load can fill it, without changing what that first step does."""

from __future__ import annotations

from typing import List

import torch


def create_state(optimizer: torch.optim.Optimizer, tensors: List[torch.Tensor]) -> None:
    """Create `optimizer`'s state for `tensors` (what it steps) when it has none: a step at lr 0 on zero gradients
    (the gradients the tensors hold are put back), then its step counts set back to 0. Adam's zero moments at step 0
    are a fresh Adam's, so the next real step is the one a fresh optimizer takes (torch's own initialiser leaves step
    1, which changes Adam's bias correction for the rest of the run)."""
    if optimizer.state:
        return
    grads = [t.grad for t in tensors]
    for t in tensors:
        t.grad = torch.zeros_like(t)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for t, g in zip(tensors, grads):
        t.grad = g
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
