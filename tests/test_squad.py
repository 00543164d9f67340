"""SQuAD data and scoring (megalm.data.tasks.squad, megalm.evaluate.squad): the official v2.0 script's
normalization, exact match and F1; reading v1.1 / v2.0 files and naming the place of each mistake;
run_squad's windows of a long context (layout, answer positions, the max-context window of each
token) with a tokenizer of two characters per id; and the answer write_predictions picks from logits.
Every expected value here is worked out by hand in the comments."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from megalm.data.tokenizers.specials import Specials
from megalm.data.tasks.squad import Question, Window, answer_text, read_squad, windows, words_of
from megalm.errors import ConfigError, DataError
from megalm.evaluate.squad import best_answer, exact_match, f1, normalize_answer, squad_scores

SPECIALS = Specials(cls=1, sep=2, mask=3, pad=0)


class Pairs:
    """A tokenizer of one id per two characters (the last piece of an odd-length text has one), ids from
    10; it strips the text's surrounding whitespace first, as WordPiece does."""

    def __init__(self):
        self.ids: Dict[str, int] = {}
        self.pieces: Dict[int, str] = {}

    def encode(self, text: str) -> List[int]:
        out, text = [], text.strip()
        for i in range(0, len(text), 2):
            piece = text[i:i + 2]
            if piece not in self.ids:
                self.ids[piece] = 10 + len(self.ids)
                self.pieces[self.ids[piece]] = piece
            out.append(self.ids[piece])
        return out

    def decode(self, ids) -> str:
        return "".join(self.pieces[int(i)] for i in ids)


def _question(context: str, answer: str = "", start: int = -1, question: str = "q", qid: str = "x") -> Question:
    if not answer:
        return Question(qid, question, context, (), None, True)
    assert context[start:start + len(answer)] == answer
    return Question(qid, question, context, (answer,), start, False)


# ------------------------------------------------------------------------------------------------ metrics

def test_normalize_answer():
    assert normalize_answer("The  Quick, brown FOX.") == "quick brown fox"
    # articles only as whole words; punctuation goes before articles, so "A-team" is the word "ateam"
    assert normalize_answer("theater an apple") == "theater apple"
    assert normalize_answer("A-team") == "ateam"
    assert normalize_answer("  a the AN ") == ""
    assert normalize_answer("\tDenver\nBroncos ") == "denver broncos"


def test_exact_match():
    assert exact_match("the Denver Broncos", ["Denver Broncos"]) == 1.0
    assert exact_match("Denver Broncos!", ["denver broncos"]) == 1.0  # punctuation and case
    assert exact_match("Broncos", ["Denver Broncos"]) == 0.0
    assert exact_match("Broncos", ["Denver Broncos", "Broncos"]) == 1.0  # the best gold
    assert exact_match("", [""]) == 1.0
    assert exact_match("Broncos", [""]) == 0.0
    assert exact_match("", []) == 1.0  # no golds: [""]


def test_f1():
    # pred {broncos, won}, gold {denver, broncos}: 1 in common, precision 1/2, recall 1/2
    assert f1("Broncos won", ["Denver Broncos"]) == pytest.approx(2 * 0.5 * 0.5 / (0.5 + 0.5))
    # against gold "Broncos": precision 1/2, recall 1: 2 * 0.5 / 1.5 = 2/3, the better of the two golds
    assert f1("Broncos won", ["Denver Broncos", "Broncos"]) == pytest.approx(2 / 3)
    # counts, not sets: {x, y, y} and {y, y, z} share y twice: precision 2/3, recall 2/3
    assert f1("x y y", ["y y z"]) == pytest.approx(2 / 3)
    assert f1("the Denver Broncos.", ["Denver Broncos"]) == 1.0
    assert f1("Broncos", ["Panthers"]) == 0.0
    # the v2.0 rule for empty token lists: 1 when both are empty, else 0
    assert f1("", [""]) == 1.0
    assert f1("the", ["a"]) == 1.0  # both normalize to nothing
    assert f1("Broncos", [""]) == 0.0
    assert f1("", ["Broncos"]) == 0.0


