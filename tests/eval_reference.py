"""What the evaluation tests score, and the independent reference they score it against: a text
(TEXT), multiple-choice examples (CHOICES, and TRAILING with whitespace at the contexts' end), and transformers' log-probabilities of a continuation
(hf_logprobs) on the run's exported weights."""

import torch

TEXT = ("Return the number of items in a container. The argument may be a sequence (such as a string, "
        "bytes, tuple, list, or range) or a collection (such as a dictionary, set, or frozen set).\n\n"
        "def __init__(self, *args, **kwargs):\n    return len(self.items)\n")
CHOICES = [{"context": "import os\nimport", "choices": [" sys", " zzz qq", " re"], "label": 0},
           {"context": "def f(self):\n    return", "choices": [" self", " 12345 67"], "label": 0},
           {"context": "The quick brown", "choices": [" fox", " elephant walking slowly"], "label": 1}]
# Contexts that end in whitespace, choices that start without it: the harness moves the whitespace into the
# continuation ("import" + " sys", not "import " + "sys"), which tokenizes differently.
TRAILING = [{"context": "import os\nimport ", "choices": ["sys", "zzz qq", "re"], "label": 0},
            {"context": "def f(self):\n    return ", "choices": ["self", "12345 67"], "label": 0},
            {"context": "for i in range(3):\n    ", "choices": ["print(i)", "return", "pass"], "label": 0}]


def hf_logprobs(hf, context, targets):
    """log p(targets[i] | context + targets[:i]) and whether each was the argmax, from transformers."""
    ids = torch.tensor([context + targets[:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0, len(context) - 1:], dim=-1)
    t = torch.tensor(targets)
    return logp.gather(-1, t[:, None])[:, 0], logp.argmax(-1) == t
