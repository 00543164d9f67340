"""Training throughput of megalm's mixture of experts against Hugging Face's MixtralForCausalLM of the
same shape and weights.

Both train in one process, fp32, with torch's AdamW, on the same synthetic batches, from the same
weights (their logits are checked equal first). The runs alternate in rounds (megalm first in even
rounds, HF first in odd ones) after warm-up steps; the table reports each run's median tokens/s
and the median of the per-round ratios, which cancels most of a shared machine's drift.

    python scripts/bench_moe.py                       # moe_cpu's shape (8 experts, 2 a token), ~2 min on 2 cores
    python scripts/bench_moe.py --model moe_tiny --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from megalm.config import OptimizerConfig, conf_dir
from megalm.models.registry import model_config_from
from megalm.models import build_model, init_weights
from megalm.models.losses import lm_loss
from megalm.training.optim import build_optimizer, kernel_options, param_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import same_model_batches  # noqa: E402  (bench.py's batches and its same-model check)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="moe_cpu", help="a mixture-of-experts preset (default moe_cpu)")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences a step (default 4)")
    ap.add_argument("--steps", type=int, default=3, help="steps a round (default 3)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap.parse_args(argv)


def model_config(name: str):
    """The preset as a GPTConfig, with Mixtral's fixed choices (no dropout; no bias, rope, rmsnorm, swiglu)."""
    cfg = model_config_from(OmegaConf.load(Path(conf_dir()) / "model" / f"{name}.yaml"))
    if not getattr(cfg, "num_experts", 0):
        raise SystemExit(f"--model {name} has no experts (model.num_experts=0)")
    import dataclasses
    return dataclasses.replace(cfg, dropout=0.0, attention_dropout=0.0, moe_aux_loss_coeff=0.0,
                               moe_z_loss_coeff=0.0, moe_capacity_factor=None, tie_embeddings=False)


def hf_model(cfg):
    """MixtralForCausalLM of cfg's shape (megalm's own export config), its experts run one by one."""
    import transformers
    from megalm.models.gpt.hf import hf_config
    hf_cfg = transformers.MixtralConfig(**{k: v for k, v in hf_config(cfg, "mixtral").items()
                                           if k not in ("architectures", "model_type", "dtype")})
    return transformers.MixtralForCausalLM(hf_cfg).float()


@torch.no_grad()
def copy_weights(mega, hf, cfg) -> None:
    """megalm's weights into the HF model (its in-memory layout: experts stacked as gate_up_proj (E, 2f, h)
    and down_proj (E, h, f), the transposes of megalm's fc1 (E, h, 2f) and fc2 (E, f, h))."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    hf.model.embed_tokens.weight.copy_(mega.embed.tok.weight[:cfg.vocab_size])
    hf.lm_head.weight.copy_(mega.head.weight[:cfg.vocab_size])
    hf.model.norm.weight.copy_(mega.norm.weight)
    for i, layer in enumerate(hf.model.layers):
        block = mega.blocks[str(i)]
        wq, wk, wv = block.attn.qkv.weight.split([q, kv, kv])
        for dst, src in ((layer.self_attn.q_proj, wq), (layer.self_attn.k_proj, wk), (layer.self_attn.v_proj, wv),
                         (layer.self_attn.o_proj, block.attn.proj.weight)):
            dst.weight.copy_(src)
        layer.input_layernorm.weight.copy_(block.norm1.weight)
        layer.post_attention_layernorm.weight.copy_(block.norm2.weight)
        layer.mlp.gate.weight.copy_(block.mlp.router.weight)
        layer.mlp.experts.gate_up_proj.copy_(block.mlp.experts.fc1.weight.transpose(1, 2))
        layer.mlp.experts.down_proj.copy_(block.mlp.experts.fc2.weight.transpose(1, 2))


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = model_config(args.model)
    mega = build_model(cfg)
    init_weights(mega, cfg, args.seed)
    hf = hf_model(cfg)
    copy_weights(mega, hf, cfg)
    B, T = args.micro_batch, cfg.seq_length
    batches, logit_diff = same_model_batches(mega, hf, cfg, B, args.seed)

    opt_cfg = OptimizerConfig(implementation="foreach")
    runs = {"megalm": (mega, build_optimizer(opt_cfg, mega), lambda x, y: mega(x, labels=y)),
            "hf": (hf, torch.optim.AdamW(param_groups(hf, opt_cfg.weight_decay), lr=opt_cfg.lr, betas=tuple(opt_cfg.betas),
                                         eps=opt_cfg.eps, **kernel_options(opt_cfg.implementation)),
                   lambda x, y: lm_loss(hf(input_ids=x).logits, y))}
    state = {name: {"step": 0, "rounds": []} for name in runs}

    def train(name: str, steps: int) -> float:
        model, opt, loss_fn = runs[name]
        model.train()
        t0 = time.perf_counter()
        for _ in range(steps):
            batch = batches[state[name]["step"] % len(batches)]
            loss = loss_fn(batch[:, :-1], batch[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            state[name]["step"] += 1
        return time.perf_counter() - t0

    for name in runs:
        train(name, args.warmup)
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            state[name]["rounds"].append(args.steps * B * T / train(name, args.steps))
    results = {name: {"tokens_per_s": statistics.median(s["rounds"]), "rounds_tokens_per_s": s["rounds"]}
               for name, s in state.items()}
    paired = statistics.median(a / b for a, b in zip(state["megalm"]["rounds"], state["hf"]["rounds"]))
    out = {"command": " ".join(["python", "scripts/bench_moe.py", *(sys.argv[1:] if argv is None else argv)]),
           "config": {k: getattr(cfg, k) for k in ("name", "num_layers", "hidden_size", "ffn_size", "num_experts",
                                                   "moe_router_topk", "seq_length", "vocab_size")},
           "micro_batch": B, "steps": args.steps, "rounds": args.rounds, "threads": torch.get_num_threads(),
           "torch": torch.__version__, "initial_logit_max_abs_diff": logit_diff, "results": results,
           "paired_ratio": paired}
    print(f"{cfg.name}: {cfg.num_experts} experts of {cfg.ffn_size}, {cfg.moe_router_topk} a token; "
          f"{B} x {T} tokens a step, {torch.get_num_threads()} threads")
    for name, r in results.items():
        print(f"  {name:7s} {r['tokens_per_s']:9.0f} tokens/s (median of {args.rounds} rounds)")
    print(f"  megalm : hf = {paired:.2f} (median of the per-round ratios)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
