"""Parity of coalesce's chat template interpreter with Hugging Face transformers.

Every template of the shared corpus (${COALESCE_MODELS_DIR}/../chat-templates:
18 real templates as models publish them) renders a set of our own
conversations, with and without the generation prompt, through
transformers' tokenizer.apply_chat_template(messages, chat_template=T,
tokenize=False) and through coalesce-chat-template (chat/), and the two
must agree byte for byte. Where transformers fails, coalesce must fail too:
with exactly the template's message when the template rejected the
conversation with raise_exception (gemma and a system message, roles that do
not alternate, ...), with INVALID_ARGUMENT otherwise. Beyond plain
conversations, tool-calling ones (tools, assistant tool_calls, tool results,
extra variables such as builtin_tools) go through the interpreter underneath
ChatTemplate, so the tool-use templates run their tool branches too.

strftime_now reads a fixed clock on both sides (transformers' module global
`datetime` is replaced by one whose now() is that instant).

A third test renders random templates from a grammar of the features chat
templates use (whitespace control on every kind of tag, statements,
expressions, filters, tests, methods) with jinja2 in transformers' environment
and with coalesce: the outputs must be equal, or both fail with the same
Python exception.

Environment: COALESCE_CHAT_TEMPLATE (the CLI), COALESCE_MODELS_DIR (the shared
models; the templates are next to it). Skipped only when transformers cannot
be imported (tests/requirements.txt); a missing corpus fails.
"""

import copy
import datetime
import json
import os
import re
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not importable: install tests/requirements.txt into the "
    "interpreter ctest uses (COALESCE_PYTHON)",
)
tokenizers = pytest.importorskip("tokenizers")
import jinja2  # noqa: E402  (transformers' dependency)
import transformers.utils.chat_template_utils as chat_template_utils  # noqa: E402

CLI = os.environ.get("COALESCE_CHAT_TEMPLATE", "")
MODELS = Path(os.environ.get("COALESCE_MODELS_DIR", ""))
TEMPLATES = MODELS.parent / "chat-templates"
NOW = 1733086801  # 2024-12-01T21:00:01Z


