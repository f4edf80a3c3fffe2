"""A gRPC client of a running server: `pagedinfer generate --server HOST:PORT`."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

import grpc

from pagedinfer.service.proto import inference_pb2 as pb
from pagedinfer.service.proto import inference_pb2_grpc
from pagedinfer.service.sampling_params import SamplingParams

AUTH_TOKEN_ENV = "PAGEDINFER_AUTH_TOKEN"
FINISH_REASON_NAMES = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort"}


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Every field of `params`, set explicitly (None fields stay unset)."""
    message = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        n=params.n,
        logit_bias=params.logit_bias,
        min_tokens=params.min_tokens,
        skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.use_beam_search:
        message.beam_search.SetInParent()
        if params.best_of is not None:
            message.beam_search.best_of = params.best_of
        message.beam_search.length_penalty = params.length_penalty
        stopping = {False: 0, True: 2, "never": 3}[params.early_stopping]
        message.beam_search.early_stopping = stopping
    return message


def open_channel(target: str, tls_ca: str | None = None) -> grpc.Channel:
    """A channel to `target` (HOST:PORT), over TLS when a CA bundle is given."""
    if tls_ca is None:
        return grpc.insecure_channel(target)
    with open(tls_ca, "rb") as f:
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=f.read()))


def auth_metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


def generate_remote(
    target: str,
    *,
    prompt: str | None,
    messages: list[dict] | None,
    params: SamplingParams,
    token: str | None = None,
    tls_ca: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Streams one completion from the server at `target` to `out`; returns an exit code.

    Give `prompt` (plain text) or `messages` (a chat: [{"role", "content"}, ...]). With
    n = 1 the text is written as it arrives; with n > 1 each sample is written whole,
    under a header, as it finishes. A summary (finish reason, token counts) goes to
    stderr. `token` defaults to $PAGEDINFER_AUTH_TOKEN. Exit codes: 0 done, 2 invalid
    input, 1 any other error; Ctrl-C cancels the request on the server.
    """
    request = pb.GenerateRequest(sampling=sampling_params_to_proto(params))
    if prompt is not None:
        request.prompt = prompt
    for message in messages or ():
        request.messages.add(role=message["role"], content=message["content"])
    token = token if token is not None else os.environ.get(AUTH_TOKEN_ENV)

    texts: dict[int, list[str]] = {}
    with open_channel(target, tls_ca) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            request, metadata=auth_metadata(token)
        )
        try:
            for response in call:
                _show(response, params.n, texts, out)
        except KeyboardInterrupt:
            call.cancel()
            raise
        except grpc.RpcError as exc:
            print(f"error: {explain_rpc_error(target, exc.code().name, exc.details())}",
                  file=sys.stderr)  # fmt: skip
            return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    return 0


def explain_rpc_error(target: str, code: str, details: str) -> str:
    """An RPC failure as the user should read it: a connection to something that is not
    a gRPC server (pagedinfer's HTTP port, say) or to nothing is named as such."""
    if code == "UNAVAILABLE" and "Failed parsing HTTP/2" in details:
        return (
            f"{target} is not a gRPC server (it answered in HTTP/1: is it the HTTP port?); "
            "--server takes the gRPC port, `serve --port`, 50051 by default"
        )
    if code == "UNAVAILABLE" and "Connection refused" in details:
        return (
            f"nothing listens on {target}: is the server running? --server takes its gRPC "
            "port, `serve --port`, 50051 by default"
        )
    return f"{code}: {details}"


def _show(response: Any, n: int, texts: dict[int, list[str]], out: TextIO) -> None:
    if n == 1:
        out.write(response.text)
        out.flush()
    else:
        texts.setdefault(response.index, []).append(response.text)
    if response.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        return
    if n == 1:
        out.write("\n")
    else:
        out.write(f"--- sample {response.index} ---\n{''.join(texts.pop(response.index))}\n")
    out.flush()
    usage = response.usage
    print(
        f"[sample {response.index}: {FINISH_REASON_NAMES[response.finish_reason]}; "
        f"prompt {usage.prompt_tokens}, completion {usage.completion_tokens}, "
        f"cached {usage.cached_tokens} tokens]",
        file=sys.stderr,
    )
