"""The fused, chunked head + cross-entropy (model.fused_loss) against LMLoss on whole logits, and what it keeps.

Single process here; its vocabulary-parallel form is checked at tp 2 and 4 in test_tensor_parallel.py,
and training with it at pipeline layouts in test_parallel_model.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megalm.models import build_model, init_weights
from megalm.ops.fused_loss import linear_cross_entropy
from megalm.models.gpt.config import GPTConfig
from megalm.ops.losses import IGNORE
from megalm.models.losses import LMLoss

B, T, H = 3, 7, 16  # 21 tokens: chunks of 5 leave a last chunk of 1
V, PADDED = 50, 56


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g).requires_grad_()
    w = (torch.randn(PADDED, H, generator=g) * 3).requires_grad_()  # large logits; padding rows arbitrary
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :3] = IGNORE
    labels[1, 0], labels[1, 1] = 0, V - 1  # the first and last real ids
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    return x, w, labels, mask


def _close(a, b, rel=1e-5):
    """Within fp32 rounding of the larger magnitude (a NaN fails)."""
    err = (a.detach() - b.detach()).abs().max().item()
    assert err <= rel * max(b.abs().max().item(), 1.0), err


BACKWARDS = ("in_forward", "recompute")


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("eps,masked", [(0.0, False), (0.0, True), (0.1, True)])
def test_fused_loss_and_gradients_equal_lm_loss(eps, masked, backward):
    x, w, labels, mask = _inputs()
    mask = mask if masked else None
    # LMLoss masks the padding columns with -inf; with label smoothing F.cross_entropy then averages
    # -log 0 over them (inf), so there the reference is LMLoss on the real columns alone.
    logits = F.linear(x, w)
    ref = (LMLoss(V)(logits, labels, mask) if eps == 0 else LMLoss(V, eps)(logits[..., :V], labels, mask))
    ref.backward()
    ref_x, ref_w = x.grad, w.grad
    x.grad = w.grad = None
    loss = LMLoss(V, eps).from_hidden(x, w, labels, mask, chunk_tokens=5, backward=backward)
    (loss * 3).backward()  # an incoming gradient other than 1
    _close(loss, ref)
    x.grad, w.grad = x.grad / 3, w.grad / 3
    _close(x.grad, ref_x)
    _close(w.grad, ref_w)
    assert torch.all(w.grad[V:] == 0)  # padding rows get no gradient
    assert torch.all(x.grad[0, :3] == 0)  # IGNORE labels: no gradient (their hidden states feed nothing else)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_chunk_size_does_not_change_the_result_and_bf16_follows_autocast(backward):
    x, w, labels, mask = _inputs(1)
    per_token = [linear_cross_entropy(x, w, labels, vocab_size=V, chunk_tokens=c) for c in (1, 5, 21, 1000)]
    for other in per_token[1:]:
        _close(other, per_token[0])
    assert torch.all(per_token[0][labels == IGNORE] == 0)
    results = []
    for c in (1, 5, 21, 1000):  # the loss and both gradients
        x.grad = w.grad = None
        loss = LMLoss(V).from_hidden(x, w, labels, mask, chunk_tokens=c, backward=backward)
        loss.backward()
        results.append((loss, x.grad, w.grad))
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            _close(a, b)
    # Under autocast the chunks' matmuls run in bf16 as the unfused head's does: the same loss to bf16 logits'
    # rounding, and gradients that differ only by bf16 products being summed in fp32 chunk by chunk.
    x.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = LMLoss(V)(F.linear(x, w), labels, mask)
    ref.backward()
    ref_x, ref_w = x.grad, w.grad
    x.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = LMLoss(V).from_hidden(x, w, labels, mask, chunk_tokens=5, backward=backward)
    loss.backward()
    _close(loss, ref)
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    _close(x.grad, ref_x, rel=1e-2)
    _close(w.grad, ref_w, rel=1e-2)


class _Matmuls(TorchDispatchMode):
    """Counts the matmul ops run inside the block."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
        return func(*args, **(kwargs or {}))


