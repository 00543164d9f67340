"""megalm checkpoints <-> Hugging Face folders (config.json + safetensors).

The weight mapping is the model family's (`Family.hf` names its module: models/gpt/hf.py for
GPT-2 and Llama, models/bert/hf.py for BERT). A mapping module provides

    ARCHS                      Hugging Face model_type -> the class it reads and writes
    SUMMARY                    (optional) a line saying which configs map to which class, for --help
    export_arch(cfg)           the model_type that computes exactly what cfg does, else an error
    hf_config(cfg, arch, dtype, eod)        its config.json
    model_config_from_hf(hf, name, seq_length)   the family's config of a config.json, else an error
    rules(arch, cfg)           Rules (megalm.models.hf_rules): HF tensors joined into each megalm parameter
    IGNORED                    a regex of HF tensors that are not weights (buffers)
    tied_copies(cfg)           HF tensors that may repeat a tied weight: HF name -> megalm name

Which rules apply is decided by the megalm model built from the config: its parameters are what
must be filled, and every HF tensor must be used by some rule, be a known buffer or a tied copy
equal to its weight, so nothing is silently dropped.

Import writes a checkpoint through megalm's own Checkpointer (single process), so training can
start from it with `checkpoint.load=PATH` at any parallel layout; checkpoints hold full tensors.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from megalm.config import CheckpointConfig, ModelConfig, OptimizerConfig, conf_dir
from megalm.convert.imported import copy_tokenizer, run_config_yaml
from megalm.data import load_tokenizer
from megalm.errors import ConfigError, DataError, MegalmError, MissingFileError
from megalm.models import build_model
from megalm.models.hf_rules import Rule, UnsupportedArchitecture, expand
from megalm.models.registry import family_names, family_of, model_config_from, preset_yaml
from megalm.training.optim import build_optimizer

log = logging.getLogger("megalm.convert")

__all__ = ["UnsupportedArchitecture", "export_arch", "export_to_hf", "hf_config", "import_from_hf",
           "locate_checkpoint", "model_config_from_hf"]

Tensor = torch.Tensor
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIMIZER_STATE_NOTE = ("The checkpoint holds a fresh optimizer state (zero moments, step 0), which "
                        "checkpoint.load needs: training starts exactly as from these weights. checkpoint.load "
                        "also restores the optimizer's hyperparameters other than lr (weight_decay, betas, eps, "
                        "momentum) from it, so import with the optimizer preset you will train with")


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise MissingPackage("megalm.convert reads and writes Hugging Face weights with the `safetensors` "
                             "package: pip install safetensors") from None
    return safetensors


class OutputExistsError(MegalmError, FileExistsError):
    """The folder to write already holds files (or is a file), and --force was not given."""

    kind = "output exists"


class MissingPackage(MegalmError, ImportError):
    """An optional package that this conversion needs is not installed."""

    kind = "missing package"


# -- the family's mapping --------------------------------------------------------------------------

def _mapping(arch: str):
    """The Hugging Face mapping module of model family `arch`."""
    module = family_of(arch).hf
    if module is None:
        raise UnsupportedArchitecture(f"model.arch={arch!r}: the {arch} family has no Hugging Face mapping")
    return importlib.import_module(module)


def family_mappings() -> Dict[str, Any]:
    """Family name -> its Hugging Face mapping module, for every family that has one."""
    return {name: _mapping(name) for name in family_names() if family_of(name).hf is not None}


def _mappings() -> Dict[str, Any]:
    """Hugging Face model_type -> the mapping module that reads it, over every family."""
    return {kind: module for module in family_mappings().values() for kind in module.ARCHS}


def export_arch(cfg: ModelConfig) -> str:
    """The HF model_type that computes exactly what cfg does; else an error naming the field."""
    return _mapping(cfg.arch).export_arch(cfg)


def hf_config(cfg: ModelConfig, arch: str, dtype: str = "float32", eod: Optional[int] = None) -> Dict[str, Any]:
    """The config.json of cfg as HF architecture `arch` (from export_arch)."""
    return _mapping(cfg.arch).hf_config(cfg, arch, dtype, eod)


def model_config_from_hf(hf: Dict[str, Any], name: str, seq_length: Optional[int] = None) -> Tuple[str, ModelConfig]:
    """(model_type, the family's config) of an HF config.json dict; an error for what megalm cannot compute."""
    kind = hf.get("model_type")
    mappings = _mappings()
    if kind not in mappings:
        raise UnsupportedArchitecture(f"config.json: model_type={kind!r} is not supported: allowed: "
                                      + ", ".join(f"{k!r} ({m.ARCHS[k]})" for k, m in mappings.items()))
    return kind, mappings[kind].model_config_from_hf(hf, name, seq_length)


def expand_rules(arch: str, cfg: ModelConfig) -> Dict[str, Rule]:
    """megalm parameter name → its rule with "{i}" filled in, for every layer of cfg."""
    return expand(_mapping(cfg.arch).rules(arch, cfg), cfg)


# -- configs ---------------------------------------------------------------------------------------

def read_model_config(path: Path) -> ModelConfig:
    """A ModelConfig from a run's config.yaml (its `model:` section) or from a model yaml."""
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # yaml errors come in several types
        raise ConfigError(f"{path} is not a YAML config: {e}") from None
    section = raw.get("model") if isinstance(raw, DictConfig) and isinstance(raw.get("model"), DictConfig) else raw
    try:
        return model_config_from(section)
    except Exception as e:  # unknown keys, wrong types, missing values
        raise ConfigError(f"{path}: not a megalm model config (a run's config.yaml or a conf/model yaml): "
                          f"{e}") from None


def model_yaml(cfg: ModelConfig, header: str) -> str:
    body = preset_yaml(cfg)  # usable as a conf/model preset
    return "".join(f"# {line}\n" for line in header.splitlines()) + body


# -- export ---------------------------------------------------------------------------------------

def locate_checkpoint(path: Path, config: Optional[Path] = None) -> Tuple[Path, ModelConfig, Optional[Path]]:
    """(step folder, model config, directory holding config.yaml) for a run dir, checkpoint dir or step folder."""
    from megalm.training.checkpoint import kept_best, resolve, run_checkpoints  # lazy: torch's checkpoint library, ~1 s off `--help`
    path = Path(path).expanduser()
    what = "a megalm run directory (config.yaml + checkpoints/), a checkpoint dir (with `latest`) or a step folder"
    if not path.exists():
        raise MissingFileError(f"{path} does not exist: expected {what}")
    is_ckpt = (path / ".metadata").exists() or (path / "latest").exists()
    if (path / "config.yaml").is_file() and not is_ckpt:  # a run directory
        try:
            step_dir = resolve(kept_best(run_checkpoints(path)))
        except FileNotFoundError as e:
            raise MissingFileError(f"run directory {path} has no complete checkpoint: {e}") from None
        config_file: Optional[Path] = path / "config.yaml"
    else:
        try:
            step_dir = resolve(path)
        except FileNotFoundError as e:
            raise MissingFileError(f"{e}; expected {what}") from None
        # The run directory's first (its tokenizer lies next to it), then the step folder's own copy.
        looked = [step_dir.parent / "config.yaml", step_dir.parent.parent / "config.yaml", step_dir / "config.yaml"]
        config_file = next((c for c in looked if c.is_file()), None)
        if config_file is None and config is None:
            raise MissingFileError(f"no config.yaml for checkpoint {step_dir} (looked for "
                                   f"{', '.join(map(str, looked))}): pass --config with the run's config.yaml or a model yaml")
    if config is not None:
        config = Path(config).expanduser()
        if not config.is_file():
            raise MissingFileError(f"--config {config} does not exist: expected a run's config.yaml or a model yaml")
        return step_dir, read_model_config(config), config_file.parent if config_file else None
    return step_dir, read_model_config(config_file), config_file.parent


def _run_tokenizer(run_dir: Optional[Path]):
    if run_dir is None or not (run_dir / "tokenizer.json").is_file():
        return None
    try:
        return load_tokenizer(run_dir)
    except Exception as e:  # a tokenizer is a nice-to-have: the weights do not depend on it
        log.warning("not copying the tokenizer of %s: %s", run_dir, e)
        return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""What `_copy_tokenizer` may write next to exported weights."""


def _copy_tokenizer(tok, run_dir: Path, out: Path) -> Optional[str]:
    """Put the run's tokenizer next to the HF weights; return what was written."""
    eod_token = getattr(tok, "eod_token", None)
    if eod_token is not None:  # a Hugging Face tokenizer.json: loadable with AutoTokenizer
        shutil.copyfile(run_dir / "tokenizer.json", out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod_token, "bos_token": eod_token,
             "model_max_length": None, "add_bos_token": False}, indent=1) + "\n")
        return "tokenizer.json, tokenizer_config.json"
    if (run_dir / "tokenizer.model").is_file():  # sentencepiece: the model file, for the user to wrap
        shutil.copyfile(run_dir / "tokenizer.model", out / "tokenizer.model")
        return "tokenizer.model (sentencepiece)"
    return None


