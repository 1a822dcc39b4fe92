"""Images through the OpenAI chat API: the real `openai` client sends data URLs (PNG, JPEG,
WebP) to a server in front of the real AsyncEngine over a tiny random Gemma 3 and gets the
text offline `LLM.chat` gives (itself checked against transformers' greedy tokens); hostile
or malformed images and too many images are refused with HTTP 400 before the engine sees
them, and no image bytes reach the logs."""

from __future__ import annotations

import base64
import http.server
import io
import logging
import re
import struct
import threading
import time
import zlib

import anthropic
import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from jaxpaged.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _image(seed: int, size=(36, 44)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _encode(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels over one tiny compressed row."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))  # fmt: skip


def _chat(parts: list[dict]) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "w1 w2 "}, *parts,
                                         {"type": "text", "text": " w3"}]}]  # fmt: skip


IMAGES = {fmt: _image(i) for i, fmt in enumerate(("PNG", "JPEG", "WEBP"))}
MIMES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


@pytest.fixture(scope="module")
def served(tiny_vl):
    from harness import ServerThread

    from jaxpaged.engine import LLMEngine
    from jaxpaged.engine.async_engine import AsyncEngine
    from jaxpaged.llm import LLM

    engine = LLMEngine.from_args(
        tiny_vl.folder, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
        block_size=4, num_kv_blocks=64, enforce_eager=True, show_progress=False,
        limit_mm_per_prompt=2,
    )  # fmt: skip
    llm = LLM.from_engine(engine)
    urls = {f: _data_url(_encode(im, f), MIMES[f]) for f, im in IMAGES.items()}
    # the decoded image (JPEG is lossy): what both the offline and the served request see
    decoded = {f: Image.open(io.BytesIO(_encode(im, f))).convert("RGB") for f, im in IMAGES.items()}
    chats = [_chat([{"type": "image_url", "image_url": {"url": urls[f]}}]) for f in IMAGES]
    chats.append(_chat([{"type": "image", "image": decoded["PNG"]},
                        {"type": "image_url", "image_url": {"url": urls["JPEG"]}}]))  # fmt: skip
    ref = llm.chat(chats, GREEDY, use_tqdm=False)
    media = _MediaServer(_encode(IMAGES["PNG"], "PNG"))
    server = ServerThread(
        AsyncEngine(engine), served_model_name="tiny-vl",
        allowed_media_domains=("127.0.0.1",), media_fetch_timeout=1.0,
    )  # fmt: skip
    server.urls, server.decoded, server.ref, server.chats = urls, decoded, ref, chats
    server.media, server.engine = media, engine
    yield server
    server.stop()
    media.shutdown()


