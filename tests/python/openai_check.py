#!/usr/bin/env python3
"""Drives an OpenAI-compatible server (kvmesh sim, later kvmesh serve) with the official
`openai` Python client: streaming and non-streaming chat and completions, and checks `usage`.

Usage: openai_check.py BASE_URL MODEL [--tokenize-url URL] [--retrieve]
  BASE_URL      e.g. http://127.0.0.1:8100/v1
  --tokenize-url  a vLLM-style /tokenize endpoint to check prompt_tokens exactly
  --retrieve    also check models.retrieve (GET /v1/models/{model}: the router serves it,
                vLLM and the simulator do not)

Exits 0 and prints one JSON line on success; prints the failure and exits 1 otherwise.
Only loopback addresses are contacted; every call has a timeout.
"""
import argparse
import json
import sys
import urllib.request

import openai


def tokenize(url, payload):
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["count"]


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("model")
    ap.add_argument("--tokenize-url")
    ap.add_argument("--retrieve", action="store_true")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="unused", timeout=60, max_retries=0)
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three prime numbers."},
    ]
    report = {}

    # Non-streaming chat.
    r = client.chat.completions.create(model=a.model, messages=messages, max_tokens=7)
    check(r.object == "chat.completion", f"object {r.object}")
    check(r.choices[0].message.role == "assistant", "role")
    check(isinstance(r.choices[0].message.content, str) and r.choices[0].message.content, "content")
    check(r.choices[0].finish_reason in ("length", "stop"), f"finish {r.choices[0].finish_reason}")
    check(r.usage.completion_tokens == 7, f"chat completion_tokens {r.usage.completion_tokens}")
    check(r.usage.total_tokens == r.usage.prompt_tokens + 7, "chat total_tokens")
    if a.tokenize_url:
        n = tokenize(a.tokenize_url, {"model": a.model, "messages": messages})
        check(r.usage.prompt_tokens == n, f"chat prompt_tokens {r.usage.prompt_tokens} != {n}")
    report["chat_prompt_tokens"] = r.usage.prompt_tokens

    # Streaming chat with usage.
    stream = client.chat.completions.create(
        model=a.model, messages=messages, max_tokens=9, stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                text += c.delta.content
            if c.finish_reason:
                finish = c.finish_reason
    check(text, "streamed chat text")
    check(finish in ("length", "stop"), f"streamed finish {finish}")
    check(usage is not None, "streamed chat usage chunk")
    check(usage.completion_tokens == 9, f"streamed completion_tokens {usage.completion_tokens}")
    check(usage.prompt_tokens == report["chat_prompt_tokens"], "streamed prompt_tokens")
    check(usage.total_tokens == usage.prompt_tokens + 9, "streamed total")

    # Non-streaming completion, text prompt.
    prompt = "The capital of France is"
    r = client.completions.create(model=a.model, prompt=prompt, max_tokens=5)
    check(r.object == "text_completion", f"object {r.object}")
    check(r.usage.completion_tokens == 5, f"completion_tokens {r.usage.completion_tokens}")
    if a.tokenize_url:
        n = tokenize(a.tokenize_url, {"model": a.model, "prompt": prompt})
        check(r.usage.prompt_tokens == n, f"completion prompt_tokens {r.usage.prompt_tokens} != {n}")
    check(r.choices[0].text, "completion text")

    # Completion with a token-id prompt.
    r = client.completions.create(model=a.model, prompt=[9707, 11, 1879, 0], max_tokens=3)
    check(r.usage.prompt_tokens == 4, f"token prompt_tokens {r.usage.prompt_tokens}")
    check(r.usage.completion_tokens == 3, "token completion_tokens")

    # Streaming completion with usage.
    stream = client.completions.create(
        model=a.model, prompt=prompt, max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text or ""
    check(text, "streamed completion text")
    check(usage is not None and usage.completion_tokens == 6, f"streamed completion usage {usage}")

    # Errors come back as OpenAI errors the client understands.
    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)
        check(False, "unknown model accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404, "404 for unknown model")
    try:
        client.chat.completions.create(model=a.model, messages=messages, max_tokens=0)
        check(False, "max_tokens=0 accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, "400 for max_tokens=0")

    # /v1/models lists the model.
    ids = [m.id for m in client.models.list()]
    check(a.model in ids, f"models {ids}")
    # ...and gives one model's card (models.retrieve); an unknown model's is a 404.
    if a.retrieve:
        card = client.models.retrieve(a.model)
        check(card.id == a.model, f"models.retrieve gave {card.id}")
        try:
            client.models.retrieve("no-such-model")
            check(False, "an unknown model's card retrieved")
        except openai.NotFoundError as e:
            check(e.status_code == 404, "404 for an unknown model's card")
    report["ok"] = True
    print(json.dumps(report))


if __name__ == "__main__":
    main()
