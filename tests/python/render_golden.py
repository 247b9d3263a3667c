#!/usr/bin/env python3
"""Golden vectors for crates/kvmesh-tokenize, produced by the Python reference implementations.

  render_golden.py render --config tokenizer_config.json [--tokenizer-dir DIR]
      Renders a fixed set of chat conversations (Qwen3's template from the config, plus small
      custom templates that exercise the Jinja environment) the way transformers'
      apply_chat_template does, on messages normalized the way vLLM prepares them, and prints
      {"cases": [{..request.., "rendered": str} | {..request.., "error": str}]} as JSON.
      With --tokenizer-dir and the `transformers` package importable, every Qwen3 case is also
      rendered by transformers itself and must agree with this script (a check of the script).

  render_golden.py encode --tokenizer tokenizer.json
      Reads {"texts": [str], "add_special_tokens": bool} on stdin and prints
      {"ids": [[int]], "decoded": [str], "decoded_skip_special": [str]} computed by the
      Python `tokenizers` package (the Rust bindings' reference implementation).

Needs jinja2 (render) and tokenizers (encode): see tests/python/requirements.txt.
"""
import argparse
import json
import random
import sys
from datetime import datetime

# ---------------------------------------------------------------------------------------------
# The transformers chat-template environment (transformers 5.x chat_template_utils).
# ---------------------------------------------------------------------------------------------


def make_env():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class AssistantTracker(Extension):
        # {% generation %} ... {% endgeneration %}: renders its body (mask tracking not used).
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(
                self.call_method("_generation_support"), [], [], body
            ).set_lineno(lineno)

        def _generation_support(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


SPECIAL_TOKEN_NAMES = [
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
]
RESERVED = {"messages", "tools", "documents", "add_generation_prompt"}
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def special_tokens(config):
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        v = config.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out


# ---------------------------------------------------------------------------------------------
# Message normalization: vLLM parse_chat_messages ("string" content format) and
# _postprocess_messages, then transformers 5 apply_chat_template (None keys dropped, reasoning
# aliases). Mirrors crates/kvmesh-tokenize/src/messages.rs.
# ---------------------------------------------------------------------------------------------


class RequestError(Exception):
    pass


def part_text(part):
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise RequestError("a content part must be an object")
    kind = part.get("type")
    if kind in ("text", "input_text", None):
        field = "text"
    elif kind == "refusal":
        field = "refusal"
    else:
        raise RequestError(f"content part type '{kind}' is not supported by this text-only model")
    text = part.get(field)
    if not isinstance(text, str):
        raise RequestError(f"a {kind or 'text'} content part needs a string '{field}'")
    return text


def flatten_content(content):
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part_text(p) for p in content)
    raise RequestError("content must be a string or a list of content parts")


def truthy(v):
    return bool(v)


def convert_tool_calls(calls):
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            out.append(call)
            continue
        args = function.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except ValueError as e:
                raise RequestError(f"arguments is not valid JSON: {e}")
        elif not truthy(args):
            args = {}
        function = dict(function)
        function["arguments"] = args
        call = dict(call)
        call["function"] = function
        out.append(call)
    return out


