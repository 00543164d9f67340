"""Tensor-parallel layers, collectives and RNG streams against their serial counterparts.

Each world size spawns its gloo ranks once (tests/distributed.py) and runs every check inside
that one call: every rank builds the same full weights and serial reference, runs its shard,
gathers shard gradients with full_from_shards, and returns max errors and comm records that the
parent process asserts on.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks
from megalm.distributed import comm
from megalm.distributed.comm import count_comm, gather_seq, reduce_scatter_seq, copy_to_tp
from megalm.parallel.random import TPRNG
from megalm.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                    vocab_parallel_cross_entropy)
from megalm.distributed.shards import TPShard, full_from_shards

B, T, H, FFN = 2, 8, 16, 32
QKV = (64, 16, 16)  # q, k, v of 4 query and 1 kv heads of 16 channels (GQA)
VOCAB, PADDED = 50, 52
TOL = 2e-5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=_gen(seed))


def _diff(a, b):
    return (a.detach() - b.detach()).abs().max().item()


def _gather(t, world):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return parts


def _sharded(module, **full):
    """Allocate for real and load this rank's shard of each full tensor, as init_weights does."""
    module.to_empty(device="cpu")
    with torch.no_grad():
        for name, tensor in full.items():
            p = getattr(module, name)
            shard = getattr(p, "tp_shard", None)
            p.copy_(tensor if shard is None else shard.local(tensor))
    return module


def _full_grad(p, world):
    return full_from_shards(_gather(p.grad, world), p.tp_shard)


def _seq(x, rank, world):
    return x.chunk(world, dim=1)[rank]


def _linear_checks(rank, world, g, out):
    x = _randn(B, T, H, seed=1).requires_grad_()
    # Column parallel, plain and fused QKV, with and without gathering the output.
    for tag, n_out, segs in (("col", FFN, None), ("col_qkv", sum(QKV), QKV)):
        w, b, gy = _randn(n_out, H, seed=2), _randn(n_out, seed=3), _randn(B, T, n_out, seed=4)
        ref = nn.Linear(H, n_out)
        with torch.no_grad():
            ref.weight.copy_(w), ref.bias.copy_(b)
        y_ref = ref(x)
        (y_ref * gy).sum().backward()
        x_grad_ref, x.grad = x.grad.clone(), None
        out_shard = TPShard(-1, rank, world, segs)
        for gather in (False, True):
            col = _sharded(ColumnParallelLinear(H, n_out, bias=True, group=g, segments=segs,
                                                gather_output=gather, device="meta"), weight=w, bias=b)
            y = col(x)
            out[f"{tag}_g{gather}_width"] = (y.shape[-1], col.out_features)
            out[f"{tag}_g{gather}_y"] = _diff(y, y_ref if gather else out_shard.local(y_ref))
            (y * (gy if gather else out_shard.local(gy))).sum().backward()
            out[f"{tag}_g{gather}_dx"] = _diff(x.grad, x_grad_ref)
            out[f"{tag}_g{gather}_dw"] = _diff(_full_grad(col.weight, world), ref.weight.grad)
            out[f"{tag}_g{gather}_db"] = _diff(_full_grad(col.bias, world), ref.bias.grad)
            x.grad = None
    # Row parallel: the input arrives split on its last dim.
    w, b, gz = _randn(H, FFN, seed=5), _randn(H, seed=6), _randn(B, T, H, seed=7)
    xin = _randn(B, T, FFN, seed=8).requires_grad_()
    ref = nn.Linear(FFN, H)
    with torch.no_grad():
        ref.weight.copy_(w), ref.bias.copy_(b)
    z_ref = ref(xin)
    (z_ref * gz).sum().backward()
    row = _sharded(RowParallelLinear(FFN, H, bias=True, group=g, device="meta"), weight=w, bias=b)
    out["row_replicated_bias_has_no_shard"] = not hasattr(row.bias, "tp_shard")
    x_local = xin.detach().chunk(world, dim=-1)[rank].clone().requires_grad_()
    z = row(x_local)
    (z * gz).sum().backward()
    out["row_y"] = _diff(z, z_ref)
    out["row_dx"] = _diff(x_local.grad, xin.grad.chunk(world, dim=-1)[rank])
    out["row_dw"] = _diff(_full_grad(row.weight, world), ref.weight.grad)
    out["row_db"] = _diff(row.bias.grad, ref.bias.grad)