def check_out_dir(out: Path, force: bool, marker: Iterable[str]) -> None:
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory: name a folder to write")
    if not force and out.is_dir() and any(out.iterdir()):
        present = [m for m in marker if (out / m).exists()] or sorted(p.name for p in out.iterdir())[:3]
        raise OutputExistsError(f"{out} is not empty (it has {', '.join(present)}): pass --force to write into it")


@torch.no_grad()
def export_to_hf(src: Path, out_dir: Path, *, config: Optional[Path] = None, dtype: str = "float32",
                 force: bool = False, copy_tokenizer: bool = True) -> Path:
    """Write a Hugging Face folder (config.json + model.safetensors) for a megalm checkpoint."""
    save_file = _safetensors().torch.save_file
    from megalm.training.checkpoint import STATE_FILE, load_model_weights  # lazy: torch's checkpoint library, ~1 s off `--help`
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    step_dir, cfg, run_dir = locate_checkpoint(src, config)
    if getattr(cfg, "fine_tuning_head", False):
        raise ConfigError(f"{src} is a fine-tuned classifier, multiple-choice or QA run: export_to_hf writes "
                          "pretraining models (language-model heads); score it with python -m megalm.evaluate")
    arch = export_arch(cfg)
    out = Path(out_dir).expanduser()
    check_out_dir(out, force, ("config.json", "model.safetensors"))
    model = build_model(cfg)
    load_model_weights(step_dir, model)
    params = dict(model.named_parameters())  # a tied weight appears once
    rules = expand_rules(arch, cfg)
    tensors: Dict[str, Tensor] = {}
    for name, p in params.items():
        if name not in rules:
            raise RuntimeError(f"no {arch} rule for megalm parameter {name}")  # a bug in the tables
        rule = rules[name]
        t = p.detach()[:cfg.vocab_size] if name in family_of(cfg.arch).vocab_params else p.detach()
        for hf_name, part in zip(rule.hf, rule.transform.split(t, cfg), strict=True):
            # A copy of its own: safetensors refuses tensors that share storage (split views).
            tensors[hf_name] = part.to(dtype=DTYPES[dtype], copy=True).contiguous()
    tok = _run_tokenizer(run_dir) if copy_tokenizer else None
    out.mkdir(parents=True, exist_ok=True)
    for stale in TOKENIZER_FILES:  # an earlier export's (--force): never left beside weights it does not fit
        (out / stale).unlink(missing_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = hf_config(cfg, arch, dtype, eod=tok.eod if tok is not None and tok.eod < cfg.vocab_size else None)
    ids_of = getattr(_mapping(cfg.arch), "generation_ids", None)  # an encoder-decoder's start, end and padding
    named = tok if tok is not None else _run_tokenizer(run_dir)
    if ids_of is not None and named is not None:
        hf.update(ids_of(named))
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    copied = _copy_tokenizer(tok, run_dir, out) if tok is not None else None
    step = json.loads((step_dir / STATE_FILE).read_text()).get("step") if (step_dir / STATE_FILE).is_file() else None
    log.info("exported %s (step %s) as %s to %s%s", step_dir, step, _mapping(cfg.arch).ARCHS[arch], out,
             f" with {copied}" if copied else "")
    return out


# -- import ---------------------------------------------------------------------------------------

class SafetensorsFolder:
    """The tensors of an HF folder: model.safetensors, a sharded index, or every *.safetensors.

    Reads with safetensors only (never torch.load / pickle); tensors are read one at a time.
    """

    def __init__(self, folder: Path):
        safe_open = _safetensors().safe_open
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map")
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
                raise DataError(f"{index} is not a JSON object: {e}") from None
            if not isinstance(weight_map, dict):
                raise DataError(f"{index} has no weight_map object")
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (folder / f).is_file():
                    raise MissingFileError(f"{folder / f} is listed in {index.name} but does not exist")
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
            hint = (f" ({', '.join(pickles)} are pickle files, which megalm does not read: re-save the model with "
                    "save_pretrained(..., safe_serialization=True))" if pickles else "")
            raise MissingFileError(f"no safetensors weights in {folder}: expected model.safetensors, "
                                   f"model.safetensors.index.json + shards, or *.safetensors{hint}")
        self.folder = folder
        self.handles = {f: self._open(safe_open, folder / f) for f in files}
        self.where: Dict[str, str] = {}
        for f, h in self.handles.items():
            for key in h.keys():
                self.where[key] = f

    @staticmethod
    def _open(safe_open, path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors' own SafetensorError, or an OSError reading it
            raise _unreadable(path, e) from None

    def keys(self) -> List[str]:
        return list(self.where)

    def get(self, name: str) -> Tensor:
        path = self.folder / self.where[name]
        try:
            return self.handles[self.where[name]].get_tensor(name)
        except Exception as e:  # the header was whole but the data behind it is not
            raise _unreadable(path, e, name) from None


def _unreadable(path: Path, error: Exception, tensor: Optional[str] = None) -> DataError:
    size = path.stat().st_size if path.exists() else 0
    what = f" (reading {tensor})" if tensor else ""
    return DataError(f"{path} is not a readable safetensors file{what}: {error} ({size} bytes); it is probably "
                     "truncated or damaged (an interrupted download or save): download or save it again")


def _fresh_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazy state (a zero-lr step on zero gradients), then zero all of it.

    Zero moments with step 0 (AdamW) and a zero momentum buffer (SGD) update exactly as a
    fresh optimizer does, so training from the import is training from these weights.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                value.zero_()


def _optimizer_config(preset: str):
    path = Path(conf_dir()) / "optimizer" / f"{preset}.yaml"
    if not path.is_file():
        have = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"--optimizer {preset!r}: no {path.name} in conf/optimizer: allowed: {', '.join(have)}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimizerConfig), OmegaConf.load(path)))


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "hf_model"


@torch.no_grad()
def import_from_hf(hf_dir: Path, out_dir: Path, *, name: Optional[str] = None, seq_length: Optional[int] = None,
                   optimizer: str = "adamw", force: bool = False,
                   origin: Optional[Tuple[str, str]] = None) -> Tuple[Path, ModelConfig]:
    """Write a megalm checkpoint dir (step_00000000 + latest, config.yaml, conf/model/NAME.yaml) for an HF folder: a
    run directory too (megalm.convert.imported). `origin`: (format, name) of what the folder was made from, when
    not a Hugging Face folder itself (("gguf", the file's name))."""
    from megalm.training.checkpoint import Checkpointer  # lazy: torch's checkpoint library, ~1 s off `--help`
    hf_dir = Path(hf_dir).expanduser()
    if not hf_dir.is_dir():
        raise MissingFileError(f"{hf_dir} is not a directory: expected a Hugging Face model folder "
                               "(config.json + *.safetensors)")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise MissingFileError(f"{config_path} does not exist: expected a Hugging Face model folder "
                               "(config.json + *.safetensors)")
    try:
        hf = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{config_path} is not JSON: {e}") from None
    if seq_length is not None and seq_length < 1:
        raise ConfigError(f"--seq-length={seq_length} must be at least 1")
    name = _safe_name(name or f"hf_{hf_dir.resolve().name}")
    arch, cfg = model_config_from_hf(hf, name, seq_length)
    opt_cfg = _optimizer_config(optimizer)
    out = Path(out_dir).expanduser().resolve()
    check_out_dir(out, force, ("latest", "config.yaml"))
    weights = SafetensorsFolder(hf_dir)

    mapping = _mapping(cfg.arch)
    hf_class = mapping.ARCHS[arch]
    model = build_model(cfg)
    params = dict(model.named_parameters())  # what this config's model needs, tied weights once
    vocab_params = family_of(cfg.arch).vocab_params
    rules = expand_rules(arch, cfg)
    used = set()
    for pname, p in params.items():
        rule = rules.get(pname)
        if rule is None:
            raise RuntimeError(f"no {arch} rule for megalm parameter {pname}")  # a bug in the tables
        missing = [n for n in rule.hf if n not in weights.where]
        if missing:
            raise DataError(f"{hf_dir}: the weights lack {', '.join(missing)}, which {hf_class} with this "
                            f"config.json needs (for megalm's {pname})")
        t = rule.transform.join([weights.get(n).float() for n in rule.hf], cfg)
        used.update(rule.hf)
        want = tuple(p.shape)
        if pname in vocab_params:  # real rows; the model's padding rows stay 0
            want = (cfg.vocab_size,) + want[1:]
        if tuple(t.shape) != want:
            raise DataError(f"{hf_dir}: {' + '.join(rule.hf)} gives shape {tuple(t.shape)} for megalm's {pname}; "
                            f"config.json implies {want}")
        p.zero_()
        p[:t.shape[0]].copy_(t)
    leftover = [k for k in weights.keys() if k not in used and not mapping.IGNORED.search(k)]
    for copy_name, pname in mapping.tied_copies(cfg).items():  # some checkpoints store a tied weight twice
        if copy_name in leftover:
            tied = params[pname][:cfg.vocab_size] if pname in vocab_params else params[pname]
            if not torch.equal(weights.get(copy_name).float(), tied):
                raise DataError(f"{hf_dir}: {copy_name} is the tied copy of the weight megalm keeps as {pname} "
                                "(config.json ties them), but its values differ")
            leftover.remove(copy_name)
    if leftover:
        raise DataError(f"{hf_dir}: {len(leftover)} tensors have no megalm counterpart under this config.json "
                        f"({', '.join(leftover[:5])}{', ...' if len(leftover) > 5 else ''})")

    optim = build_optimizer(opt_cfg, model)
    _fresh_optimizer_state(optim)
    out.mkdir(parents=True, exist_ok=True)
    fmt, source = origin or ("huggingface", hf_dir.name)
    header = (f"{cfg.name}: imported from {'GGUF' if fmt == 'gguf' else 'Hugging Face'} {hf_class} ({source}) by "
              "python -m megalm.convert.\n"
              f"Train from it: python -m megalm.train --config-dir DIR/conf model={cfg.name} checkpoint.load=DIR\n"
              "where DIR is the folder with the step_00000000 checkpoint.")
    (out / "config.yaml").write_text(run_config_yaml(cfg, header, out, copy_tokenizer(hf_dir, out)))
    (out / "conf" / "model").mkdir(parents=True, exist_ok=True)
    (out / "conf" / "model" / f"{cfg.name}.yaml").write_text(model_yaml(cfg, header))
    state = {"consumed_samples": 0, "val_loss": None, "skipped_steps": 0,
             "imported_from": {"format": fmt, "architecture": hf_class, "folder": source,
                               "optimizer": opt_cfg.name}}
    with torch.random.fork_rng(devices=[]):  # the saved RNG state is the same on every import
        torch.manual_seed(0)
        Checkpointer(CheckpointConfig(dir=str(out), keep_last=0), out).save(0, model, optim, state)
    n = sum(p.numel() for p in model.parameters())
    log.info("imported %s (%s, %.2fM parameters) into %s", hf_dir, hf_class, n / 1e6, out)
    return out, cfg