def normalize(msg):
    if not isinstance(msg, dict):
        raise RequestError("message must be an object")
    role = msg.get("role")
    if not isinstance(role, str):
        raise RequestError("message has no string 'role'")
    content = flatten_content(msg.get("content"))
    out = {}
    for k, v in msg.items():
        if k == "content":
            out[k] = content
        elif v is None:
            continue
        elif k == "tool_calls" and role == "assistant":
            out[k] = convert_tool_calls(v)
        else:
            out[k] = v
    if "content" not in msg:
        items = list(out.items())
        at = next((i + 1 for i, (k, _) in enumerate(items) if k == "role"), 0)
        items.insert(at, ("content", content))
        out = dict(items)
    reasoning = next((out[k] for k in REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def select_template(templates, has_tools):
    if has_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise RequestError("This model has multiple chat templates with no default specified!")


def render_case(env, templates, specials, case):
    """transformers apply_chat_template(tokenize=False) on vLLM-normalized messages."""
    tools = case.get("tools")
    source = select_template(templates, tools is not None)
    messages = case["messages"]
    agp = case.get("add_generation_prompt", True)
    cfm = case.get("continue_final_message", False)
    if not messages:
        raise RequestError("Cannot apply chat template to an empty conversation.")
    if cfm and agp:
        raise RequestError("continue_final_message and add_generation_prompt are not compatible.")
    chat = [normalize(m) for m in messages]
    final_message = None
    if cfm:
        if "content" not in source:
            raise RequestError("continue_final_message: content is not a field of the template")
        final_message = chat[-1]["content"]
        chat[-1]["content"] = chat[-1]["content"] + CONTINUE_TAG
    kwargs = dict(specials)
    for k, v in (case.get("template_kwargs") or {}).items():
        if k not in RESERVED:
            kwargs[k] = v
    template = env.from_string(source)
    rendered = template.render(
        messages=chat, tools=tools, documents=None, add_generation_prompt=agp, **kwargs
    )
    if cfm:
        if final_message.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
            raise RequestError("continue_final_message: the final message does not appear")
        at = rendered.rindex(CONTINUE_TAG.strip())
        if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
            rendered = rendered[:at]
        else:
            rendered = rendered[:at].rstrip()
    return rendered


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city. Returns °C, \"quoted\" <b>html</b> & more.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 東京 or Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7, "default": 1.0},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.\nReturns a list of results.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": []},
    },
}

SYS = {"role": "system", "content": "You are a helpful assistant."}


