"""A chat as the token ids a decoder model continues with the assistant's reply.

A model whose tokenizer carries its own Jinja chat template (an imported model's, e.g. SmolLM2's, which adds a
default system message when a chat has none) gets the chat written by that template with the assistant's opening
after it, tokenized as it stands, as transformers' apply_chat_template(..., add_generation_prompt=True) gives it.
Any other model gets each message written with the run's data.chat_template, then the assistant's part of it up
to its content, after the start token (tokenizer.start), as fine-tuning on chats wrote them.
"""

from __future__ import annotations

from typing import List, Sequence

from megalm.data.tasks.sft import template_parts
from megalm.errors import DataError
from megalm.serve.schemas import BadRequest


def chat_prompt(tokenizer, template: str, messages: Sequence) -> List[int]:
    """The prompt ids of `messages` (objects with .role and .content); `template`: data.chat_template."""
    if tokenizer.chat_template:
        try:
            text = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages], True)
        except DataError as e:  # the template's own refusal (roles that must alternate, ...)
            raise BadRequest(f"messages: {e}", "messages") from None
        return tokenizer.encode(text) or tokenizer.context
    text = ""
    for m in messages:
        before, after = template_parts(template, m.role)
        text += before + m.content + after
    before, _ = template_parts(template, "assistant")
    return tokenizer.prompt(text + before)
