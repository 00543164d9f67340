"""megalm.serve as users reach it: a real server process on 127.0.0.1 driven with plain HTTP
(httpx) and the openai client. Its answers are checked against independent paths: greedy text
against megalm's own KV-cache generation of each request alone, log-probabilities against
transformers on the exported weights; concurrent requests come back unmixed; bad requests get a
400 naming the field and the server goes on; a full queue answers 503; SIGTERM lets the request in
flight finish and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eval_reference import hf_logprobs
from server_process import start_server, stop_server

PROMPTS = ["import os\n", "def f(x):", "class A:\n    def", "for i in range(3):", "# a comment\n", "while True:",
           "x = [", "return self."]


@pytest.fixture(scope="module")
def served(run):
    proc, url = start_server(run[0])
    yield proc, url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def server(served):
    return served[1]


@pytest.fixture(scope="module")
def alone(run):
    """Greedy completions of each prompt, generated alone in this process (KV cache, no server):
    prompt -> (text, token ids, their log-probabilities from transformers)."""
    from megalm.generate import generate_ids, load_for_generation
    cfg, model, tok, _ = load_for_generation(run[0])
    out = {}
    for p in PROMPTS:
        context = [tok.eod] + tok.encode(p)
        ids = list(generate_ids(model, context, max_new_tokens=12, temperature=0, top_k=0, vocab_size=tok.vocab_size,
                                eod=tok.eod))
        out[p] = (tok.decode(context + ids)[len(tok.decode(context)):], ids,
                  hf_logprobs(run[1], context, ids)[0].tolist())
    return out


def test_completions_equal_generation_alone_and_logprobs_equal_transformers(server, run, alone):
    _, hf, tok = run
    for prompt in PROMPTS[:3]:
        r = httpx.post(f"{server}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                          "logprobs": 0}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text, ids, ref = alone[prompt]
        assert choice["text"] == text
        lp = choice["logprobs"]
        assert "".join(lp["tokens"]) == text and len(lp["token_logprobs"]) == len(ids)
        context = [tok.eod] + tok.encode(prompt)
        assert lp["token_logprobs"] == pytest.approx(ref, abs=1e-4)
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(context) and usage["completion_tokens"] == len(ids)


def test_megatron_api(server, run, alone):
    _, hf, tok = run
    prompts = ["def f(x):", "import os\n"]
    r = httpx.put(f"{server}/api", json={"prompts": prompts, "tokens_to_generate": 6, "top_k": 1, "logprobs": True,
                                         "add_BOS": True}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    for k, prompt in enumerate(prompts):
        ids = [tok.eod] + tok.encode(prompt)
        head, text = tok.decode(ids), out["text"][k]
        generated = text[len(head):]
        assert text.startswith(head) and generated and alone[prompt][0].startswith(generated)  # greedy (top_k=1)
        assert "".join(out["segments"][k]) == text and len(out["logprobs"][k]) == len(out["segments"][k]) - 1
        prompt_ref, _ = hf_logprobs(hf, ids[:1], ids[1:])
        assert out["logprobs"][k][:len(ids) - 1] == pytest.approx(prompt_ref.tolist(), abs=1e-4)
    # tokens_to_generate=0 scores the prompt only
    r = httpx.put(f"{server}/api", json={"prompts": ["import os"], "tokens_to_generate": 0, "logprobs": True,
                                         "add_BOS": True}, timeout=60)
    ids = [tok.eod] + tok.encode("import os")
    assert r.json()["logprobs"][0] == pytest.approx(hf_logprobs(hf, ids[:1], ids[1:])[0].tolist(), abs=1e-4)


def test_openai_client_completions_chat_and_streams(server, alone):
    import openai
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    models = client.models.list().data
    assert len(models) == 1
    done = client.completions.create(model=models[0].id, prompt="def f(x):", max_tokens=12, temperature=0)
    assert done.choices[0].text == alone["def f(x):"][0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=models[0].id, prompt="def f(x):", max_tokens=12, temperature=0, stream=True))
    assert streamed == done.choices[0].text
    ranked = client.completions.create(model=models[0].id, prompt="def f(x):", max_tokens=6, temperature=0,
                                       logprobs=3).choices[0].logprobs
    assert len(ranked.top_logprobs) == len(ranked.tokens) == 6
    for token, logprob, top in zip(ranked.tokens, ranked.token_logprobs, ranked.top_logprobs):
        values = list(top.values())
        assert 1 <= len(top) <= 3 and values == sorted(values, reverse=True)
        assert top[token] == pytest.approx(logprob) == pytest.approx(values[0])  # greedy: the best one was taken
    echo = client.completions.create(model=models[0].id, prompt="def f(x):", max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("def f(x):")
    messages = [{"role": "user", "content": "write a loop"}]
    chat = client.chat.completions.create(model=models[0].id, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
    pieces = list(client.chat.completions.create(model=models[0].id, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == chat.choices[0].message.content
    seeded = [client.completions.create(model=models[0].id, prompt="x = ", max_tokens=8, temperature=1.0, seed=7)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def _sampled_alone(run_dir, prompt, **sampling):
    """The text megalm's own KV-cache generation samples for `prompt` with these settings (top_k off, as the
    OpenAI API has none), from the generator seeded as the server seeds a request's."""
    from megalm.generate import generate_ids, load_for_generation
    _, model, tok, _ = load_for_generation(run_dir)
    context = [tok.eod] + tok.encode(prompt)
    ids = list(generate_ids(model, context, max_new_tokens=16, top_k=0, vocab_size=tok.vocab_size, eod=tok.eod,
                            **sampling))
    return tok.decode(context + ids)[len(tok.decode(context)):]