def qwen_cases():
    u = lambda c: {"role": "user", "content": c}
    a = lambda c, **kw: {"role": "assistant", "content": c, **kw}
    call = lambda name, args, **kw: {
        "id": "call_" + name, "type": "function", "function": {"name": name, "arguments": args}, **kw
    }
    tool = lambda c, **kw: {"role": "tool", "content": c, **kw}
    return [
        {"name": "system_user", "messages": [SYS, u("Hello! What is 2+2?")]},
        {"name": "user_only_no_generation_prompt", "messages": [u("Hi")],
         "add_generation_prompt": False},
        {"name": "multi_turn", "messages": [
            SYS, u("Name a prime."), a("7 is prime."), u("Another one?"), a("11."),
            u("Thanks. Now explain why 9 is not prime.")]},
        {"name": "reasoning_content_history_and_last", "messages": [
            u("First question"),
            a("First answer", reasoning_content="I should think about the first.\n"),
            u("Second question"),
            a("Second answer", reasoning_content="\nThinking about the second.\n\n")],
         "add_generation_prompt": False},
        {"name": "reasoning_alias_fields", "messages": [
            u("q1"), a("a1", reasoning="via reasoning"), u("q2"),
            a("a2", thinking="via thinking", reasoning_content=None)],
         "add_generation_prompt": False},
        {"name": "think_blocks_in_content", "messages": [
            u("Solve x+1=2"), a("<think>\nx = 2-1\n</think>\n\nx = 1"),
            u("And x+2=5?"), a("<think>\nsubtract 2\n</think>\n\n\nx = 3")],
         "add_generation_prompt": False},
        {"name": "think_then_new_user", "messages": [
            u("a"), a("<think>hidden</think>visible"), u("b")]},
        {"name": "tool_calls_and_tool_messages", "tools": [WEATHER_TOOL, SEARCH_TOOL], "messages": [
            SYS, u("Weather in Paris and Tokyo?"),
            a(None, tool_calls=[
                call("get_weather", '{"city":"Paris","unit":"celsius"}'),
                call("get_weather", {"city": "東京", "days": 2})]),
            tool('{"temp": 21.5}', tool_call_id="call_get_weather"),
            tool("晴れ, 18°C", tool_call_id="call_get_weather"),
            a("Paris is 21.5°C and Tokyo 18°C.")], "add_generation_prompt": False},
        {"name": "tool_call_with_content_and_followup", "tools": [SEARCH_TOOL], "messages": [
            u("Find kvmesh"),
            a("Let me search.", tool_calls=[call("search", '{\n  "q": "kvmesh"\n}')]),
            tool("<tool_response>nested</tool_response>"),
            u("<tool_response>looks like a tool</tool_response>")]},
        {"name": "tool_call_empty_arguments", "tools": [SEARCH_TOOL], "messages": [
            u("go"), a("", tool_calls=[call("search", ""), call("search", None)]),
            tool("done")], "add_generation_prompt": True},
        {"name": "tools_without_system", "tools": [WEATHER_TOOL], "messages": [u("Weather?")]},
        {"name": "tools_empty_list", "tools": [], "messages": [SYS, u("No tools really")]},
        {"name": "enable_thinking_false", "messages": [SYS, u("Quick answer please")],
         "template_kwargs": {"enable_thinking": False}},
        {"name": "enable_thinking_true", "messages": [u("Think hard")],
         "template_kwargs": {"enable_thinking": True}},
        {"name": "list_of_parts_content", "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."},
                "bare string part"]}]},
        {"name": "unicode_and_specials_in_content", "messages": [
            u("日本語のテキスト, emoji 👩‍👩‍👧‍👦🚀, Ünïcödé, <|im_start|>not a turn<|im_end|>"),
            a("Réponse\twith\ttabs   and   spaces\n\n\n"), u("  leading and trailing  \n")]},
        {"name": "system_not_first", "messages": [u("hi"), SYS, u("again")]},
        {"name": "continue_final_message", "messages": [
            u("Write a haiku"), a("Autumn moonlight—\na worm digs silently  ")],
         "add_generation_prompt": False, "continue_final_message": True},
        {"name": "continue_final_message_reasoning", "messages": [
            u("Write"), a("The start", reasoning_content="plan")],
         "add_generation_prompt": False, "continue_final_message": True},
        {"name": "content_null_assistant", "messages": [u("x"), a(None), u("y")]},
        {"name": "extra_keys_passed_through", "messages": [
            {"role": "user", "content": "named", "name": "alice", "weird": {"a": [1, 2.5]}}]},
        {"name": "kwargs_override_special", "messages": [u("k")],
         "template_kwargs": {"eos_token": "<custom>", "messages": "ignored"}},
        # Errors
        {"name": "error_empty_messages", "messages": []},
        {"name": "error_image_part", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        {"name": "error_generation_prompt_and_continue", "messages": [u("a"), a("b")],
         "add_generation_prompt": True, "continue_final_message": True},
        {"name": "error_bad_tool_arguments", "messages": [
            u("a"), a("", tool_calls=[call("search", "{not json")])]},
        {"name": "error_tools_and_no_messages_index", "tools": [SEARCH_TOOL],
         "messages": [{"role": "user", "content": 5}]},
    ]


ENV_DATA = {
    "a": 1, "b": [1, 2.5, 1e16, 1.5e-07, -0.0, 100.0, True, False, None],
    "text": "quote \" backslash \\ newline \n tab \t ctrl \u0001 del \u007f <b>&amp;</b> 'single' é 😀",
    "nested": {"empty_list": [], "empty_dict": {}, "deep": {"x": [{"y": None}]}},
    "zebra": 0, "Alpha": 0,
}

