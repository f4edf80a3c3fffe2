"""`pagedinfer generate`: stream a completion to the terminal, locally or from a server."""

from __future__ import annotations

import argparse
import sys

from pagedinfer.service.config import add_engine_arguments, config_from_args
from pagedinfer.service.sampling_params import SamplingParams


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=d.top_p,
                   help="sample from the smallest set of tokens this likely (1 = all)")  # fmt: skip
    g.add_argument("--top-k", type=int, default=d.top_k,
                   help="sample from the k likeliest tokens (0 or -1 = all)")  # fmt: skip
    g.add_argument("--min-p", type=float, default=d.min_p,
                   help="drop tokens less likely than this share of the likeliest")  # fmt: skip
    g.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty,
                   help="divide the logits of tokens seen so far by this (1 = off)")  # fmt: skip
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                   help="subtract this from the logits of tokens generated so far")  # fmt: skip
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                   help="subtract this times each token's count in the output so far")  # fmt: skip
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the sampler: the same output whatever the batch (default: "
                   "random)")  # fmt: skip
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append",
                   default=[], help="token id that ends the output (repeatable)")  # fmt: skip
    g.add_argument("--ignore-eos", action="store_true",
                   help="go on past the end-of-sequence token, up to --max-tokens")  # fmt: skip
    g.add_argument("-n", "--n", type=int, default=1, help="number of samples")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        n=args.n,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    remote = parser.add_argument_group("remote server")
    remote.add_argument("--server", metavar="HOST:PORT", help="call a running pagedinfer server")
    remote.add_argument("--token", default=None, help="bearer token for the server")
    remote.add_argument("--tls-ca", default=None, help="CA certificate to verify the server")
    add_sampling_arguments(parser)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    if not args.prompt:
        raise ValueError("prompt is empty")
    messages = None
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
    if args.server:
        from pagedinfer.service.client import generate_remote

        return generate_remote(
            args.server,
            prompt=None if messages else args.prompt,
            messages=messages,
            params=params,
            token=args.token,
            tls_ca=args.tls_ca,
        )
    return _generate_local(args, params, messages)


def _generate_local(args, params: SamplingParams, messages: list[dict] | None) -> int:
    from pagedinfer.service.engine import LLMEngine

    engine = LLMEngine(config_from_args(args))
    if messages:
        ids = engine.encode_prompt(messages=messages)
    else:
        ids = engine.encode_prompt(prompt=args.prompt)
    engine.add_request(ids, params)
    out = sys.stdout
    samples: dict[int, list[str]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if params.n == 1:
                out.write(delta.text)  # one sample streams as it comes
                out.flush()
                continue
            samples.setdefault(delta.index, []).append(delta.text)
            if delta.finish_reason is not None:
                # Several samples print whole, one after another, as each finishes.
                text = "".join(samples.pop(delta.index))
                out.write(f"[{delta.index}] {text}\n[{delta.index}: {delta.finish_reason}]\n")
                out.flush()
    out.write("\n")
    return 0