@pytest.mark.parametrize("sampling", [dict(temperature=0.7, top_p=0.6, seed=11),
                                      dict(temperature=1.6, top_p=1.0, seed=3)], ids=["top_p", "temperature"])
def test_a_seeded_sampled_completion_is_what_generation_samples_with_its_settings(server, run, sampling):
    """A request's temperature, top_p and seed reach the sampler: the openai client's completion equals megalm's
    generation of the prompt alone with the same settings and seed, and differs from what it samples with the
    setting changed (so a server that dropped the setting would fail here)."""
    import openai
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    prompt = "def f(x):"
    got = client.completions.create(model=model, prompt=prompt, max_tokens=16, **sampling).choices[0].text
    assert got == _sampled_alone(run[0], prompt, **sampling)
    changed = dict(sampling, top_p=1.0) if sampling["top_p"] < 1 else dict(sampling, temperature=0.7)
    assert got != _sampled_alone(run[0], prompt, **changed)


def _greedy_adjusted(run_dir, context, steps, presence=0.0, frequency=0.0, bias=None):
    """Greedy decoding written out over the model's whole-sequence forward (no KV cache, no engine): each step's
    logits less presence x (generated before) and frequency x (times generated), plus the bias; the ids chosen."""
    import torch
    from megalm.generate import load_for_generation
    _, model, tok, _ = load_for_generation(run_dir)
    ids = list(context)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids]))[0, -1, :tok.vocab_size].float()
            made = ids[len(context):]
            for t in set(made):
                logits[t] -= presence + frequency * made.count(t)
            for t, b in (bias or {}).items():
                logits[t] += b
            nxt = int(logits.argmax())
            if nxt == tok.eod:
                break
            ids.append(nxt)
    return ids[len(context):]