ENV_TEMPLATES = [
    ("tojson_default", "{{ data | tojson }}"),
    ("tojson_indent", "{{ data | tojson(indent=2) }}\n{{ data.nested | tojson(indent='\t') }}"),
    ("tojson_sort_ascii", "{{ data | tojson(sort_keys=true, ensure_ascii=true) }}"),
    ("tojson_separators", "{{ data | tojson(separators=(',', ':')) }}|{{ [] | tojson(indent=2) }}"),
    ("tojson_messages", "{{ messages | tojson }}"),
    ("python_str",
     "{{ none }}|{{ true }}|{{ false }}|{{ 1.0 }}|{{ 2.50 }}|{{ 1e20 }}|{{ 3 / 2 }}|{{ 4 / 2 }}"
     "|{{ 7 // 2 }}|{{ [1, 'a', none, true, 1.5] }}|{{ {'a': 1, 'b': [none, \"it's\"]} }}"
     "|{{ messages[0] }}|{{ none | string }}|{{ data.b }}|{{ data.missing }}|{{ 10 % 3 }}"),
    ("string_methods",
     "{% set c = messages[0].content %}"
     "{{ c.split('</think>')[-1].lstrip('\\n') }}|{{ c.split('</think>')[0].split('<think>')[-1] }}"
     "|{{ c.strip() }}|{{ c.rstrip() }}|{{ c.lstrip() }}|{{ c.strip('\\n ') }}|{{ c.upper() }}"
     "|{{ c.lower() }}|{{ c.replace('a', 'A') }}|{{ c.startswith(('x', '  ')) }}"
     "|{{ c.endswith('z') }}|{{ c.find('é') }}|{{ c.rfind('a') }}|{{ c.rsplit(' ', 1) }}"
     "|{{ c.splitlines() }}|{{ c.count('a') }}|{{ c.split() }}|{{ c.split(' ', 2) }}"
     "|{{ '-'.join(['x', 'y']) }}|{{ c.title() }}|{{ 'abc'.capitalize() }}|{{ c | length }}"
     "|{{ c[2:9] }}|{{ c[::-1] }}|{{ c | trim }}|{{ 'ab' in c }}|{{ 'zz' not in c }}"),
    ("control_flow",
     "{%- set ns = namespace(count=0, last='') -%}\n"
     "{%- for m in messages[::-1] %}\n"
     "  {%- if m.role == 'system' %}{% continue %}{% endif %}\n"
     "  {%- set ns.count = ns.count + 1 %}{% set ns.last = m.role %}\n"
     "  {%- if loop.index0 > 3 %}{% break %}{% endif %}\n"
     "[{{ loop.index }}/{{ loop.length }} {{ loop.first }} {{ loop.last }} {{ loop.revindex }} "
     "{{ m.role }}]\n"
     "{%- endfor %}\n"
     "{{ ns.count }} {{ ns.last }}\n"
     "{%- for k, v in data.nested.items() %} {{ k }}={{ v }}{% endfor %}\n"
     "{{ data.get('a') }} {{ data.get('missing', 'dflt') }} {{ data.keys() | list }}\n"
     "{{ messages | selectattr('role', 'equalto', 'user') | list | length }} "
     "{{ messages | map(attribute='role') | join(',') }} {{ (messages | first).role }} "
     "{{ (messages | last).role }} {{ data.missing | default('d') }} "
     "{{ data.a is defined }} {{ data.zz is defined }} {{ none is none }} {{ 'x' is string }} "
     "{{ data is mapping }} {{ 1 is number }} {{ data.b is sequence }}\n"
     "{%- macro show(x, sep='/') %}<{{ x }}{{ sep }}>{% endmacro %}\n"
     "{{ show(1) }}{{ show('a', sep='|') }}{{ 'yes' if data.a else 'no' }}{{ 'x' ~ 'y' }}"),
    ("whitespace",
     "<start>\n"
     "    {% if true %}\n"
     "        indented line\n"
     "    {% endif %}\n"
     "  {# a comment #}\n"
     "{% for m in messages %}\n"
     "  - {{ m.role }}: {{ m.content }}\n"
     "{% endfor %}\n"
     "{%- if true -%}   stripped   {%- endif -%}\n"
     "{{- '  keep  ' -}}\n"
     "    {%+ if true %}plus{% endif %}\n"
     "{% raw %}{{ not rendered }}{% endraw %}\n"
     "<end>\n"),
    ("generation_tag",
     "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
     "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"),
    ("special_token_variables",
     "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ bos_token is defined }}"
     "|{{ eos_token is defined }}|{{ custom }}|{{ add_generation_prompt }}|{{ tools }}"
     "|{{ documents }}"),
    ("raise_exception_alternation",
     "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
     "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
     "{% endif %}{{ m.content }}{% endfor %}"),
    ("raise_exception_no_user",
     "{% set ns = namespace(found=false) %}{% for m in messages %}{% if m.role == 'user' %}"
     "{% set ns.found = true %}{% endif %}{% endfor %}"
     "{% if not ns.found %}{{ raise_exception('No user query found in messages.') }}{% endif %}ok"),
    ("error_undefined_attribute", "{{ messages[0].nope.deeper }}"),
]