def _mlp(rank, world, g, sp, out, tag):
    """fc1 (column) → GELU → fc2 (row) against the serial MLP, recording comm per direction."""
    w1, b1, w2, b2 = _randn(FFN, H, seed=10), _randn(FFN, seed=11), _randn(H, FFN, seed=12), _randn(H, seed=13)
    x, gy = _randn(B, T, H, seed=14).requires_grad_(), _randn(B, T, H, seed=15)
    fc1, fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)
    with torch.no_grad():
        fc1.weight.copy_(w1), fc1.bias.copy_(b1), fc2.weight.copy_(w2), fc2.bias.copy_(b2)
    y_ref = fc2(F.gelu(fc1(x)))
    (y_ref * gy).sum().backward()
    col = _sharded(ColumnParallelLinear(H, FFN, bias=True, group=g, sequence_parallel=sp, device="meta"),
                   weight=w1, bias=b1)
    row = _sharded(RowParallelLinear(FFN, H, bias=True, group=g, sequence_parallel=sp, device="meta"),
                   weight=w2, bias=b2)
    xl = (_seq(x, rank, world) if sp else x).detach().clone().requires_grad_()
    with count_comm() as fwd:
        y = row(F.gelu(col(xl)))
    with count_comm() as bwd:
        (y * (_seq(gy, rank, world) if sp else gy)).sum().backward()
    out[f"{tag}_fwd"], out[f"{tag}_bwd"] = fwd.events, bwd.events
    out[f"{tag}_y"] = _diff(y, _seq(y_ref, rank, world) if sp else y_ref)
    out[f"{tag}_dx"] = _diff(xl.grad, _seq(x.grad, rank, world) if sp else x.grad)
    out[f"{tag}_dw1"] = _diff(_full_grad(col.weight, world), fc1.weight.grad)
    out[f"{tag}_db1"] = _diff(_full_grad(col.bias, world), fc1.bias.grad)
    out[f"{tag}_dw2"] = _diff(_full_grad(row.weight, world), fc2.weight.grad)
    # Under SP each rank's replicated-bias gradient covers its own tokens: they sum to the whole.
    db2 = sum(_gather(row.bias.grad, world)) if sp else row.bias.grad
    out[f"{tag}_db2"] = _diff(db2, fc2.bias.grad)
    out[f"{tag}_bias_marked"] = getattr(row.bias, "sequence_parallel", False)


def _gathered_linear_checks(rank, world, g, out):
    """Under sequence parallelism a column-parallel linear keeps its input's shard, in the compute dtype, and
    gathers it again in backward (Korthikanti et al. sec. 4.2.2): the same numbers, bit for bit, as gathering
    first and letting autograd keep the gathered input, which is what it saves instead."""
    w, b = _randn(FFN, H, seed=20), _randn(FFN, seed=21)
    x, gy = _randn(B, T, H, seed=22), _randn(B, T, FFN // world, seed=23 + rank)
    for precision in ("fp32", "bf16"):
        runs = {}
        for path in ("shard_kept", "gather_first"):
            col = _sharded(ColumnParallelLinear(H, FFN, bias=True, group=g, sequence_parallel=True, device="meta"),
                           weight=w, bias=b)
            params = {p.untyped_storage().data_ptr() for p in col.parameters()}
            saved = []
            pack = lambda t: saved.append(0 if t.untyped_storage().data_ptr() in params  # noqa: E731
                                          else t.untyped_storage().nbytes()) or t
            xl = _seq(x, rank, world).clone().requires_grad_()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), count_comm() as fwd, \
                    torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                y = col(xl) if path == "shard_kept" else F.linear(gather_seq(xl, g, 1), col.weight, col.bias)
            with count_comm() as bwd:
                y.backward(gy.to(y.dtype))
            runs[path] = (y.detach(), xl.grad, col.weight.grad, col.bias.grad, sum(saved), fwd.events, bwd.events)
        new, old = runs["shard_kept"], runs["gather_first"]
        out[f"gl_{precision}_bitwise"] = all(torch.equal(a, c) for a, c in zip(new[:4], old[:4]))
        out[f"gl_{precision}_saved"] = (new[4], old[4])
        out[f"gl_{precision}_comm"] = (new[5], new[6])


