"""SQuAD v1.1 / v2.0 extractive question answering data, for fine-tuning and scoring a BERT reader.

`read_squad` reads the official JSON files into Questions (v2.0's `is_impossible` questions have no
answer; in v1.1 every question has one) and checks them: every mistake is a DataError naming the
file and the question's place in it. `windows` turns a question into samples as Google's BERT
run_squad.py does (and Hugging Face's squad processor after it):

- the context is split into words at whitespace (`words_of`), each word encoded on its own into
  sub-tokens, after one space as it reads in the text (a tokenizer that keeps whitespace, as
  megalm's own sentencepiece models do, then sees the words as in running text; one that strips
  it sees the bare word), and the question encoded and cut to max_query_length tokens;
- a sample is `[CLS] question [SEP] context window [SEP]`, token types 0 through the first [SEP] and
  1 after it, padded to seq_length; long contexts give several windows, each starting doc_stride
  sub-tokens (at most a window's length) after the one before, until one reaches the end;
- the targets are the positions of the answer's first and last sub-tokens in the sample (narrowed to
  the answer text's own tokens inside its words, as run_squad's _improve_answer_span), or (0, 0),
  the [CLS], when the question is impossible or the answer does not lie wholly in the window;
- each window maps its context positions back to word indices (`token_to_word`) and says for each
  whether it is the window that sees the token with the most context on both sides (`max_context`),
  which megalm.evaluate.squad uses to turn the model's logits into an answer text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from megalm.data.tokenizers.specials import Specials
from megalm.errors import ConfigError, DataError, not_a_file

WHITESPACE = frozenset(" \t\r\n" + chr(0x202F))
"""What separates the words of a context: run_squad's is_whitespace."""


@dataclass(frozen=True)
class Question:
    qid: str
    question: str
    context: str
    answers: Tuple[str, ...]  # every gold answer text; () when impossible
    answer_start: Optional[int]  # char offset of answers[0] in context; None when impossible
    impossible: bool


@dataclass
class Window:
    """One sample of a question: its arrays, and where its context tokens come from."""
    qid: str
    sample: Dict[str, np.ndarray]
    token_to_word: Dict[int, int] = field(default_factory=dict)  # sample position -> word index (context only)
    max_context: Dict[int, bool] = field(default_factory=dict)  # sample position -> the best window for it


# ---------------------------------------------------------------------------------------------------------- reading

def _need(obj: Dict[str, Any], key: str, kind: Union[type, Tuple[type, ...]], what: str, where: str) -> Any:
    """obj[key], which must be of type `kind` (bools are not ints)."""
    if key not in obj:
        raise DataError(f"{where}: has no {key!r} (needs {what})")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise DataError(f"{where}: {key!r} is {type(value).__name__} {_short(value)}, not {what}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _object(value: Any, where: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{where}: is {type(value).__name__} {_short(value)}, not a JSON object")
    return value


def _question(qa: Dict[str, Any], context: str, where: str) -> Question:
    qid = _need(qa, "id", str, "a string", where)
    text = _need(qa, "question", str, "a string", where)
    impossible = qa.get("is_impossible", False)
    if not isinstance(impossible, bool):
        raise DataError(f"{where}: 'is_impossible' is {_short(impossible)}, not true or false")
    if impossible:
        answers = qa.get("answers", [])
        if not isinstance(answers, list) or answers:
            raise DataError(f"{where}: question {qid!r} is_impossible but has answers {_short(answers)} "
                            f"(an impossible question's 'answers' must be [] or left out)")
        return Question(qid, text, context, (), None, True)
    answers = _need(qa, "answers", list, "a list of {'text', 'answer_start'}", where)
    if not answers:
        raise DataError(f"{where}: question {qid!r} has no answers and is not is_impossible "
                        f"(an answerable question needs at least one answer)")
    texts = []
    for k, answer in enumerate(answers):
        at = f"{where}.answers[{k}]"
        answer = _object(answer, at)
        answer_text = _need(answer, "text", str, "a string", at)
        start = _need(answer, "answer_start", int, "a character offset (an integer)", at)
        if not answer_text:
            raise DataError(f"{at}: the answer text is empty")
        if not 0 <= start <= len(context) - len(answer_text):
            raise DataError(f"{at}: answer_start={start} with a {len(answer_text)}-character answer is out of "
                            f"range for a {len(context)}-character context (0..{len(context) - len(answer_text)})")
        found = context[start:start + len(answer_text)]
        if found != answer_text:
            raise DataError(f"{at}: the answer text {_short(answer_text)} is not the context at answer_start={start}, "
                            f"which reads {_short(found)}")
        texts.append(answer_text)
    return Question(qid, text, context, tuple(texts), answers[0]["answer_start"], False)


