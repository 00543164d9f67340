"""How long a group's collectives take: the alpha-beta model with the ring's bus-bandwidth factors
(`collective_seconds`), the global ranks a group spans (megalm.distributed.mesh's order) and the cluster's link
between them (`link`)."""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple


# Bytes each rank puts on its link per byte of the message CommStats records (megalm.distributed.comm:
# all_reduce counts the full tensor, all_gather the local input, reduce_scatter the full input), for
# ring algorithms over p ranks (Thakur, Rabenseifner and Gropp 2005; NCCL's nccl-tests
# doc/PERFORMANCE.md gives the same factors as its bus bandwidth: all-reduce 2(p-1)/p, all-gather and
# reduce-scatter (p-1)/p of the full buffer).
def wire_factor(kind: str, p: int) -> float:
    if p <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (p - 1) / p
    if kind == "all_gather":  # the recorded size is the local input, 1/p of the full buffer
        return p - 1
    if kind == "reduce_scatter":
        return (p - 1) / p
    if kind in ("send", "recv", "broadcast", "ring"):
        return 1.0
    if kind == "all_to_all":  # the recorded size is what a rank sends; (p - 1) / p of it leaves the rank
        return (p - 1) / p
    raise ValueError(f"unknown collective kind {kind!r}: all_reduce, all_gather, reduce_scatter, send, recv, ring, "
                     "all_to_all")


def latency_steps(kind: str, p: int) -> int:
    """Messages in sequence a ring needs: 2(p - 1) for all-reduce, p - 1 for the others, 1 point to point
    (a pipeline send, a cp ring's send to its neighbour)."""
    if p <= 1:
        return 0
    if kind in ("send", "recv", "broadcast", "ring"):
        return 1
    return 2 * (p - 1) if kind == "all_reduce" else p - 1  # all_to_all: p - 1 pairwise exchanges


def collective_seconds(kind: str, nbytes: float, p: int, bandwidth: float, latency: float,
                       calls: int = 1) -> float:
    """Time of `calls` collectives of `kind` moving `nbytes` in all (as CommStats counts them) over p
    ranks: alpha x steps + bytes on the wire / bandwidth (Hockney's model; the ring's factors above)."""
    if p <= 1 or (nbytes <= 0 and calls <= 0):
        return 0.0
    return calls * latency_steps(kind, p) * latency + wire_factor(kind, p) * nbytes / bandwidth


# ---------------------------------------------------------------------------------------------
# Rank placement (megalm.distributed.mesh: (pp, dp, cp, tp), tp varying fastest)
# ---------------------------------------------------------------------------------------------

def group_ranks(dims, dim: str, rank: int) -> List[int]:
    """The global ranks of `rank`'s group along mesh dimension `dim`."""
    sizes = {"pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "tp": dims.tp}
    order = ["pp", "dp", "cp", "tp"]
    stride = 1
    for name in reversed(order):
        if name == dim:
            break
        stride *= sizes[name]
    index = (rank // stride) % sizes[dim]
    base = rank - index * stride
    return [base + i * stride for i in range(sizes[dim])]


def replica_ranks(dims, rank: int) -> List[int]:
    """The global ranks holding the same weights as `rank`: its dp group, or dp x cp flattened under context
    parallelism (megalm.distributed.mesh.replica_mesh), over which gradients are reduced."""
    return sorted({r for d in group_ranks(dims, "dp", rank) for r in group_ranks(dims, "cp", d)})


def expert_ranks(dims, ep: int, rank: int, which: str) -> List[int]:
    """The global ranks of `rank`'s expert-parallel group ("ep": its block of ep consecutive dp ranks) or
    expert-data-parallel group ("edp": the dp ranks at its place in every block, with every cp rank of each),
    as megalm.parallel.experts.expert_groups cuts dp."""
    dp_ranks = group_ranks(dims, "dp", rank)
    d = dp_ranks.index(rank)
    if which == "ep":
        return [dp_ranks[i] for i in range(d - d % ep, d - d % ep + ep)]
    return sorted(q for i in range(d % ep, dims.dp, ep) for q in group_ranks(dims, "cp", dp_ranks[i]))


def inside_one_node(ranks: Sequence[int], devices_per_node: int) -> bool:
    return len({r // devices_per_node for r in ranks}) == 1


def link(cluster, ranks: Sequence[int]) -> Tuple[Optional[float], float]:
    """(effective bytes/s, latency) of a group: NVLink inside one node, the network otherwise. Across nodes a
    group with k ranks on each node crosses between nodes on k devices' shares of the network at once (NCCL
    splits a collective over channels, each ring through its own device's adapter on a node with one per
    device, as DGX H100 has), so its ring runs at min(k x the network, NVLink): k = 1 when every rank sits on
    a node of its own, or when the group's ranks are shared unevenly (its fewest on any node). Bandwidth None
    when the profile does not give it."""
    intra = inside_one_node(ranks, cluster.devices_per_node)
    lat = cluster.intra_node_latency if intra else cluster.inter_node_latency
    if intra:
        bw = cluster.intra_node_bandwidth
    elif cluster.inter_node_bandwidth:
        rails = min(Counter(r // cluster.devices_per_node for r in ranks).values())
        bw = rails * cluster.inter_node_bandwidth
        if rails > 1 and cluster.intra_node_bandwidth:
            bw = min(bw, cluster.intra_node_bandwidth)
    else:
        bw = None
    return (bw * cluster.comm_efficiency if bw else None), lat


def group_seconds(kinds: Dict[str, Dict[str, float]], p: int, bandwidth: float, latency: float) -> float:
    """Time of a group's collectives of one step, {kind: {"calls", "bytes"}} as CommStats counts them."""
    return sum(collective_seconds(k, v["bytes"], p, bandwidth, latency, int(v["calls"])) for k, v in kinds.items())