def test_squad_scores():
    questions = [
        Question("a", "q", "c", ("Denver Broncos",), 0, False),
        Question("b", "q", "c", ("Denver Broncos", "Broncos"), 0, False),
        Question("c", "q", "c", (), None, True),
        Question("d", "q", "c", (), None, True),
        Question("e", "q", "c", (), None, True),
    ]
    # a: EM 1, F1 1; b: EM 0, F1 2/3 (vs "Broncos"); c: "" EM 1 F1 1; d: wrong, 0 0; e: missing = "", 1 1
    predictions = {"a": "the Denver Broncos", "b": "Broncos won", "c": "", "d": "Panthers"}
    scores = squad_scores(predictions, questions)
    assert scores["exact_match"] == pytest.approx(100 * 3 / 5)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 + 0 + 1) / 5)
    assert scores["has_answer_exact_match"] == pytest.approx(50.0)
    assert scores["has_answer_f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert scores["no_answer_exact_match"] == pytest.approx(100 * 2 / 3)
    assert scores["no_answer_f1"] == pytest.approx(100 * 2 / 3)
    assert scores["has_answer_total"] == 2 and scores["no_answer_total"] == 3

    v1 = squad_scores({"a": "Denver", "b": "Broncos"}, questions[:2])
    # a: EM 0, F1 precision 1 recall 1/2 = 2/3; b: EM 1 F1 1
    assert v1 == pytest.approx({"exact_match": 50.0, "f1": 100 * (2 / 3 + 1) / 2})
    # a gold answer that normalizes to nothing is dropped, as the v2.0 script drops it
    odd = Question("f", "q", "c", ("the", "Broncos"), 0, False)
    assert squad_scores({"f": ""}, [odd])["exact_match"] == 0.0
    with pytest.raises(DataError, match="no questions"):
        squad_scores({}, [])


# ------------------------------------------------------------------------------------------------ reading

V11 = {"version": "1.1", "data": [
    {"title": "Super_Bowl_50", "paragraphs": [
        {"context": "The Denver Broncos won Super Bowl 50.",
         "qas": [{"id": "q1", "question": "Who won?",
                  "answers": [{"text": "Denver Broncos", "answer_start": 4},
                              {"text": "The Denver Broncos", "answer_start": 0}]},
                 {"id": "q2", "question": "Which Super Bowl?", "answers": [{"text": "50", "answer_start": 34}]}]},
        {"context": "It was in Santa Clara.",
         "qas": [{"id": "q3", "question": "Where?", "answers": [{"text": "Santa Clara", "answer_start": 10}]}]}]}]}


def _write(tmp_path: Path, content, name: str = "squad.json") -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


def test_read_v11(tmp_path):
    qs = read_squad(_write(tmp_path, V11))
    assert [q.qid for q in qs] == ["q1", "q2", "q3"]
    assert qs[0] == Question("q1", "Who won?", "The Denver Broncos won Super Bowl 50.",
                             ("Denver Broncos", "The Denver Broncos"), 4, False)
    assert qs[1].answers == ("50",) and qs[1].answer_start == 34
    assert qs[2].context == "It was in Santa Clara." and not qs[2].impossible


def test_read_v20(tmp_path):
    data = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [
        {"context": "Normans came from Normandy.",
         "qas": [{"id": "a", "question": "From where?", "is_impossible": False,
                  "answers": [{"text": "Normandy", "answer_start": 18}]},
                 {"id": "b", "question": "When?", "is_impossible": True, "answers": [],
                  "plausible_answers": [{"text": "Normandy", "answer_start": 18}]},
                 {"id": "c", "question": "Why?", "is_impossible": True}]}]}]}
    qs = read_squad(_write(tmp_path, data))
    assert qs[0] == Question("a", "From where?", "Normans came from Normandy.", ("Normandy",), 18, False)
    assert qs[1] == Question("b", "When?", "Normans came from Normandy.", (), None, True)
    assert qs[2].impossible and qs[2].answers == () and qs[2].answer_start is None


def _broken(**qa) -> dict:
    """V11 with the second question of the first paragraph changed: keys set to None are removed."""
    data = json.loads(json.dumps(V11))
    q = data["data"][0]["paragraphs"][0]["qas"][1]
    for key, value in qa.items():
        if value is None:
            q.pop(key)
        else:
            q[key] = value
    return data


