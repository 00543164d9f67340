"""Which layers each pipeline stage holds and which stages each rank runs: arithmetic only (no torch),
shared by validation and the pipeline."""

from __future__ import annotations

from typing import List, Optional

from megalm.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb", "zbv")


def stage_layer_ranges(num_layers: int, num_stages: int, layers_per_stage: Optional[List[int]]) -> List[range]:
    """Layer range of every (virtual) stage; every layer exactly once, or a ValueError."""
    if layers_per_stage:
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise ConfigError(f"parallel.layers_per_stage has {len(counts)} entries but the pipeline has "
                              f"pp * virtual_pipeline_size = {num_stages} stages")
        if any(c < 0 for c in counts) or sum(counts) != num_layers:
            raise ConfigError(f"parallel.layers_per_stage={counts} must be non-negative and sum to "
                              f"model.num_layers={num_layers} (sums to {sum(counts)}): no layer dropped or doubled")
        if any(c == 0 for c in counts[1:-1]):
            raise ConfigError(f"parallel.layers_per_stage={counts}: only the first and last stage may hold no layer")
    else:
        if num_layers % num_stages:
            raise ConfigError(f"model.num_layers={num_layers} does not split evenly over pp * "
                              f"virtual_pipeline_size = {num_stages} stages; set parallel.layers_per_stage "
                              "to an explicit list (e.g. fewer layers on the first and last stage)")
        counts = [num_layers // num_stages] * num_stages
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def virtual_stages_of(pp_rank: int, pp: int, vpp: int, schedule: str) -> List[int]:
    """Stage indices a rank runs: looped (r, r + pp, ...), or V-shaped for ZBV (r, 2 pp - 1 - r)."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(vpp)]