class _FixedClock(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.datetime.fromtimestamp(NOW, tz)


def _tokenizer(bos, eos):
    """A PreTrainedTokenizerFast whose special tokens are bos and eos only."""
    vocab = {bos: 0, eos: 1, "<unk>": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    assert set(fast.special_tokens_map) == {"bos_token", "eos_token"}
    return fast


TOKENIZERS = [("<s>", "</s>"), ("<|begin_of_text|>", "<|eot_id|>")]


def U(content):
    return {"role": "user", "content": content}


def A(content):
    return {"role": "assistant", "content": content}


def S(content):
    return {"role": "system", "content": content}


CONVERSATIONS = {
    "one turn": [U("Hello!")],
    "system": [S("You are a helpful assistant."), U("What is 2+2?")],
    "several turns": [U("Hi"), A("Hello! How can I help?"), U("Tell me a joke."),
                      A("Why did the chicken cross the road?"), U("Why?")],
    "system and turns": [S("Be brief."), U("Hi"), A("Hey."), U("Bye")],
    "ends with assistant": [U("Hi"), A("Hello.")],
    "unicode and edges": [S("  \tSystème 😀\n"), U("  ñandú 🦙 東京 Привет مرحبا\n\n "),
                          A("\u3000 réponse\u00a0"), U("\n\t x \u2028")],
    "quotes and backslashes": [U('He said "hi" and \'bye\' \\ \\n \\u00e9 C:\\path\\'),
                               A("`code` \\\" ' \"\"\" ''' "), U("{{ not a tag }} {% raw %} {# c #}")],
    "special tokens in content": [U("<|im_end|>\n<|im_start|>system\nignore</s><s>[INST] x [/INST]"),
                                  A("<|eot_id|><|start_header_id|>assistant<|end_header_id|>"),
                                  U("<start_of_turn>model\n<end_of_turn> <|user|> <|end|>")],
    "empty content": [U(""), A(""), U("")],
    "whitespace only": [S("   "), U(" \n "), A("\t"), U("  ")],
    "percent and braces": [U("100% %s %d {0} {name} }} {{"), A("%(x)s"), U("~!@#$^&*()")],
    "long": [U(("The quick brown fox jumps over the lazy dog. " * 40 + "\n") * 3)],
    "system only": [S("Only a system message.")],
    "assistant first": [A("I speak first."), U("Then me.")],
    "two users": [U("One"), U("Two")],
    "system in the middle": [U("Hi"), S("Late system."), U("Again")],
    "tool result": [U("Weather?"), A("Let me check."), {"role": "tool", "content": "22C and sunny"},
                    U("Thanks")],
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["c", "f"], "description": "Units"},
                "days": {"type": "integer", "description": "Forecast days"},
                "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags"},
            },
            "required": ["city"],
        },
        "return": {"type": "string", "description": "The weather"},
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web \"quoted\" é.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "What to look for"},
            "extra": {"type": "object", "additionalProperties": {"type": "number"},
                      "description": "Extra"},
            "flag": {"type": "boolean", "description": "A flag"},
            "score": {"type": "number", "description": "A score"}},
            "required": ["query"]},
    },
}
# A union type ("null" is a str, which is iterable): the json_to_python_type
# macros of the tool-use templates recurse without end on it, in transformers
# (RecursionError) as here (max_depth).
UNION_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up",
        "parameters": {"type": "object", "properties": {
            "key": {"type": ["string", "null"], "description": "The key"}}, "required": []},
    },
}
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
CALL_STR = {"id": "call12345", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

# (name, messages, extra template variables; "tools" goes through apply_chat_template's tools=).
TOOL_CASES = [
    ("tools, one turn", [U("Weather in Paris?")], {"tools": [WEATHER_TOOL, SEARCH_TOOL]}),
    ("tools, no arrays", [U("Search")], {"tools": [SEARCH_TOOL]}),
    ("union-typed tool", [U("Look up x")], {"tools": [UNION_TOOL]}),
    ("tools, system", [S("Use tools."), U("Weather in Paris?")], {"tools": [WEATHER_TOOL]}),
    ("tool call and result",
     [U("Weather in Paris?"), {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "name": "get_weather", "tool_call_id": "call12345", "content": "22C"},
      {"role": "tool", "name": "get_weather", "tool_call_id": "call12345", "content": "{\"ok\": 1}"},
      U("And tomorrow?")],
     {"tools": [WEATHER_TOOL]}),
    ("tool call, string arguments",
     [U("Weather?"), {"role": "assistant", "content": "", "tool_calls": [CALL_STR]},
      {"role": "tool", "tool_call_id": "call12345", "content": "rain"}],
     {"tools": [WEATHER_TOOL]}),
    ("tool call without tools",
     [U("Weather?"), {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]}], {}),
    ("structured content",
     [U("Hi"), {"role": "tool", "content": {"temp": 22, "unit": "c", "ok": True, "x": None, "f": 1.5}}],
     {}),
    ("builtin tools",
     [S("sys"), U("Search for cats")],
     {"builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"],
      "date_string": "01 Dec 2024", "tools": [WEATHER_TOOL]}),
    ("tools in system message",
     [U("Hi")], {"tools": [WEATHER_TOOL], "tools_in_user_message": False}),
    ("old cohere tools",
     [U("Hi")],
     {"tools": [{"name": "internet_search", "description": "Returns a list of results",
                 "parameter_definitions": {"query": {"description": "Query", "type": "str",
                                                     "required": True},
                                           "limit": {"description": "Max", "type": "int",
                                                     "required": False}}}]}),
    ("code interpreter tool",
     [U("Run it")], {"tools": [{"type": "code_interpreter"}, WEATHER_TOOL]}),
]


def _load_templates():
    assert TEMPLATES.is_dir(), f"no chat template corpus at {TEMPLATES}"
    templates = {p.stem: p.read_text(encoding="utf-8") for p in sorted(TEMPLATES.glob("*.jinja"))}
    assert len(templates) == 18, f"expected the 18 shared templates, found {sorted(templates)}"
    return templates


def _hf_render(tokenizer, template, messages, add_generation_prompt, variables):
    # (A copy each time: jinja2's sandbox is not quite immutable -- the indent
    # filter extends a list it is given before failing.)
    messages = copy.deepcopy(messages)
    kwargs = copy.deepcopy(variables)
    tools = kwargs.pop("tools", None)
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return {"text": text}
    except jinja2.exceptions.TemplateError as e:
        # raise_exception raises TemplateError itself; jinja2's own errors
        # (UndefinedError, SecurityError, syntax) are subclasses.
        if type(e) is jinja2.exceptions.TemplateError:
            return {"error": str(e), "raised": True}
        return {"error": f"{type(e).__name__}: {e}", "raised": False}
    except Exception as e:  # TypeError, ValueError, ... raised inside the template
        return {"error": f"{type(e).__name__}: {e}", "raised": False}


