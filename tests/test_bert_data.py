"""BERT samples: megatron-core's rules, sample by sample, and what the model makes of them.

megatron-core 0.16.1 (a test dependency; its data code runs on CPU) builds the reference: its
BERTMaskedWordPieceDataset.__getitem__ is run on the same sentences, target lengths and seed as
megalm.data.samples.bert.bert_sample, over a WordPiece-like vocabulary with "##" continuation
pieces, and every field must be equal: segment split and order swap, trimming, layout, token
types, whole-word n-gram masking with the 80/10/10 rule, labels and masks.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megalm.data.samples.bert import MockBertDataset, bert_sample
from megalm.data.tokenizers.specials import Specials
from megalm.data.tokenizers.base import NullTokenizer
from megalm.ops.losses import IGNORE

PAD, CLS, SEP, MASK = 0, 1, 2, 3
VOCAB = 120
SEQ = 64


def _vocab():
    """id -> piece: the four specials, then words, every third one a "##" continuation."""
    inv = {PAD: "[PAD]", CLS: "[CLS]", SEP: "[SEP]", MASK: "[MASK]"}
    for i in range(4, VOCAB):
        inv[i] = f"##p{i}" if i % 3 == 0 else f"w{i}"
    return inv


def _megatron_dataset(sentences, index, seed, binary_head, inv_vocab):
    """megatron-core's BERT dataset over `sentences` and sample `index` rows (begin, end,
    target length), without the files and caches its constructor builds them from."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset
    ds = object.__new__(BERTMaskedWordPieceDataset)
    tokenizer = SimpleNamespace(cls=CLS, sep=SEP, mask=MASK, pad=PAD, inv_vocab=inv_vocab)
    ds.config = SimpleNamespace(tokenizer=tokenizer, random_seed=seed, sequence_length=SEQ,
                                classification_head=binary_head, masking_probability=0.15, masking_max_ngram=3,
                                masking_do_full_word=True, masking_do_permutation=False,
                                masking_use_longer_ngrams=False, masking_use_geometric_distribution=False)
    ds.dataset = sentences
    ds.sample_index = index
    ds._pad_token_id = PAD
    # Every id but [PAD] as a random replacement: megatron-core marks any [PAD] id in a sample as
    # padding, even one the 10% rule drew, where megalm's padding mask is the sample's length.
    ds.token_lookup = [i for i in inv_vocab if i != PAD]
    return ds


def _corpus(rng, n):
    """n sentences of 1-20 non-special ids."""
    return [rng.integers(4, VOCAB, size=int(rng.integers(1, 21))).tolist() for _ in range(n)]


@pytest.mark.parametrize("binary_head", [True, False])
def test_samples_equal_megatron_core(binary_head):
    rng = np.random.default_rng(0)
    sentences = _corpus(rng, 400)
    rows = []
    for _ in range(300):  # runs of 2-6 consecutive sentences, target lengths as build_mapping gives
        begin = int(rng.integers(0, len(sentences) - 6))
        rows.append((begin, begin + int(rng.integers(2, 7)), int(rng.integers(2, SEQ - 3 + 1))))
    seed = 1234
    inv = _vocab()
    reference = _megatron_dataset(sentences, np.array(rows), seed, binary_head, inv)
    continues = np.array([inv[i].startswith("##") for i in range(VOCAB)])
    specials = Specials(cls=CLS, sep=SEP, mask=MASK, pad=PAD)
    trimmed = swapped = 0
    for idx, (begin, end, target) in enumerate(rows):
        want = reference[idx]
        got = bert_sample(sentences[begin:end], target, SEQ, np.random.RandomState(seed + idx), specials,
                          reference.token_lookup, binary_head, continues)
        np.testing.assert_array_equal(got["tokens"], want["text"], err_msg=f"sample {idx}")
        np.testing.assert_array_equal(got["token_types"], want["types"])
        np.testing.assert_array_equal(got["padding_mask"], want["padding_mask"])
        np.testing.assert_array_equal(got["loss_mask"], want["loss_mask"])
        np.testing.assert_array_equal(got["labels"][got["loss_mask"] > 0], want["labels"][want["loss_mask"] > 0])
        assert (got["labels"][got["loss_mask"] == 0] == IGNORE).all()
        assert int(got["is_random"]) == want["is_random"]
        trimmed += want["truncated"]
        swapped += want["is_random"]
    # The cases the rules branch on all occurred.
    assert 0 < trimmed < len(rows)
    assert (0 < swapped < len(rows)) if binary_head else swapped == 0


def test_masking_rates():
    """15% of the tokens predicted; of those 80% [MASK], 10% a random id, 10% kept (statistically)."""
    ds = MockBertDataset(NullTokenizer(1000), 128, seed=3)
    masked = replaced = kept = real = 0
    for i in range(400):
        s = ds[i]
        at = s["loss_mask"] > 0
        real += int(s["padding_mask"].sum())
        masked += int(at.sum())
        replaced += int((s["tokens"][at] == 3).sum())
        kept += int((s["tokens"][at] == s["labels"][at]).sum())
    assert masked / real == pytest.approx(0.15, abs=0.02)
    assert replaced / masked == pytest.approx(0.8, abs=0.03)
    assert kept / masked == pytest.approx(0.1, abs=0.03)


def test_mock_samples_depend_on_seed_split_and_index_only():
    tok = NullTokenizer(256)
    a, b = MockBertDataset(tok, 32, seed=5), MockBertDataset(tok, 32, seed=5, num_samples=50)
    for i in (7, 0, 49, 7):  # any order of reading
        for k in a[i]:
            np.testing.assert_array_equal(a[i][k], b[i][k])
    assert not np.array_equal(a[3]["tokens"], MockBertDataset(tok, 32, seed=6)[3]["tokens"])
    assert not np.array_equal(a[3]["tokens"], MockBertDataset(tok, 32, seed=5, name="valid")[3]["tokens"])
    s = a[11]
    n = int(s["padding_mask"].sum())
    assert s["tokens"][0] == CLS and (s["tokens"][n:] == PAD).all() and (s["padding_mask"][:n] == 1).all()
    assert (s["tokens"][:n] == SEP).sum() == 2  # [CLS] A [SEP] B [SEP]
    with pytest.raises(IndexError, match="out of range"):
        b[50]


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_padding_does_not_reach_real_tokens(norm_position):
    """Bidirectional attention reads only the keys the padding mask keeps: what stands in the
    padded positions changes nothing at the real ones; unmasked, it would."""
    from megalm.models import build_model, init_weights
    from megalm.models.bert.config import BertConfig
    cfg = BertConfig(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                     make_vocab_size_divisible_by=8, norm_position=norm_position)
    model = build_model(cfg)
    init_weights(model, cfg, seed=0)
    model.eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 64, (2, 16), generator=g)
    types = torch.zeros_like(tokens)
    mask = torch.ones_like(tokens)
    mask[:, 10:] = 0
    other = tokens.clone()
    other[:, 10:] = torch.randint(4, 64, (2, 6), generator=g)
    with torch.no_grad():
        logits, order = model(tokens, types, mask)
        logits2, order2 = model(other, types, mask)
        logits3, _ = model(other, types, torch.ones_like(mask))
    torch.testing.assert_close(logits[:, :10], logits2[:, :10])
    torch.testing.assert_close(order, order2)
    assert not torch.allclose(logits[:, :10], logits3[:, :10])