def read_squad(path: Union[str, Path]) -> List[Question]:
    """Every question of a SQuAD v1.1 or v2.0 JSON file, in file order."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{path} {not_a_file(path)}")
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a leading byte-order mark is not JSON
            root = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    root = _object(root, f"{path}")
    data = _need(root, "data", list, "a list of articles {'title', 'paragraphs'}", f"{path}")
    out: List[Question] = []
    seen: Dict[str, str] = {}
    for a, article in enumerate(data):
        where = f"{path}: data[{a}]"
        paragraphs = _need(_object(article, where), "paragraphs", list, "a list of {'context', 'qas'}", where)
        for p, paragraph in enumerate(paragraphs):
            at = f"{where}.paragraphs[{p}]"
            paragraph = _object(paragraph, at)
            context = _need(paragraph, "context", str, "a string", at)
            qas = _need(paragraph, "qas", list, "a list of questions {'id', 'question', 'answers'}", at)
            for k, qa in enumerate(qas):
                spot = f"data[{a}].paragraphs[{p}].qas[{k}]"
                q = _question(_object(qa, f"{path}: {spot}"), context, f"{path}: {spot}")
                if q.qid in seen:
                    raise DataError(f"{path}: {spot}: question id {q.qid!r} is already used at {seen[q.qid]}")
                seen[q.qid] = spot
                out.append(q)
    if not out:
        raise DataError(f"{path} holds no questions")
    return out


# ---------------------------------------------------------------------------------------------------------- samples

def words_of(context: str) -> Tuple[List[str], List[int]]:
    """(the context's whitespace-separated words, the word index of each character). A whitespace
    character belongs to the word before it (run_squad's char_to_word_offset); leading whitespace,
    which has no word before it, to word 0 (run_squad gives -1, which Python would read as the last)."""
    words: List[str] = []
    char_to_word: List[int] = []
    after_space = True
    for c in context:
        if c in WHITESPACE:
            after_space = True
        else:
            if after_space:
                words.append(c)
            else:
                words[-1] += c
            after_space = False
        char_to_word.append(max(len(words) - 1, 0))
    return words, char_to_word


def answer_text(words: List[str], first_word: int, last_word: int) -> str:
    """The words first_word..last_word (inclusive) joined by single spaces."""
    return " ".join(words[first_word:last_word + 1])


def _is_max_context(spans: List[Tuple[int, int]], current: int, position: int) -> bool:
    """Whether span `current` of the (start, length) spans is the one where sub-token `position` has
    the most context: the highest min(left, right) + 0.01 * length, the first span on a tie."""
    best_score, best = -1.0, -1
    for k, (start, length) in enumerate(spans):
        end = start + length - 1
        if not start <= position <= end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if score > best_score:
            best_score, best = score, k
    return best == current


def _tighter_span(doc: List[int], first: int, last: int, target: List[int]) -> Tuple[int, int]:
    """The answer's sub-tokens inside its words' span: the first and longest run of `doc[first:last + 1]`
    that is the answer text encoded (an answer "1917" in the word "1917." leaves out the "."), or the
    whole span when none is (run_squad's _improve_answer_span)."""
    for start in range(first, last + 1):
        for end in range(last, start - 1, -1):
            if doc[start:end + 1] == target:
                return start, end
    return first, last


def windows(q: Question, encode: Callable[[str], List[int]], specials: Specials, seq_length: int,
            doc_stride: int = 128, max_query_length: int = 64) -> List[Window]:
    """The samples of one question, one per window of its context (at least one)."""
    if doc_stride < 1:
        raise ConfigError(f"doc_stride={doc_stride} must be at least 1")
    if max_query_length < 1:
        raise ConfigError(f"max_query_length={max_query_length} must be at least 1")
    query = list(encode(q.question))[:max_query_length]
    room = seq_length - len(query) - 3
    if room < 1:
        raise ConfigError(f"seq_length={seq_length} leaves no room for the context after a {len(query)}-token "
                          f"question (max_query_length={max_query_length}) and [CLS] [SEP] [SEP]: "
                          f"raise seq_length or lower max_query_length")
    words, char_to_word = words_of(q.context)
    word_first: List[int] = []  # word index -> its first sub-token in `doc`
    doc: List[int] = []
    doc_word: List[int] = []  # sub-token -> its word index
    for w, word in enumerate(words):
        word_first.append(len(doc))
        pieces = list(encode(word if w == 0 else " " + word))  # as the word reads in the text, after its space
        doc += pieces
        doc_word += [w] * len(pieces)

    answer: Optional[Tuple[int, int]] = None  # (first, last) sub-token of the answer in `doc`
    if not q.impossible and q.answer_start is not None and q.answers:
        start_word = char_to_word[q.answer_start]
        end_word = char_to_word[q.answer_start + len(q.answers[0]) - 1]
        first = word_first[start_word]
        last = (word_first[end_word + 1] if end_word + 1 < len(words) else len(doc)) - 1
        if last >= first:  # else the answer's words encode to nothing
            text = " ".join(q.answers[0].split())
            answer = _tighter_span(doc, first, last, list(encode(text if start_word == 0 else " " + text)))

    spans: List[Tuple[int, int]] = []
    start = 0
    while True:
        length = min(room, len(doc) - start)
        spans.append((start, length))
        if start + length >= len(doc):
            break
        start += min(length, doc_stride)

    out = []
    offset = len(query) + 2  # sample position of the context's first token
    for k, (start, length) in enumerate(spans):
        tokens = [specials.cls, *query, specials.sep, *doc[start:start + length], specials.sep]
        n = len(tokens)
        sample = {"tokens": np.full(seq_length, specials.pad, dtype=np.int64),
                  "token_types": np.zeros(seq_length, dtype=np.int64),
                  "padding_mask": np.zeros(seq_length, dtype=np.int64)}
        sample["tokens"][:n] = tokens
        sample["token_types"][offset:n] = 1
        sample["padding_mask"][:n] = 1
        first = last = 0
        if answer is not None and start <= answer[0] and answer[1] < start + length:
            first, last = answer[0] - start + offset, answer[1] - start + offset
        sample["start_positions"] = np.array(first, dtype=np.int64)
        sample["end_positions"] = np.array(last, dtype=np.int64)
        token_to_word = {offset + i: doc_word[start + i] for i in range(length)}
        max_context = {offset + i: _is_max_context(spans, k, start + i) for i in range(length)}
        out.append(Window(q.qid, sample, token_to_word, max_context))
    return out
