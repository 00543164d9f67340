"""Training throughput of megalm's GPT against Hugging Face GPT2LMHeadModel of the same shape.

Both models train in one process, fp32, with AdamW (the same torch kernel, --optimizer), on the same synthetic batches,
starting from the same weights. On a noisy shared machine a single timing says little, so:
warm-up steps first, then the two models alternate in rounds (megalm first in even rounds, HF
first in odd ones, so a slow drift hits both alike), and the table reports the median of the
per-round tokens/s, the ratio of the two medians and the median of the per-round ratios.

    python scripts/bench.py                          # gpt_cpu's shape as GPT-2, ~1-2 min on 2 cores
    python scripts/bench.py --layers 2 --hidden 128 --json out.json
    python scripts/bench.py --modes eager,compiled,compiled-blocks,bf16,bf16-compiled   # every mode side by side
    python scripts/bench.py --modes eager,eager+fused-loss   # megalm's fused head + loss against its plain one

With --modes, each mode is one more pair of runs (megalm and HF from the same weights) in the same
alternating rounds, so every ratio between two runs is measured side by side.
The process's malloc policy (--cpu-allocator, by default the trainer's `reuse`) holds for both models
alike; comparing two policies takes two runs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from omegaconf import OmegaConf

from megalm.config import ModelConfig, OptimizerConfig, TrainerConfig, conf_dir
from megalm.models.registry import model_config_from
from megalm.models import build_model, family_of, flops_per_token, init_weights
from megalm.models.losses import lm_loss
from megalm.models.layers import MLP, AttentionCore
from megalm.training.compiling import apply_compile
from megalm.training.cpu_memory import CHOICES as CPU_ALLOCATORS, apply_cpu_allocator
from megalm.training.metrics import measure_matmul_peak
from megalm.training.optim import build_optimizer, kernel_options, param_groups

# The GPT-2 architecture is all HF's GPT2LMHeadModel can express, so it is forced on the preset.
GPT2_ARCH = dict(position_embedding="learned", normalization="layernorm", activation="gelu", bias=True,
                 tie_embeddings=True, num_query_groups=None, dropout=0.0, attention_dropout=0.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="gpt_cpu",
                   help="preset under conf/model: its shape is used, its architecture forced to GPT-2")
    p.add_argument("--layers", type=int, help="num_layers instead of the preset's")
    p.add_argument("--hidden", type=int, help="hidden_size instead of the preset's")
    p.add_argument("--heads", type=int, help="num_attention_heads instead of the preset's")
    p.add_argument("--seq", type=int, help="seq_length instead of the preset's")
    p.add_argument("--vocab", type=int, help="vocab_size instead of the preset's (padded as the preset says)")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per step")
    p.add_argument("--steps", type=int, default=4, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=11, help="alternating rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model before the rounds")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch intra-op threads")
    p.add_argument("--peak-seconds", type=float, default=0.3, help="length of each round's matmul-peak measurement")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic batches")
    p.add_argument("--optimizer", default=OptimizerConfig.implementation, choices=("fused", "foreach", "for_loop"),
                   help="torch.optim AdamW kernel, for both models (optimizer.implementation)")
    p.add_argument("--cpu-allocator", default=TrainerConfig.cpu_allocator, choices=CPU_ALLOCATORS,
                   help="malloc's policy for this whole process, both models alike (trainer.cpu_allocator; default "
                        "%(default)s, the trainer's)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after the rounds, profile this many steps of each megalm run (torch.profiler): the "
                        "share of self CPU time in matmuls and the ops that take the most")
    p.add_argument("--modes", default="eager",
                   help="comma-separated: eager, compiled (torch.compile of the whole model, megalm's "
                        "trainer.compile=model), compiled-blocks (megalm's blocks compiled one by one; HF is compiled "
                        "whole), bf16 (CPU autocast), bf16-compiled, bf16-compiled-sdpa (megalm's attention on SDPA "
                        "instead of model.attention_backend=auto's unfused choice there), compiled-tanh-gelu and "
                        "bf16-compiled-tanh-gelu (megalm's MLP on aten's tanh GELU kernel instead of the sigmoid form "
                        "it takes in a compiled graph); each runs for megalm and HF "
                        "alike. Any of them with +fused-loss (eager+fused-loss, bf16-compiled+fused-loss, ...): "
                        "megalm's model with model.fused_loss=true, HF's as in the mode without it")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m.removesuffix(FUSED) not in MODES]
    if bad or not args.modes:
        p.error(f"--modes {','.join(bad) or '(empty)'}: choose from {', '.join(MODES)}, each with or without "
                f"{FUSED}")
    return args


MODES = ("eager", "compiled", "compiled-blocks", "bf16", "bf16-compiled", "bf16-compiled-sdpa", "compiled-tanh-gelu",
         "bf16-compiled-tanh-gelu")
FUSED = "+fused-loss"  # a mode's suffix: megalm's head and loss fused (model.fused_loss), HF's unchanged


def _mlp_on_aten_gelu(mlp, x):
    """MLP.forward with aten's tanh GELU kernel in place of `gelu`'s sigmoid form under compile."""
    return mlp.dropout(mlp.fc2(torch.nn.functional.gelu(mlp.fc1(x), approximate="tanh")))


def model_config(args) -> ModelConfig:
    node = OmegaConf.structured(model_config_from(OmegaConf.load(Path(conf_dir()) / "model" / f"{args.model}.yaml")))
    overrides = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                     seq_length=args.seq, vocab_size=args.vocab)
    node = OmegaConf.merge(node, {k: v for k, v in overrides.items() if v is not None}, GPT2_ARCH)
    return OmegaConf.to_object(node)


def hf_model(cfg: ModelConfig):
    from transformers import GPT2Config, GPT2LMHeadModel
    hf_cfg = GPT2Config(
        vocab_size=cfg.padded_vocab_size, n_positions=cfg.seq_length, n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_size,
        # HF's GPT-2 default "gelu_new" is the same tanh GELU written as ~8 Python-level ops; the
        # fused kernel megalm uses is an HF option too, so take it and compare model code, not GELUs.
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=cfg.norm_eps,
        initializer_range=cfg.init_std, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        use_cache=False)  # a training step keeps no KV cache
    return GPT2LMHeadModel(hf_cfg)


@torch.no_grad()
def copy_weights(src, dst) -> None:
    """megalm's weights into the HF model: the same start, so the losses are comparable too.

    HF's Conv1D stores weights as (in, out), the transpose of nn.Linear.
    """
    t = dst.transformer
    t.wte.weight.copy_(src.embed.tok.weight)
    t.wpe.weight.copy_(src.embed.pos.weight)
    for i, b in enumerate(src.blocks.values()):
        h = t.h[i]
        pairs = [(b.norm1, h.ln_1, False), (b.attn.qkv, h.attn.c_attn, True), (b.attn.proj, h.attn.c_proj, True),
                 (b.norm2, h.ln_2, False), (b.mlp.fc1, h.mlp.c_fc, True), (b.mlp.fc2, h.mlp.c_proj, True)]
        for a, c, transpose in pairs:
            c.weight.copy_(a.weight.T if transpose else a.weight)
            c.bias.copy_(a.bias)
    t.ln_f.weight.copy_(src.norm.weight)
    t.ln_f.bias.copy_(src.norm.bias)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once


def same_model_batches(mega, hf, cfg, micro_batch: int, seed: int):
    """Four synthetic batches (micro_batch x seq_length + 1 token ids), and the largest logit difference on the
    first, which must be small (megalm's model and the HF one give the same logits over the real vocabulary, or
    they are not the same model)."""
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length + 1), generator=g) for _ in range(4)]
    mega.eval(), hf.eval()
    with torch.no_grad():
        x = batches[0][:, :-1]
        logit_diff = (mega(x)[..., :cfg.vocab_size] - hf(input_ids=x).logits).abs().max().item()
    assert logit_diff < 1e-3, f"megalm and HF logits differ by {logit_diff:.2e} from the same weights"
    return batches, logit_diff


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    why = apply_cpu_allocator(args.cpu_allocator)
    if why is not None:
        print(f"--cpu-allocator {args.cpu_allocator}: {why}", file=sys.stderr)
    torch.manual_seed(args.seed)
    cfg = model_config(args)

    mega = build_model(cfg)
    init_weights(mega, cfg, args.seed)
    hf = hf_model(cfg)
    copy_weights(mega, hf)
    params = {"megalm": n_params(mega), "hf": n_params(hf)}
    assert params["megalm"] == params["hf"], (
        f"parameter counts differ (megalm {params['megalm']:,} vs HF {params['hf']:,}): the shapes do not match, "
        "so the FLOPs, and the comparison, would not be the same")

    B, T = args.micro_batch, cfg.seq_length
    batches, logit_diff = same_model_batches(mega, hf, cfg, B, args.seed)

    opt_cfg = OptimizerConfig(implementation=args.optimizer)
    runs = {}
    for mode in args.modes:
        m_model, h_model = (mega, hf) if mode == args.modes[0] else (copy.deepcopy(mega), copy.deepcopy(hf))
        if mode.endswith(FUSED):  # the same weights, the loss computed from the head's input
            m_model = build_model(dataclasses.replace(cfg, fused_loss=True))
            m_model.load_state_dict(mega.state_dict())
        if mode.removesuffix(FUSED).endswith("-sdpa"):  # the attention kernel auto would not pick here
            for module in m_model.modules():
                if isinstance(module, AttentionCore):
                    module.backend = "sdpa"
        if mode.removesuffix(FUSED).endswith("-tanh-gelu"):  # the GELU a compiled graph would not take
            for module in m_model.modules():
                if isinstance(module, MLP):
                    module.forward = types.MethodType(_mlp_on_aten_gelu, module)
        if "compiled" in mode:  # HF's user compiles the whole model; megalm's option picks the granularity
            apply_compile(m_model, family_of(m_model.cfg.arch).parts, "blocks" if mode == "compiled-blocks" else "model", "inductor", "cpu")
            h_model.compile()
        amp = mode.startswith("bf16")
        # Both losses go through lm_loss, so the step differs only in model code.
        runs[f"megalm/{mode}"] = (m_model, build_optimizer(opt_cfg, m_model),
                                  lambda x, y, m=m_model: m(x, labels=y), amp)
        # Plain torch AdamW for HF, with the same settings and the same decay / no-decay split.
        runs[f"hf/{mode}"] = (h_model, torch.optim.AdamW(param_groups(h_model, opt_cfg.weight_decay), lr=opt_cfg.lr,
                                                         betas=tuple(opt_cfg.betas), eps=opt_cfg.eps,
                                                         **kernel_options(opt_cfg.implementation)),
                              lambda x, y, m=h_model: lm_loss(m(input_ids=x).logits, y), amp)
    state = {name: {"step": 0, "loss": float("nan"), "rounds": [], "warmup_s": 0.0} for name in runs}

    def train(name: str, steps: int) -> float:
        model, opt, loss_fn, amp = runs[name]
        model.train()
        s = state[name]
        t0 = time.perf_counter()
        for _ in range(steps):
            batch = batches[s["step"] % len(batches)]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = loss_fn(batch[:, :-1], batch[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            s["step"] += 1
        s["loss"] = loss.item()
        return time.perf_counter() - t0

    for name in runs:
        if args.warmup:
            state[name]["warmup_s"] = train(name, args.warmup)  # compiled runs compile here
    # A shared machine's matmul speed was seen to swing 3x within seconds (other tenants), so the
    # MFU denominator is measured in every round, next to the steps it divides.
    peaks = []
    for r in range(args.rounds):
        peaks.append(measure_matmul_peak(torch.device("cpu"), seconds=args.peak_seconds))
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            state[name]["rounds"].append(args.steps * B * T / train(name, args.steps))

    fpt = flops_per_token(cfg)
    results = {}
    for name, s in state.items():
        tps = statistics.median(s["rounds"])
        results[name] = {"tokens_per_s": tps, "tflops": tps * fpt / 1e12,
                         "mfu": statistics.median(t * fpt / p for t, p in zip(s["rounds"], peaks)),
                         "rounds_tokens_per_s": s["rounds"], "final_loss": s["loss"], "warmup_s": s["warmup_s"]}

    # After the results are read: the profiled steps are extra steps for megalm's runs only.
    profiles = {name: profile_steps(lambda: train(name, args.profile), args.profile)
                for name in runs if args.profile and name.startswith("megalm/")}

    def paired(a: str, b: str) -> float:
        """A round's runs are seconds apart, so their ratio cancels most of the machine's drift."""
        return statistics.median(x / y for x, y in zip(state[a]["rounds"], state[b]["rounds"]))
    first = args.modes[0]
    ratios = {}
    for mode in args.modes:
        ratios[f"megalm/{mode} : hf/{mode}"] = paired(f"megalm/{mode}", f"hf/{mode}")
        if mode != first:
            ratios[f"megalm/{mode} : megalm/{first}"] = paired(f"megalm/{mode}", f"megalm/{first}")
            ratios[f"megalm/{mode} : hf/{first}"] = paired(f"megalm/{mode}", f"hf/{first}")
            ratios[f"hf/{mode} : hf/{first}"] = paired(f"hf/{mode}", f"hf/{first}")
    pairs = [("compiled", "compiled-blocks"), ("bf16", "bf16-compiled"), ("bf16-compiled-sdpa", "bf16-compiled"),
             ("compiled-tanh-gelu", "compiled"), ("bf16-compiled-tanh-gelu", "bf16-compiled")]
    for a, b in pairs + [(m.removesuffix(FUSED), m) for m in args.modes if m.endswith(FUSED)]:
        if a in args.modes and b in args.modes:
            ratios[f"megalm/{b} : megalm/{a}"] = paired(f"megalm/{b}", f"megalm/{a}")
    # Each megalm mode against HF's baseline of its precision that the speed targets name: in fp32 HF's compiled
    # model, in bf16 HF's eager one.
    for base, fp32 in (("compiled", True), ("bf16", False)):
        if base in args.modes:
            for mode in args.modes:
                if mode.startswith("bf16") != fp32 and mode != base:
                    ratios[f"megalm/{mode} : hf/{base}"] = paired(f"megalm/{mode}", f"hf/{base}")
    out = {"command": " ".join(["python", "scripts/bench.py", *(sys.argv[1:] if argv is None else argv)]),
           "config": {k: getattr(cfg, k) for k in ("name", "num_layers", "hidden_size", "num_attention_heads",
                                                   "seq_length", "vocab_size", "padded_vocab_size", "ffn_size")},
           "micro_batch": B, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "modes": args.modes,
           "threads": torch.get_num_threads(), "cpu_allocator": args.cpu_allocator, "torch": torch.__version__,
           "hf_attn_implementation": hf.config._attn_implementation,
           "params": params, "flops_per_token": fpt, "peak_tflops": statistics.median(peaks) / 1e12,
           "rounds_peak_tflops": [p / 1e12 for p in peaks],
           "initial_logit_max_abs_diff": logit_diff, "results": results, "paired_ratios": ratios,
           "ratio": results[f"megalm/{first}"]["tokens_per_s"] / results[f"hf/{first}"]["tokens_per_s"],
           "paired_ratio": ratios[f"megalm/{first} : hf/{first}"], "profiles": profiles}
    print_table(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def profile_steps(run, steps: int, top: int = 8) -> dict:
    """Self CPU time per op over `steps` steps of `run`: each op's milliseconds and calls a step, the top ones."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    ops = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return {"self_cpu_ms_per_step": total / 1e3 / steps,
            "matmul_share": sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / total,
            "top": [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "share": e.self_cpu_time_total / total,
                     "calls_per_step": e.count / steps} for e in ops]}


