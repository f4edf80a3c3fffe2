"""KV blocks a sliding window frees: one long generation, with and without freeing.

A tiny random-weight Mistral (transformers' own MistralConfig, every layer windowed)
generates one long greedy request twice on the same engine settings: once with the KV
blocks behind the window freed as it slides, once keeping every block. Prints one JSON
summary (the blocks held when the request ends and at the peak, for both, and whether
the outputs are identical) and saves it and a plot of the blocks held per step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tiny_mistral(out: Path, window: int, max_len: int) -> Path:
    """A 2-layer random-weight Mistral with window `window`, and the default tokenizer."""
    import torch
    import transformers

    from pagedinfer.service.loader import ensure_default_model

    config = transformers.MistralConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        sliding_window=window,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer_dir = ensure_default_model()
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def run_once(
    model_dir: Path, free: bool, prompt_len: int, max_tokens: int, block_size: int
) -> dict[str, Any]:
    """One greedy request, stepped by hand: its tokens and the KV blocks held per step."""
    from pagedinfer.service.llm import LLM
    from pagedinfer.service.sampling_params import SamplingParams

    llm = LLM(
        str(model_dir),
        max_model_len=prompt_len + max_tokens,
        block_size=block_size,
        num_gpu_blocks=-(-(prompt_len + max_tokens) // block_size),
    )
    engine = llm.engine
    if not free:
        engine.scheduler.kv_cache.sliding_window = None  # the same engine, keeping every block
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request_id = engine.add_request(list(range(1, prompt_len + 1)), params)
    tokens: list[int] = []
    held: list[int] = []  # blocks held after each step while the request runs
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id == request_id:
                tokens.extend(delta.token_ids)
        if engine.has_unfinished():
            held.append(engine.stats().kv.used)
    return {"tokens": tokens, "held": held}


def measure(
    model_dir: Path, window: int, prompt_len: int, max_tokens: int, block_size: int
) -> dict[str, Any]:
    """Both runs of one long request; the summary of blocks held and output equality."""
    runs = {
        name: run_once(model_dir, free, prompt_len, max_tokens, block_size)
        for name, free in (("freed", True), ("kept", False))
    }
    return {
        "setup": {
            "model": "tiny random Mistral, 2 layers, every layer windowed",
            "window": window,
            "block_size": block_size,
            "prompt_tokens": prompt_len,
            "generated_tokens": max_tokens,
        },
        "blocks_at_end": {name: run["held"][-1] for name, run in runs.items()},
        "peak_blocks": {name: max(run["held"]) for name, run in runs.items()},
        "identical_outputs": runs["freed"]["tokens"] == runs["kept"]["tokens"],
        "held_per_step": {name: run["held"] for name, run in runs.items()},
    }


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup = summary["setup"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in (("kept", "every block kept"), ("freed", "freed behind the window")):
        ax.plot(summary["held_per_step"][name], label=label)
    ax.set_xlabel("engine step")
    ax.set_ylabel(f"KV blocks held ({setup['block_size']} tokens each)")
    ax.set_title(
        f"One request, {setup['generated_tokens']} generated tokens, window {setup['window']}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default=str(RESULTS / "sliding_window.json"), help="JSON path")
    parser.add_argument("--plot", default=str(RESULTS / "sliding_window.png"), help="PNG path")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_mistral(Path(tmp), args.window, args.prompt_len + args.max_tokens)
        summary = measure(model_dir, args.window, args.prompt_len, args.max_tokens, args.block_size)
    if args.plot:
        plot(summary, Path(args.plot))
    del summary["held_per_step"]  # in the plot
    text = json.dumps(summary, indent=2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