def test_what_openai_clients_send_is_taken_and_honoured(served, run):
    """Fields the openai client sends by default or commonly: token-id prompts (one list, or a batch) read as given;
    presence and frequency penalties and logit_bias applied before the draw (greedy here, against the same
    adjustments written out over the model's forward); best_of's pick of the candidates by log-probability a token;
    stream_options.include_usage's last chunk; and the server's log line for each request."""
    import openai
    from megalm.generate import load_for_generation
    proc, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    _, _, tok, _ = load_for_generation(run[0])
    prompt = "def f(x):"
    context = [tok.eod] + tok.encode(prompt)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    # token ids as given: the server's own reading of the text (end-of-document first) gives the same completion
    by_ids = client.completions.create(model=model, prompt=context, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == plain.choices[0].text
    batch = client.completions.create(model=model, prompt=[context, tok.encode(prompt)], max_tokens=10, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == plain.choices[0].text
    assert batch.usage.prompt_tokens == 2 * len(context) - 1
    ids = tok.encode(prompt)  # echoed: given ids have no end-of-document token before them, so the first has no
    echoed = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, echo=True,  # logprob
                                       logprobs=0).choices[0]
    assert echoed.text.startswith(tok.decode(ids)) and echoed.logprobs.token_logprobs[0] is None
    assert len(echoed.logprobs.tokens) == len(echoed.logprobs.token_logprobs) == len(ids) + 4
    assert all(isinstance(v, float) for v in echoed.logprobs.token_logprobs[1:])
    # penalties and bias, greedy, against the written-out decoding; zeros change nothing
    zeros = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, presence_penalty=0.0,
                                      frequency_penalty=0.0, logit_bias={})
    assert zeros.choices[0].text == plain.choices[0].text
    first = _greedy_adjusted(run[0], context, 1)[0]
    for kw, ref in ((dict(presence_penalty=1.5, frequency_penalty=0.5), dict(presence=1.5, frequency=0.5)),
                    (dict(logit_bias={str(first): -100}), dict(bias={first: -100.0})),
                    (dict(logit_bias={"42": 100}), dict(bias={42: 100.0}))):
        got = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, **kw)
        want = _greedy_adjusted(run[0], context, 10, **ref)
        assert got.choices[0].text == tok.decode(context + want)[len(tok.decode(context)):], kw
    assert tok.decode([42] * 10) == client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                                              logit_bias={"42": 100}).choices[0].text
    # best_of: the candidate with the highest log-probability a token among seeds 5, 6, 7 (seed + j)
    best = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, best_of=3)
    candidates = [client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=5 + j,
                                            logprobs=0).choices[0] for j in range(3)]
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates]
    assert len(set(c.text for c in candidates)) > 1
    assert best.choices[0].text == candidates[mean.index(max(mean))].text and len(best.choices) == 1
    # include_usage: the last chunk, no choices, the request's usage
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == plain.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    chat = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens >= 1
    # the access log: one line a request with its tokens
    lines = proc.log_path.read_text().splitlines()
    usage = plain.usage
    assert any(f"POST /v1/completions 200 prompt_tokens={usage.prompt_tokens} "
               f"completion_tokens={usage.completion_tokens} " in line for line in lines)
    assert any("GET /v1/models 200" in line for line in lines)


def test_a_stream_sends_a_character_only_once_its_bytes_are_complete():
    """Byte pieces of one character decode to U+FFFD until its last byte comes: held back, never sent and
    then contradicted (which used to stop the stream's text there)."""
    from megalm.serve.api import _delta
    decoded = ["s", "s\ufffd", "s\ufffd\ufffd", "sՍ", "sՍ\ufffd", "sՍ\ufffdx", "sՍ\ufffdxy"]
    sent, deltas = "", []
    for so_far in decoded:
        deltas.append(_delta(so_far, sent))
        sent += deltas[-1]
    assert deltas == ["s", "", "", "Ս", "", "\ufffdx", "y"]  # an invalid byte inside the text stays U+FFFD
    assert sent == decoded[-1]


