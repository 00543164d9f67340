"""Write SQuAD v2.0 files of made-up short biographies (no QA data ships offline): where and when
someone was born, where someone moved, and questions about a person the paragraph does not name,
which have no answer.

    python examples/question_answering/make_squad.py OUT_DIR [--train 300] [--dev 60] [--seed 0]
"""

import argparse
import json
import random
from pathlib import Path

FIRST = ["Anna", "Boris", "Carla", "David", "Elena", "Felix", "Greta", "Hugo", "Irene", "Jonas", "Klara", "Luca",
         "Marta", "Nils", "Olga", "Pavel", "Rosa", "Stefan", "Tilda", "Viktor"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Delhi", "Quito", "Bern", "Lisbon", "Prague", "Vienna", "Dublin",
          "Madrid", "Warsaw", "Athens", "Tokyo", "Nairobi", "Toronto", "Sydney", "Santiago"]
JOBS = ["a painter", "an engineer", "a teacher", "a doctor", "a pilot", "a baker", "a writer", "a chemist"]


def paragraph(rng: random.Random, k: int):
    a, b, c = rng.sample(FIRST, 3)
    born, moved = rng.sample(CITIES, 2)
    year, job = str(rng.randint(1850, 2005)), rng.choice(JOBS)
    context = (f"{a} was born in {born} in {year} and worked as {job}. Years later {b} moved to {moved}, "
               f"where the two of them met.")

    def qa(suffix, question, answer):
        start = context.index(answer)
        return {"id": f"{k}{suffix}", "question": question, "is_impossible": False,
                "answers": [{"text": answer, "answer_start": start}]}
    qas = [qa("b", f"Where was {a} born?", born), qa("y", f"In which year was {a} born?", year),
           qa("j", f"What did {a} work as?", job), qa("m", f"Where did {b} move?", moved),
           {"id": f"{k}n", "question": f"Where was {c} born?", "is_impossible": True, "answers": []}]
    return {"context": context, "qas": qas}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("output", type=Path)
    ap.add_argument("--train", type=int, default=300, help="training paragraphs (5 questions each)")
    ap.add_argument("--dev", type=int, default=60, help="held-out paragraphs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    args.output.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, n in (("train", args.train), ("dev", args.dev)):
        paragraphs = [paragraph(rng, f"{name}{k}") for k in range(n)]
        doc = {"version": "v2.0", "data": [{"title": "biographies", "paragraphs": paragraphs}]}
        (args.output / f"{name}-v2.0.json").write_text(json.dumps(doc, indent=1))
        counts[name] = sum(len(p["qas"]) for p in paragraphs)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