@pytest.mark.parametrize("change, message", [
    (dict(question=None), r"qas\[1\]: has no 'question'"),
    (dict(id=7), r"qas\[1\]: 'id' is int 7, not a string"),
    (dict(answers=[]), r"qas\[1\]: question 'q2' has no answers and is not is_impossible"),
    (dict(answers=None), r"qas\[1\]: has no 'answers'"),
    (dict(answers=[{"text": "50", "answer_start": 99}]),
     r"qas\[1\]\.answers\[0\]: answer_start=99 .* out of range for a 37-character context"),
    (dict(answers=[{"text": "50", "answer_start": 33}]),
     r"qas\[1\]\.answers\[0\]: the answer text '50' is not the context at answer_start=33, which reads ' 5'"),
    (dict(answers=[{"text": "50", "answer_start": "34"}]), r"qas\[1\]\.answers\[0\]: 'answer_start' is str '34'"),
    (dict(answers=[{"text": "50", "answer_start": True}]), r"qas\[1\]\.answers\[0\]: 'answer_start' is bool"),
    (dict(answers=["50"]), r"qas\[1\]\.answers\[0\]: is str '50', not a JSON object"),
    (dict(is_impossible="no"), r"qas\[1\]: 'is_impossible' is 'no', not true or false"),
    (dict(is_impossible=True), r"qas\[1\]: question 'q2' is_impossible but has answers"),
    (dict(id="q1"), r"qas\[1\]: question id 'q1' is already used at data\[0\]\.paragraphs\[0\]\.qas\[0\]"),
])
def test_read_errors(tmp_path, change, message):
    path = _write(tmp_path, _broken(**change))
    with pytest.raises(DataError, match=re.escape(str(path)) + r": data\[0\]\.paragraphs\[0\]\." + message):
        read_squad(path)