def env_cases():
    msgs = [
        {"role": "system", "content": "sys é"},
        {"role": "user", "content": "  abc <think>x</think>\n\nafter é z  "},
        {"role": "assistant", "content": "ans\r\nline2\u2028line3"},
        {"role": "user", "content": "u2"},
    ]
    cases = []
    for name, template in ENV_TEMPLATES:
        m = msgs
        if name == "raise_exception_no_user":
            m = [msgs[0], msgs[2]]
        if name == "string_methods":
            m = [msgs[1]]
        cases.append({
            "name": "env_" + name, "template": template, "messages": m,
            "template_kwargs": {"data": ENV_DATA, "custom": [1, "two", None]},
            "add_generation_prompt": False,
            "error_exact": name.startswith("raise_exception"),
        })
    cases.append({"name": "env_raise_exception_ok_when_alternating",
                  "template": dict(ENV_TEMPLATES)["raise_exception_alternation"],
                  "messages": [msgs[1], msgs[2], msgs[3]], "add_generation_prompt": False})
    return cases


# Random conversations: many seeds of text that stresses the template's string handling.
PIECES = [
    "hello", "world", " ", "  ", "\n", "\n\n", "\t", "<think>", "</think>", "<tool_response>",
    "</tool_response>", "<|im_start|>", "<|im_end|>", "日本", "語", "😀", "🚀", "é", "ß", "\u3000",
    "\u00a0", "{", "}", "\"", "'", "\\", "json", "x", ".", ",", "1.5", "-", "#",
]


def random_text(rng, n):
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, n)))


