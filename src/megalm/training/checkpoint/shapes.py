"""Which model tensors a checkpoint holds, against those a model expects, before DCP loads.

DCP's own error names only the first size mismatch, and it silently skips stored tensors the
model lacks (a checkpoint of more layers would load into fewer), so a wrong model.* setting
is best reported here, all at once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Sequence

import torch.distributed as dist

from megalm.errors import CheckpointError

log = logging.getLogger("megalm.checkpoint")
_LISTED = 40  # differences named per kind in the error; the rest are counted


class ShapeMismatchError(CheckpointError, ValueError):
    """The checkpoint holds tensors of another model config."""


def check_shapes(path: Path, metadata, model_sd, gather: bool = True, fresh: Sequence[str] = (),
                 ignore_unexpected: bool = False) -> List[str]:
    """Raise, listing every difference, if the stored model tensors are not the ones `model_sd`
    expects. `metadata`: flattened key ("model.blocks.0.attn.qkv.weight") -> DCP metadata, as
    safe_load.read_metadata gives it (state_dict_metadata). Both sides are global shapes (real vocabulary rows; `model_sd` holds a rank's
    Chunked entries, megalm.training.checkpoint.sharded_state); a pipeline stage holds only its layers, so
    the expectation is the union over every rank (gather=False: `model_sd` is the whole model already).

    Fine-tuning: tensors of the modules in `fresh` (new heads) may be missing from the checkpoint,
    and with `ignore_unexpected` stored tensors the model lacks (the pretraining heads) are
    passed over. Returns the model keys the load must leave out (missing fresh tensors)."""
    expected = {k: tuple(v.size()) if hasattr(v, "size") else None for k, v in model_sd.items()}
    if gather and dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, expected)
        expected = {k: v for part in every for k, v in part.items()}
    stored = {k[len("model."):]: tuple(m.size) if hasattr(m, "size") else None
              for k, m in metadata.items() if k.startswith("model.")}
    mismatched = [f"{k}: stored {stored[k]}, expected {shape}" for k, shape in expected.items()
                  if k in stored and stored[k] != shape]
    missing = sorted(set(expected) - set(stored))
    skipped = [k for k in missing if any(k.startswith(f + ".") for f in fresh)]
    missing = [k for k in missing if k not in skipped]
    unexpected = sorted(set(stored) - set(expected))
    if ignore_unexpected and unexpected:
        log.info("fine-tuning: %d tensors of %s are not in this model and are not loaded (%s%s)", len(unexpected),
                 path, ", ".join(unexpected[:8]), ", ..." if len(unexpected) > 8 else "")
        unexpected = []
    if skipped:
        log.info("fine-tuning: %s start from their initialisation (not in %s)", ", ".join(skipped), path)
    if not (mismatched or missing or unexpected):
        return skipped
    lines = [f"checkpoint {path} does not fit this model config (model.* sizes or layer count differ?):"]
    for title, items in (("shapes differ", mismatched), ("in the model, not in the checkpoint", missing),
                         ("in the checkpoint, not in the model", unexpected)):
        if items:
            shown = items[:_LISTED] + ([f"... and {len(items) - _LISTED} more"] if len(items) > _LISTED else [])
            lines.append(f"  {title} ({len(items)}):\n    " + "\n    ".join(shown))
    raise ShapeMismatchError("\n".join(lines))
