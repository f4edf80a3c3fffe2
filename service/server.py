"""The inference server: `pagedinfer serve`.

A `grpc.aio` server over `AsyncLLMEngine` (docs/architecture.md section 8): the `Inference`
service, `grpc.health.v1.Health` (NOT_SERVING until the model is loaded and warmed up)
and server reflection; telemetry from `pagedinfer.service.metrics`. In the same process
and event loop, over the same engine, the OpenAI-compatible HTTP API
(`pagedinfer.service.openai`, the same section) on `--http-port`. The ports open before the
model loads so that probes get an answer; inference calls are UNAVAILABLE (HTTP 503)
until then.

Lifecycle: SIGTERM (or SIGINT) flips health to NOT_SERVING (HTTP /health to 503),
stops admitting requests, gives in-flight calls and streams `--grace-period` seconds to
finish, then cancels them, which aborts their requests and frees their KV-cache blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedinfer.service.reasoning import REASONING_PARSERS, get_reasoning_parser
from pagedinfer.service.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:  # grpc and the engine are imported in `run`, keeping `--help` fast
    import grpc

    from pagedinfer.service.async_engine import AsyncLLMEngine
    from pagedinfer.service.config import EngineConfig
    from pagedinfer.service.metrics import Telemetry
    from pagedinfer.service.sampling_params import SamplingParams
    from pagedinfer.service.structured_output import StructuredOutput

log = logging.getLogger("pagedinfer.server")
# The thread that builds the engine (and, with a compile record, its CPU kernels).
ENGINE_LOAD_THREAD = "engine-load"

SERVICE_NAME = "pagedinfer.v1.Inference"
AUTH_TOKEN_ENV = "PAGEDINFER_AUTH_TOKEN"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9464
DEFAULT_HTTP_PORT = 8000
DEFAULT_MAX_QUEUE = 256
# Kubernetes sends SIGKILL 30 s after SIGTERM by default; abort what is left before that.
DEFAULT_GRACE_PERIOD = 25.0
GRACE_CUT_S = 2.0  # for HTTP answers cut at the grace period's end to say so and close
FINISH_REASONS = {"stop": 1, "length": 2, "abort": 3}  # FinishReason enum values


# ---------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagedinfer serve`: one per engine setting, then the server's own."""
    from pagedinfer.service.config import add_engine_arguments

    add_engine_arguments(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port")
    server.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help="OpenAI-compatible HTTP API port (-1 disables it)")  # fmt: skip
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model names the HTTP API answers to; the first is the one it "
                        "reports (default: the model's own name)")  # fmt: skip
    server.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                        help="split thinking models' reasoning into the chat API's "
                        "reasoning_content (qwen3, smollm3: <think>...</think>; deepseek_r1: "
                        "the output starts inside the thinking)")  # fmt: skip
    server.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                        help="how the chat API reads tool calls in the model's text (default: "
                        "from the chat template; hermes where it says nothing)")  # fmt: skip
    server.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help="leave a chat request's tools out of its prompt when its "
                        "tool_choice is none (by default the model still sees them, as "
                        "OpenAI shows them)")  # fmt: skip
    server.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                        help="Prometheus /metrics port (-1 disables it)")  # fmt: skip
    server.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="waiting requests beyond which calls get RESOURCE_EXHAUSTED")  # fmt: skip
    server.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_PERIOD,
                        help="seconds in-flight calls get to finish after SIGTERM")  # fmt: skip
    server.add_argument("--auth-token", default=None,
                        help=f"require 'authorization: Bearer TOKEN' (or set ${AUTH_TOKEN_ENV})")  # fmt: skip
    server.add_argument("--tls-cert", default=None, help="PEM certificate chain; enables TLS")
    server.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    server.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="JSON log lines at this level and above; DEBUG adds tracebacks "
                        "to errors")  # fmt: skip


