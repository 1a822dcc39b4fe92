"""Tools and a question for the tool-call tests on the real model, and the reassembly of
streamed tool-call deltas."""

from __future__ import annotations

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# a reply in Hermes' tool-call format, as a regex (guided_regex)
HERMES_GET_TIME = (
    r'<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}\n</tool_call>'
)
# a tool call and its result, the call as the openai client sends a reply back (nulls too)
TOOL_TURNS = [
    *WEATHER_ASK,
    {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "audio": None,
        "tool_calls": [
            {
                "id": "call_7",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"},
]


def streamed_calls(stream) -> tuple[list[dict], str | None]:
    """Tool calls reassembled from OpenAI deltas (a call's first delta has its id and
    name, later ones argument pieces), and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            if c.id is not None:
                assert c.type == "function" and c.function.arguments == ""
                calls[c.index] = {"name": c.function.name, "arguments": ""}
            else:
                calls[c.index]["arguments"] += c.function.arguments
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    return [calls[i] for i in sorted(calls)], finish


WEATHER_TIME_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def reflected_generate(target: str, request: dict) -> list[dict]:
    """Calls jaxpaged.v1.Generation/Generate with message classes built from the server's
    reflection (no generated stubs), the request and responses as JSON-shaped dicts."""
    import grpc
    from google.protobuf import descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(target) as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        method = pool.FindServiceByName("jaxpaged.v1.Generation").methods_by_name["Generate"]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        generate = channel.unary_stream(
            "/jaxpaged.v1.Generation/Generate",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        message = json_format.ParseDict(request, request_cls())
        return [json_format.MessageToDict(m) for m in generate(message, timeout=120)]