class _MediaServer(http.server.ThreadingHTTPServer):
    """Images over http on 127.0.0.1: /cat.png, and a redirect, a huge Content-Length,
    a slow answer and a 404."""

    def __init__(self, png: bytes) -> None:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/cat.png":
                    self._send(200, {"Content-Length": str(len(png))}, png)
                elif self.path == "/redirect":
                    self._send(302, {"Location": "/cat.png", "Content-Length": "0"}, b"")
                elif self.path == "/huge":
                    self._send(200, {"Content-Length": str(1 << 40)}, b"")
                elif self.path == "/slow":
                    time.sleep(3)
                    self._send(200, {"Content-Length": str(len(png))}, png)
                else:
                    self._send(404, {"Content-Length": "0"}, b"")

            def _send(self, code: int, headers: dict, body: bytes) -> None:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # quiet
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.daemon_threads = True
        threading.Thread(target=outer.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


def test_offline_chat_matches_transformers(tiny_vl, served):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "w1 w2 "}, {"type": "image"},
                                         {"type": "text", "text": " w3"}]}]  # fmt: skip
    inputs = tiny_vl.processor.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
        images=[served.decoded["WEBP"]],
    )  # fmt: skip
    with torch.no_grad():
        out = tiny_vl.hf.generate(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
            pixel_values=inputs["pixel_values"], token_type_ids=inputs["token_type_ids"],
            max_new_tokens=6, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    ref = served.ref[2]  # the WebP chat
    assert list(ref.prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert list(ref.outputs[0].token_ids) == out[0, inputs["input_ids"].shape[1] :].tolist()


def test_openai_client_image_chat_equals_offline(served):
    client = openai.OpenAI(base_url=served.http + "/v1", api_key="x", max_retries=0)
    # the offline PIL part goes as the PNG data URL of the same pixels
    png = {"type": "image_url", "image_url": {"url": served.urls["PNG"]}}
    for chat, ref in zip(served.chats, served.ref, strict=True):
        parts = [png if p["type"] == "image" else p for p in chat[0]["content"]]
        chat = [{"role": "user", "content": parts}]
        reply = client.chat.completions.create(
            model="tiny-vl", messages=chat, max_tokens=6, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert reply.choices[0].message.content == ref.outputs[0].text
        assert reply.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert len({r.outputs[0].text for r in served.ref}) > 1  # the image changes the reply
    # the PNG again, fetched over http from an allowed host
    fetched = [{"type": "image_url", "image_url": {"url": served.media.url("/cat.png")}}]
    reply = client.chat.completions.create(
        model="tiny-vl", messages=_chat(fetched), max_tokens=6, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].message.content == served.ref[0].outputs[0].text


def test_bad_images_are_refused_with_400(served, caplog):
    client = openai.OpenAI(base_url=served.http + "/v1", api_key="x", max_retries=0)
    png = _encode(IMAGES["PNG"], "PNG")
    gif = _encode(IMAGES["PNG"], "GIF")
    cases = [
        (_data_url(b"\x89PNG not really an image" * 4), "not a valid"),
        (_data_url(png[: len(png) // 2]), "truncated"),
        (_data_url(_png_claiming(0, 0)), "image: "),  # Pillow refuses it at the header
        (_data_url(_png_claiming(8000, 8000)), "more than the limit"),  # a bomb's header
        (_data_url(_png_claiming(60000, 60000)), "more than the limit"),  # past Pillow's own
        (_data_url(gif, "image/png"), "not a valid PNG/JPEG/WEBP"),
        (_data_url(gif, "image/gif"), "only data:image"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("https://example.com/cat.png", "example.com is not one of the allowed media"),
        (served.media.url("/redirect"), "HTTP 302 (redirects are not followed)"),
        (served.media.url("/huge"), "larger than"),
        (served.media.url("/slow"), "could not fetch from 127.0.0.1"),
        (served.media.url("/missing"), "HTTP 404"),
    ]
    with caplog.at_level(logging.DEBUG, logger="jaxpaged"):
        for url, why in cases:
            with pytest.raises(openai.BadRequestError, match=re.escape(why)):
                client.chat.completions.create(
                    model="tiny-vl", max_tokens=2,
                    messages=_chat([{"type": "image_url", "image_url": {"url": url}}]),
                )  # fmt: skip
        three = [{"type": "image_url", "image_url": {"url": served.urls["PNG"]}}] * 3
        with pytest.raises(openai.BadRequestError, match="more than the limit of 2"):
            client.chat.completions.create(model="tiny-vl", max_tokens=2, messages=_chat(three))
        # /tokenize renders no images: refused, not dropped
        r = httpx.post(served.http + "/tokenize", json={"messages": _chat(three[:1])})
        assert r.status_code == 400 and "chat/completions only" in r.text
    payload = served.urls["PNG"].split(",", 1)[1]
    assert (
        payload[40:80] not in caplog.text and base64.b64encode(png[:30]).decode() not in caplog.text
    )


def test_responses_and_messages_images_equal_chat(served):
    """The Responses API's input_image parts and Anthropic's image blocks take the chat
    path: the same text and prompt tokens as /v1/chat/completions for the same turn."""
    client = openai.OpenAI(base_url=served.http + "/v1", api_key="x", max_retries=0)
    url = served.urls["WEBP"]
    chat = client.chat.completions.create(
        model="tiny-vl", max_tokens=6, temperature=0.0,
        messages=_chat([{"type": "image_url", "image_url": {"url": url}}]),
    )  # fmt: skip
    reply = client.responses.create(
        model="tiny-vl", max_output_tokens=6, temperature=0.0, store=False,
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "w1 w2 "}, {"type": "input_image", "image_url": url},
            {"type": "input_text", "text": " w3"}]}],
    )  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content
    assert (
        reply.usage.input_tokens == chat.usage.prompt_tokens == len(served.ref[2].prompt_token_ids)
    )
    with pytest.raises(openai.BadRequestError, match="not a valid"):
        client.responses.create(
            model="tiny-vl", max_output_tokens=2, store=False,
            input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": _data_url(b"not an image")}]}],
        )  # fmt: skip

    b64 = served.urls["WEBP"].split(",", 1)[1]
    message = anthropic.Anthropic(base_url=served.http, api_key="x", max_retries=0).messages.create(
        model="tiny-vl", max_tokens=6, extra_body={"temperature": 0.0},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "w1 w2 "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/webp", "data": b64}},
            {"type": "text", "text": " w3"}]}],
    )  # fmt: skip
    assert message.content[0].text == chat.choices[0].message.content
    usage = message.usage  # Anthropic leaves the prefix cache's tokens out of input_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_grpc_chat_image_bytes_equal_chat(served):
    """gRPC chat messages carry image bytes (placed before the text): the same text as the
    chat API's image-then-text message; bad bytes are INVALID_ARGUMENT."""
    import grpc

    from jaxpaged.serving import generation_pb2 as pb
    from jaxpaged.serving import generation_pb2_grpc as pb_grpc

    client = openai.OpenAI(base_url=served.http + "/v1", api_key="x", max_retries=0)
    url = served.urls["JPEG"]
    chat = client.chat.completions.create(
        model="tiny-vl", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "w1 w2"}]}],
    )  # fmt: skip
    data = base64.b64decode(url.split(",", 1)[1])

    def request(images: list[bytes]) -> pb.GenerateRequest:
        message = pb.ChatMessage(role="user", content="w1 w2", images=images)
        return pb.GenerateRequest(
            chat=pb.Chat(messages=[message]),
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        )

    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        msgs = list(stub.Generate(request([data]), timeout=120))
        assert "".join(d.text for m in msgs for d in m.outputs) == chat.choices[0].message.content
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([b"not an image"]), timeout=120))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid" in e.value.details()


def test_metrics_expose_the_encoder_cache(served):
    text = httpx.get(served.http + "/metrics", timeout=10).text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith(("vllm:mm_cache", "jaxpaged:mm_"))
    }
    stats = served.engine.get_stats()  # no request runs meanwhile: the same counts
    assert values["vllm:mm_cache_queries_total"] == stats.mm_cache_queries
    # the offline chats' three distinct images (the fourth chat resends two) were encoded
    assert stats.mm_cache_queries - stats.mm_cache_hits == 3
    assert values["vllm:mm_cache_hits_total"] == stats.mm_cache_hits
    assert values["jaxpaged:mm_cache_evictions_total"] == stats.mm_cache_evictions
    assert values["jaxpaged:mm_encoder_seconds_total"] == pytest.approx(stats.mm_encoder_seconds)
    assert stats.mm_encoder_seconds > 0