@dataclass
class ServerOptions:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    metrics_port: int | None = DEFAULT_METRICS_PORT
    http_port: int | None = DEFAULT_HTTP_PORT
    served_model_names: list[str] | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    max_queue: int = DEFAULT_MAX_QUEUE
    grace_period: float = DEFAULT_GRACE_PERIOD
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if args.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
        if args.grace_period < 0:
            raise ValueError(f"--grace-period must be >= 0, got {args.grace_period}")
        names = args.served_model_name
        if names is not None and not all(name.strip() for name in names):
            raise ValueError("--served-model-name must not be empty")
        for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{flag} {path}: no such file, or not readable")
        _check_host(args.host)
        return cls(
            host=args.host,
            port=args.port,
            metrics_port=None if args.metrics_port < 0 else args.metrics_port,
            http_port=None if args.http_port < 0 else args.http_port,
            served_model_names=names,
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            max_queue=args.max_queue,
            grace_period=args.grace_period,
            auth_token=args.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )


def _check_host(host: str) -> None:
    """ValueError unless `host` resolves to an address (not that it is this machine's:
    binding says so, naming the port's flag)."""
    import socket

    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"--host {host}: not an address ({exc})") from None


def run(args: argparse.Namespace) -> int:
    from pagedinfer.service.config import config_from_args

    configure_logging(args.log_level)
    # A server reports SERVING once the model is loaded; the CPU backend's kernels compile
    # (or load from the disk cache) in the background while the torch forward serves.
    config = dataclasses.replace(config_from_args(args), compile_in_background=True)
    options = ServerOptions.from_args(args)
    try:
        code = asyncio.run(serve(config, options))
    except OSError as exc:  # a port in use, an unreadable certificate
        log.error("cannot start the server: %s", exc)
        code = 1
    except ValueError as exc:  # a configuration mistake found while loading the model
        log.debug("configuration error", exc_info=True)
        print(f"pagedinfer serve: error: {exc}", file=sys.stderr)
        code = 2
    _exit_past_a_running_compile(code)
    return code


def listen_error(flag: str, host: str, port: int, exc: BaseException) -> OSError:
    """A listener that could not bind, said with the flag that chose its port."""
    reason = f" ({os.strerror(exc.errno)})" if isinstance(exc, OSError) and exc.errno else ""
    return OSError(
        f"{flag} {port}: cannot listen on {host}:{port}{reason}: another process holds the "
        f"port, or the address is not this machine's; stop that process or choose another {flag}"
    )


