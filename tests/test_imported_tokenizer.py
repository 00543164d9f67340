"""An imported model keeps its own tokenizer's conventions, which a tokenizer.json alone cannot say.

The folder here is a tiny Llama whose tokenizer puts <s> in front of every text (its post-processor), ends
documents with </s> (tokenizer_config.json's eos_token) and has a Jinja chat template that writes {{ bos_token }}
first. The reference is transformers' own fast tokenizer over the same files:
- a prompt is what transformers' tokenizer(text) gives (<s> first, not megalm's end-of-document token);
- a chat served is what apply_chat_template(..., add_generation_prompt=True) gives;
- training from the import (the run config's tokenizer) ends documents with </s> and starts them with <s>.
A megalm-trained tokenizer keeps megalm's convention: every document after the end-of-document token.
"""

import json
from types import SimpleNamespace

import pytest
import transformers
from omegaconf import OmegaConf

from megalm.convert import import_from_hf
from megalm.data import build_tokenizer, load_tokenizer
from megalm.data.tasks.sft import encode_example
from megalm.serve.chat import chat_prompt

WORDS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "hello", "world", "user", "assistant", ":", "[INST]", "[/INST]"]
JINJA = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST] "
         "{% else %}assistant : {{ m['content'] }}{{ eos_token }} {% endif %}{% endfor %}"
         "{% if add_generation_prompt %}assistant : {% endif %}")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    root = tmp_path_factory.mktemp("imported_tok")
    hf_dir = root / "hf"
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                   max_position_embeddings=32, vocab_size=len(WORDS), bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf_dir)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[
        ("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>", "[INST]", "[/INST]"])
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": JINJA}))
    out, _ = import_from_hf(hf_dir, root / "ckpt", name="tiny_llama")
    reference = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    return out, reference


def test_a_prompt_starts_as_the_models_own_tokenizer_starts_it(imported):
    out, reference = imported
    tok = load_tokenizer(out)
    assert tok.eod == WORDS.index("</s>") and tok.start == [WORDS.index("<s>")]
    for text in ("hello world", "world", ""):
        assert tok.prompt(text) == reference(text)["input_ids"], text


def test_a_chat_is_what_the_models_own_template_gives(imported):
    out, reference = imported
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
                {"role": "user", "content": "world hello"}]
    theirs = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    ours = chat_prompt(load_tokenizer(out), "{role}: {content}\n", [SimpleNamespace(**m) for m in messages])
    assert ours == list(theirs)


def test_training_from_the_import_keeps_its_end_and_start_tokens(imported):
    out, _ = imported
    run = OmegaConf.load(out / "config.yaml")
    tok = build_tokenizer(run.data.tokenizer)  # what train builds from the run config
    assert tok.eod == WORDS.index("</s>") and tok.start == [WORDS.index("<s>")]
    ids, learned = encode_example([("hello", False), ("world", True)], tok, 8, "example")
    assert ids.tolist()[:4] == [WORDS.index(w) for w in ("<s>", "hello", "world", "</s>")]
    assert learned.tolist()[:4] == [False, False, True, True]
    saved = out.parent / "run_tokenizer"
    tok.save_to(saved)  # a fine-tuned run's copy keeps all of it
    again = load_tokenizer(saved)
    assert (again.eod, again.start, again.chat_template) == (tok.eod, tok.start, JINJA)


def test_a_megalm_tokenizer_starts_every_document_after_its_end_token(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megalm.data.tokenizers.huggingface import HuggingFaceTokenizer
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.save(str(tmp_path / "tokenizer.json"))
    tok = HuggingFaceTokenizer(tmp_path / "tokenizer.json")
    assert tok.eod == WORDS.index("<|endoftext|>") and tok.chat_template is None
    assert tok.prompt("hello") == [tok.eod, WORDS.index("hello")] and tok.context == [tok.eod]
    assert chat_prompt(tok, "{role}: {content}\n", [SimpleNamespace(role="user", content="hello")]) == \
        [tok.eod] + tok.encode("user: hello\nassistant: ")


def test_a_sidecar_naming_a_start_token_the_vocabulary_lacks_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    from megalm.data.tokenizers.huggingface import HF_SIDECAR
    from megalm.errors import DataError
    Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json"))
    (tmp_path / HF_SIDECAR).write_text(json.dumps({"type": "huggingface", "start_tokens": ["<bos>"]}))
    with pytest.raises(DataError, match=r"start_tokens \['<bos>'\] are not in tokenizer.json"):
        load_tokenizer(tmp_path)


def test_fine_tuning_chats_are_written_by_the_models_own_template(imported):
    """A chat of the fine-tuning data is the one the server's prompt continues: transformers' apply_chat_template
    of the whole chat, then the end token; the loss is on what follows the template's assistant opening."""
    out, reference = imported
    tok = load_tokenizer(out)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
                {"role": "user", "content": "world"}, {"role": "assistant", "content": "hello world"}]

    def theirs(chat, opening):
        return list(reference.apply_chat_template(chat, add_generation_prompt=opening, tokenize=True,
                                                  return_dict=True)["input_ids"])
    from megalm.data.tasks.sft import read_examples
    data = out.parent / "chats.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n")
    [(ids, learned)] = read_examples([str(data)], tok, 24, "{role}: {content}\n")
    whole = theirs(messages, False)
    assert ids.tolist()[:len(whole) + 1] == whole + [tok.eod]
    taught = [i for i, on in enumerate(learned.tolist()) if on]
    first, second = len(theirs(messages[:1], True)), len(theirs(messages[:3], True))
    assert taught == list(range(first, len(theirs(messages[:2], False)))) + list(range(second, len(whole) + 1))


def test_a_chat_the_models_template_refuses_names_its_line(imported, tmp_path):
    from megalm.data.tasks.sft import read_examples
    from megalm.data.tokenizers.huggingface import HF_SIDECAR
    from megalm.errors import DataError
    out, _ = imported
    run = tmp_path / "tok"
    run.mkdir()
    (run / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    side = json.loads((out / HF_SIDECAR).read_text())
    side["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('a chat starts with a user') }}" \
        "{% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (run / HF_SIDECAR).write_text(json.dumps(side))
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(DataError, match=r"chats.jsonl:1: the model's chat template refused the chat: a chat starts "
                                        r"with a user"):
        read_examples([str(data)], load_tokenizer(run), 16, "{role}: {content}\n")
