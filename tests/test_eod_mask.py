"""data.eod_mask_loss (Megatron's --eod-mask-loss): exactly the positions whose INPUT token is
end-of-document leave the loss, and the loss is the plain mean over the rest.

A sample of seq_length + 1 tokens gives inputs t[:-1] and labels t[1:]; the position after an
eod predicts the first token of an unrelated document, so that prediction is not trained on.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megalm.config import DataConfig, TokenizerConfig
from megalm.data import build_data, eod_loss_mask
from megalm.models import build_model, init_weights
from megalm.ops.losses import IGNORE

from configs import load

EOD = 99  # the null tokenizer's eod for a vocabulary of 100 (the conftest model's)
# Two samples of seq_length + 1 = 17 tokens: eods inside, two in a row, at the first input
# position, at the last input position (16th token), and as the final token (a label only).
BATCH = torch.tensor([
    [5, 6, EOD, 7, 8, 9, EOD, EOD, 10, 11, 12, 13, 14, 15, 16, EOD, 3],
    [EOD, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, EOD, 20, 21, EOD],
])
# The positions (sample, input index) that must be masked, written out by hand.
MASKED = {(0, 2), (0, 6), (0, 7), (0, 15), (1, 0), (1, 13)}


def _hand_mask():
    mask = torch.ones(2, 16)
    for b, t in MASKED:
        mask[b, t] = 0.0
    return mask


def test_mask_is_zero_exactly_where_the_input_is_eod():
    torch.testing.assert_close(eod_loss_mask(BATCH, EOD), _hand_mask(), rtol=0, atol=0)
    as_numpy = eod_loss_mask(BATCH.numpy(), EOD)
    assert as_numpy.dtype == np.float32 and np.array_equal(as_numpy, _hand_mask().numpy())


def test_data_bundle_batches_ignore_the_labels_after_each_eod():
    cfg = DataConfig(name="mock", source="mock", tokenizer=TokenizerConfig(type="null", vocab_size=100),
                     eod_mask_loss=True)
    bundle = build_data(cfg, seq_length=16, seed=0)
    assert bundle.tokenizer.eod == EOD
    torch.testing.assert_close(bundle.loss_mask(BATCH), _hand_mask(), rtol=0, atol=0)
    # The batch the trainer hands the model: labels IGNORE'd at the masked positions, nowhere else.
    batch = bundle.batch(BATCH)
    assert torch.equal(batch["tokens"], BATCH[:, :-1])
    y = batch["labels"]
    ignored = {(b, t) for b in range(2) for t in range(16) if y[b, t] == IGNORE}
    assert ignored == MASKED
    assert torch.equal(y[_hand_mask() == 1], BATCH[:, 1:][_hand_mask() == 1])
    torch.testing.assert_close(batch["loss_mask"], _hand_mask(), rtol=0, atol=0)
    # Off, nothing is masked.
    plain = build_data(DataConfig(name="mock", source="mock", tokenizer=cfg.tokenizer), seq_length=16, seed=0)
    assert plain.loss_mask(BATCH) is None
    assert torch.equal(plain.batch(BATCH)["labels"], BATCH[:, 1:])
    assert torch.equal(plain.batch(BATCH)["loss_mask"], torch.ones(2, 16))


def _hand_loss(logits, tokens, eod):
    """Mean of -log p(next token) over the positions whose input token is not eod, one by one."""
    logp = logits.double().log_softmax(-1)
    terms = [-logp[b, t, tokens[b, t + 1]] for b in range(tokens.shape[0]) for t in range(tokens.shape[1] - 1)
             if tokens[b, t] != eod]
    return torch.stack(terms).mean()


def test_masked_model_loss_is_the_mean_over_the_kept_positions(tiny_model_cfg):
    # Large weights, so the per-token losses differ widely (at the usual init every one is near
    # log V, and any choice of positions would give nearly the same mean).
    cfg = dataclasses.replace(tiny_model_cfg, init_std=0.5)
    model = build_model(cfg).eval()
    init_weights(model, cfg, 0)
    x = BATCH[:, :-1]
    y = BATCH[:, 1:].masked_fill(eod_loss_mask(BATCH, EOD) == 0, IGNORE)
    with torch.no_grad():
        logits = model(x)[..., :cfg.vocab_size]
        loss = model(x, labels=y)
    want = _hand_loss(logits, BATCH, EOD)
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=0)
    # The test can tell the positions apart: masking by the label instead (one position late)
    # or not at all gives a different number.
    late = F.cross_entropy(logits.flatten(0, 1), BATCH[:, 1:].masked_fill(BATCH[:, 1:] == EOD, IGNORE).flatten(),
                           ignore_index=IGNORE)
    unmasked = F.cross_entropy(logits.flatten(0, 1), BATCH[:, 1:].flatten())
    for other in (late, unmasked):
        assert abs(other.item() - want.item()) > 0.05, (other.item(), want.item())


def test_training_loss_of_a_run_is_the_hand_masked_loss(tmp_path):
    """End to end: the first logged loss of a mock run with eod_mask_loss equals the hand
    computation on the same 8 samples with the initial weights (one micro-batch, no dropout)."""
    from megalm.train import run
    cfg = load("model=gpt_tiny", "model.vocab_size=32", "data=mock", "data.eod_mask_loss=true", "trainer.max_steps=1",
               "trainer.micro_batch_size=8", "trainer.global_batch_size=8", "trainer.eval_steps=0",
               "trainer.log_interval=1", "trainer.progress_bar=false", "trainer.num_threads=1",
               "cluster.peak_flops=1e12", "checkpoint.save=false", "model.dropout=0.0",
               "model.attention_dropout=0.0", "model.init_std=0.5")  # per-token losses far apart, as above
    run(cfg, tmp_path)
    logged = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=cfg.trainer.seed)
    eod = data.tokenizer.eod
    tokens = torch.from_numpy(np.stack([data.train[i] for i in range(8)]))
    assert int((tokens[:, :-1] == eod).sum()) >= 8  # the mask has something to do here (eod = 31)
    model = build_model(cfg.model).eval()
    init_weights(model, cfg.model, cfg.trainer.seed)
    with torch.no_grad():
        logits = model(tokens[:, :-1])[..., :cfg.model.vocab_size]
    want = _hand_loss(logits, tokens, eod).item()
    assert logged[0] == pytest.approx(want, rel=1e-5)
    unmasked = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert abs(unmasked - want) > 1e-3 * want  # so the masking, not chance, makes them agree