def random_value(rng, depth=0):
    kind = rng.randint(0, 7 if depth < 2 else 4)
    if kind == 0:
        return rng.choice([0, 1, -7, 123456789, 2**40])
    if kind == 1:
        return rng.choice([0.1, 1.0, -0.0, 1e16, 1.5e-7, 3.14159, 2.5e-5, 1e300])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind in (3, 4):
        return random_text(rng, 6)
    if kind == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {random_text(rng, 3) or "k": random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def random_case(seed):
    rng = random.Random(seed)
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": random_text(rng, 8)})
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.4:
            content = random_text(rng, 12)
            if rng.random() < 0.2:
                content = [{"type": "text", "text": random_text(rng, 5)} for _ in range(rng.randint(1, 3))]
            messages.append({"role": "user", "content": content})
        elif r < 0.8:
            m = {"role": "assistant", "content": random_text(rng, 12) if rng.random() < 0.9 else None}
            if rng.random() < 0.3:
                m["reasoning_content"] = random_text(rng, 8)
            if rng.random() < 0.3:
                args = {random_text(rng, 3) or "a": random_value(rng) for _ in range(rng.randint(0, 3))}
                if rng.random() < 0.5:
                    args = json.dumps(args, separators=rng.choice([(",", ":"), (", ", ": ")]))
                m["tool_calls"] = [{"id": "c", "type": "function",
                                    "function": {"name": random_text(rng, 3), "arguments": args}}]
            messages.append(m)
        else:
            messages.append({"role": "tool", "content": random_text(rng, 10)})
    case = {"name": f"random_{seed}", "messages": messages,
            "add_generation_prompt": rng.random() < 0.7}
    if rng.random() < 0.3:
        case["tools"] = [WEATHER_TOOL] if rng.random() < 0.5 else [
            {"type": "function", "function": {"name": random_text(rng, 3),
                                              "parameters": random_value(rng)}}]
    if rng.random() < 0.3:
        case["template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    return case


def all_cases():
    return qwen_cases() + env_cases() + [random_case(s) for s in range(150)]


def cmd_render(args):
    import jinja2

    with open(args.config, encoding="utf-8") as f:
        config = json.load(f)
    specials = special_tokens(config)
    ct = config.get("chat_template")
    templates = {t["name"]: t["template"] for t in ct} if isinstance(ct, list) else {"default": ct}
    env = make_env()
    hf_tok = None
    if args.tokenizer_dir:
        try:
            from transformers import AutoTokenizer  # optional cross-check of this script

            hf_tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
        except ImportError:
            hf_tok = None
    out = []
    checked = 0
    for case in all_cases():
        case_templates = {"default": case["template"]} if "template" in case else templates
        result = dict(case)
        try:
            result["rendered"] = render_case(env, case_templates, specials, case)
        except (RequestError, jinja2.exceptions.TemplateError, ValueError, TypeError) as e:
            result["error"] = str(e) if str(e) else type(e).__name__
        if hf_tok is not None and "template" not in case:
            checked += 1
            cross_check(hf_tok, case, result)
        out.append(result)
    json.dump({"jinja2": jinja2.__version__, "transformers_checked": checked, "cases": out},
              sys.stdout, ensure_ascii=False)


def cross_check(hf_tok, case, result):
    """Render with transformers itself (on the vLLM-normalized messages) and compare."""
    try:
        msgs = [normalize(m) for m in case["messages"]]
        kwargs = {k: v for k, v in (case.get("template_kwargs") or {}).items() if k not in RESERVED}
        got = hf_tok.apply_chat_template(
            msgs, tools=case.get("tools"), tokenize=False,
            add_generation_prompt=case.get("add_generation_prompt", True),
            continue_final_message=case.get("continue_final_message", False), **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure is an error case on both sides
        if "error" not in result:
            sys.exit(f"{case['name']}: transformers failed ({e!r}) but this script rendered")
        return
    if "error" in result:
        sys.exit(f"{case['name']}: transformers rendered but this script failed: {result['error']}")
    if got != result["rendered"]:
        sys.exit(f"{case['name']}: transformers disagrees:\n{got!r}\n!=\n{result['rendered']!r}")


def cmd_encode(args):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    # transformers ignores stored truncation/padding unless asked, and so does kvmesh-tokenize.
    tok.no_truncation()
    tok.no_padding()
    req = json.load(sys.stdin)
    add = bool(req.get("add_special_tokens", False))
    ids = [tok.encode(t, add_special_tokens=add).ids for t in req["texts"]]
    json.dump({
        "tokenizers": __import__("tokenizers").__version__,
        "ids": ids,
        "decoded": [tok.decode(i, skip_special_tokens=False) for i in ids],
        "decoded_skip_special": [tok.decode(i, skip_special_tokens=True) for i in ids],
    }, sys.stdout, ensure_ascii=False)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("--config", required=True)
    r.add_argument("--tokenizer-dir")
    e = sub.add_parser("encode")
    e.add_argument("--tokenizer", required=True)
    args = p.parse_args()
    if args.cmd == "render":
        cmd_render(args)
    else:
        cmd_encode(args)


if __name__ == "__main__":
    main()