def test_gradients_in_forward_only_where_wanted():
    """Made in forward, the gradients cost two matmuls a chunk beside the logits' one: under no_grad (an
    evaluation's loss) none are made, with a frozen head only the input's, and the values stay the same."""
    x, w, labels, mask = _inputs(3)
    crit, chunks = LMLoss(V), -(-B * T // 5)
    ref = crit.from_hidden(x, w, labels, mask, chunk_tokens=5)
    ref.backward()
    ref_x = x.grad
    x.grad = w.grad = None
    with torch.no_grad(), _Matmuls() as mm:
        loss = crit.from_hidden(x, w, labels, mask, chunk_tokens=5)
    assert mm.count == chunks and not loss.requires_grad
    _close(loss, ref)
    w.requires_grad_(False)
    with _Matmuls() as mm:
        loss = crit.from_hidden(x, w, labels, mask, chunk_tokens=5)
    assert mm.count == 2 * chunks
    loss.backward()
    _close(x.grad, ref_x)
    assert w.grad is None


@pytest.mark.parametrize("backward", BACKWARDS)
def test_fused_loss_compiles_whole(backward):
    """Under torch.compile (fullgraph: no break; aot_eager runs AOT autograd's forward and backward graphs)
    the loss and both gradients are the eager ones."""
    x, w, labels, mask = _inputs(2)
    crit = LMLoss(V, 0.1)
    eager = crit.from_hidden(x, w, labels, mask, chunk_tokens=5, backward=backward)
    eager.backward()
    ref_x, ref_w = x.grad, w.grad
    x.grad = w.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: crit.from_hidden(*a, chunk_tokens=5, backward=backward), backend="aot_eager",
                             fullgraph=True)
    loss = compiled(x, w, labels, mask)
    loss.backward()
    _close(loss, eager)
    _close(x.grad, ref_x)
    _close(w.grad, ref_w)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_gpt_with_fused_loss_trains_alike_and_still_gives_logits(backward):
    """The model: training mode hands `loss` the final-normed hidden states, eval mode and generation
    still get logits; loss and every gradient (the tied embedding's too) equal the unfused model's, and
    the parameters (so checkpoints) are the same."""
    cfg = dict(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=250,
               make_vocab_size_divisible_by=8)  # padded to 256
    plain, fused = (build_model(GPTConfig(**cfg, fused_loss=f, loss_chunk_tokens=7, fused_loss_backward=backward))
                    for f in (False, True))
    for model in (plain, fused):
        init_weights(model, model.cfg, 0)
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: v.shape for k, v in fused.state_dict().items()}
    tokens = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
    batch["labels"][0, :4] = IGNORE
    out = fused(batch["tokens"])
    assert out.shape == (2, 16, 32)  # hidden states, not (2, 16, 256) logits
    losses = [m.loss(m(batch["tokens"]), batch) for m in (plain, fused)]
    for loss in losses:
        loss.backward()
    _close(losses[1], losses[0])
    grads = [dict(m.named_parameters()) for m in (plain, fused)]
    for name, p in grads[0].items():
        _close(grads[1][name].grad, p.grad)
    with_labels = [m(batch["tokens"], labels=batch["labels"]) for m in (plain, fused)]
    _close(with_labels[1], with_labels[0])
    for model in (plain, fused):
        model.eval()
    with torch.no_grad():
        logits = [m(batch["tokens"]) for m in (plain, fused)]
        assert logits[1].shape == (2, 16, 256)
        _close(logits[1], logits[0])
        _close(fused.loss(logits[1], batch), losses[0])  # eval: the loss of logits, as before


class _SavedBytes:
    """Bytes of each storage autograd saves for backward (once per storage); parameters are model state."""

    def __init__(self, params):
        self.params, self.seen = {p.untyped_storage().data_ptr() for p in params}, {}

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self):
        return sum(self.seen.values())


class _LargestOutput(TorchDispatchMode):
    """The largest tensor any op makes (bytes)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("backward", BACKWARDS)
def test_fused_loss_keeps_no_logits(backward):
    """At a realistic vocabulary (32,000 of 32,768 padded rows) on a small hidden size (64), 512 tokens:
    unfused, F.cross_entropy keeps its fp32 log-softmax, 4 V bytes a token. Recomputing, what is kept is the
    head input (4 h), the label (8), the log-sum-exp (4) and the masked mean's mask (4), with no vocabulary
    term: the saved bytes must drop by at least 4 V / (4 h + 16) = 470x. Made in forward, the gradients are
    kept: the input's (4 h a token) and the fp32 weight's (4 h a vocabulary row), with no token x vocabulary
    term. And no op makes a tensor larger than one chunk's fp32 logits (chunk x V x 4 bytes), where the
    unfused loss makes N x V ones."""
    n, h, vocab, padded, chunk = 512, 64, 32000, 32768, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).requires_grad_()
    w = (torch.randn(padded, h, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    crit = LMLoss(vocab)
    usage = {}
    for name, run in (("unfused", lambda: crit(F.linear(x, w), labels)),
                      ("fused", lambda: crit.from_hidden(x, w, labels, chunk_tokens=chunk, backward=backward))):
        saved, largest = _SavedBytes([w]), _LargestOutput()
        with largest, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            run().backward()
        usage[name] = saved.total, largest.largest
    (unfused_saved, unfused_largest), (fused_saved, fused_largest) = usage["unfused"], usage["fused"]
    assert unfused_saved >= n * vocab * 4  # the log-softmax (padded: 4 x 32768 a token)
    if backward == "recompute":
        assert fused_saved <= n * (4 * h + 16) + 64  # + the masked mean's scalars
        assert unfused_saved / fused_saved > 4 * vocab / (4 * h + 16)
    else:
        assert fused_saved <= 4 * h * (n + padded) + 64
        assert unfused_saved / fused_saved > n * vocab / (h * (n + padded))
    assert unfused_largest >= n * padded * 4
    assert fused_largest <= chunk * padded * 4