def test_read_file_errors(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(DataError, match=re.escape(f"{missing} does not exist")):
        read_squad(missing)
    with pytest.raises(DataError, match=r"bad\.json: not JSON"):
        read_squad(_write(tmp_path, '{"data": [', "bad.json"))
    with pytest.raises(DataError, match=r"empty\.json holds no questions"):
        read_squad(_write(tmp_path, {"version": "1.1", "data": [{"title": "t", "paragraphs": []}]}, "empty.json"))
    with pytest.raises(DataError, match=r"list\.json: has no 'data'"):
        read_squad(_write(tmp_path, {"version": "1.1"}, "list.json"))
    with pytest.raises(DataError, match=r"ctx\.json: data\[0\]\.paragraphs\[0\]: 'context' is int"):
        read_squad(_write(tmp_path, {"data": [{"paragraphs": [{"context": 3, "qas": []}]}]}, "ctx.json"))


# ------------------------------------------------------------------------------------------------ windows

def test_words_of():
    # a b _ _ c \t d _   ->  words ab, c, d; whitespace belongs to the word before it
    assert words_of("ab  c\td ") == (["ab", "c", "d"], [0, 0, 0, 0, 1, 1, 2, 2])
    assert words_of("x\u202fy\r\nz") == (["x", "y", "z"], [0, 0, 1, 1, 1, 2])
    assert words_of("  a") == (["a"], [0, 0, 0])  # leading whitespace: word 0
    assert words_of("") == ([], [])
    assert answer_text(["The", "Denver", "Broncos", "won"], 1, 2) == "Denver Broncos"
    assert answer_text(["The", "Denver", "Broncos", "won"], 3, 3) == "won"


def test_window_layout():
    tok = Pairs()
    q = _question("ab cd", "cd", 3, question="what")
    (w,) = windows(q, tok.encode, SPECIALS, seq_length=10)
    wh, at, ab, cd = tok.ids["wh"], tok.ids["at"], tok.ids["ab"], tok.ids["cd"]
    assert w.qid == "x"
    assert w.sample["tokens"].tolist() == [1, wh, at, 2, ab, cd, 2, 0, 0, 0]
    assert w.sample["token_types"].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert w.sample["padding_mask"].tolist() == [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    for key in ("tokens", "token_types", "padding_mask", "start_positions", "end_positions"):
        assert w.sample[key].dtype == np.int64
    assert w.sample["start_positions"].shape == () and int(w.sample["start_positions"]) == 5
    assert int(w.sample["end_positions"]) == 5
    assert w.token_to_word == {4: 0, 5: 1}
    assert w.max_context == {4: True, 5: True}


def test_answer_of_whole_words():
    tok = Pairs()
    # words abcd -> ab cd, efg -> ef g, hi -> hi; the query "q" is one id, so the context starts at 3
    context = "abcd efg hi"
    (w,) = windows(_question(context, "efg", 5), tok.encode, SPECIALS, seq_length=16)
    s, e = int(w.sample["start_positions"]), int(w.sample["end_positions"])
    assert (s, e) == (5, 6) and tok.decode(w.sample["tokens"][s:e + 1]) == "efg"
    (w,) = windows(_question(context, "efg hi", 5), tok.encode, SPECIALS, seq_length=16)
    s, e = int(w.sample["start_positions"]), int(w.sample["end_positions"])
    assert (s, e) == (5, 7) and tok.decode(w.sample["tokens"][s:e + 1]) == "efghi"
    # an answer starting or ending inside a word takes the whole word (run_squad's word positions)
    (w,) = windows(_question(context, "fg h", 6), tok.encode, SPECIALS, seq_length=16)
    assert (int(w.sample["start_positions"]), int(w.sample["end_positions"])) == (5, 7)
    assert w.token_to_word == {3: 0, 4: 0, 5: 1, 6: 1, 7: 2}
    (w,) = windows(_question(context), tok.encode, SPECIALS, seq_length=16)  # impossible
    assert (int(w.sample["start_positions"]), int(w.sample["end_positions"])) == (0, 0)


def test_several_windows():
    tok = Pairs()
    context = "ab cd ef gh ij"  # five words of one id each; query "q": one id; room = 7 - 1 - 3 = 3
    # doc_stride 2: windows at sub-tokens 0 (ab cd ef) and 2 (ef gh ij), which reaches the end
    ws = windows(_question(context, "gh", 9), tok.encode, SPECIALS, seq_length=7, doc_stride=2)
    assert [tok.decode(w.sample["tokens"][3:6]) for w in ws] == ["abcdef", "efghij"]
    assert [w.sample["tokens"][6] for w in ws] == [2, 2]
    assert [(int(w.sample["start_positions"]), int(w.sample["end_positions"])) for w in ws] == [(0, 0), (4, 4)]
    assert [w.token_to_word for w in ws] == [{3: 0, 4: 1, 5: 2}, {3: 2, 4: 3, 5: 4}]
    # ef: last of window 0 (min(2, 0) + 0.03) and first of window 1 (min(0, 2) + 0.03): a tie, the first wins
    assert [w.max_context for w in ws] == [{3: True, 4: True, 5: True}, {3: False, 4: True, 5: True}]
    ws = windows(_question(context, "cd ef", 3), tok.encode, SPECIALS, seq_length=7, doc_stride=2)
    assert [(int(w.sample["start_positions"]), int(w.sample["end_positions"])) for w in ws] == [(4, 5), (0, 0)]

    # a stride longer than a window advances by the window: 0-2, 3-4
    ws = windows(_question(context, "gh", 9), tok.encode, SPECIALS, seq_length=7, doc_stride=128)
    assert [w.token_to_word for w in ws] == [{3: 0, 4: 1, 5: 2}, {3: 3, 4: 4}]
    assert ws[1].sample["tokens"].tolist() == [1, tok.ids["q"], 2, tok.ids["gh"], tok.ids["ij"], 2, 0]
    assert ws[1].sample["padding_mask"].tolist() == [1, 1, 1, 1, 1, 1, 0]
    assert [(int(w.sample["start_positions"]), int(w.sample["end_positions"])) for w in ws] == [(0, 0), (3, 3)]
    # an answer across the two windows lies wholly in neither
    ws = windows(_question(context, "ef gh", 6), tok.encode, SPECIALS, seq_length=7, doc_stride=128)
    assert [(int(w.sample["start_positions"]), int(w.sample["end_positions"])) for w in ws] == [(0, 0), (0, 0)]


def test_max_context_owner():
    tok = Pairs()
    context = " ".join(f"w{i}" for i in range(10))  # ten one-id words; room = 8 - 1 - 3 = 4, stride 2
    ws = windows(_question(context, "w4 w5", 12), tok.encode, SPECIALS, seq_length=8, doc_stride=2)
    assert [sorted(w.token_to_word.values()) for w in ws] == [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7], [6, 7, 8, 9]]
    # word 3: window 0 at 3 (min(3, 0) = 0) or window 1 at 1 (min(1, 2) = 1): window 1; word 5: window 1 at 3 (0)
    # or window 2 at 1 (1): window 2; word 7 likewise window 3; words 2, 4, 6 sit at 2 of 0..3 (1) in the earlier
    owner = {}
    for k, w in enumerate(ws):
        for position, best in w.max_context.items():
            if best:
                assert w.token_to_word[position] not in owner
                owner[w.token_to_word[position]] = k
    assert owner == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2, 7: 3, 8: 3, 9: 3}
    # w4 w5 is sub-tokens 4-5: wholly in windows 1 (positions 2, 3 -> 5, 6) and 2 (0, 1 -> 3, 4)
    spans = [(int(w.sample["start_positions"]), int(w.sample["end_positions"])) for w in ws]
    assert spans == [(0, 0), (5, 6), (3, 4), (0, 0)]
    for w, (s, e) in zip(ws, spans):
        if s:
            assert tok.decode(w.sample["tokens"][s:e + 1]) == "w4w5"


