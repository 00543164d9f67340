"""parallel.tp_comm_overlap: sequence parallelism's collectives cut into pieces and run beside the matmuls.

A column-parallel linear followed by a row-parallel one (an MLP's pair) on two gloo ranks, with the overlap and
without, from the same weights and input: the same output and gradients up to the rounding of a matmul over
fewer rows, and the collectives the overlap issues (the same bytes, in pieces). Whole models at the layouts
are in test_parallel_model.py and test_main_params.py.
"""

import pytest
from distributed import run_ranks

B, S, H, F = 2, 8, 16, 48  # a rank's shard of S tokens (the sequence is 2S); fc1 H -> F, fc2 F -> H


def _pair(rank, world, mode):
    import torch
    import torch.distributed as dist
    from megalm.distributed.comm import count_comm
    from megalm.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    group = dist.new_group(list(range(world)))
    dtype = torch.bfloat16 if mode == "bf16_weights" else torch.float32
    g = torch.Generator().manual_seed(0)
    full_w1, full_b1 = torch.randn(F, H, generator=g), torch.randn(F, generator=g)
    full_w2, full_b2 = torch.randn(H, F, generator=g) / F ** 0.5, torch.randn(H, generator=g)
    x_full = torch.randn(B, world * S, H, generator=g)
    grad_full = torch.randn(B, world * S, H, generator=g)
    out = {}
    for overlap in (False, True):
        fc1 = ColumnParallelLinear(H, F, bias=True, group=group, sequence_parallel=True, comm_overlap=overlap)
        fc2 = RowParallelLinear(F, H, bias=True, group=group, sequence_parallel=True, comm_overlap=overlap)
        with torch.no_grad():
            fc1.weight.copy_(full_w1.chunk(world, 0)[rank])
            fc1.bias.copy_(full_b1.chunk(world, 0)[rank])
            fc2.weight.copy_(full_w2.chunk(world, 1)[rank])
            fc2.bias.copy_(full_b2)
        fc1.to(dtype)
        fc2.to(dtype)
        x = x_full.chunk(world, 1)[rank].clone().to(dtype).requires_grad_()  # this rank's sequence shard
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            with count_comm() as fwd:
                y = fc2(torch.nn.functional.gelu(fc1(x)))
        with count_comm() as bwd:
            y.backward(grad_full.chunk(world, 1)[rank].to(y.dtype))
        out[overlap] = {"y": y.detach().float(), "x": x.grad.float(), "w1": fc1.weight.grad.float(),
                        "b1": fc1.bias.grad.float(), "w2": fc2.weight.grad.float(), "b2": fc2.bias.grad.float(),
                        "fwd": (dict(fwd.calls), dict(fwd.bytes)), "bwd": (dict(bwd.calls), dict(bwd.bytes))}
    dist.destroy_process_group(group)
    return out


def _modes(rank, world):
    return {mode: _pair(rank, world, mode) for mode in ("fp32", "autocast", "bf16_weights")}


@pytest.fixture(scope="module")
def pairs():
    return run_ranks(2, _modes)


def test_the_overlapped_pair_computes_what_the_waited_one_does(pairs):
    """fp32: the products over a piece's rows round as a matmul of those rows does, not as the whole's (a few fp32
    ulps, measured: 1e-7 relative); the reduction order of the pieces' reduce-scatters is the whole's."""
    import torch
    for rank in pairs:
        plain, overlapped = rank["fp32"][False], rank["fp32"][True]
        for key in ("y", "x", "w1", "b1", "w2", "b2"):
            torch.testing.assert_close(overlapped[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("mode", ["autocast", "bf16_weights"])
def test_the_overlapped_pair_in_bf16_is_the_waited_one_within_bf16_rounding(pairs, mode):
    """Under autocast (fp32 weights, bf16 matmuls) and with bf16 weights (trainer.mixed_precision=main_params): a
    piece's bf16 matmul rounds its output once as the whole's does, so elements differ by about one bf16 ulp
    (2^-8 relative) where the fp32 accumulation inside differs by ulps; the tolerance is two of them."""
    import torch
    for rank in pairs:
        plain, overlapped = rank[mode][False], rank[mode][True]
        for key in ("y", "x", "w1", "b1", "w2", "b2"):
            scale = plain[key].abs().max().item()
            torch.testing.assert_close(overlapped[key], plain[key], rtol=2 ** -7, atol=2 ** -7 * scale, msg=key)


def test_the_collectives_move_the_same_bytes_in_pieces(pairs):
    """Two ranks, a shard of 8 tokens: 2 pieces. Forward: fc1's input gathered in 2 all-gathers (half the shard
    each), fc2's partial output reduce-scattered in 2. Backward: fc2's output gradient gathered in 2 pieces; fc1's
    input gathered again and its gradient reduce-scattered whole, each beside a matmul. The bytes are the waited
    pair's, so the volume the planner counts holds."""
    for rank in pairs:
        plain, overlapped = rank["fp32"][False], rank["fp32"][True]
        assert plain["fwd"][0] == {"all_gather": 1, "reduce_scatter": 1}
        assert overlapped["fwd"][0] == {"all_gather": 2, "reduce_scatter": 2}
        assert plain["bwd"][0] == {"all_gather": 2, "reduce_scatter": 1}
        assert overlapped["bwd"][0] == {"all_gather": 3, "reduce_scatter": 1}
        assert overlapped["fwd"][1] == plain["fwd"][1] and overlapped["bwd"][1] == plain["bwd"][1]
