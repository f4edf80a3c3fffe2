"""How far speculative decoding could take this workload on this machine, whatever drafts it.

Decoding one token per sequence per pass, the mixed workload's longest request needs a
pass per output token, and most passes carry few tokens, which the GEMMs run at a small
share of the matmul rate (`throughput.py`'s `gemm_limits`). Drafts lift that: a pass
verifies several tokens of a sequence. This driver measures what the best drafts could
do, on the workload's own outputs (greedy, fixed lengths: what every engine must emit):

- Drafts copied from the request's own text (prompt lookup, n-gram tables, suffix trees,
  trees of such candidates): `limits.copy_draft_passes` gives each request the fewest
  passes any such drafter can need with drafts of up to K tokens, always choosing the
  copy that the model then keeps longest, and never drafting a token it rejects. Every
  prompt goes in one first pass. The GEMMs of those passes, at the least each pass size
  can cost on this machine's library (`limits.best_gemm_curves`, the best rate seen),
  bound from below the run time of any engine drafting so: attention, the ops between
  the GEMMs and everything else only add to it.
- Drafts from the model itself (early exit): how often the next token that the first l
  of its layers predict (final norm and LM head on layer l's hidden state) is the one
  the whole model picks. A self-drafting engine pays l/L of a pass per draft token.

    python benchmarks/draft_limits.py --json \\
        --baseline benchmarks/results/throughput.json   # speedup ceilings against its HF runs

Prints one JSON object; --out saves it too.
"""

from __future__ import annotations

# First, before torch loads: the engine's OpenMP settings (`pagedinfer.service.openmp`).
import os  # isort: skip

from pagedinfer.service.openmp import spin_env  # isort: skip

os.environ.update(spin_env())
import argparse
import json
import sys
import time
from pathlib import Path

import limits
import torch
from throughput import _load_hf, add_workload_args, matmul_gflops, workload_from_args

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.engine import LLMEngine
from pagedinfer.service.loader import load_model
from pagedinfer.service.sampling_params import SamplingParams


def greedy_outputs(
    engine: LLMEngine, prompts: list[list[int]], lengths: list[int]
) -> list[list[int]]:
    """Each request's output: greedy, exactly `lengths` tokens (EOS ignored)."""
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
    return [tokens[r] for r in ids]