@pytest.mark.parametrize("method, path, body, status, param", [
    ("post", "/v1/completions", "{not json", 400, "body"),
    ("post", "/v1/completions", {"prompt": 5, "max_tokens": 4}, 400, "prompt"),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": "4"}, 400, "max_tokens"),
    ("post", "/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("post", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("post", "/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("post", "/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("post", "/v1/completions", {"prompt": "x", "logit_bias": {"10": 101}}, 400, "logit_bias"),
    ("post", "/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("post", "/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ("post", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("post", "/v1/completions", {"prompt": [1, 10 ** 6]}, 400, "prompt"),
    ("post", "/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": 40}, 400, "max_tokens"),
    ("post", "/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("post", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("post", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("put", "/api", {"prompts": ["x"], "top_k": 2, "top_p": 0.5}, 400, "top_p"),
    ("put", "/api", {"prompts": ["x"], "temperature": 0}, 400, "temperature"),
    ("put", "/api", {"prompts": [""], "tokens_to_generate": 2}, 400, "prompts"),
    ("put", "/api", {"prompts": ["x"], "beam_width": 2}, 400, "beam_width"),
    ("post", "/v1/embeddings", {"input": "x"}, 404, None),
    ("get", "/v1/completions", None, 405, None),
])
def test_bad_requests_name_the_field_and_the_server_goes_on(server, method, path, body, status, param):
    """Every error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: a bad field names it; an unknown
    path (404) or a method the path does not take (405) says so and lists the endpoints."""
    kw = {"content": body} if isinstance(body, str) else {"json": body} if body is not None else {}
    r = httpx.request(method.upper(), f"{server}{path}", headers={"Content-Type": "application/json"}, timeout=60,
                      **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and set(error) == {"message", "type", "param", "code"}
    if status in (404, 405):
        assert path in error["message"] and "POST /v1/completions" in error["message"]
    assert httpx.get(f"{server}/health", timeout=10).json()["status"] == "ok"


def test_concurrent_clients_get_their_own_answers(server, alone):
    """32 clients x 20 requests at once: every answer is its prompt's greedy completion alone, with
    the log-probabilities of the request alone (batched rows see only their own keys)."""
    latencies, answers = [], []

    async def client(k: int, http: httpx.AsyncClient):
        for i in range(20):
            prompt = PROMPTS[(k + i) % len(PROMPTS)]
            start = time.perf_counter()
            r = await http.post(f"{server}/v1/completions",
                                json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0})
            latencies.append(time.perf_counter() - start)
            answers.append((prompt, r.status_code, r.json()["choices"][0] if r.status_code == 200 else r.text))

    async def main():
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            await asyncio.gather(*(client(k, http) for k in range(32)))
    asyncio.run(main())
    assert len(answers) == 640
    for prompt, status, choice in answers:
        assert status == 200 and choice["text"] == alone[prompt][0], (prompt, choice)
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(alone[prompt][2], abs=1e-4), prompt
    latencies.sort()
    print(f"640 requests, 32 clients: latency p50 {latencies[319]:.3f} s, p99 {latencies[633]:.3f} s")


def test_full_queue_is_503_and_sigterm_finishes_the_request_in_flight(run, alone):
    proc, url = start_server(run[0], "--slots", "1", "--max-queue", "1")
    try:
        async def flood():
            async with httpx.AsyncClient(timeout=300) as http:
                return await asyncio.gather(*(http.post(f"{url}/v1/completions", json={
                    "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}) for _ in range(16)))
        codes = [r.status_code for r in asyncio.run(flood())]
        assert 503 in codes and 200 in codes and set(codes) == {200, 503}
        with httpx.stream("POST", f"{url}/v1/completions", timeout=300, json={
                "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "stream": True}) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)  # mid-stream
            rest = [line for line in lines if line.startswith("data: ")]
        chunks = [json.loads(x[6:]) for x in [first] + rest[:-1]]
        assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bench_serve_runs_and_every_system_generates_the_same_tokens(run, tmp_path):
    """scripts/bench_serve.py end to end on a few requests (a smoke test, never a timing test): the
    server at each concurrency and transformers generate the same greedy tokens, so the same count."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_serve.py"
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(script), str(run[0]), "--requests", "6", "--max-tokens", "8",
                        "--concurrency", "1", "3", "--slots", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["system"] for row in rows] == ["megalm.serve, 1 in flight", "megalm.serve, 3 in flight",
                                               "transformers generate, one by one"]
    assert all(row["requests"] == 6 and row["tokens_per_s"] > 0 for row in rows)
    assert len({row["tokens"] for row in rows}) == 1 and rows[0]["tokens"] > 0


def test_bench_pretrained_runs_both_models_on_the_same_run(run, tmp_path):
    """scripts/bench_pretrained.py end to end on the trained test run (a smoke test, never a timing test)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_pretrained.py"
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(script), str(run[0]), "--rounds", "2", "--seq", "16", "--new-tokens", "4",
                        "--micro-batch", "1", "--threads", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert all(result[what][k] > 0 for what in ("train", "generate") for k in ("megalm", "transformers", "ratio"))


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_a_layout_serves_what_one_process_does(run, alone, layout):
    """Two ranks started by the server itself: rank 0 takes the requests, the other runs its forwards;
    concurrent greedy answers and their log-probabilities are those of each request alone, and
    SIGTERM stops both ranks with exit 0."""
    proc, url = start_server(run[0], *layout, "--slots", "4")
    try:
        async def ask():
            async with httpx.AsyncClient(timeout=300) as http:
                return await asyncio.gather(*(http.post(f"{url}/v1/completions", json={
                    "prompt": p, "max_tokens": 12, "temperature": 0, "logprobs": 0}) for p in PROMPTS))
        for prompt, r in zip(PROMPTS, asyncio.run(ask())):
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == alone[prompt][0]
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(alone[prompt][2], abs=1e-4)
        assert stop_server(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_playground_streams_a_completion_in_a_real_browser(server, alone, tmp_path):
    """Debian's Chromium, headless, through chromedriver: type a prompt, press Generate, and watch
    the completion arrive in pieces until it is the greedy completion of that prompt."""
    import shutil
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1000,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(server + "/")
        WebDriverWait(driver, 60).until(lambda d: "model:" in d.find_element(By.ID, "model").text)
        box = driver.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys("def f(x):")
        for field, value in (("max_tokens", "12"), ("temperature", "0")):
            el = driver.find_element(By.ID, field)
            el.clear()
            el.send_keys(value)
        driver.find_element(By.ID, "generate").click()
        seen = []
        want = alone["def f(x):"][0]

        def progressed(d):
            text = d.find_element(By.ID, "completion").get_attribute("textContent")
            if not seen or seen[-1] != text:
                seen.append(text)
            return d.find_element(By.ID, "status").text.startswith("done")
        WebDriverWait(driver, 120, poll_frequency=0.01).until(progressed)
        final = driver.find_element(By.ID, "completion").get_attribute("textContent")
        status = driver.find_element(By.ID, "status").text  # "done (length): N pieces in S s"
        assert final == want and all(want.startswith(text) for text in seen)  # it grew by pieces of the completion
        assert status.startswith("done (") and int(status.split(": ")[1].split()[0]) > 1  # streamed, not one blob
        assert driver.save_screenshot(str(tmp_path / "playground.png"))
    finally:
        driver.quit()


def test_a_port_in_use_is_named_before_anything_loads(tmp_path, capsys):
    import socket
    from megalm.serve import main
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as stop:
            main([str(tmp_path / "no_run"), "--port", str(port)])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 1 and err.startswith(f"megalm.serve: invalid config: --host 127.0.0.1 --port {port}: "
                                                   "cannot listen there (Address already in use)"), err


@pytest.mark.parametrize("port", ["-1", "65536"])
def test_a_port_out_of_range_is_named_before_anything_loads(tmp_path, capsys, port):
    """--port -1 is one line naming it (not uvicorn's OverflowError), said before the run is looked for."""
    from megalm.serve import main
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "no_run"), "--port", port])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 1 and err == f"megalm.serve: invalid config: --port {port} must be 0 to 65535 (0: any free port)", err
