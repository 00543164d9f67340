"""Supervised fine-tuning samples for decoder models: the loss on responses only (data=sft).

Each line of the JSON-lines files in data.paths is one example, either
  {"prompt": str, "response": str}                        a single turn, or
  {"messages": [{"role": str, "content": str}, ...]}      a chat, at least one "assistant" message;
or, with data.pair_suffixes [S, T], each data.paths entry PREFIX names two line-aligned text files,
PREFIX.S and PREFIX.T, whose line k is a pair (a translation corpus): a chat of the source as the
user's message and the target as the assistant's (an encoder-decoder family reads the pair itself).
An example becomes one sample of seq_length + 1 tokens, as training sees a document:
  [eod] prompt response [eod]             (loss on the response and the final eod)
  [eod] m1 m2 ... [eod]                   each message rendered by data.chat_template, split at
                                          {content}: the loss is on the content and the rest of the
                                          template of every assistant message, and the final eod (a
                                          tokenizer with its own Jinja chat template, an imported
                                          model's, writes the chat instead, cut the same way)
(an imported model's own start tokens, tokenizer.start, in place of the first eod: none for SmolLM2)
then padded (with eod, no loss); with data.packing, whole examples are packed in file order into
each sequence instead, positions restarting and attention kept inside each example, so every
token is predicted from exactly what it would see alone. Pieces are tokenized one by one, so the boundary between what
is learned and what is given is exact. An example that does not fit is an error naming its file
and line: nothing is cut silently. data.split divides the examples in file order; the training
order is a fresh permutation of the split's examples each epoch (numpy RandomState(seed + epoch)),
so a sample depends on its index only, at any layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from megalm.data.formats.jsonl import json_lines, parallel_lines
from megalm.errors import ConfigError, DataError, not_a_file
from megalm.ops.labels import IGNORE

ROLES = ("system", "user", "assistant")
ASSISTANT = "assistant"


def template_parts(template: str, role: str) -> Tuple[str, str]:
    """(text before the content, text after it) of data.chat_template for `role`."""
    if template.count("{content}") != 1:
        raise ConfigError(f"data.chat_template={template!r} must hold {{content}} exactly once "
                          "(and may hold {role})")
    before, after = template.split("{content}")
    try:
        return before.format(role=role), after.format(role=role)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"data.chat_template={template!r}: only {{role}} and {{content}} may be filled in ({e})") \
            from None


def example_pieces(record, template: str, where: str, tokenizer=None) -> List[Tuple[str, bool]]:
    """(text, learned) pieces of one JSON record, in order; a chat through `tokenizer`'s own Jinja chat template
    when it has one (an imported model's), else through data.chat_template."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: an example is a JSON object, got {type(record).__name__}")
    if "messages" in record:
        both = [k for k in ("prompt", "response") if k in record]
        if both:
            raise DataError(f"{where}: an example is either a chat ('messages') or a prompt / response pair; this "
                            f"one has 'messages' and {' and '.join(repr(k) for k in both)}")
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        pieces = []
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise DataError(f"{where}: message {k} must be {{\"role\": one of {', '.join(ROLES)}, "
                                f"\"content\": a string}}, got {json.dumps(m)[:80]}")
        if not any(m["role"] == ASSISTANT for m in messages):
            raise DataError(f"{where}: the chat has no assistant message to learn from")
        if getattr(tokenizer, "chat_template", None):
            return _jinja_pieces(messages, tokenizer, where)
        for m in messages:
            before, after = template_parts(template, m["role"])
            learned = m["role"] == ASSISTANT
            pieces += [(before, False), (m["content"] + after, learned)]
        return pieces
    missing = [k for k in ("prompt", "response") if not isinstance(record.get(k), str)]
    if missing:
        raise DataError(f"{where}: needs string fields 'prompt' and 'response' (or 'messages'); "
                        f"{', '.join(repr(k) for k in missing)} missing or not a string")
    if not record["response"]:
        raise DataError(f"{where}: the response is empty: nothing to learn")
    return [(record["prompt"], False), (record["response"], True)]


def _jinja_pieces(messages: List[dict], tokenizer, where: str) -> List[Tuple[str, bool]]:
    """A chat as the model's Jinja template writes it, cut where each message's text begins: what rendering the
    chat up to a message adds is that message; an assistant's is cut again where the template's opening for it
    (add_generation_prompt) ends, the rest learned, as in serving the reply follows that opening."""
    pieces: List[Tuple[str, bool]] = []
    done = ""
    for k, m in enumerate(messages):
        try:
            cuts = [(tokenizer.apply_chat_template(messages[:k + 1], False), m["role"] == ASSISTANT)]
            if m["role"] == ASSISTANT:
                cuts.insert(0, (tokenizer.apply_chat_template(messages[:k], True), False))
        except DataError as e:  # the template's own refusal, or one it cannot render
            raise DataError(f"{where}: {e}") from None
        for text, learned in cuts:
            if not text.startswith(done):
                raise DataError(f"{where}: the model's chat template does not write message {k} after the messages "
                                "before it, so the chat cannot be cut into what is given and what is learned")
            pieces.append((text[len(done):], learned))
            done = text
    return pieces


def encode_example(pieces: Sequence[Tuple[str, bool]], tokenizer, seq_length: int, where: str,
                   start: Optional[List[int]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(ids, learned) of seq_length + 1 tokens: [eod] pieces [eod], padded with eod (learned 0); an imported
    model's own start tokens (tokenizer.start) in place of the first eod, or `start` where given (nothing: a chat
    its Jinja template wrote whole)."""
    ids = list(tokenizer.start if start is None else start)
    learned = [False] * len(ids)
    for text, learn in pieces:
        piece = tokenizer.encode(text) if text else []
        ids += piece
        learned += [learn] * len(piece)
    ids.append(tokenizer.eod)
    learned.append(True)  # the model learns to end its answer
    if len(ids) > seq_length + 1:
        raise DataError(f"{where}: the example is {len(ids)} tokens with its end-of-document tokens; "
                        f"model.seq_length={seq_length} takes at most {seq_length + 1}")
    pad = seq_length + 1 - len(ids)
    return (np.array(ids + [tokenizer.eod] * pad, dtype=np.int64),
            np.array(learned + [False] * pad, dtype=bool))


def sft_records(paths: Sequence[str], pair_suffixes: Sequence[str] = (), as_chat: bool = False) -> Iterator[Tuple[str, dict]]:
    """(where, record) of each example of data.paths: JSON lines; or, with data.pair_suffixes [S, T], the
    line pairs of each PREFIX.S (sources) and PREFIX.T (targets), as {prompt: source, response: target},
    or as a chat of a user's source and an assistant's target (`as_chat`: a decoder model, whose
    data.chat_template then marks where the source ends and the target starts)."""
    if pair_suffixes and (len(pair_suffixes) != 2 or not all(isinstance(s, str) and s for s in pair_suffixes)):
        raise ConfigError(f"data.pair_suffixes={list(pair_suffixes)} must be two file suffixes, the source's and the "
                          "target's (e.g. [en, fr]: PREFIX.en and PREFIX.fr), or [] for JSON lines")
    for p in paths:
        path = Path(p).expanduser()
        if not pair_suffixes:
            if not path.is_file():
                raise DataError(f"data.paths: {path} {not_a_file(path)}")
            yield from json_lines(path)
            continue
        source, target = (path.with_name(f"{path.name}.{s}") for s in pair_suffixes)
        for f in (source, target):
            if not f.is_file():
                raise DataError(f"data.paths: {f} {not_a_file(f)} (data.pair_suffixes={list(pair_suffixes)} reads "
                                f"{source.name} and {target.name} for the prefix {path})")
        for where, x, y in parallel_lines(source, target):
            yield where, ({"messages": [{"role": "user", "content": x}, {"role": ASSISTANT, "content": y}]}
                          if as_chat else {"prompt": x, "response": y})


def read_examples(paths: Sequence[str], tokenizer, seq_length: int, template: str,
                  pair_suffixes: Sequence[str] = ()) -> List[Tuple[np.ndarray, np.ndarray]]:
    examples = []
    for where, record in sft_records(paths, pair_suffixes, as_chat=True):
        if pair_suffixes and not record["messages"][1]["content"]:
            raise DataError(f"{where}: the target is empty: nothing to learn")
        own = bool(tokenizer.chat_template) and isinstance(record, dict) and "messages" in record
        examples.append(encode_example(example_pieces(record, template, where, tokenizer), tokenizer, seq_length,
                                       where, [] if own else None))  # the template writes its own start
    if not examples:
        raise DataError(f"data.paths {list(paths)} hold no examples")
    return examples


def read_records(paths: Sequence[str], make: Callable[[dict, str], Dict[str, np.ndarray]],
                 pair_suffixes: Sequence[str] = ()) -> List[Dict[str, np.ndarray]]:
    """Each record of `paths` (sft_records) made into its sample by `make(record, where)` (a family's own
    samples: T5's source / target pairs), in file order."""
    examples = [make(record, where) for where, record in sft_records(paths, pair_suffixes)]
    if not examples:
        raise DataError(f"data.paths {list(paths)} hold no examples")
    return examples


def pack_examples(examples: Sequence[Tuple[np.ndarray, np.ndarray]], seq_length: int,
                  pad: int) -> List[Tuple[np.ndarray, ...]]:
    """Whole examples (as encode_example pads them) packed in order into sequences of
    seq_length + 1 tokens, each starting a new one when the next does not fit: (ids, learned,
    positions (restarting at 0 in each example), segments (1, 2, ... per example; 0 = padding))."""
    rows: List[Tuple[np.ndarray, ...]] = []
    parts: List[Tuple[np.ndarray, np.ndarray]] = []

    def flush() -> None:
        if not parts:
            return
        lengths = [len(ids) for ids, _ in parts]
        n, room = sum(lengths), seq_length + 1 - sum(lengths)
        ids = np.concatenate([ids for ids, _ in parts] + [np.full(room, pad, np.int64)])
        learned = np.concatenate([lrn for _, lrn in parts] + [np.zeros(room, bool)])
        positions = np.concatenate([np.arange(k) for k in lengths] + [np.zeros(room, np.int64)]).astype(np.int64)
        segments = np.concatenate([np.full(k, s + 1) for s, k in enumerate(lengths)] + [np.zeros(room, np.int64)])
        rows.append((ids, learned, positions, segments.astype(np.int64)))
        parts.clear()
        assert n <= seq_length + 1

    used = 0
    for ids, learned in examples:
        n = int(np.flatnonzero(learned)[-1]) + 1  # the final eod is the last token learned
        if used + n > seq_length + 1:
            flush()
            used = 0
        parts.append((ids[:n], learned[:n]))
        used += n
    flush()
    return rows


class EpochShuffle:
    """Sample index i -> the example at position i % n of epoch i // n's permutation, drawn by
    numpy RandomState(seed + epoch): a fresh order each epoch, the same at every layout."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._order: Tuple[int, Optional[np.ndarray]] = (-1, None)  # the last epoch's permutation

    def __call__(self, i: int) -> int:
        epoch, k = divmod(i, self.n)
        if self._order[0] != epoch:
            self._order = (epoch, np.random.RandomState((self.seed + epoch) % 2**32).permutation(self.n))
        return int(self._order[1][k])


class SFTDataset:
    """Samples of one split: dicts of tokens, labels (IGNORE where nothing is learned) and
    loss_mask, each (seq_length,); from packed sequences also position_ids and segment_ids; or the
    sample dicts a family made (read_records)."""

    def __init__(self, examples: Sequence[Tuple[np.ndarray, np.ndarray]], name: str, seed: int,
                 num_samples: Optional[int]):
        if not examples and num_samples:
            raise DataError(f"the {name} split has no SFT examples; give data.split a larger {name} part or "
                            "more examples")
        self.examples, self.name = list(examples), name
        n = len(self.examples)
        self.num_samples = (num_samples or n) if n else 0
        self.order = EpochShuffle(n, seed)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name} SFT sample {i} is out of range [0, {self.num_samples})")
        example = self.examples[self.order(i)]
        if isinstance(example, dict):  # a family's own sample (read_records)
            return example
        ids, learned, *packed = example
        labels = np.where(learned[1:], ids[1:], IGNORE)
        sample = {"tokens": ids[:-1], "labels": labels, "loss_mask": learned[1:].astype(np.float32)}
        if packed:
            sample.update(position_ids=packed[0][:-1], segment_ids=packed[1][:-1])
        return sample
