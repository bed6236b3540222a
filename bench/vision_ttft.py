"""Images on this CPU: vision-encoder time and time to first token for a 1-megapixel screenshot
at two image-quality settings, dgpp beside transformers on the same random weights.

    .venv/bin/python bench/vision_ttft.py [--repeats 3] [--threads 2] [--size 1280x800]
        [--qualities 1048576,262144]

The checkpoint is Qwen3-VL-shaped, written once under ~/.cache/dgpp-bench/: Qwen3-VL-2B's
vision tower as released (24 blocks, width 1024, 16-pixel patches merged 2x2, DeepStack at
blocks 5, 11 and 17) before a small Qwen3 text model (SmolLM2-135M's widths, 30 layers) so the
image's share of the time shows; float32, random weights, the SmolLM2 tokenizer with the vision
markers added.

dgpp: the server's own path (`ServerImages`: PNG decode, resize by the checkpoint's processor,
placeholder widening) then `LLMEngine` steps until the first token; its encoder time is the
engine's `vision.encoder_seconds`. transformers: its image processor, then one forward of
`Qwen3VLForConditionalGeneration` over the prompt (the prefill that yields the first token);
its encoder time is `model.visual` on the same pixels. Each quality is `max_pixels` (the
knob's, per request): about 1024 and 256 vision tokens. Medians of `--repeats`, after one
warm-up of each.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH_CACHE = Path.home() / ".cache" / "dgpp-bench"
VISION = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [5, 11, 17],
}
TEXT = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 100000.0,
        "mrope_section": [12, 10, 10],
        "mrope_interleaved": True,
    },
}
PROCESSOR = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
QUESTION = "Which button closes this dialog? Answer with its bbox_2d."


def checkpoint() -> Path:
    out = BENCH_CACHE / "qwen3-vl-bench"
    if (out / "preprocessor_config.json").is_file():
        return out
    import transformers

    from dgpp.appliance.models.default import install_default

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helpers
    from tests.engine.vision.vl_helpers import VISION_TOKENS, VL_TEMPLATE

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(install_default()))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_TEMPLATE  # the tests' Qwen-VL-style template
    start, image, end = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = {**TEXT, "vocab_size": len(tokenizer) + 8}
    vision = {**VISION, "out_hidden_size": TEXT["hidden_size"]}
    config = transformers.Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return out


def screenshot(width: int, height: int) -> bytes:
    """A synthetic UI screenshot: panels, text-like stripes, a dialog with buttons."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (236, 238, 241))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, 40), fill=(40, 44, 52))
    for row in range(60, height - 20, 22):
        draw.rectangle((20, row, 20 + (row * 37) % (width // 2), row + 10), fill=(120, 124, 130))
    box = (width // 4, height // 3, 3 * width // 4, 2 * height // 3)
    draw.rectangle(box, fill=(255, 255, 255), outline=(0, 0, 0), width=2)
    for index, label in enumerate(("OK", "Cancel")):
        left = box[2] - 220 + index * 110
        draw.rectangle((left, box[3] - 60, left + 90, box[3] - 20), fill=(30, 110, 220))
        draw.text((left + 25, box[3] - 48), label, fill=(255, 255, 255))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def dgpp_run(path: Path, png: bytes, max_pixels: int, threads: int) -> dict[str, float]:
    from dgpp.engine.configuration.engine_config import EngineConfig
    from dgpp.engine.engine import LLMEngine
    from dgpp.engine.planning.resolved import resolve
    from dgpp.engine.sampling.sampling_params import SamplingParams
    from dgpp.engine.server.chat.image_inputs import ServerImages
    from dgpp.engine.server.chat.render import normalise, probe_template, render
    from dgpp.engine.server.core.config import ServerConfig
    from dgpp.engine.server.openai.protocol import ChatMessage

    config = EngineConfig(
        model=str(path), num_threads=threads, prefix_cache=False, max_model_len=4096
    )
    engine = LLMEngine(resolve(config, path))
    images = ServerImages(path, engine.model_config)
    traits = probe_template(engine.tokenizer)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [ChatMessage(role="user", content=content)]
    server = ServerConfig()
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def once() -> tuple[float, float, int]:
        vision = engine.runner.vision
        assert vision is not None
        vision.cache.clear()  # every run encodes the image
        spent = vision.encoder_seconds
        started = time.perf_counter()
        urls: list[str] = []
        rendered = normalise(messages, traits, urls)
        prepared = images.prepare(urls, server, {"max_pixels": max_pixels})
        prompt = images.expand(render(engine.tokenizer, rendered, None, {}, True), prepared)
        request = engine.add_request(prompt, params)
        while not request.output_token_ids:
            engine.step()
        ttft = time.perf_counter() - started
        while engine.has_unfinished():
            engine.step()
        return ttft, vision.encoder_seconds - spent, sum(i.span.tokens for i in prompt.images)

    once()
    runs = [once() for _ in range(ARGS.repeats)]
    return {
        "ttft_s": statistics.median(r[0] for r in runs),
        "encoder_s": statistics.median(r[1] for r in runs),
        "vision_tokens": runs[0][2],
    }


def transformers_run(path: Path, png: bytes, max_pixels: int) -> dict[str, float]:
    import transformers
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in PROCESSOR.items() if k != "size"})
    size = {"shortest_edge": 65536, "longest_edge": max_pixels}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image_token = model.config.image_token_id

    def once() -> tuple[float, float]:
        started = time.perf_counter()
        image = Image.open(io.BytesIO(png)).convert("RGB")
        inputs = processor(images=[image], size=size, return_tensors="pt")
        grid = inputs["image_grid_thw"]
        ids: list[int] = []
        for token in tokenizer(text, add_special_tokens=False).input_ids:
            ids += [token] * (int(grid.prod()) // 4 if token == image_token else 1)
        types = torch.tensor([[int(t == image_token) for t in ids]])
        with torch.inference_mode():
            logits = model(
                input_ids=torch.tensor([ids]),
                pixel_values=inputs["pixel_values"],
                image_grid_thw=grid,
                mm_token_type_ids=types,
                logits_to_keep=1,
            ).logits
            int(logits[0, -1].argmax())
            ttft = time.perf_counter() - started
            encoder_started = time.perf_counter()
            model.model.visual(inputs["pixel_values"], grid_thw=grid)
            encoder = time.perf_counter() - encoder_started
        return ttft, encoder

    once()
    runs = [once() for _ in range(ARGS.repeats)]
    return {
        "ttft_s": statistics.median(r[0] for r in runs),
        "encoder_s": statistics.median(r[1] for r in runs),
    }


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    path = checkpoint()
    width, height = (int(v) for v in ARGS.size.split("x"))
    png = screenshot(width, height)
    print(f"screenshot {width}x{height} ({width * height / 1e6:.2f} MP), {ARGS.threads} threads")
    print("| max_pixels | vision tokens | dgpp encoder s | hf encoder s | ratio | dgpp TTFT s | "
          "hf TTFT s | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for quality in (int(q) for q in ARGS.qualities.split(",")):
        ours = dgpp_run(path, png, quality, ARGS.threads)
        theirs = transformers_run(path, png, quality)
        print(
            f"| {quality:,} | {ours['vision_tokens']} | {ours['encoder_s']:.2f} | "
            f"{theirs['encoder_s']:.2f} | "
            f"{theirs['encoder_s'] / ours['encoder_s']:.2f}x | {ours['ttft_s']:.2f} | "
            f"{theirs['ttft_s']:.2f} | {theirs['ttft_s'] / ours['ttft_s']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", default="1280x800")
    parser.add_argument("--qualities", default="1048576,262144")
    ARGS = parser.parse_args()
    sys.exit(main())
