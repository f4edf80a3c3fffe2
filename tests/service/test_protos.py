"""The committed gRPC stubs match the proto, import from the package, and keep the
contract names of docs/architecture.md section 8."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from pagedinfer.service.client import sampling_params_to_proto
from pagedinfer.service.prompts import ChatOptions
from pagedinfer.service.proto import inference_pb2 as pb
from pagedinfer.service.proto import inference_pb2_grpc
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.server import prompt_from_proto, sampling_params_from_proto

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "protos" / "pagedinfer" / "v1" / "inference.proto"
STUBS = ROOT / "service" / "proto"
GENERATED = ("inference_pb2.py", "inference_pb2_grpc.py")


def committed_generator_version() -> str:
    text = (STUBS / "inference_pb2_grpc.py").read_text()
    return re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", text).group(1)


def test_regenerating_the_stubs_gives_the_committed_files(tmp_path):
    from grpc_tools import grpc_version

    if committed_generator_version() != grpc_version.VERSION:
        pytest.skip(
            f"grpcio-tools {grpc_version.VERSION} is installed but the stubs were made by "
            f"{committed_generator_version()}; the descriptor test still checks them"
        )
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    for name in GENERATED:
        assert (tmp_path / name).read_text() == (STUBS / name).read_text(), (
            f"service/proto/{name} is stale: run scripts/gen_protos.sh"
        )


def test_committed_descriptor_is_the_compiled_proto(tmp_path):
    """Independent of the grpcio-tools version: the stub's embedded descriptor is
    exactly what protoc makes of the proto file today."""
    import grpc_tools
    from grpc_tools import protoc

    out = tmp_path / "set.pb"
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    rc = protoc.main(
        [
            "protoc",
            f"-I{ROOT / 'protos'}",
            f"-I{well_known}",
            f"--descriptor_set_out={out}",
            "pagedinfer/v1/inference.proto",
        ]
    )
    assert rc == 0
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    messages = list(compiled.message_type)
    while messages:  # the Python plugin omits derived JSON names, nested messages' too
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert committed == compiled, "service/proto is stale: run scripts/gen_protos.sh"


def test_stubs_import_from_the_package_not_from_the_proto_path():
    text = (STUBS / "inference_pb2_grpc.py").read_text()
    assert "from pagedinfer.service.proto import inference_pb2" in text
    assert "from pagedinfer.v1" not in text
    assert inference_pb2_grpc.pagedinfer_dot_v1_dot_inference__pb2 is pb
    assert pb.GenerateRequest.__module__ == "pagedinfer.service.proto.inference_pb2"


def test_service_has_the_contract_methods():
    service = pb.DESCRIPTOR.services_by_name["Inference"]
    assert service.full_name == "pagedinfer.v1.Inference"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Tokenize", "GetModelInfo"}
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert methods["Generate"].output_type.name == "GenerateResponse"
    assert not methods["Tokenize"].server_streaming


def test_messages_have_the_contract_fields():
    def fields(message) -> set[str]:
        return set(message.DESCRIPTOR.fields_by_name)

    assert {"prompt", "prompt_token_ids", "messages", "sampling", "request_id",
            "cache_salt"} <= fields(pb.GenerateRequest)  # fmt: skip
    assert {"request_id", "index", "token_ids", "text", "finish_reason",
            "usage"} <= fields(pb.GenerateResponse)  # fmt: skip
    assert fields(pb.Usage) == {"prompt_tokens", "completion_tokens", "cached_tokens"}
    assert {"model_name", "max_model_len", "block_size", "num_blocks"} <= fields(pb.ModelInfo)
    assert {pb.FinishReason.Name(v) for v in (pb.STOP, pb.LENGTH, pb.ABORT)} == {
        "STOP",
        "LENGTH",
        "ABORT",
    }


# Sampling fields only the HTTP API serves: its `echo` returns prompt logprobs, which
# the gRPC response has no field for.
HTTP_ONLY_FIELDS = {"prompt_logprobs"}
# Beam search is one message on the wire: set means use_beam_search.
BEAM_FIELDS = {"best_of", "length_penalty", "early_stopping"}


def test_sampling_params_message_mirrors_the_dataclass():
    python_fields = {f.name for f in dataclasses.fields(SamplingParams)} - HTTP_ONLY_FIELDS
    wire = set(pb.SamplingParams.DESCRIPTOR.fields_by_name) - {"beam_search"}
    assert wire | BEAM_FIELDS | {"use_beam_search"} == python_fields
    assert set(pb.BeamSearch.DESCRIPTOR.fields_by_name) == BEAM_FIELDS


def test_sampling_params_round_trip_through_the_proto():
    params = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.75,
        top_k=20,
        min_p=0.25,
        repetition_penalty=1.5,
        presence_penalty=-0.5,
        frequency_penalty=0.5,
        seed=1234,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 3],
        ignore_eos=True,
        n=3,
        logprobs=5,
        logit_bias={5: 100.0, 9: -1.5},
        min_tokens=2,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    wire = pb.SamplingParams.FromString(sampling_params_to_proto(params).SerializeToString())
    assert sampling_params_from_proto(wire) == params


def test_unset_sampling_fields_take_the_dataclass_defaults():
    assert sampling_params_from_proto(pb.SamplingParams()) == SamplingParams()
    assert sampling_params_from_proto(pb.SamplingParams(temperature=0.0)).greedy


def test_bad_sampling_field_is_named_with_its_proto_path():
    with pytest.raises(ValueError, match=r"^sampling\.top_p"):
        sampling_params_from_proto(pb.SamplingParams(top_p=1.5))


CHAT = [pb.ChatMessage(role="user", content="Hi"), pb.ChatMessage(role="assistant", content="He")]


def test_chat_template_fields_become_the_chat_options():
    request = pb.GenerateRequest(messages=CHAT[:1])
    request.chat_template_kwargs.update({"enable_thinking": False, "depth": 3, "scale": 0.5,
                                         "nested": {"items": [1, "a"]}})  # fmt: skip
    given = prompt_from_proto(request)
    assert given["chat_options"] == ChatOptions(
        template_kwargs={
            "enable_thinking": False,
            "depth": 3,
            "scale": 0.5,
            "nested": {"items": [1, "a"]},
        }
    )
    assert isinstance(given["chat_options"].template_kwargs["depth"], int)
    opened = pb.GenerateRequest(
        messages=CHAT, add_generation_prompt=False, continue_final_message=True
    )
    assert prompt_from_proto(opened)["chat_options"] == ChatOptions(
        add_generation_prompt=False, continue_final_message=True
    )
    assert "chat_options" not in prompt_from_proto(pb.GenerateRequest(messages=CHAT))
    tokenize = pb.TokenizeRequest(messages=CHAT[:1], add_generation_prompt=False)
    assert prompt_from_proto(tokenize)["chat_options"] == ChatOptions(add_generation_prompt=False)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(prompt="Hi", add_generation_prompt=False),
         "^add_generation_prompt: applies only to a chat given as messages"),
        (pb.GenerateRequest(messages=CHAT, continue_final_message=True),
         "^continue_final_message: set add_generation_prompt to false"),
        (pb.GenerateRequest(messages=CHAT[:1], add_generation_prompt=False,
                            continue_final_message=True),
         "^continue_final_message: the last message must be an assistant message"),
    ],
)  # fmt: skip
def test_bad_chat_template_fields_are_named(request_, message):
    with pytest.raises(ValueError, match=message):
        prompt_from_proto(request_)


def test_reserved_template_variables_are_refused():
    request = pb.GenerateRequest(messages=CHAT[:1])
    request.chat_template_kwargs.update({"messages": []})
    with pytest.raises(ValueError, match=r"^chat_template_kwargs: messages cannot be set here"):
        prompt_from_proto(request)
    request = pb.GenerateRequest(prompt="Hi")
    request.chat_template_kwargs.update({"enable_thinking": True})
    with pytest.raises(ValueError, match=r"^chat_template_kwargs: applies only to a chat"):
        prompt_from_proto(request)
