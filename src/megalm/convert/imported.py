"""What makes an imported checkpoint dir a run directory: a whole run's config.yaml (the default run with the
imported model, its tokenizer and chat template, its checkpoints in the dir itself) and the tokenizer with its
end token, start tokens and Jinja chat template, so generate, serve, evaluate and plan take the dir as they take
a trained run's, and train takes it as checkpoint.load."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from megalm.config import ModelConfig, conf_dir
from megalm.data.tokenizers.huggingface import HF_SIDECAR, HuggingFaceTokenizer
from megalm.models.registry import register_configs

log = logging.getLogger("megalm.convert")


def copy_tokenizer(hf_dir: Path, out: Path) -> Optional[str]:
    """tokenizer.json into `out`, with megalm's note of what the model's own tokenizer does that the file cannot
    say: its end token (tokenizer_config.json's eos_token), the tokens its post-processor puts in front of a text
    (what a prompt starts with) and its Jinja chat template. Returns the end token (None: none named), or "" when
    the folder has no tokenizer.json."""
    if not (hf_dir / "tokenizer.json").is_file():
        return ""
    shutil.copyfile(hf_dir / "tokenizer.json", out / "tokenizer.json")
    meta = json.loads((hf_dir / "tokenizer_config.json").read_text()) \
        if (hf_dir / "tokenizer_config.json").is_file() else {}
    eos = meta.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos  # older files: an AddedToken's fields
    side = {"type": "huggingface", "eod_token": eos, "add_special_tokens": False,
            "start_tokens": HuggingFaceTokenizer(out / "tokenizer.json", eos, False).own_start_tokens()}
    bos = meta.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if isinstance(bos, str):
        side["bos_token"] = bos
    jinja = chat_template_of(hf_dir, meta)
    if jinja:
        side["chat_template"] = jinja
    (out / HF_SIDECAR).write_text(json.dumps(side, indent=1) + "\n")
    return eos


def chat_template_of(hf_dir: Path, tokenizer_config: dict) -> Optional[str]:
    """The folder's Jinja chat template: chat_template.jinja, or tokenizer_config.json's chat_template (a string;
    a list of named ones gives its "default"); None without one."""
    if (hf_dir / "chat_template.jinja").is_file():
        return (hf_dir / "chat_template.jinja").read_text()
    jinja = tokenizer_config.get("chat_template")
    if isinstance(jinja, list):
        jinja = next((t.get("template") for t in jinja if isinstance(t, dict) and t.get("name") == "default"), None)
    return jinja if isinstance(jinja, str) else None


def run_config_yaml(cfg: ModelConfig, header: str, out: Path, eos: Optional[str]) -> str:
    """config.yaml of the default run (conf/config.yaml) with this model; checkpoint.dir is the dir itself; the
    tokenizer copied there (`eos`: copy_tokenizer's answer) and data.chat_template written as the model's own
    template writes each message, when it does so the same way for every role."""
    from hydra import compose, initialize_config_dir  # lazy: Hydra's compose, off `--help`
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        run = compose("config")
    run.model = OmegaConf.structured(cfg)
    run.checkpoint.dir = "."
    if eos != "":
        run.data.tokenizer.type = "huggingface"
        run.data.tokenizer.model = str(out / "tokenizer.json")
        run.data.tokenizer.eod_token = eos
        pattern = simple_chat_template(HuggingFaceTokenizer(out / "tokenizer.json"))
        if pattern is not None:
            run.data.chat_template = pattern
    return "".join(f"# {line}\n" for line in header.splitlines()) + OmegaConf.to_yaml(run)


def simple_chat_template(tokenizer: HuggingFaceTokenizer) -> Optional[str]:
    """data.chat_template (`{role}` / `{content}` text) that renders each message as the tokenizer's Jinja template
    does, found by rendering it; None when there is none or it is no such per-message pattern (megalm's default then
    applies: fine-tuning data is written with it; a chat served renders the Jinja template itself)."""
    if not tokenizer.chat_template:
        return None
    try:
        def render(messages, add_generation_prompt):
            return tokenizer.apply_chat_template(messages, add_generation_prompt)
        system = [{"role": "system", "content": "<<S>>"}]
        user = system + [{"role": "user", "content": "<<U>>"}]
        both = user + [{"role": "assistant", "content": "<<A>>"}]
        base, with_user, with_both = (render(messages=m, add_generation_prompt=False) for m in (system, user, both))
    except Exception as e:  # a template that needs more than messages (tools, dates): keep megalm's
        log.warning("the model's chat template could not be rendered (%s): data.chat_template keeps megalm's default",
                    e)
        return None
    if not (with_user.startswith(base) and with_both.startswith(with_user)):
        return None
    user_part, assistant_part = with_user[len(base):], with_both[len(with_user):]
    patterns = _as_pattern(user_part, "user", "<<U>>"), _as_pattern(assistant_part, "assistant", "<<A>>")
    if None in patterns or patterns[0] != patterns[1]:
        log.warning("the model's chat template renders roles differently: data.chat_template keeps megalm's default")
        return None
    return patterns[0]


def _as_pattern(rendered: str, role: str, content: str) -> Optional[str]:
    if rendered.count(role) != 1 or rendered.count(content) != 1 or rendered.index(role) > rendered.index(content):
        return None
    escaped = rendered.replace("{", "{{").replace("}", "}}")
    return escaped.replace(role, "{role}", 1).replace(content, "{content}", 1)