def print_table(out: dict) -> None:
    c = out["config"]
    print(f"shape: {c['num_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads, "
          f"seq {c['seq_length']}, vocab {c['vocab_size']} (padded {c['padded_vocab_size']}); "
          f"micro-batch {out['micro_batch']}, {out['threads']} threads, AdamW, cpu allocator {out['cpu_allocator']}; "
          f"modes {', '.join(out['modes'])}")
    print(f"params: {out['params']['megalm']:,} (both)   model FLOPs/token: {out['flops_per_token'] / 1e6:.1f} M   "
          f"fp32 matmul peak (median of rounds): {out['peak_tflops'] * 1e3:.0f} GFLOP/s   "
          f"HF attention: {out['hf_attn_implementation']}")
    print(f"{out['rounds']} rounds x {out['steps']} steps per run after {out['warmup']} warm-up steps (compilation "
          "happens there); median of per-round tokens/s; MFU against the fp32 peak")
    print(f"| {'run':<25} | {'tokens/s':>9} | {'TFLOP/s':>8} | {'MFU':>6} | {'round min-max tokens/s':>22} "
          f"| {'warm-up s':>9} | {'loss':>6} |")
    print(f"|{'-' * 27}|{'-' * 11}|{'-' * 10}|{'-' * 8}|{'-' * 24}|{'-' * 11}|{'-' * 8}|")
    for name, r in out["results"].items():
        spread = f"{min(r['rounds_tokens_per_s']):.0f}-{max(r['rounds_tokens_per_s']):.0f}"
        print(f"| {name:<25} | {r['tokens_per_s']:>9.0f} | {r['tflops']:>8.4f} | {r['mfu']:>6.1%} | {spread:>22} "
              f"| {r['warmup_s']:>9.1f} | {r['final_loss']:>6.3f} |")
    print("paired ratios (median over rounds of the ratio within a round):")
    for name, ratio in out["paired_ratios"].items():
        print(f"  {name:<52} {ratio:.3f}")
    for name, prof in out.get("profiles", {}).items():
        print(f"{name}: {prof['self_cpu_ms_per_step']:.1f} ms self CPU time a step (profiled), matmuls "
              f"{prof['matmul_share']:.1%}; " + ", ".join(f"{t['op'].replace('aten::', '')} {t['share']:.1%} "
                                                            f"({t['calls_per_step']:.0f}x)" for t in prof["top"]))

if __name__ == "__main__":
    main()