def _exit_past_a_running_compile(code: int) -> None:
    """Exit now, skipping interpreter shutdown, while the model still loads or the CPU
    kernels still compile in the background: LLVM aborts when its state is torn down
    under a compile. Everything the server owns has been closed by then; only logs need
    flushing."""
    if any(t.name == ENGINE_LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
        log.info("exiting while the model still loads")
    elif "pagedinfer.kernels.cpu.executor" in sys.modules:
        from pagedinfer.kernels.cpu import executor

        if not executor.warm_up_running():
            return
        log.info("exiting while the CPU kernels still compile in the background")
    else:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------ logging


class JsonFormatter(logging.Formatter):
    """One JSON object per line; `extra=` fields become top-level keys."""

    _STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in self._STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO") -> None:
    """Every line on stderr is JSON: Python's warnings go through logging, and gRPC's C
    core (which writes its own lines, e.g. when the CPU backend forks its compiler) says
    only errors unless GRPC_VERBOSITY asks for more. Set in the serving process only,
    before grpc loads."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)
    if "grpc" not in sys.modules:
        os.environ.setdefault("GRPC_VERBOSITY", "DEBUG" if level == "DEBUG" else "ERROR")


# ------------------------------------------------------------- proto conversion

# The proto's EarlyStopping values as SamplingParams.early_stopping (transformers' values).
EARLY_STOPPING = {0: False, 1: False, 2: True, 3: "never"}
BEAM_SEARCH_FIELDS = ("best_of", "length_penalty", "early_stopping")


def sampling_params_from_proto(message: Any) -> SamplingParams:
    """A SamplingParams from its proto; unset optional fields keep the defaults.

    Errors name the proto field (`sampling.top_p must be in (0, 1], got 1.5`).
    """
    from pagedinfer.service.sampling_params import SamplingParams

    kwargs: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "n", "logprobs"):  # fmt: skip
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    kwargs["stop"] = list(message.stop)
    kwargs["stop_token_ids"] = list(message.stop_token_ids)
    kwargs["ignore_eos"] = message.ignore_eos
    kwargs["logit_bias"] = dict(message.logit_bias)
    if message.HasField("min_tokens"):
        kwargs["min_tokens"] = message.min_tokens
    if message.HasField("skip_special_tokens"):
        kwargs["skip_special_tokens"] = message.skip_special_tokens
    kwargs["include_stop_str_in_output"] = message.include_stop_str_in_output
    if message.HasField("structured_output"):
        kwargs["structured_output"] = structured_output_from_proto(message.structured_output)
    if message.HasField("beam_search"):
        beam = message.beam_search
        kwargs["use_beam_search"] = True
        kwargs.setdefault("temperature", 0.0)  # deterministic, unless a client asks otherwise
        if beam.HasField("best_of"):
            kwargs["best_of"] = beam.best_of
        if beam.HasField("length_penalty"):
            kwargs["length_penalty"] = beam.length_penalty
        if beam.early_stopping not in EARLY_STOPPING:
            raise ValueError(
                f"sampling.beam_search.early_stopping: unknown value {beam.early_stopping}"
            )
        kwargs["early_stopping"] = EARLY_STOPPING[beam.early_stopping]
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        where = "beam_search." if str(exc).split(" ", 1)[0] in BEAM_SEARCH_FIELDS else ""
        raise ValueError(f"sampling.{where}{exc}") from None


def structured_output_from_proto(message: Any) -> StructuredOutput:
    """The StructuredOutput of its proto (compiled when the request is made)."""
    from pagedinfer.service.structured_output import StructuredOutput

    kind = message.WhichOneof("constraint")
    field = f"sampling.structured_output.{kind}"
    if kind is None:
        raise ValueError("sampling.structured_output must set one of its constraints")
    if kind == "json_schema":
        try:
            schema = json.loads(message.json_schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"{field} is not valid JSON: {err}") from None
        return StructuredOutput.json_schema(schema)
    if kind == "json_object":
        if not message.json_object:
            raise ValueError(f"{field} must be true when set")
        return StructuredOutput.json_object()
    if kind == "choice":
        return StructuredOutput.choice(list(message.choice.choices))
    return StructuredOutput(kind, getattr(message, kind))


def prompt_from_proto(message: Any) -> dict[str, Any]:
    """The keyword arguments of `engine.encode_prompt` for a request's input fields: the
    fields it sets (a repeated field is set when it is not empty). `encode_prompt`
    checks them."""
    given: dict[str, Any] = {}
    if message.HasField("prompt"):
        given["prompt"] = message.prompt
    if getattr(message, "prompt_token_ids", None):
        given["prompt_token_ids"] = list(message.prompt_token_ids)
    if message.messages:
        given["messages"] = [{"role": m.role, "content": m.content} for m in message.messages]
    options = chat_options_from_proto(message)
    if options is not None:
        from pagedinfer.service.prompts import check_chat_options

        if "messages" not in given:
            named = [f for f in CHAT_OPTION_FIELDS if _is_set(message, f)]
            raise ValueError(f"{', '.join(named)}: applies only to a chat given as messages")
        check_chat_options(options, given["messages"])
        given["chat_options"] = options
    return given


# A request's fields for how the chat template renders its messages.
CHAT_OPTION_FIELDS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")


def chat_options_from_proto(message: Any) -> Any:
    """The `prompts.ChatOptions` of a request's chat template fields; None when it sets
    none of them."""
    from google.protobuf.json_format import MessageToDict

    from pagedinfer.service.prompts import ChatOptions

    if not any(_is_set(message, f) for f in CHAT_OPTION_FIELDS):
        return None
    generation_prompt = message.HasField("add_generation_prompt")
    return ChatOptions(
        add_generation_prompt=message.add_generation_prompt if generation_prompt else True,
        continue_final_message=message.continue_final_message,
        template_kwargs=_whole_numbers(MessageToDict(message.chat_template_kwargs)),
    )


def _is_set(message: Any, name: str) -> bool:
    if name == "continue_final_message":  # no presence: set means true
        return message.continue_final_message
    if name == "chat_template_kwargs":
        return bool(message.chat_template_kwargs.fields)
    return message.HasField(name)


def _whole_numbers(value: Any) -> Any:
    """A Struct's JSON with its whole numbers as ints (a Struct holds every number as a
    double; a template that prints one expects 3, not 3.0)."""
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def response_from_delta(delta: Any) -> Any:
    """The GenerateResponse of one CompletionDelta."""
    from pagedinfer.service.proto import inference_pb2 as pb

    response = pb.GenerateResponse(
        request_id=delta.request_id,
        index=delta.index,
        token_ids=delta.token_ids,
        text=delta.text,
    )
    for entry in delta.logprobs or ():
        response.logprobs.add(
            token_id=entry["token_id"],
            logprob=entry["logprob"],
            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.get("top", ())],
        )
    if delta.finish_reason is not None:
        response.finish_reason = FINISH_REASONS[delta.finish_reason]
        response.usage.prompt_tokens = delta.prompt_tokens
        response.usage.completion_tokens = delta.completion_tokens
        response.usage.cached_tokens = delta.cached_tokens
    return response


# ------------------------------------------------------------------- the service


class InferenceServicer:
    """The `pagedinfer.v1.Inference` service over one engine.

    `engine` is None until the model is loaded and warmed up; calls get UNAVAILABLE
    until then.
    """

    def __init__(self, max_queue: int, telemetry: Telemetry | None = None):
        self.engine: AsyncLLMEngine | None = None
        self.telemetry = telemetry
        self.max_queue = max_queue

    def stats(self) -> Any:
        """The engine's latest stats snapshot, or None while the model loads."""
        return None if self.engine is None else self.engine.stats()

    async def _ready_engine(self, context: grpc.aio.ServicerContext) -> AsyncLLMEngine:
        import grpc

        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.engine

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
        import grpc

        engine = await self._ready_engine(context)
        try:
            params = sampling_params_from_proto(request.sampling)
            prompt = prompt_from_proto(request)
            prompt_token_ids = engine.encode_prompt(**prompt)
            if engine.num_waiting >= self.max_queue:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the waiting queue is full ({self.max_queue} requests); retry later",
                )
            stream = engine.add_request(
                prompt_token_ids,
                params,
                request_id=request.request_id or None,
                cache_salt=request.cache_salt or None,
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        operation = "chat" if "messages" in prompt else "text_completion"
        trace = self.telemetry.start_request(
            request_id=stream.request_id, operation=operation, model=engine.model_name
        )
        trace.queued(len(prompt_token_ids), params.n)
        error: str | None = None
        completion_tokens: dict[int, int] = {}
        try:
            async for delta in stream:
                trace.on_delta(
                    delta.index,
                    len(delta.token_ids),
                    delta.completion_tokens,
                    delta.cached_tokens,
                    delta.finish_reason,
                    queue_time=delta.queue_time,
                )
                completion_tokens[delta.index] = delta.completion_tokens
                yield response_from_delta(delta)
        except asyncio.CancelledError:  # the client cancelled, or the deadline expired
            error = "cancelled"
            raise
        except Exception as exc:
            error = type(exc).__name__
            log.exception("request failed", extra={"request_id": stream.request_id})
            raise
        finally:
            await stream.aclose()  # aborts the request (frees its blocks) unless finished
            trace.end(error)
            log.info(
                "request done",
                extra={
                    "request_id": stream.request_id,
                    "operation": operation,
                    "prompt_tokens": len(prompt_token_ids),
                    "completion_tokens": sum(completion_tokens.values()),
                    "finish_reasons": [trace.finish_reasons.get(i) for i in range(params.n)],
                    "error": error,
                },
            )

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        import grpc

        from pagedinfer.service.proto import inference_pb2 as pb

        engine = await self._ready_engine(context)
        try:
            token_ids = engine.encode_prompt(**prompt_from_proto(request))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=token_ids)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        from pagedinfer.service.proto import inference_pb2 as pb

        engine = await self._ready_engine(context)
        return pb.ModelInfo(
            model_name=engine.model_name,
            max_model_len=engine.max_model_len,
            block_size=engine.block_size,
            num_blocks=engine.num_blocks,
            vocab_size=engine.vocab_size,
        )