def test_window_query_and_errors():
    tok = Pairs()
    (w,) = windows(_question("ab", question="abcdef"), tok.encode, SPECIALS, seq_length=8, max_query_length=2)
    assert w.sample["tokens"].tolist() == [1, tok.ids["ab"], tok.ids["cd"], 2, tok.ids["ab"], 2, 0, 0]
    assert w.sample["token_types"].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    with pytest.raises(ConfigError, match=r"seq_length=4 .*max_query_length=64"):
        windows(_question("ab"), tok.encode, SPECIALS, seq_length=4)
    with pytest.raises(ConfigError, match="doc_stride=0"):
        windows(_question("ab"), tok.encode, SPECIALS, seq_length=16, doc_stride=0)


# ------------------------------------------------------------------------------------------------ answers

WORDS = ["The", "Denver", "Broncos", "won", "it"]


def _window(token_to_word: Dict[int, int], best=None) -> Window:
    best = best if best is not None else {p: True for p in token_to_word}
    return Window("x", {}, token_to_word, best)


def _logits(n: int, **at) -> np.ndarray:
    out = np.zeros(n)
    for position, value in at.items():
        out[int(position[1:])] = value
    return out


def test_best_answer():
    w = _window({3: 1, 4: 2, 5: 3})  # [CLS] q [SEP] Denver Broncos won [SEP]
    start, end = _logits(7, p3=5, p4=0.5), _logits(7, p3=1, p4=5)
    assert best_answer([w], [start], [end], WORDS) == "Denver Broncos"  # 5 + 5
    # two sub-tokens is too long: Denver alone (5 + 1 = 6) beats Broncos alone (0.5 + 5)
    assert best_answer([w], [start], [end], WORDS, max_answer_length=1) == "Denver"
    # the best logits at the [CLS] (0) and in the query (1, and the [SEP] at 2) are no spans: (3, 4) = 2 + 3
    start, end = _logits(7, p0=9, p1=8, p3=2), _logits(7, p0=9, p2=8, p4=3)
    assert best_answer([w], [start], [end], WORDS) == "Denver Broncos"


def test_best_answer_rules():
    w = _window({3: 1, 4: 2, 5: 3})
    # (5, 3) = 4 + 6 ends before it starts; the next best is (5, 5) = 4 + 2 (then (3, 3) = -1 + 6)
    start, end = _logits(7, p0=9, p1=8, p5=4, p3=-1), _logits(7, p0=9, p1=8, p3=6, p5=2)
    assert best_answer([w], [start], [end], WORDS) == "won"
    # the n_best highest: starts 0, 1, 5, 2 (the first of the zeros), ends 0, 1, 3, 5. Three ends stop
    # before 5: no span is left, and without allow_null the answer is ""; four reach it
    assert best_answer([w], [start], [end], WORDS, n_best=2) == ""
    assert best_answer([w], [start], [end], WORDS, n_best=3) == ""
    assert best_answer([w], [start], [end], WORDS, n_best=4) == "won"
    # a start where this window has not the most context is not taken
    start, end = _logits(7, p3=5, p4=1), _logits(7, p4=5)
    assert best_answer([_window({3: 1, 4: 2, 5: 3}, {3: False, 4: True, 5: True})], [start], [end],
                       WORDS) == "Broncos"


