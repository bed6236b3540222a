"""`dgpp generate` and `dgpp chat`: the engine from the command line, streaming as it decodes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from dgpp.appliance.commands.engine_options import engine_knobs, sampling_kwargs
from dgpp.appliance.offline import LLM
from dgpp.engine import SamplingParams
from dgpp.engine.errors import InvalidRequestError


def stream(llm: LLM, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Yield text deltas of one request as the engine produces them."""
    engine = llm.engine
    request = engine.add_request(prompt, params)
    while True:
        for output in engine.step():
            if output.request_id != request.request_id:
                continue
            if output.text_delta:
                yield output.text_delta
            if output.finished:
                return


def run_generate(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    llm = LLM(args.model or "default", **engine_knobs(args))
    params = SamplingParams(**sampling_kwargs(args))
    prompt = " ".join(args.prompt) if args.prompt else sys.stdin.read()
    if args.chat_template:
        prompt = llm.render_chat([{"role": "user", "content": prompt}])
    for delta in stream(llm, prompt, params):
        out.write(delta)
        out.flush()
    out.write("\n")
    return 0


def run_chat(args: argparse.Namespace, inp: TextIO | None = None, out: TextIO | None = None) -> int:
    """A conversation on the terminal; `/reset` starts over, `/exit` or end of input leaves."""
    inp, out = inp or sys.stdin, out or sys.stdout
    llm = LLM(args.model or "default", **engine_knobs(args))
    params = SamplingParams(**sampling_kwargs(args))
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = inp.isatty()
    while True:
        if interactive:
            out.write("you> ")
            out.flush()
        line = inp.readline()
        if not line:
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return 0
        if text == "/reset":
            del messages[int(bool(args.system)) :]
            continue
        messages.append({"role": "user", "content": text})
        try:
            prompt = llm.render_chat(messages)
            if interactive:
                out.write("assistant> ")
            reply = ""
            for delta in stream(llm, prompt, params):
                reply += delta
                out.write(delta)
                out.flush()
        except InvalidRequestError as err:
            messages.pop()
            out.write(f"error: {err.message}\n")
            continue
        out.write("\n")
        messages.append({"role": "assistant", "content": reply})
