"""megalm.plan: what each rank of a layout holds, computes and sends, and what a step costs on a cluster,
before any run (`python -m megalm.plan`, megalm.plan.cli). Every formula it estimates with cites its
source; one module for each quantity:

- shapes: the sizes the formulas read off a config (`_Shape`: one micro-batch on one rank);
- flops: a pipeline stage's FLOPs, forward and backward, from the family's one FLOPs definition;
- traffic: the bytes a stage moves outside its matmuls, counted op by op on fake tensors;
- activations (with attention and moe): what autograd keeps for backward per layer, per stage and at
  a rank's peak under its schedule (Korthikanti et al. 2022, with megalm's own coefficients);
- layout: what one rank holds, read off the meta-device model over a fake process group;
- collectives (with group_collectives and expert_collectives): the collectives of one optimizer step
  on a rank, counted as megalm.distributed.comm counts them; model_state: the exact model state it holds;
- collective_time: the time of one collective (the alpha-beta model with the ring's bus-bandwidth
  factors) over the link between the ranks of its group;
- schedules: the order each rank runs its actions in, and an event simulation of that order with
  per-action times, which gives the bubble;
- step_time: step time, tokens/s and MFU on a cluster profile;
- positions (`plan`) and layout_search (`search`): one layout's rank positions, and the layouts of a GPU
  count ranked; cli: the command line, its table and JSON.

Context parallelism (parallel.cp) runs through all of them: a rank's seq_length / cp tokens, the ring
attention's saved tensors, the ring's sends and their overlap with the attention, gradients and ZeRO
shards over dp x cp. So does a mixture of experts (model.num_experts > 0, megalm.models.moe): the FLOPs of k
experts a token and the router; what its router and experts keep (`moe_kept_bytes`), planned for balanced
routing (`moe_rows`: dropless, tokens x k rows; under expert parallelism every rank receiving as many rows
as it sends); each tp rank routing its own tokens; expert parallelism's all-to-alls (`expert_parallel`),
waited on in the step time; the experts' buckets over the (dp / ep) x cp ranks holding them (`expert_data_parallel`),
ZeRO-3's gathers of them there too. Under expert tensor parallelism (parallel.expert_tp) each expert is split
over tp and every tp rank runs all tp ranks' rows through its slices: tp x the rows' fc1 inputs and grouping
indices kept (`moe_kept_bytes`), the rows' all-to-alls over tp, forward and backward (`expert_tensor_parallel`),
and the counts' gather (`untracked_collectives`), both under "tp" and waited on like tp's collectives, the
experts' tp slices in the gradient norm (`other`).

Each estimate is checked against a measured run: tests/test_plan_activations.py (saved tensors),
tests/test_plan_collectives.py (count_comm and the held model state), tests/test_plan.py
(schedules, step time, search) and scripts/bench_pp.py (the bubble).
"""

from megalm.plan.cli import compose, format_search, format_table, main
from megalm.plan.layout_search import candidates, expert_params_per_layer, search, stage_params_estimate
from megalm.plan.positions import plan, rank_params

__all__ = ["candidates", "compose", "expert_params_per_layer", "format_search", "format_table", "main", "plan",
           "rank_params", "search", "stage_params_estimate"]