def _embedding_checks(rank, world, g, out):
    per = PADDED // world
    edges = [k * per + d for k in range(world + 1) for d in (-1, 0) if 0 <= k * per + d < VOCAB]
    ids = torch.tensor(edges + [VOCAB - 1] * (B * T - len(edges)))[torch.randperm(B * T, generator=_gen(20))]
    ids = ids.view(B, T)
    w, gy = _randn(PADDED, H, seed=21), _randn(B, T, H, seed=22)
    ref = nn.Embedding(PADDED, H)
    with torch.no_grad():
        ref.weight.copy_(w)
    y_ref = ref(ids)
    (y_ref * gy).sum().backward()
    for reduce in ("all_reduce", "reduce_scatter", "none"):
        emb = _sharded(VocabParallelEmbedding(PADDED, H, group=g, reduce=reduce, device="meta"), weight=w)
        out["emb_range"] = (emb.vocab_start, emb.vocab_end, tuple(emb.weight.shape))
        y = emb(ids)
        if reduce == "reduce_scatter":
            out[f"emb_{reduce}_y"] = _diff(y, _seq(y_ref, rank, world))
            (y * _seq(gy, rank, world)).sum().backward()
        else:
            whole = sum(_gather(y.detach(), world)) if reduce == "none" else y
            out[f"emb_{reduce}_y"] = _diff(whole, y_ref)
            (y * gy).sum().backward()
        out[f"emb_{reduce}_dw"] = _diff(_full_grad(emb.weight, world), ref.weight.grad)


def _ce_checks(rank, world, g, out):
    per = PADDED // world
    edges = [k * per + d for k in range(world + 1) for d in (-1, 0) if 0 <= k * per + d < VOCAB]
    labels = torch.randint(0, VOCAB, (B * T,), generator=_gen(30))
    labels[:len(edges)] = torch.tensor(edges)
    labels = labels.view(B, T)
    # Large logits with a large offset: a naive exp would overflow.
    full = (_randn(B, T, PADDED, seed=31) * 10 + 80).masked_fill(torch.arange(PADDED) >= VOCAB, float("-inf"))
    gl = _randn(B, T, seed=32)
    for eps in (0.0, 0.1):
        ref_in = full.clone().requires_grad_()
        # F.cross_entropy's smoothing averages over every column, so −inf padding makes it inf;
        # for eps > 0 the reference is the real columns only (identical for eps = 0).
        ref = F.cross_entropy((ref_in if eps == 0 else ref_in[..., :VOCAB]).flatten(0, 1), labels.flatten(),
                              reduction="none", label_smoothing=eps).view(B, T)
        (ref * gl).sum().backward()
        local = torch.randn(B, T, per, generator=_gen(33))  # arbitrary values in the padding
        local.copy_(torch.where(torch.isinf(full[..., rank * per:(rank + 1) * per]),
                                local, full[..., rank * per:(rank + 1) * per]))
        local.requires_grad_()
        loss = vocab_parallel_cross_entropy(local, labels, g, vocab_start=rank * per, vocab_size=VOCAB,
                                            label_smoothing=eps)
        (loss * gl).sum().backward()
        out[f"ce_{eps}_loss"] = _diff(loss, ref)
        out[f"ce_{eps}_dlogits"] = _diff(local.grad, ref_in.grad[..., rank * per:(rank + 1) * per])
        out[f"ce_{eps}_finite"] = bool(torch.isfinite(loss).all() and torch.isfinite(local.grad).all())