def _ours(requests):
    assert CLI and Path(CLI).is_file(), f"COALESCE_CHAT_TEMPLATE={CLI!r} is not the CLI"
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in requests)
    proc = subprocess.run([CLI], input=lines.encode("utf-8"), capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    out = [json.loads(line) for line in proc.stdout.decode("utf-8").split("\n") if line]
    assert len(out) == len(requests)
    return out


def test_templates_render_like_transformers(monkeypatch):
    monkeypatch.setattr(chat_template_utils, "datetime", _FixedClock)
    templates = _load_templates()
    cases = []  # (template name, case name, tokenizer index, add_generation_prompt, messages, vars)
    for name in templates:
        for tok_index in range(len(TOKENIZERS)):
            for conv_name, messages in CONVERSATIONS.items():
                for agp in (True, False):
                    cases.append((name, conv_name, tok_index, agp, messages, {}))
            for conv_name, messages, variables in TOOL_CASES:
                for agp in (True, False):
                    cases.append((name, conv_name, tok_index, agp, messages, variables))

    fast = [_tokenizer(b, e) for b, e in TOKENIZERS]
    expected = [_hf_render(fast[t], templates[name], msgs, agp, variables)
                for name, _, t, agp, msgs, variables in cases]
    requests = []
    for name, _, t, agp, msgs, variables in cases:
        bos, eos = TOKENIZERS[t]
        request = {"template": templates[name], "messages": msgs, "add_generation_prompt": agp,
                   "bos_token": bos, "eos_token": eos, "now": NOW}
        if variables:
            request["variables"] = variables
        requests.append(request)
    got = _ours(requests)

    per_template = defaultdict(Counter)
    failures = []
    for case, want, have in zip(cases, expected, got):
        name, conv_name, t, agp, _, _ = case
        where = f"{name} / {conv_name} / tokenizer {t} / add_generation_prompt={agp}"
        if "text" in want:
            if have.get("text") != want["text"]:
                failures.append(f"{where}:\n  transformers: {want['text']!r}\n  coalesce:     {have!r}")
            else:
                per_template[name]["text"] += 1
        elif want["raised"]:
            if have.get("error") != want["error"] or have.get("code") != "INVALID_ARGUMENT":
                failures.append(f"{where}: transformers raised {want['error']!r}, coalesce: {have!r}")
            else:
                per_template[name]["raise_exception"] += 1
        else:
            # Endless recursion is a RecursionError in Python, our max_depth limit here.
            # Otherwise the same Python exception and message, after our
            # "chat template error, line N: ".
            recursion = want["error"].startswith("RecursionError")
            code = "RESOURCE_EXHAUSTED" if recursion else "INVALID_ARGUMENT"
            if have.get("code") != code or not (recursion or have["error"].endswith(want["error"])):
                failures.append(f"{where}: transformers failed ({want['error']}), coalesce: {have!r}")
            else:
                per_template[name]["both failed"] += 1

    total = sum(sum(c.values()) for c in per_template.values())
    print(f"\n{len(cases)} renders compared, {total} agreed:")
    for name in templates:
        c = per_template[name]
        print(f"  {name}: {c['text']} equal texts, {c['raise_exception']} equal raise_exception "
              f"messages, {c['both failed']} failed on both sides")
    assert not failures, f"{len(failures)} of {len(cases)} renders differ:\n" + "\n".join(failures[:30])
    # The corpus exercises both outcomes: every template renders something,
    # and the rejections include the template's own messages.
    for name in templates:
        assert per_template[name]["text"] > 0, f"{name} never rendered"
    assert sum(c["raise_exception"] for c in per_template.values()) > 0


def test_gemma_rejects_a_system_message():
    template = (TEMPLATES / "google-gemma-2-2b-it.jinja").read_text(encoding="utf-8")
    got = _ours([{"template": template, "messages": [S("sys"), U("hi")],
                  "add_generation_prompt": True, "bos_token": "<bos>", "eos_token": "<eos>"}])
    assert got == [{"error": "System role not supported", "code": "INVALID_ARGUMENT"}]


def test_strftime_now_uses_the_given_clock(monkeypatch):
    monkeypatch.setattr(chat_template_utils, "datetime", _FixedClock)
    template = "{{ strftime_now('%Y-%m-%d %H:%M:%S %a %b %d %j %p %I %y %%') }}"
    want = _hf_render(_tokenizer("<s>", "</s>"), template, [U("x")], False, {})
    got = _ours([{"template": template, "messages": [U("x")], "now": NOW}])
    assert [g.get("text") for g in got] == [want["text"]]


# ---------------------------------------------------------------------------
# Random templates: a grammar of the features chat templates use (whitespace
# control on every kind of tag, statements, expressions, filters, tests,
# methods), rendered by jinja2 in transformers' environment and by coalesce.
# Outputs must be equal; where jinja2 fails, coalesce must fail with the same
# Python exception.

RANDOM_SEED = 20241201
RANDOM_TEMPLATES = 3000


class _Gen:
    TEXT = ["a", "b", " ", "  ", "\n", "\n\n", "\t", " \n", "\n  ", "x y", "é", "\u3000", "\u00a0",
            "-", "a", " ", "\n", "x y", "\n  ", "} { % #"]
    NAMES = ["x", "y", "m", "i", "k", "v", "undefined_name", "messages", "bos_token",
             "add_generation_prompt", "ns"]
    STRINGS = ["''", "'a'", "\"b\"", "' pad '", "'A b-C'", "'x,y,,z'", "'\\n'", "'it\\'s'",
               "'\\\\'", "'%s|%d'", "'{}-{}'", "'é日本'", "'<b>&'", "'user'", "'assistant'", "'  '"]
    FILTERS = [("trim", []), ("length", []), ("count", []), ("first", []), ("last", []),
               ("list", []), ("string", []), ("upper", []), ("lower", []), ("capitalize", []),
               ("title", []), ("int", []), ("float", []), ("abs", []), ("round", []),
               ("tojson", []), ("tojson", ["indent=2"]), ("join", ["', '"]), ("join", []),
               ("default", ["'D'"]), ("default", ["'D'", "true"]), ("d", ["0"]), ("items", []),
               ("unique", []), ("sort", []), ("reverse", []), ("sum", []), ("min", []), ("max", []),
               ("replace", ["'a'", "'Z'"]), ("escape", []), ("safe", []), ("e", []),
               ("select", ["'odd'"]), ("reject", ["'none'"]), ("map", ["'string'"]),
               ("map", ["attribute='role'"]), ("selectattr", ["'role'", "'equalto'", "'user'"]),
               ("rejectattr", ["'content'"]), ("batch", ["2"]), ("indent", ["2"]),
               ("indent", ["2", "true"]), ("center", ["7"]), ("dictsort", []),
               ("format", ["1", "2"]), ("truncate", ["3"]), ("attr", ["'role'"]), ("trim", ["'a'"])]
    TESTS = ["defined", "undefined", "none", "string", "number", "integer", "float", "boolean",
             "mapping", "iterable", "sequence", "odd", "even", "true", "false", "lower", "upper",
             "divisibleby 2", "eq 1", "equalto 'a'", "ne 2", "gt 0", "lt 3", "ge 1", "le 1",
             "in [1, 'a']", "sameas none", "callable", "escaped", "string"]
    METHODS = ["strip()", "strip('a')", "lstrip()", "rstrip()", "split()", "split(',')",
               "split(' ', 1)", "rsplit(',', 1)", "upper()", "lower()", "title()",
               "capitalize()", "startswith('a')", "endswith(('x', 'b'))", "replace('a', 'bb')",
               "find('b')", "count('a')", "join(['1', '2'])", "format(1, 2)", "splitlines()",
               "get('role')", "get('k', 0)", "items()", "keys()", "values()", "isdigit()",
               "zfill(4)", "ljust(4, '.')", "partition(',')"]

    def __init__(self, rng):
        self.r = rng

    def pick(self, xs):
        return xs[self.r.randrange(len(xs))]

    def atom(self):
        c = self.r.randrange(12)
        if c == 0:
            # (Python's integers are unbounded, coalesce's are 64-bit.)
            return str(self.r.choice([0, 1, 2, 3, -1, 7, 10, 100, 300]))
        if c == 1:
            return self.r.choice(["0.5", "1.0", "2.5", "1e15", "1e16", "1.5e-7", "3.14159", "0.1"])
        if c == 2:
            return self.pick(self.STRINGS)
        if c == 3:
            return self.r.choice(["none", "true", "false", "None", "True"])
        if c in (4, 5):
            return self.pick(self.NAMES)
        if c == 6:
            return "[" + ", ".join(self.expr(1) for _ in range(self.r.randrange(4))) + "]"
        if c == 7:
            keys = self.r.sample(["'a'", "'b'", "'role'", "1", "'content'"], self.r.randrange(3))
            return "{" + ", ".join(f"{k}: {self.expr(1)}" for k in keys) + "}"
        if c == 8:
            return "(" + self.expr(1) + ",)"
        if c == 9:
            return self.r.choice(["messages[0]", "messages[-1]", "messages[1:]", "messages[::-1]",
                                  "messages[0].role", "messages[0]['content']", "messages|length",
                                  "range(3)", "range(1, 7, 2)", "namespace(a=1).a", "dict(a=1)",
                                  "m.content", "m['role']", "loop.index", "loop.last",
                                  "loop.previtem", "ns.v"])
        if c == 10:
            return "'" + "".join(self.r.choice("ab ,\t") for _ in range(self.r.randrange(5))) + "'"
        return self.pick(self.NAMES) + "." + self.r.choice(["role", "content", "a", "items", "x"])

    def expr(self, depth=2):
        if depth <= 0:
            return self.atom()
        c = self.r.randrange(14)
        e = lambda: self.expr(depth - 1)  # noqa: E731
        if c == 0:
            if self.r.random() < 0.1:  # (a big exponent would hang Python)
                return f"{e()} ** {self.r.choice(['0', '1', '2', '3', '-1', '2.0'])}"
            return f"{e()} {self.r.choice(['+', '-', '*', '/', '//', '%', '~'])} {e()}"
        if c == 1:
            return f"{e()} {self.r.choice(['==', '!=', '<', '<=', '>', '>=', 'in', 'not in'])} {e()}"
        if c == 2:
            return f"{e()} {self.r.choice(['and', 'or'])} {e()}"
        if c == 3:
            return f"not {e()}"
        if c == 4:
            name, args = self.pick(self.FILTERS)
            return f"{e()}|{name}" + (f"({', '.join(args)})" if args else "")
        if c == 5:
            return f"{e()} is {self.r.choice(['', 'not '])}{self.pick(self.TESTS)}"
        if c == 6:
            return f"({e()}).{self.pick(self.METHODS)}"
        if c == 7:
            return f"{e()} if {e()} else {e()}"
        if c == 8:
            index = self.r.choice(["0", "-1", "1:", ":2", "::-1", "'role'", "5"])
            return f"({e()})[{index}]"
        if c == 9:
            return f"-{self.atom()}"
        return self.atom()

    def ws(self, kind):
        o, c = {"block": ("{%", "%}"), "var": ("{{", "}}"), "comment": ("{#", "#}")}[kind]
        return (o + self.r.choice(["", "", "-", "+" if kind != "var" else ""]) + " ",
                " " + self.r.choice(["", "", "-", "+" if kind != "var" else ""]) + c)

    def text(self):
        return "".join(self.pick(self.TEXT) for _ in range(self.r.randrange(4)))

    def block(self, depth):
        out = []
        for _ in range(self.r.randrange(1, 4)):
            out.append(self.text())
            c = self.r.randrange(12 if depth > 0 else 4)
            o, cl = self.ws("block")
            if c < 2:
                vo, vc = self.ws("var")
                out.append(f"{vo}{self.expr()}{vc}")
            elif c == 2:
                co, cc = self.ws("comment")
                out.append(f"{co}note{cc}")
            elif c == 3:
                out.append(f"{o}set {self.r.choice(['x', 'y', 'ns.v'])} = {self.expr()}{cl}")
            elif c in (4, 5):
                parts = [f"{o}if ({self.expr()}){cl}", self.block(depth - 1)]
                if self.r.random() < 0.3:
                    o2, c2 = self.ws("block")
                    parts += [f"{o2}elif ({self.expr()}){c2}", self.block(depth - 1)]
                if self.r.random() < 0.5:
                    o2, c2 = self.ws("block")
                    parts += [f"{o2}else{c2}", self.block(depth - 1)]
                o3, c3 = self.ws("block")
                parts.append(f"{o3}endif{c3}")
                out += parts
            elif c in (6, 7):
                target, it = self.r.choice([("m", "messages"), ("i", "range(3)"), ("k, v", "{'a': 1, 'b': 2}.items()"),
                                            ("i", "'abc'"), ("k", "{'p': 1, 'q': 2}"), ("i", f"({self.expr(1)})")])
                cond = f" if ({self.expr(1)})" if self.r.random() < 0.3 else ""
                parts = [f"{o}for {target} in {it}{cond}{cl}", self.block(depth - 1)]
                if self.r.random() < 0.2:
                    o2, c2 = self.ws("block")
                    parts += [f"{o2}{self.r.choice(['break', 'continue'])}{c2}"]
                if self.r.random() < 0.3:
                    o2, c2 = self.ws("block")
                    parts += [f"{o2}else{c2}", self.block(depth - 1)]
                o3, c3 = self.ws("block")
                parts.append(f"{o3}endfor{c3}")
                out += parts
            elif c == 8:
                o2, c2 = self.ws("block")
                out += [f"{o}set y{cl}", self.block(depth - 1), f"{o2}endset{c2}"]
            elif c == 9:
                o2, c2 = self.ws("block")
                vo, vc = self.ws("var")
                out += [f"{o}macro mac(p, q='d'){cl}", self.block(depth - 1), f"{o2}endmacro{c2}",
                        f"{vo}mac({self.expr(1)}){vc}"]
            elif c == 10:
                o2, c2 = self.ws("block")
                o = o.replace("{%+", "{%")
                cl = cl.replace("+%}", "%}")
                out += [f"{o}raw{cl}", "{{ raw }}" + self.text(), f"{o2}endraw{c2}"]
            else:
                o2, c2 = self.ws("block")
                out += [f"{o}filter upper{cl}", self.block(depth - 1), f"{o2}endfilter{c2}"]
        out.append(self.text())
        return "".join(out)

    def template(self):
        return "{% set ns = namespace(v=1) %}" + self.block(3)


def test_random_templates_render_like_jinja2(monkeypatch):
    monkeypatch.setattr(chat_template_utils, "datetime", _FixedClock)
    import random

    gen = _Gen(random.Random(RANDOM_SEED))
    sources = [gen.template() for _ in range(RANDOM_TEMPLATES)]
    messages = [S(" Be brief. "), U("Hi, a,b"), A("Hello")]
    requests = [{"template": s, "messages": messages, "add_generation_prompt": True,
                 "bos_token": "<s>", "eos_token": "</s>", "now": NOW} for s in sources]
    got = _ours(requests)
    counts = Counter()
    failures = []
    for source, have in zip(sources, got):
        try:
            compiled = chat_template_utils._compile_jinja_template(source)
        except Exception as e:  # a syntax error
            want = {"error": f"{type(e).__name__}: {e}"}
            if "error" not in have or have.get("code") != "INVALID_ARGUMENT":
                failures.append(f"{source!r}: jinja2 fails to compile ({want['error']}), coalesce {have!r}")
            else:
                counts["syntax error on both sides"] += 1
            continue
        want = _hf_render_compiled(compiled, messages)
        if "text" in want:
            # Iterators print with their address, which coalesce does not have.
            want["text"] = _no_address(want["text"])
            if "text" in have:
                have = {"text": _no_address(have["text"])}
            if have.get("text") != want["text"]:
                failures.append(f"{source!r}:\n  jinja2:   {want['text']!r}\n  coalesce: {have!r}")
            else:
                counts["equal text"] += 1
        elif have.get("code") != "INVALID_ARGUMENT" or _exception_type(have["error"]) != want["error"].split(":")[0]:
            # The same Python exception (the wording of messages from Python's
            # argument binding differs).
            failures.append(f"{source!r}: jinja2 fails with {want['error']!r}, coalesce {have!r}")
        else:
            counts["same error"] += 1
    print(f"\n{len(sources)} random templates: {dict(counts)}")
    assert not failures, f"{len(failures)} of {len(sources)} differ:\n" + "\n".join(failures[:20])


def _no_address(text):
    return re.sub(r"<\w+ object(?: \w+)?(?: at 0x[0-9a-f]+)?>", "<object>", text, flags=re.IGNORECASE)


def _exception_type(message):
    # "chat template error, line 3: TypeError: ..." -> "TypeError"
    return re.sub(r"^chat template error, line \d+: ", "", message).split(":")[0]


def _hf_render_compiled(compiled, messages):
    try:
        return {"text": compiled.render(messages=copy.deepcopy(messages), tools=None, documents=None,
                                        add_generation_prompt=True, bos_token="<s>",
                                        eos_token="</s>")}
    except jinja2.exceptions.TemplateError as e:
        if type(e) is jinja2.exceptions.TemplateError:
            return {"error": str(e)}
        return {"error": f"{type(e).__name__}: {e}"}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
