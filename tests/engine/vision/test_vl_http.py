"""Images through the HTTP APIs on a tiny Qwen3-VL checkpoint (real SmolLM2 tokenizer with the
vision markers, a Qwen-VL-style template, the image processor's settings): the OpenAI,
Anthropic and Responses SDKs send the same PNG and get transformers' greedy answer; the
quality knob changes the vision tokens as smart_resize says; a repeated screenshot in an
agent's next turn hits the prefix cache; bad images get 400s that name them."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
    smart_resize,
)

from tests.engine.server.harness import RunningServer, running_server, server_settings
from tests.engine.vision.vl_helpers import PROCESSOR, build_vl_checkpoint

QUESTION = "What is in this picture?"
NEW = 8


def _png(width: int = 120, height: int = 90) -> bytes:
    image = Image.new("RGB", (width, height))
    image.putdata(
        [((x * 7) % 256, (y * 5) % 256, (x * y) % 256) for y in range(height) for x in range(width)]
    )
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


PNG = _png()
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def vl_server(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Iterator[RunningServer]:
    checkpoint = build_vl_checkpoint(
        tmp_path_factory.mktemp("qwen3-vl-http"), tokenizer_dir, "Qwen3VLForConditionalGeneration"
    )
    options = {"kv_capacity": 4096, "block_size": 8, "prefix_min_tokens": 0}
    with running_server(checkpoint, ("m",), options) as server:
        yield server


@pytest.fixture(scope="module")
def reference(vl_server: RunningServer) -> str:
    return _reference(vl_server, "Qwen3VLForConditionalGeneration")


def _reference(server: RunningServer, architecture: str) -> str:
    """transformers' greedy answer: its image processor's pixels, the template's prompt with
    the placeholder widened, its model's tokens."""
    import transformers

    checkpoint = Path(server.engine.checkpoint)
    model = (
        getattr(transformers, architecture)
        .from_pretrained(str(checkpoint), dtype=torch.float32)
        .eval()
    )
    tokenizer = server.state.tokenizer
    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in PROCESSOR.items() if k != "size"})
    size = {"shortest_edge": 256, "longest_edge": 4096}
    image = Image.open(io.BytesIO(PNG)).convert("RGB")
    inputs = processor(images=[image], size=size, return_tensors="pt")
    grid = inputs["image_grid_thw"]
    text = tokenizer.apply_chat_template(_messages(), tokenize=False, add_generation_prompt=True)
    image_token = model.config.image_token_id
    ids: list[int] = []
    for token in tokenizer(text, add_special_tokens=False).input_ids:
        ids += [token] * (int(grid.prod()) // 4 if token == image_token else 1)
    sequence = list(ids)
    with torch.inference_mode():
        for _ in range(NEW):
            types = torch.tensor([[int(t == image_token) for t in sequence]])
            logits = model(
                input_ids=torch.tensor([sequence]),
                pixel_values=inputs["pixel_values"],
                image_grid_thw=grid,
                mm_token_type_ids=types,
            ).logits
            sequence.append(int(logits[0, -1].argmax()))
    return tokenizer.decode(sequence[len(ids) :], skip_special_tokens=True)


def test_a_hybrid_qwen3_5_takes_the_image_too(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> None:
    """Qwen3.5 (Gated DeltaNet layers beside gated attention, no DeepStack) through the same
    route: transformers' answer."""
    architecture = "Qwen3_5ForConditionalGeneration"
    checkpoint = build_vl_checkpoint(
        tmp_path_factory.mktemp("qwen3.5-http"), tokenizer_dir, architecture
    )
    with running_server(checkpoint, ("m",), {"kv_capacity": 4096, "block_size": 8}) as server:
        assert _chat(server).choices[0].message.content == _reference(server, architecture)


def _messages() -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}]


def _openai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def _chat(server: RunningServer, **extra: Any) -> Any:
    content = [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": DATA_URL}},
    ]
    return _openai(server).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": content}],
        max_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )


def test_the_three_sdks_send_an_image(vl_server: RunningServer, reference: str) -> None:
    chat = _chat(vl_server)
    assert chat.choices[0].message.content == reference
    with anthropic.Anthropic(base_url=vl_server.url, api_key="x", max_retries=0) as client:
        message = client.messages.create(
            model="m",
            max_tokens=NEW,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": QUESTION},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": DATA_URL.partition(",")[2],
                            },
                        },
                    ],
                }
            ],
            extra_body={"ignore_eos": True, "temperature": 0},
        )
    assert message.content[0].text == reference
    response = _openai(vl_server).responses.create(
        model="m",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": DATA_URL, "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.output_text == reference
    anthropic_prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert chat.usage.prompt_tokens == anthropic_prompt == response.usage.input_tokens


def _tokens(width: int, height: int, low: int, high: int) -> int:
    h, w = smart_resize(height, width, factor=8, min_pixels=low, max_pixels=high)
    return h * w // 64


def test_the_quality_knob_sets_the_vision_tokens(vl_server: RunningServer) -> None:
    text_tokens = _chat(vl_server).usage.prompt_tokens - _tokens(120, 90, 256, 4096)
    low = _chat(vl_server, mm_processor_kwargs={"max_pixels": 1024}).usage.prompt_tokens
    assert low - text_tokens == _tokens(120, 90, 256, 1024) == 12
    with server_settings(vl_server, image_max_pixels=2048):
        capped = _chat(vl_server, mm_processor_kwargs={"max_pixels": 100_000}).usage.prompt_tokens
    assert capped - text_tokens == _tokens(120, 90, 256, 2048)  # the server's bound wins


def test_an_agents_next_turn_hits_the_cache_with_its_screenshot(vl_server: RunningServer) -> None:
    content = [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": DATA_URL}},
    ]
    history: list[dict[str, Any]] = [{"role": "user", "content": content}]
    client = _openai(vl_server)
    first = client.chat.completions.create(model="m", messages=history, max_tokens=4, temperature=0)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And now?"},
    ]
    second = client.chat.completions.create(
        model="m", messages=history, max_tokens=4, temperature=0
    )
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8