@torch.inference_mode()
def early_exit_agreement(
    prompts: list[list[int]], outputs: list[list[int]], depths: list[int]
) -> dict[str, float]:
    """Share of output tokens (after the first) whose argmax from the first l layers
    equals the whole model's, for each depth l (Hugging Face's model of the same weights).
    """
    model = _load_hf(torch.float32)
    agree = dict.fromkeys(depths, 0)
    total = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([[*prompt, *output]])
        hidden = model(ids, output_hidden_states=True).hidden_states
        # Positions len(prompt) .. end - 1 predict output tokens 1 ..: the decode tokens.
        rows = slice(len(prompt), ids.shape[1] - 1)
        final = model.lm_head(hidden[-1][0, rows]).argmax(-1)  # last entry is normed
        for depth in depths:
            early = model.lm_head(model.model.norm(hidden[depth][0, rows])).argmax(-1)
            agree[depth] += int((early == final).sum())
        total += final.shape[0]
    return {str(depth): round(agree[depth] / total, 4) for depth in depths}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(ap)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--draft-tokens", default="4,8,16", help="draft lengths K to bound")
    ap.add_argument(
        "--baseline",
        type=Path,
        help="a throughput.py JSON of the same workload: speedup ceilings against its "
        "Hugging Face runs, scaled by its best matmul rate over this run's",
    )
    ap.add_argument("--no-early-exit", action="store_true", help="skip the early-exit check")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        draft_tokens = sorted({int(k) for k in args.draft_tokens.split(",")})
    except ValueError:
        ap.error(f"--draft-tokens takes comma-separated integers, got {args.draft_tokens!r}")
    if draft_tokens[0] < 1:
        ap.error(f"--draft-tokens must be at least 1, got {draft_tokens[0]}")
    baseline = None
    if args.baseline is not None:
        try:
            baseline = json.loads(args.baseline.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--baseline: cannot read {args.baseline}: {e}")
        machine = baseline.get("machine") if isinstance(baseline, dict) else None
        if not isinstance(machine, dict) or "matmul_gflops_best" not in machine:
            ap.error(f"--baseline: {args.baseline} is not a throughput.py JSON summary")
        if machine.get("dtype", "float32") != "float32":
            ap.error("--baseline must be a float32 run (this driver measures float32)")

    def say(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    engine = LLMEngine(EngineConfig(max_model_len=args.max_model_len))
    wl = workload_from_args(args, engine.vocab_size)
    shape = (len(wl.prompts), wl.prompt_tokens, wl.output_tokens)
    for name in ("hf_static", "hf_continuous"):
        run = (baseline or {}).get(name)
        if (
            run is not None
            and (run["requests"], run["prompt_tokens"], run["output_tokens"]) != shape
        ):
            ap.error(
                f"--baseline: its {name} run served {run['requests']} requests, "
                f"{run['prompt_tokens']} prompt + {run['output_tokens']} output tokens; this "
                f"workload has {shape[0]}, {shape[1]} + {shape[2]} (pass the same workload options)"
            )
    say(f"{len(wl.prompts)} requests, {wl.prompt_tokens} prompt + {wl.output_tokens} output tokens")
    start = time.perf_counter()
    outputs = greedy_outputs(engine, wl.prompts, wl.output_lens)
    say(f"greedy outputs in {time.perf_counter() - start:.1f} s")
    params = sum(p.numel() for p in engine.runner.model.parameters())
    del engine

    prompt_lens = [len(p) for p in wl.prompts]
    passes = {
        k: [limits.copy_draft_passes(p, o, k) for p, o in zip(wl.prompts, outputs, strict=True)]
        for k in draft_tokens
    }
    schedules = {k: limits.copy_draft_schedule(prompt_lens, passes[k]) for k in draft_tokens}
    tokens = {m for s in schedules.values() for m, _ in s}
    grid = {*range(1, 33), 40, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048}
    say("timing the GEMMs in their fastest forms ...")
    rate_before = matmul_gflops(torch.float32)
    dense = load_model(None, "cpu", torch.float32, args.max_model_len).model
    best, best_lm = limits.best_gemm_curves(
        dense, {m for m in grid if m <= max(tokens)}, {m for m in grid if m <= max(tokens)}
    )
    per_token = limits.layer_flops_per_token(dense)
    per_row = 2 * dense.lm_head_weight().numel()
    rate = max(
        1e9 * max(rate_before, matmul_gflops(torch.float32)),
        *(m * per_token / t for m, t in best.items()),
        *(r * per_row / t for r, t in best_lm.items()),
    )
    layer_costs = limits.staircase(best, per_token / rate, max(tokens))
    lm_costs = limits.staircase(best_lm, per_row / rate, max(tokens))
    flops = 2 * params * (wl.prompt_tokens + wl.output_tokens)
    hf = {}
    if baseline is not None:
        scale = baseline["machine"]["matmul_gflops_best"] * 1e9 / rate
        hf = {
            name: baseline[name]["seconds"] * scale
            for name in ("hf_static", "hf_continuous")
            if name in baseline
        }

    copied = {}
    for k, schedule in schedules.items():
        floor = sum(layer_costs[m] + lm_costs[r] for m, r in schedule)
        per_request = [len(p) for p in passes[k]]
        copied[str(k)] = {
            "passes": len(schedule),
            "longest_request_decode_passes": max(per_request),
            "decode_passes_summed_over_requests": sum(per_request),
            "gemm_floor_s": round(floor, 2),
            "mfu_ceiling": round(flops / floor / rate, 4),
            **{f"max_speedup_vs_{name}": round(seconds / floor, 2) for name, seconds in hf.items()},
        }
    result = {
        "requests": len(wl.prompts),
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,
        "threads": torch.get_num_threads(),
        "matmul_gflops_best": round(rate / 1e9, 1),
        "one_token_per_pass_decode_passes": max(wl.output_lens) - 1,
        "copied_drafts": copied,
    }
    if hf:
        result["hf_seconds_scaled_to_this_rate"] = {n: round(s, 2) for n, s in hf.items()}
    if not args.no_early_exit:
        say("early exit ...")
        layers = dense.config.num_layers
        depths = sorted({*range(2, layers, 2), layers - 1})
        result["early_exit_agreement"] = early_exit_agreement(wl.prompts, outputs, depths)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
