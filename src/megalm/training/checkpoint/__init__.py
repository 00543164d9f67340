"""Checkpoints through torch.distributed.checkpoint (DCP).

DCP stores every tensor with its global shape, which is what lets a later change load a
checkpoint at another parallel layout. Layout on disk:

    <dir>/step_00000100/        DCP shards + .metadata, trainer_state.json, config.yaml, manifest.json
    <dir>/latest                name of the newest step folder, written last (for people and tools)
    <dir>/best                  checkpoint.save_best: the step folder of the best evaluation (kept from pruning);
                                evaluate, generate, serve and convert read it instead of `latest`

Every tensor is stored under its global name and full shape, the vocabulary matrices with only
the real rows (their padding depends on tp), so a checkpoint holds the same keys and shapes
whatever layout it was written at. Each rank writes only the blocks it holds (tensor-parallel
shards, ZeRO's flat ranges: sharded_state.py, chunks.py) with their global offsets, nothing is
gathered, and a load reads into each rank's own tensors whatever blocks overlap them.

Order of a save: every rank writes its blocks into <dir>/.step_XXXXXXXX.tmp (DCP); rank 0 adds
trainer_state.json, then the manifest (manifest.py), renames the folder into place, then replaces
`latest`. A crash, even kill -9, leaves a .tmp folder, which nothing loads, or a whole one. With
async_save the blocks are copied to CPU memory, the write and the manifest run in background
threads, and the rename waits for them at the next save or at finish(): at most one save is
ever in flight.

Auto-resume (Checkpointer.latest) takes the newest step folder that matches its manifest,
logging and skipping damaged ones; an explicit checkpoint.load that does not match is an error.
Folders from before manifests load unverified, with a warning.

The modules: checkpointer (Checkpointer: save, load, which folder), paths (a step folder's own
files, finding one), manifest (sizes and checksums), sharded_state and chunks (a rank's blocks
of the global tensors), shapes (stored against expected tensors), safe_load (reading without
running code from the files), random_state (the shared and per-rank random streams).
"""

from megalm.training.checkpoint.checkpointer import Checkpointer, CorruptCheckpointError, load_model_weights
from megalm.training.checkpoint.paths import CONFIG_FILE, STATE_FILE, kept_best, resolve, run_checkpoints

__all__ = ["CONFIG_FILE", "STATE_FILE", "Checkpointer", "CorruptCheckpointError", "kept_best", "load_model_weights",
           "resolve", "run_checkpoints"]