def test_best_answer_windows_and_null():
    # two windows over words 1..3 and 3..4; the best span is in the second
    w0, w1 = _window({3: 1, 4: 2, 5: 3}), _window({3: 3, 4: 4}, {3: False, 4: True})
    s0, e0 = _logits(7, p0=3, p3=1), _logits(7, p3=1)  # null 3, best (3, 3) = 2
    s1, e1 = _logits(7, p0=1, p4=2), _logits(7, p4=2)  # null 1, best (4, 4) = 4
    assert best_answer([w0, w1], [s0, s1], [e0, e1], WORDS) == "it"
    # null score: the lowest [CLS] score, 1; 1 - 4 < 0: the span
    assert best_answer([w0, w1], [s0, s1], [e0, e1], WORDS, allow_null=True) == "it"
    s1, e1 = _logits(7, p0=5, p4=2), _logits(7, p0=5, p4=2)  # null min(3, 10) = 3, best 4 - still the span
    assert best_answer([w0, w1], [s0, s1], [e0, e1], WORDS, allow_null=True) == "it"
    s0, e0 = _logits(7, p0=3, p3=1), _logits(7, p0=3, p3=1)  # null min(6, 10) = 6 > 4 by 2
    assert best_answer([w0, w1], [s0, s1], [e0, e1], WORDS, allow_null=True) == ""
    assert best_answer([w0, w1], [s0, s1], [e0, e1], WORDS, allow_null=True, null_threshold=2.0) == "it"
    assert best_answer([w0, w1], [s0, s1], [e0, e1], WORDS, allow_null=True, null_threshold=1.5) == ""
    assert best_answer([w0, w1], [s0, s1], [e0, e1], WORDS) == "it"  # v1.1: never null
    with pytest.raises(ValueError, match="2 windows but 1 start"):
        best_answer([w0, w1], [s0], [e0, e1], WORDS)


def test_windows_to_answer():
    """windows -> logits peaked at the gold positions -> best_answer gives the answer's words back."""
    tok = Pairs()
    context = " ".join(f"w{i}" for i in range(10))
    q = _question(context, "w4 w5", 12)
    ws = windows(q, tok.encode, SPECIALS, seq_length=8, doc_stride=2)
    starts = [np.eye(8)[int(w.sample["start_positions"])] * 3 for w in ws]
    ends = [np.eye(8)[int(w.sample["end_positions"])] * 3 for w in ws]
    # windows 1 and 2 both hold it; window 1 owns w4 (its max-context window): (5, 6) there
    assert best_answer(ws, starts, ends, words_of(context)[0]) == "w4 w5"
    assert exact_match(best_answer(ws, starts, ends, words_of(context)[0]), q.answers) == 1.0


def test_answer_targets_leave_out_what_its_word_carries():
    """An answer "1917" inside the word "1917." targets the answer's own pieces, without the ".";
    when no run of the word's pieces is the answer encoded, the whole word is the target."""
    tok = Pairs()
    q = _question("born in 1917.", "1917", 8)
    (w,) = windows(q, tok.encode, SPECIALS, seq_length=16)
    start, end = int(w.sample["start_positions"]), int(w.sample["end_positions"])
    assert tok.decode(w.sample["tokens"][start:end + 1]) == "1917"
    q = _question("born in 917.", "917", 8)  # pieces "91", "7.": the answer is not a run of them
    (w,) = windows(q, tok.encode, SPECIALS, seq_length=16)
    start, end = int(w.sample["start_positions"]), int(w.sample["end_positions"])
    assert tok.decode(w.sample["tokens"][start:end + 1]) == "917."