def _fused_ce_checks(rank, world, g, out):
    """The fused head + loss (model.fused_loss) through the real head and loss modules, against the single
    process's unfused LMLoss: value, input and weight gradients, with and without sequence parallelism, the
    gradients made in forward and recomputed in backward; the collectives of the unfused vocabulary-parallel
    loss (recompute: the same calls; in forward: the same calls chunk by chunk, as many bytes in all). Then a
    vocabulary small enough that some ranks' shards are padding alone: they still join every collective."""
    from functools import partial
    from megalm.ops.losses import IGNORE
    from megalm.models.losses import LMLoss
    from megalm.parallel.styles import VocabParallelLMLoss
    per = PADDED // world
    edges = [k * per + d for k in range(world + 1) for d in (-1, 0) if 0 <= k * per + d < VOCAB]
    labels = torch.randint(0, VOCAB, (B * T,), generator=_gen(60))
    labels[:len(edges)] = torch.tensor(edges)
    labels[-2:] = IGNORE
    labels = labels.view(B, T)
    mask = (torch.rand(B, T, generator=_gen(61)) > 0.2).float()
    w, x = _randn(PADDED, H, seed=62), _randn(B, T, H, seed=63)
    chunk, chunks = 5, -(-B * T // 5)
    for eps in (0.0, 0.1):
        ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
        logits = F.linear(ref_x, ref_w)  # real columns only for smoothing: LMLoss's -inf padding would give inf
        ref = LMLoss(VOCAB)(logits, labels, mask) if eps == 0 else LMLoss(VOCAB, eps)(logits[..., :VOCAB], labels, mask)
        ref.backward()
        crit = VocabParallelLMLoss(g, rank * per, VOCAB, eps)
        for backward in ("in_forward", "recompute"):
            for sp in (False, True):
                tag = f"fused_{backward}_{eps}_{'sp' if sp else 'f'}"
                head = _sharded(ColumnParallelLinear(H, PADDED, bias=False, group=g, sequence_parallel=sp,
                                                     device="meta"), weight=w)
                x_in = (_seq(x, rank, world) if sp else x).clone().requires_grad_()
                with count_comm() as fused:
                    loss = head(x_in, fuse=partial(crit.from_hidden, labels=labels, loss_mask=mask,
                                                   chunk_tokens=chunk, backward=backward))
                loss.backward()
                out[f"{tag}_loss"] = _diff(loss, ref)
                out[f"{tag}_dx"] = _diff(x_in.grad, _seq(ref_x.grad, rank, world) if sp else ref_x.grad)
                out[f"{tag}_dw"] = _diff(_full_grad(head.weight, world), ref_w.grad)
                with count_comm() as unfused:
                    crit(head(x_in), labels, mask)
                loss_calls = [[e for e in c.events if e[0] == "all_reduce"] for c in (fused, unfused)]
                others = [[e for e in c.events if e[0] != "all_reduce"] for c in (fused, unfused)]  # the head's
                out[f"{tag}_comm"] = (others[0] == others[1] and len(loss_calls[1]) == 2
                                      and len(loss_calls[0]) == 2 * (chunks if backward == "in_forward" else 1)
                                      and sum(b for _, b in loss_calls[0]) == sum(b for _, b in loss_calls[1]))
    small = 2 * per - 3  # shards 2.. (at tp 4) hold padding alone
    labels_small = labels.clamp(max=small - 1)  # IGNORE (-100) stays
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = LMLoss(small)(F.linear(ref_x, ref_w), labels_small, mask)
    ref.backward()
    head = _sharded(ColumnParallelLinear(H, PADDED, bias=False, group=g, device="meta"), weight=w)
    x_in = x.clone().requires_grad_()
    loss = head(x_in, fuse=partial(VocabParallelLMLoss(g, rank * per, small, 0.0).from_hidden, labels=labels_small,
                                   loss_mask=mask, chunk_tokens=chunk, backward="in_forward"))
    loss.backward()
    out["fused_padding_shard_loss"] = _diff(loss, ref)
    out["fused_padding_shard_dx"] = _diff(x_in.grad, ref_x.grad)
    out["fused_padding_shard_dw"] = _diff(_full_grad(head.weight, world), ref_w.grad)


def _rng_checks(rank, world, out):
    rng = TPRNG(1234, rank, "cpu")
    outer = torch.get_rng_state()
    masks = {}
    for name in ("shared", "tp"):
        with rng.fork(name):
            masks[name] = [F.dropout(torch.ones(256), p=0.5) != 0 for _ in range(2)]
    out["rng_outer_restored"] = torch.equal(outer, torch.get_rng_state())
    shared, tp = (torch.stack(_gather(torch.stack(masks[n]).float(), world)) for n in ("shared", "tp"))
    out["rng_shared_equal"] = all(torch.equal(shared[0], s) for s in shared)
    out["rng_tp_distinct"] = all(not torch.equal(tp[i], tp[j]) for i in range(world) for j in range(i))
    out["rng_stream_advances"] = not torch.equal(masks["shared"][0], masks["shared"][1])


def _identity_checks(rank, world, out):
    # Every rank creates every size-1 group, in the same order, then uses its own.
    solo = [dist.new_group([r]) for r in range(world)][rank]
    x = _randn(B, T, H, seed=40).requires_grad_()
    w, b = _randn(FFN, H, seed=41), _randn(FFN, seed=42)
    with count_comm() as stats:
        col = _sharded(ColumnParallelLinear(H, FFN, bias=True, group=solo, sequence_parallel=True,
                                            gather_output=True, device="meta"), weight=w, bias=b)
        row = _sharded(RowParallelLinear(FFN, H, bias=True, group=solo, sequence_parallel=True,
                                         device="meta"), weight=w.t().contiguous(), bias=b[:H])
        y = row(col(x))
        y.sum().backward()
    ref = F.linear(F.linear(x.detach(), w, b), w.t(), b[:H])
    out["solo_exact"] = torch.equal(y.detach(), ref)
    out["solo_no_comm"] = stats.events == []
    out["solo_same_object"] = copy_to_tp(x, solo) is x and gather_seq(x, solo) is x


def _error_and_fallback_checks(rank, world, g, out):
    msgs = []
    for bad in (lambda: reduce_scatter_seq(torch.ones(B, 5, H), g),
                lambda: ColumnParallelLinear(H, 7, bias=False, group=g, device="meta"),
                lambda: VocabParallelEmbedding(VOCAB + 1, H, group=g, device="meta")):
        try:
            bad()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    out["errors"] = msgs
    # The all-reduce stand-in for reduce-scatter gives the native result.
    x = _randn(world * 3, 5, seed=50 + rank)
    native = comm._reduce_scatter(x, g, 0)
    out["rs_fallback"] = _diff(comm._reduce_scatter_via_all_reduce(x, g), native)


def _all_checks(rank, world):
    torch.manual_seed(0)
    g = dist.group.WORLD
    out = {}
    _linear_checks(rank, world, g, out)
    _mlp(rank, world, g, False, out, "mlp")
    _mlp(rank, world, g, True, out, "mlp_sp")
    _gathered_linear_checks(rank, world, g, out)
    _embedding_checks(rank, world, g, out)
    _ce_checks(rank, world, g, out)
    _fused_ce_checks(rank, world, g, out)
    _rng_checks(rank, world, out)
    _identity_checks(rank, world, out)
    _error_and_fallback_checks(rank, world, g, out)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_serial(world):
    results = run_ranks(world, _all_checks)
    full, local = B * T * H * 4, B * (T // world) * H * 4  # fp32 activation bytes
    for rank, out in enumerate(results):
        diffs = {k: v for k, v in out.items() if isinstance(v, float)}
        assert len(diffs) > 20, sorted(diffs)  # the checks really reported their errors
        # `not v <= TOL` rather than `v > TOL`: a NaN error (a NaN output) fails too.
        errs = {k: v for k, v in diffs.items() if not v <= TOL}
        assert not errs, f"rank {rank}: errors above {TOL} (or NaN): {errs}"
        assert out["col_gFalse_width"] == (FFN // world, FFN // world)  # out_features is local
        assert out["col_qkv_gFalse_width"] == (sum(QKV) // world, sum(QKV) // world)
        assert out["col_qkv_gTrue_width"] == (sum(QKV), sum(QKV))
        assert out["row_replicated_bias_has_no_shard"]
        # MLP pattern: one all-reduce each way; with SP an all-gather and a reduce-scatter each way.
        assert out["mlp_fwd"] == [("all_reduce", full)]
        assert out["mlp_bwd"] == [("all_reduce", full)]
        assert out["mlp_sp_fwd"] == [("all_gather", local), ("reduce_scatter", full)]
        # backward: fc2's all-gather, fc1's input gathered again (it kept its shard) and its reduce-scatter
        assert sorted(out["mlp_sp_bwd"]) == [("all_gather", local), ("all_gather", local), ("reduce_scatter", full)]
        # The sequence-parallel column linear keeps the shard: (B, T/tp, H) in the compute dtype (bf16: 2 bytes),
        # where gathering first keeps the whole (B, T, H) and, under autocast, the linear's bf16 weight copy.
        half, weight_copy = local // 2, FFN // world * H * 2
        for precision, kept, whole in (("fp32", local, full), ("bf16", half, full // 2 + weight_copy)):
            assert out[f"gl_{precision}_bitwise"], precision
            assert out[f"gl_{precision}_saved"] == (kept, whole), precision
            # forward gathers the (cast) shard; backward gathers it again and reduce-scatters the fp32 gradient
            assert out[f"gl_{precision}_comm"] == ([("all_gather", kept)],
                                                   [("all_gather", kept), ("reduce_scatter", full)]), precision
        assert out["mlp_sp_bias_marked"] and not out["mlp_bias_marked"]
        per = PADDED // world
        assert out["emb_range"] == (rank * per, (rank + 1) * per, (per, H))
        assert out["ce_0.0_finite"] and out["ce_0.1_finite"]
        assert all(out[f"fused_{b}_{eps}_{sp}_comm"] for b in ("in_forward", "recompute") for eps in (0.0, 0.1)
                   for sp in ("f", "sp"))
        assert "fused_padding_shard_dw" in diffs
        assert out["rng_outer_restored"] and out["rng_shared_equal"] and out["rng_tp_distinct"]
        assert out["rng_stream_advances"]
        assert out["solo_exact"] and out["solo_no_comm"] and out["solo_same_object"]
        rs, col, emb = out["errors"]
        assert rs and "5" in rs and str(world) in rs
        assert col and "7" in col and str(world) in col
        assert emb and str(VOCAB + 1) in emb and str(world) in emb


def test_shard_layout_roundtrip_and_errors():
    full = torch.arange(96.0).view(96, 1)
    for world in (1, 2, 4):
        specs = [TPShard(0, r, world, QKV) for r in range(world)]
        shards = [s.local(full) for s in specs]
        assert torch.equal(full_from_shards(shards, specs[0]), full)
        q, k, v = shards[-1].split([s // world for s in QKV])
        r = world - 1
        assert q[0, 0] == 64 // world * r and k[0, 0] == 64 + 16 // world * r and v[0, 0] == 80 + 16 // world * r
        assert specs[0].full_shape(shards[0].shape) == (96, 1)
    with pytest.raises(ValueError, match="30"):
        TPShard(0, 0, 4, (64, 30, 2))
    with pytest.raises(ValueError, match="7"):
        TPShard(1, 0, 2).local(torch.ones(3, 7))


def test_no_group_is_serial_and_rng_fork_restores():
    x = torch.randn(B, T, H)
    assert comm.copy_to_tp(x, None) is x and comm.reduce_scatter_seq(x, None) is x
    col = ColumnParallelLinear(H, FFN, bias=False, group=None, device="meta").to_empty(device="cpu")
    assert col.weight.tp_shard == TPShard(0, 0, 1)  # survives to_empty from meta
    rng = TPRNG(7, 0)
    before = torch.get_rng_state()
    with rng.fork("tp"):
        a = torch.rand(8)
        with pytest.raises(ValueError, match="already forked"):
            with rng.fork("tp"):
                pass
    assert torch.equal(before, torch.get_rng_state())
    saved = rng.state_dict()
    with rng.fork("tp"):
        b = torch.rand(8)
    rng.load_state_dict(saved)
    with rng.fork("tp"):
        assert torch.equal(torch.rand(8), b) and not torch.equal(a, b)
    with pytest.raises(ValueError, match="unknown RNG stream"):
        with rng.fork("data"):
            pass


def test_compiled_tp_dropout_keeps_each_ranks_share_of_one_draw():
    """Inside a compiled graph (no break: fullgraph) a tp fork cannot swap generators: each of 2 tp ranks
    draws 2 x the numbers it needs from the default generator and keeps its own half, so the two ranks'
    masks differ while their draws, and the generator after them, are alike. Checked against the same
    numbers drawn by hand (aot_eager runs torch's own random ops), for nn.Dropout and for the attention
    core's dropout on its probabilities (the unfused ops, which SDPA's own dropout cannot take)."""
    import torch._dynamo
    from megalm.models.layers import AttentionCore
    from megalm.parallel.styles import ForkRNG
    p = 0.3
    x = torch.randn(B, T, H)
    q, k, v = torch.randn(3, B, 2, T, 4).unbind(0)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~causal, float("-inf")).softmax(-1)
    masks = []
    for rank in range(2):
        for inner, args in ((nn.Dropout(p), (x,)), (AttentionCore(p, True, "sdpa"), (q, k, v))):
            # an attention core takes its numbers as `uniform` (GPT's plan says so: TPRandom(uniform=True))
            takes_uniform = isinstance(inner, AttentionCore)
            fork = torch.compile(ForkRNG(inner, TPRNG(0, rank), "tp", rank, 2, takes_uniform=takes_uniform).train(),
                                 backend="aot_eager", fullgraph=True)
            torch.manual_seed(5)
            got = fork(*args)
            after = torch.rand(4)
            torch.manual_seed(5)
            if isinstance(inner, nn.Dropout):
                keep = torch.rand(2, *x.shape)[rank] >= p
                torch.testing.assert_close(got, x * keep / (1 - p))
                masks.append(keep)
            else:
                keep = torch.rand(2, *probs.shape)[rank] >= p
                torch.testing.assert_close(got, (probs * keep / (1 - p)) @ v)
            assert torch.equal(torch.rand(4), after)  # the generator moved by the one draw, on either rank
            torch._dynamo.reset()
    assert not torch.equal(masks[0], masks[1])
    assert 0.2 < 1 - masks[0].float().mean() < 0.4  # 256 elements: 0.3 give or take 3.5 standard deviations