def _post(server: RunningServer, content: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_bad_images_get_precise_400s(vl_server: RunningServer) -> None:
    garbage = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    cases = [
        ([_image(garbage)], "image 0: the image could not be decoded"),
        ([{"type": "text", "text": "x"}, _image("data:image/png;base64,@@@")], "not valid base64"),
        ([_image("https://example.invalid/a.png")], "image_url_fetch is off"),
        ([{"type": "input_audio", "input_audio": {}}], "'input_audio' is not supported"),
        ([{"type": "image_url"}], "needs image_url.url"),
    ]
    for content, message in cases:
        response = _post(vl_server, content)
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
    with server_settings(vl_server, max_images_per_request=1):
        response = _post(vl_server, [_image(DATA_URL), _image(DATA_URL)])
    assert response.status_code == 400 and "at most 1" in response.json()["error"]["message"]
    response = _post(vl_server, [_image(DATA_URL)] * 1)
    assert response.status_code == 200


class _Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args: Any) -> None:
        pass


def test_image_urls_are_fetched_when_the_knob_allows(
    vl_server: RunningServer, reference: str
) -> None:
    """A loopback HTTP server holds the PNG: the answer equals the data URL's."""
    host = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{host.server_address[1]}/shot.png"
    try:
        with server_settings(vl_server, image_url_fetch=True):
            content = [{"type": "text", "text": QUESTION}, _image(url)]
            body = {
                "model": "m",
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": content}],
            }
            response = httpx.post(f"{vl_server.url}/v1/chat/completions", json=body, timeout=60)
    finally:
        host.shutdown()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == reference


def test_a_screenshot_in_a_tool_result_counts_its_vision_tokens(vl_server: RunningServer) -> None:
    """Claude Code returns screenshots as image blocks inside tool_result content."""
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": DATA_URL.partition(",")[2]},
    }

    def count(result: list[dict[str, Any]]) -> int:
        body = {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Take a screenshot."},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result}],
                },
            ],
        }
        response = httpx.post(f"{vl_server.url}/v1/messages/count_tokens", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["input_tokens"]

    text = [{"type": "text", "text": "done"}]
    assert count([*text, image]) - count(text) == _tokens(120, 90, 256, 4096) + 2  # + markers


BOX_SCHEMA = {
    "type": "object",
    "properties": {
        "bbox_2d": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 1000},
            "minItems": 4,
            "maxItems": 4,
        }
    },
    "required": ["bbox_2d"],
    "additionalProperties": False,
}


def test_a_box_comes_back_in_the_original_images_pixels(vl_server: RunningServer) -> None:
    """The answer is held to a Qwen-style box (a JSON schema); the model's 0-1000 numbers
    come back as pixels of the 120x90 PNG, unless the request asks for the model's own."""
    import json

    def box(**extra: Any) -> list[int]:
        answer = _chat(
            vl_server,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "b", "schema": BOX_SCHEMA},
            },
            **extra,
        )
        return json.loads(answer.choices[0].message.content)["bbox_2d"]

    raw = box(image_coordinates="model", max_tokens=40)
    mapped = box(max_tokens=40)
    assert mapped == [
        round(v * size / 1000) for v, size in zip(raw, (120, 90, 120, 90), strict=True)
    ]
    assert raw != mapped
    with server_settings(vl_server, image_coordinates="model"):
        assert box(max_tokens=40) == raw


def test_metrics_count_images_and_the_encoders_work(vl_server: RunningServer) -> None:
    """The same screenshot twice without the prefix cache: encoded once, then an encoder-cache
    hit; both requests' images and vision tokens counted."""
    before = httpx.get(f"{vl_server.url}/v1/metrics", timeout=30).json()["vision"]
    for _ in range(2):
        assert _chat(vl_server, prefix_cache=False).usage.prompt_tokens
    after = httpx.get(f"{vl_server.url}/v1/metrics", timeout=30).json()["vision"]
    assert after["images"] - before["images"] == 2
    assert after["tokens"] - before["tokens"] == 2 * _tokens(120, 90, 256, 4096)
    assert after["encoder_cache_hits"] - before["encoder_cache_hits"] >= 1
    assert after["encoder_seconds"] > 0 and after["encoded"] >= 1
    exposition = httpx.get(f"{vl_server.url}/metrics", timeout=30).text
    assert f'dgpp:vision_images_total{{model_name="m"}} {float(after["images"])}' in exposition
