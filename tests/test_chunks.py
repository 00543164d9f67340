"""Sharded checkpoint geometry: the blocks every rank holds tile the global tensor exactly.

Independent reference: the full tensor itself, cut by TPShard.local (the code that shards the
model) and by arbitrary flat ranges (as ZeRO buckets cut parameters)."""

import pytest
import torch

from megalm.distributed.shards import TPShard
from megalm.training.checkpoint.chunks import Chunked, ChunkedSavePlanner, place
from megalm.training.checkpoint.safe_load import load_state, read_metadata

CASES = [  # (padded global shape, tp dim, segments, real rows)
    ((24, 6), 0, None, None),          # column-parallel weight
    ((6, 24), 1, None, None),          # row-parallel weight
    ((36, 6), 0, (12, 12, 12), None),  # fused QKV: [q | k | v], each split
    ((40, 6), 0, (24, 8, 8), None),    # GQA: fewer k, v rows
    ((32, 6), 0, None, 27),            # vocabulary rows padded from 27
    ((24,), 0, None, None),            # column-parallel bias
    ((7, 5), None, None, None),        # replicated
    ((9,), None, None, None),
]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("shape,dim,segments,rows", CASES)
def test_blocks_of_every_rank_tile_the_global_tensor(shape, dim, segments, rows, tp):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    expected = full[:rows] if rows is not None else full
    seen = torch.zeros_like(expected)
    count = torch.zeros_like(expected)
    world = tp if dim is not None else 1
    g = torch.Generator().manual_seed(len(shape) + tp)
    for r in range(world):
        spec = TPShard(dim, r, world, segments) if dim is not None else None
        local = (spec.local(full) if spec is not None else full).clone()
        n = local.numel()
        cuts = sorted(set([0, n] + torch.randint(0, n, (3,), generator=g).tolist()))  # uneven flat ranges
        for a, b in zip(cuts, cuts[1:]):
            flat = local.view(-1)[a:b]
            size, blocks = place(flat, local.shape, a, b, spec, rows)
            assert size == expected.shape
            for off, v in blocks:
                region = tuple(slice(o, o + s) for o, s in zip(off, v.shape))
                seen[region] += v
                count[region] += 1
                v.add_(1000)  # a view of the rank's own memory: loading writes in place
        # every element this rank holds was in a block (marked +1000), except the padding rows
        kept = (local >= 1000).sum().item()
        pad = 0 if rows is None else (spec.local(full) if spec is not None else full).ge(rows * shape[-1]).sum().item()
        assert kept == n - pad
    assert torch.equal(count, torch.ones_like(count))
    assert torch.equal(seen, expected)


@pytest.mark.parametrize("ep,tp,dim", [(1, 1, 0), (2, 1, 0), (4, 1, 0), (2, 2, 2), (1, 3, 1), (2, 2, 1), (4, 3, 2)])
def test_stacked_experts_are_the_rows_of_each_expert_and_split_by_expert(ep, tp, dim):
    """A mixture's (E, in, out) expert stack is stored as (E x in, out), expert after expert. Expert
    parallelism's dim-0 shard holds whole experts, a contiguous range of those rows; expert tensor
    parallelism splits each expert too: its columns (dim 2, fc1's [gate | up], each split) or its rows
    (dim 1, fc2's). Every element lands once at its place, from ZeRO's flat ranges that cut experts."""
    full = torch.arange(4 * 6 * 12, dtype=torch.float32).view(4, 6, 12)
    expected = full.reshape(24, 12)
    seen = torch.zeros_like(expected)
    for r in range(ep * tp):
        experts = TPShard(0, r // tp, ep) if ep > 1 else None
        spec = TPShard(dim, r % tp, tp, (6, 6) if dim == 2 else None) if tp > 1 else None
        local = full
        for s in (experts, spec):
            local = s.local(local) if s is not None else local
        local = local.clone()
        n = local.numel()
        for a, b in ((0, n // 3 + 1), (n // 3 + 1, n)):  # two flat ranges, as ZeRO buckets cut
            size, blocks = place(local.view(-1)[a:b], local.shape, a, b, spec, experts=experts)
            assert size == expected.shape
            for off, v in blocks:
                assert torch.equal(v, expected[tuple(slice(o, o + k) for o, k in zip(off, v.shape))])
                seen[tuple(slice(o, o + k) for o, k in zip(off, v.shape))] += 1
    assert torch.equal(seen, torch.ones_like(expected))


def test_four_dimensional_tensors_are_refused():
    with pytest.raises(ValueError, match=r"1-D, 2-D or stacked 2-D tensors, not shape \(2, 2, 2, 2\)"):
        place(torch.zeros(16), (2, 2, 2, 2), 0, 16)


def _save_tp2(rank, world, path):
    import torch.distributed.checkpoint as dcp
    full = torch.arange(40 * 6, dtype=torch.float32).view(40, 6)
    spec = TPShard(0, rank, world, (24, 8, 8))  # GQA-like fused rows
    local = spec.local(full).clone()
    n = local.numel()
    state = {"qkv": Chunked(*place(local.view(-1), local.shape, 0, n, spec)),
             "norm": Chunked(*place(torch.ones(6), (6,), 0, 6)),  # replicated: one rank writes it
             "step": 7}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), planner=ChunkedSavePlanner())


def test_blocks_saved_at_one_split_load_at_another(tmp_path):
    """Saved by two tensor-parallel ranks; loaded whole, and as tp4 shards cut in ZeRO halves."""
    from distributed import run_ranks
    run_ranks(2, _save_tp2, str(tmp_path))
    full = torch.arange(40 * 6, dtype=torch.float32).view(40, 6)
    assert read_metadata(tmp_path).state_dict_metadata["qkv"].size == full.shape
    whole = {"qkv": torch.zeros(40, 6), "norm": torch.zeros(6), "step": 0}
    load_state(whole, tmp_path)
    assert torch.equal(whole["qkv"], full) and torch.equal(whole["norm"], torch.ones(6)) and whole["step"] == 7
    for r in range(4):
        spec = TPShard(0, r, 4, (24, 8, 8))
        local = torch.zeros(10, 6)
        half = local.numel() // 2 + 3  # a flat cut in the middle of a row
        for a, b in ((0, half), (half, local.numel())):
            state = {"qkv": Chunked(*place(local.view(-1)[a:b], local.shape, a, b, spec))}
            load_state(state, tmp_path)
        assert torch.equal(local, spec.local(full)), r