def bearer_token_interceptor(token: str) -> Any:
    """A server interceptor that refuses calls without `authorization: Bearer <token>`.

    Health checks stay open: Kubernetes probes cannot send credentials.
    """
    import grpc

    expected = f"Bearer {token}".encode()

    async def deny(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    async def deny_stream(request_or_iterator: Any, context: grpc.aio.ServicerContext):
        await deny(request_or_iterator, context)
        yield  # pragma: no cover - makes this an async generator, as streaming expects

    class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
        async def intercept_service(
            self,
            continuation: Callable[[Any], Awaitable[Any]],
            details: grpc.HandlerCallDetails,
        ) -> Any:
            handler = await continuation(details)
            if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
                return handler
            given = dict(details.invocation_metadata or ()).get("authorization", "")
            if hmac.compare_digest(str(given).encode(), expected):
                return handler
            # The refusal must have the same streaming kind as the method it replaces.
            kind = {
                (False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler,
            }[(handler.request_streaming, handler.response_streaming)]
            return kind(
                deny_stream if handler.response_streaming else deny,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

    return BearerTokenInterceptor()


# ------------------------------------------------------------------------ serving


def _start_engine_load(config: EngineConfig) -> asyncio.Future[AsyncLLMEngine]:
    """Starts building the engine in a daemon thread, so that the model loads while the
    server sets itself up, and a SIGTERM during a long load can exit without waiting."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[AsyncLLMEngine] = loop.create_future()

    def load() -> None:
        try:
            from pagedinfer.service.async_engine import AsyncLLMEngine

            engine = AsyncLLMEngine(config)
        except BaseException as exc:
            loop.call_soon_threadsafe(_set_exception, future, exc)
        else:
            loop.call_soon_threadsafe(_set_result, future, engine)

    threading.Thread(target=load, name=ENGINE_LOAD_THREAD, daemon=True).start()
    return future


async def _drain_http(http: Any, state: Any, grace_period: float) -> None:
    """HTTP's half of a drain: /health answers 503 and new requests are refused while
    in-flight ones get the grace period; then the listener closes and what is left is
    cancelled."""
    state.draining = True
    if not await state.wait_idle(grace_period):
        state.cut_all()  # each ends with a 503 error
        await state.wait_idle(GRACE_CUT_S)
    await http.stop(GRACE_CUT_S)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


async def serve(config: EngineConfig, options: ServerOptions) -> int:
    """Runs the server until SIGTERM or SIGINT; returns the process exit code."""
    load = _start_engine_load(config)  # first: the model loads while the server sets up
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from pagedinfer.service.metrics import create_telemetry
    from pagedinfer.service.proto import inference_pb2, inference_pb2_grpc

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    servicer = InferenceServicer(options.max_queue)
    try:
        servicer.telemetry = create_telemetry(
            servicer.stats,
            host=options.host,
            metrics_port=options.metrics_port,
            prometheus=options.http_port is not None,
        )
    except OSError as exc:
        if exc.errno is None:
            raise
        raise listen_error("--metrics-port", options.host, options.metrics_port, exc) from None
    http, http_state = None, None
    if options.http_port is not None:
        from pagedinfer.service.openai import HttpServer, ServingState, create_app

        http_state = ServingState(max_queue=options.max_queue, telemetry=servicer.telemetry)
        if options.reasoning_parser is not None:
            http_state.reasoning_parser = get_reasoning_parser(options.reasoning_parser)
        http_state.tool_call_parser = options.tool_call_parser
        http_state.exclude_tools_when_none = options.exclude_tools_when_tool_choice_none
        http = HttpServer(create_app(http_state, options.auth_token), options.host,
                          options.http_port, options.tls_cert, options.tls_key)  # fmt: skip

    interceptors = [bearer_token_interceptor(options.auth_token)] if options.auth_token else []
    # gRPC sets SO_REUSEPORT by default, so a second server on the same port would bind
    # beside the first and take half of its calls; each port is ours alone.
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        [
            inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    address = f"{options.host}:{options.port}"
    if options.tls_cert:
        with open(options.tls_key, "rb") as key, open(options.tls_cert, "rb") as cert:
            credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
    try:
        if options.tls_cert:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's "Failed to bind to address"
        servicer.telemetry.shutdown()
        raise listen_error("--port", options.host, options.port, exc) from None
    await server.start()
    http_port = None
    if http is not None:
        try:
            http_port = await http.start()
        except OSError as exc:
            await server.stop(None)
            servicer.telemetry.shutdown()
            if exc.errno is None:  # the TLS certificate, said by HttpServer
                raise
            raise listen_error("--http-port", options.host, options.http_port, exc) from None
    log.info(
        "listening; loading the model",
        extra={"grpc_port": port, "http_port": http_port, "tls": bool(options.tls_cert),
               "auth": bool(interceptors)},
    )  # fmt: skip

    engine: AsyncLLMEngine | None = None
    exit_code = 0
    try:
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            log.info("stopped while loading the model")
            load.cancel()
            return 0
        stopped.cancel()
        engine = load.result()
        await engine.start()
        started = time.monotonic()
        await engine.warmup()
        served_names = options.served_model_names or [engine.model_name]
        if servicer.telemetry.vllm is not None:
            from pagedinfer.service.vllm_metrics import CacheConfig

            cache = CacheConfig(
                served_names[0],
                engine.block_size,
                engine.num_blocks,
                config.enable_prefix_caching,
                max_model_len=engine.max_model_len,
            )
            servicer.telemetry.vllm.bind(cache)
        servicer.engine = engine
        if http_state is not None:
            http_state.served_model_names = served_names
            http_state.engine = engine
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "ready",
            extra={
                "grpc_port": port,
                "http_port": http_port,
                "served_model_names": served_names,
                "metrics_port": options.metrics_port,
                "model": engine.model_name,
                "num_blocks": engine.num_blocks,
                "block_size": engine.block_size,
                "max_model_len": engine.max_model_len,
                "warmup_s": round(time.monotonic() - started, 3),
            },
        )
        await stop.wait()
    except ValueError:
        raise  # a configuration mistake: `run` says it in one line
    except Exception:
        log.exception("the server failed")
        exit_code = 1
    finally:
        log.info("shutting down", extra={"grace_period_s": options.grace_period})
        await health_servicer.enter_graceful_shutdown()
        # Both APIs stop admitting requests, wait up to the grace period for in-flight
        # ones, then cancel them; a cancelled call or stream aborts its request.
        drains = [server.stop(options.grace_period)]
        if http is not None:
            drains.append(_drain_http(http, http_state, options.grace_period))
        await asyncio.gather(*drains)
        if engine is not None:
            await engine.shutdown()
        servicer.telemetry.shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        log.info("stopped")
    return exit_code
