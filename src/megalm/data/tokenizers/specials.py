"""The special ids BERT's sample layout needs from a tokenizer ([CLS], [SEP], [MASK], [PAD]: `Specials`,
`bert_specials`), which BERT's samples, SQuAD's windows and T5's spans read."""

from __future__ import annotations

from dataclasses import dataclass

from megalm.errors import DataError


@dataclass(frozen=True)
class Specials:
    """The ids BERT samples need from the tokenizer."""
    cls: int
    sep: int
    mask: int
    pad: int


# The names a vocabulary may give each role: WordPiece's, Megatron's sentencepiece additions, RoBERTa-style.
SPECIAL_NAMES = {"cls": ("[CLS]", "<CLS>", "<cls>"), "sep": ("[SEP]", "<SEP>", "<sep>"),
                 "mask": ("[MASK]", "<MASK>", "<mask>"), "pad": ("[PAD]", "<PAD>", "<pad>")}
BERT_SPECIAL_TOKENS = ["[CLS]", "[SEP]", "[MASK]", "[PAD]"]
"""What megalm reserves in a sentencepiece model it trains for BERT (data=stdlib_prose)."""


def bert_specials(tokenizer) -> Specials:
    """The tokenizer's [CLS] / [SEP] / [MASK] / [PAD] ids, found under any name of SPECIAL_NAMES. A
    tokenizer without a vocabulary (the null tokenizer of pre-tokenized or mock data) uses ids 1, 2,
    3 and 0, as the mock data does."""
    if tokenizer.pieces() is None:
        return Specials(cls=1, sep=2, mask=3, pad=0)
    found = {}
    for role, names in SPECIAL_NAMES.items():
        ids = [i for i in map(tokenizer.token_to_id, names) if i is not None]
        if ids:
            found[role] = ids[0]
    missing = [names[0] for role, names in SPECIAL_NAMES.items() if role not in found]
    if missing:
        raise DataError(
            f"BERT samples need [CLS], [SEP], [MASK] and [PAD] tokens; the {tokenizer.identity} tokenizer"
            f"{f' ({tokenizer.origin})' if tokenizer.origin else ''} lacks {', '.join(missing)} (under any of the "
            f"names {', '.join(n for r in SPECIAL_NAMES.values() for n in r)}): use a WordPiece tokenizer.json, or a "
            f"sentencepiece model trained with them (scripts/train_tokenizer.py --special-tokens "
            f"{' '.join(BERT_SPECIAL_TOKENS)}, or tokenizer.special_tokens when megalm trains it)")
    return Specials(**found)
