// chat/: the jinja2 interpreter behind ChatTemplate, feature by
// feature, against what jinja2 3.1.6 (in transformers' sandboxed
// environment: trim_blocks, lstrip_blocks, loopcontrols) renders; its errors;
// and the limits that bound a hostile template. The parity with transformers
// on real templates is test_chat_template_parity.py.
#include "chat/chat_template.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace coalesce::chat {
namespace {

const std::vector<ChatMessage> kChat = {{"system", "You are terse."},
                                        {"user", "Hi \"there\""},
                                        {"assistant", "Hello."},
                                        {"user", "Bye"}};

absl::StatusOr<std::string> RenderWith(std::string_view source, const ChatRenderOptions& options,
                                       const std::vector<ChatMessage>& messages = kChat) {
  auto tmpl = ChatTemplate::Parse(source);
  if (!tmpl.ok()) return tmpl.status();
  return tmpl->Render(messages, options);
}

absl::StatusOr<std::string> Render(std::string_view source,
                                   const std::vector<ChatMessage>& messages = kChat) {
  ChatRenderOptions options;
  options.bos_token = "<s>";
  options.eos_token = "</s>";
  return RenderWith(source, options, messages);
}

// The rendered text, or the error as text (so a failure shows it).
std::string R(std::string_view source) {
  auto out = Render(source);
  return out.ok() ? *out : "ERROR: " + std::string(out.status().message());
}

struct Case {
  const char* source;
  const char* want;
};

void ExpectAll(const std::vector<Case>& cases) {
  for (const Case& c : cases) EXPECT_EQ(R(c.source), c.want) << c.source;
}

TEST(ChatTemplateTest, PrintsValuesAsPythonStr) {
  ExpectAll({
      {"{{ 1 }}|{{ -7 }}|{{ 1.0 }}|{{ 2.5 }}|{{ 0.1 + 0.2 }}", "1|-7|1.0|2.5|0.30000000000000004"},
      {"{{ 1e16 }}|{{ 1e15 }}|{{ 0.0001 }}|{{ 0.00001 }}|{{ 1.5e-7 }}|{{ 1e100 }}",
       "1e+16|1000000000000000.0|0.0001|1e-05|1.5e-07|1e+100"},
      {"{{ none }}|{{ None }}|{{ true }}|{{ False }}", "None|None|True|False"},
      {"{{ [1, 'a', none, 1.5, true] }}", "[1, 'a', None, 1.5, True]"},
      {"{{ {'k': \"it's\", 'n': [1, {'x': none}]} }}", "{'k': \"it's\", 'n': [1, {'x': None}]}"},
      {"{{ (1,) }}|{{ (1, 2) }}|{{ () }}|{{ [] }}|{{ {} }}", "(1,)|(1, 2)|()|[]|{}"},
      {"{{ ['a\\nb', 'tab\\t', 'q\\'\"', '\\\\'] }}", "['a\\nb', 'tab\\t', 'q\\'\"', '\\\\']"},
      {"{{ {'a': 1}.items() }}|{{ {'a': 1}.keys() }}|{{ range(3) }}|{{ range(1, 9, 2) }}",
       "dict_items([('a', 1)])|dict_keys(['a'])|range(0, 3)|range(1, 9, 2)"},
      {"{{ x }}|{{ 'a' ~ 1 ~ none ~ 1.5 ~ x }}", "|a1None1.5"},
      {"{% set ns = namespace(a=1, b='x') %}{{ ns }}", "<Namespace {'a': 1, 'b': 'x'}>"},
      {"{% macro m() %}{% endmacro %}{{ m }}", "<Macro 'm'>"},
      {"{% for x in 'ab' %}{{ loop }}{% endfor %}", "<LoopContext 1/2><LoopContext 2/2>"},
  });
}

TEST(ChatTemplateTest, Literals) {
  ExpectAll({
      {"{{ 'single' }}{{ \"double\" }}{{ 'a' 'b' \"c\" }}", "singledoubleabc"},
      {"{{ '\\x41\\u00e9\\U0001F600\\101\\n\\q' }}",
       "A\xC3\xA9\xF0\x9F\x98\x80"
       "A\n\\q"},
      {"{{ 1_000 }} {{ 0x1f }} {{ 0o17 }} {{ 0b101 }} {{ 1.5e3 }} {{ 12.5 }}",
       "1000 31 15 5 1500.0 12.5"},
      {"{{ [1, 2,] }}{{ {'a': 1,} }}{{ (1, 2,) }}", "[1, 2]{'a': 1}(1, 2)"},
      {"{{ {1: 'a', true: 'b', 1.0: 'c'} }}", "{1: 'c'}"},
  });
}

TEST(ChatTemplateTest, Operators) {
  ExpectAll({
      {"{{ 1 + 2 * 3 }}|{{ (1 + 2) * 3 }}|{{ 2 ** 3 ** 2 }}|{{ -2 ** 2 }}", "7|9|64|4"},
      {"{{ 10 / 4 }}|{{ 10 // 4 }}|{{ -10 // 4 }}|{{ 10 % -3 }}|{{ -7 % 3 }}|{{ 10.5 % 3 }}",
       "2.5|2|-3|-2|2|1.5"},
      {"{{ 2 ** -1 }}|{{ 2 ** 0.5 }}|{{ 7.0 // 2 }}|{{ true + 1 }}|{{ -true }}",
       "0.5|1.4142135623730951|3.0|2|-1"},
      {"{{ 'ab' * 2 }}{{ 2 * 'c' }}{{ [1] * 2 }}{{ [1] + [2] }}{{ (1,) + (2,) }}",
       "ababcc[1, 1][1, 2](1, 2)"},
      {"{{ 'a' ~ 'b' ~ 3 }}|{{ 'a' + 'b' }}", "ab3|ab"},
      {"{{ 1 == 1.0 }}{{ (1, 2) == [1, 2] }}{{ 'a' < 'b' }}{{ [1, 2] < [1, 3] }}{{ x == y }}{{ "
       "none == x }}",
       "TrueFalseTrueTrueTrueFalse"},
      {"{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 1 != 2 }}{{ 2 >= 2 }}{{ 1 <= 0 }}",
       "TrueFalseTrueTrueFalse"},
      {"{{ 'b' in 'abc' }}{{ 2 in [1, 2] }}{{ 'k' in {'k': 1} }}{{ 3 not in (1, 2) }}{{ 'z' in x "
       "}}",
       "TrueTrueTrueTrueFalse"},
      {"{{ none or 'x' }}|{{ 0 and 'y' }}|{{ 'a' and 'b' }}|{{ [] or {} }}|{{ not none }}",
       "x|0|b|{}|True"},
      {"{{ 1 if true else 2 }}|{{ 1 if false else 2 if false else 3 }}|{{ 1 if false }}|{{ (1 if "
       "false) is defined }}",
       "1|3||False"},
      {"{{ not 1 == 2 }}|{{ not x is defined }}|{{ -1|abs }}", "True|True|1"},
  });
}

TEST(ChatTemplateTest, AttributesItemsAndSlices) {
  ExpectAll({
      {"{{ messages[0].role }}|{{ messages[1]['content'] }}|{{ messages[-1].content }}",
       "system|Hi \"there\"|Bye"},
      {"{{ messages[9] }}|{{ messages[9] is defined }}|{{ messages[0].nope is defined }}",
       "|False|False"},
      {"{{ none.foo }}|{{ none.foo is defined }}|{{ 'abc'[10] is defined }}", "|False|False"},
      {"{{ messages[1:]|length }}|{{ messages[::-1][0].content }}|{{ "
       "messages[1:3]|map(attribute='role')|join(',') }}",
       "3|Bye|user,assistant"},
      {"{{ 'hello'[1:] }}|{{ 'hello'[::-1] }}|{{ 'hello'[-3:-1] }}|{{ 'h\xC3\xA9llo'[1] }}|{{ [1, "
       "2, 3][::2] }}",
       "ello|olleh|ll|\xC3\xA9|[1, 3]"},
      {"{{ messages[0]['items'] is defined }}|{{ {'items': 1}.items is defined }}", "True|True"},
      {"{{ {'a': {'b': [10, 20]}}.a.b.1 }}", "20"},
  });
}

TEST(ChatTemplateTest, Undefined) {
  ExpectAll({
      {"[{{ x }}]|{{ x is defined }}|{{ x is undefined }}|{{ x|length }}|{{ x|default('d') }}|{{ "
       "x|trim }}",
       "[]|False|True|0|d|"},
      {"{% for i in x %}no{% else %}empty{% endfor %}|{{ x|list }}|{{ 'a' in x }}",
       "empty|[]|False"},
      {"{{ x is none }}|{{ none is none }}|{{ x == y }}", "False|True|True"},
  });
  for (const char* source :
       {"{{ x.y }}", "{{ x + 1 }}", "{{ x() }}", "{{ x[0] }}", "{{ x.y is defined }}"}) {
    auto out = Render(source);
    ASSERT_FALSE(out.ok()) << source;
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(out.status().message().find("'x' is undefined"), std::string::npos) << out.status();
    EXPECT_NE(out.status().message().find("line 1"), std::string::npos) << out.status();
  }
}

TEST(ChatTemplateTest, WhitespaceControl) {
  ExpectAll({
      // trim_blocks eats the newline after a block tag; lstrip_blocks the
      // indentation before it.
      {"a\n  {% if true %}\nb\n  {% endif %}\nc", "a\nb\nc"},
      {"a  {% if true %}b{% endif %}  c", "a  b  c"},
      {"a\n  {{ 'x' }}\n  {# c #}\nd {#- c -#}  e", "a\n  x\nde"},
      {"  {%+ if true %}x{% endif +%}\ny", "  x\ny"},
      {"a   {%- if true -%}   b   {%- endif -%}   c", "abc"},
      {"a {{- 'b' -}} c|{{ 'd' }}\n", "abc|d"},
      {"x\n\n", "x\n"},
      {"\t{% for i in [1, 2] %}\n\t{{ i }}\n\t{% endfor %}\n", "\t1\n\t2\n"},
      {"a\r\nb\rc", "a\nb\nc"},
      {"a {%- raw %} {{ x }} {% endraw -%} b", "a {{ x }} b"},
      {"{% raw %}{% if %}{{ }}{% endraw %}", "{% if %}{{ }}"},
      {"a \xE3\x80\x80{%- if true %}b{% endif %}", "ab"},  // - strips Unicode whitespace
      {"{# comment\nover lines #}x", "x"},
      {"{% set x = 1 -%}\n\n  {{ x }}", "1"},
  });
}

TEST(ChatTemplateTest, ForLoops) {
  ExpectAll({
      {"{% for m in messages %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ "
       "loop.revindex0 }}"
       "{{ loop.first|int }}{{ loop.last|int }}{{ loop.length }} {% endfor %}",
       "1043104 2132004 3221004 4310014 "},
      {"{% for x in 'abc' %}{{ loop.previtem }}{{ x }}{{ loop.nextitem }},{% endfor %}",
       "ab,abc,bc,"},
      {"{% for a, b in [[1, 2], (3, 4)] %}{{ a }}{{ b }}{% endfor %}", "1234"},
      {"{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}", "a=1;b=2;"},
      {"{% for k in {'x': 1, 'y': 2} %}{{ k }}{% endfor %}", "xy"},
      {"{% for x in [1, 2, 3, 4] if x is even %}{{ loop.index }}/{{ loop.length }}:{{ x }} {% "
       "endfor %}",
       "1/2:2 2/2:4 "},
      {"{% for x in [] %}no{% else %}else{% endfor %}", "else"},
      {"{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}"
       "{% endif %}{{ x }}{% endfor %}",
       "0134"},
      {"{% for a in [1, 2] %}{% for b in [3] %}{{ loop.index }}{{ a }}{% endfor %}{% endfor %}",
       "1112"},
      {"{% for x in [1, 2, 3] %}{{ loop.cycle('a', 'b') }}{{ loop.changed(x > 1) }}{% endfor %}",
       "aTruebTrueaFalse"},
      // An assignment in a loop body stays in that iteration.
      {"{% set y = 0 %}{% for i in [1, 2, 3] %}{% if loop.first %}{% set y = 5 %}{% endif %}{{ y }}"
       "{% endfor %}{{ y }}",
       "5000"},
  });
}

TEST(ChatTemplateTest, SetNamespaceMacro) {
  ExpectAll({
      {"{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t }}", "12(1, 2)"},
      {"{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}", "2"},
      {"{% set x %}  hi {{ 1 }}  {% endset %}[{{ x }}]", "[  hi 1  ]"},
      {"{% set x | upper %}abc{% endset %}{{ x }}", "ABC"},
      {"{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor "
       "%}{{ ns.n }}",
       "6"},
      {"{% set ns = namespace() %}{% set ns.a = 'x' %}{{ ns.a }}{{ namespace({'b': 2}).b }}", "x2"},
      {"{% macro m(a, b=2, c='x') %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ m(1) }}|{{ m(1, c=3) "
       "}}|{{ m(b=5, a=0) }}",
       "12x|123|05x"},
      {"{% macro m(a) %}[{{ a }}]{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, k=3) }}",
       "[1](2,){'k': 3}"},
      {"{% macro m(a) %}{{ a is defined }}{% endmacro %}{{ m() }}", "False"},
      // Macros see the variables of where they are defined, as they are
      // when called.
      {"{% macro f() %}{{ a }}{% endmacro %}{% set a = 1 %}{{ f() }}{% set a = 2 %}{{ f() }}",
       "12"},
      {"{% macro f() %}{{ a }}{% endmacro %}{% for a in [7] %}[{{ f() }}]{% endfor %}", "[]"},
      {"{% macro rec(n) %}{{ n }}{% if n > 0 %}{{ rec(n - 1) }}{% endif %}{% endmacro %}{{ rec(3) "
       "}}",
       "3210"},
      {"{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}{{ a }}", "3"},
      {"{% filter upper %}ab{{ 'c' }}{% endfilter %}", "ABC"},
      {"{% generation %}gen{% endgeneration %}", "gen"},
  });
}

TEST(ChatTemplateTest, Filters) {
  ExpectAll({
      {"{{ '  a b \\n'|trim }}|{{ 'xxaxx'|trim('x') }}|{{ '\xE3\x80\x80"
       "a\xC2\xA0'|trim }}",
       "a b|a|a"},
      {"{{ [1, 2]|length }}{{ 'h\xC3\xA9'|length }}{{ {'a': 1}|count }}", "221"},
      {"{{ [3, 1, 2]|first }}{{ [3, 1, 2]|last }}{{ 'abc'|first }}{{ []|first is defined }}",
       "32aFalse"},
      {"{{ [1, 2, 3]|join('-') }}|{{ messages|map(attribute='role')|join(', ') }}|{{ [1, 2]|join "
       "}}",
       "1-2-3|system, user, assistant, user|12"},
      {"{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|list }}",
       "['Hi \"there\"', 'Bye']"},
      {"{{ messages|rejectattr('role', 'in', ['user', 'system'])|map(attribute='role')|list }}",
       "['assistant']"},
      {"{{ [1, 2, 3]|select('odd')|list }}{{ [1, 2, 3]|reject('odd')|list }}{{ [0, 1]|select|list "
       "}}",
       "[1, 3][2][1]"},
      {"{{ ['a', 'B']|map('upper')|list }}{{ [1.5, 2.5]|map('round')|list }}",
       "['A', 'B'][2.0, 2.0]"},
      {"{{ messages|map(attribute='nope', default='D')|first }}", "D"},
      {"{{ x|default('d') }}{{ ''|default('d') }}{{ ''|default('d', true) }}{{ 0|d(5, "
       "boolean=true) }}",
       "dd5"},
      {"{{ {'b': 1, 'a': 2}|items|list }}{{ {'b': 1, 'a': 2}|dictsort }}",
       "[('b', 1), ('a', 2)][('a', 2), ('b', 1)]"},
      {"{{ 3|string ~ 'x' }}|{{ 3.7|int }}|{{ '42'|int }}|{{ '4.5'|int }}|{{ 'x'|int(7) }}|{{ "
       "'0x1A'|int(0, 16) }}",
       "3x|3|42|4|7|26"},
      {"{{ '2.5'|float }}|{{ 'x'|float }}|{{ 5|float }}", "2.5|0.0|5.0"},
      {"{{ 'hello wORLD'|upper }}|{{ 'HeLLo'|lower }}|{{ 'hello wORLD'|capitalize }}|{{ 'hello "
       "world-foo(bar'|title }}",
       "HELLO WORLD|hello|Hello world|Hello World-Foo(Bar"},
      {"{{ 'aaa'|replace('a', 'b') }}|{{ 'aaa'|replace('a', 'b', 2) }}", "bbb|bba"},
      {"{{ [3, 1, 2]|sort }}|{{ ['b', 'A', 'c']|sort }}|{{ [3, 1, 2]|sort(reverse=true) }}|{{ [1, "
       "2]|reverse|list }}",
       "[1, 2, 3]|['A', 'b', 'c']|[3, 2, 1]|[2, 1]"},
      {"{{ [1, 2, 2, 'a', 'A']|unique|list }}|{{ [4, 2, 8]|min }}|{{ [4, 2, 8]|max }}|{{ [1, "
       "2]|sum }}",
       "[1, 2, 'a']|2|8|3"},
      {"{{ -3|abs }}|{{ 2.5|round }}|{{ 3.5|round }}|{{ 2.675|round(2) }}|{{ 3|round }}|{{ "
       "2.1|round(0, 'ceil') }}",
       "3|2.0|4.0|2.67|3|3.0"},
      {"{{ 'abc'|list }}|{{ 'abc'|reverse }}|{{ ('a', 'b')|list }}",
       "['a', 'b', 'c']|cba|['a', 'b']"},
      {"{{ 'a\\nb'|indent(2) }}|{{ 'a\\n\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent('> ', "
       "blank=true) }}",
       "a\n  b|  a\n\n  b|a\n> \n> b"},
      {"{{ '<a href=\"x\">&\\'</a>'|e }}|{{ '<b>'|safe }}|{{ 'a'|safe + '<b>' }}|{{ '<' + 'a'|safe "
       "}}",
       "&lt;a href=&#34;x&#34;&gt;&amp;&#39;&lt;/a&gt;|<b>|a&lt;b&gt;|&lt;a"},
      {"{{ [1, 2, 3, 4, 5]|batch(2)|list }}|{{ [1, 2, 3, 4, 5]|slice(2)|list }}",
       "[[1, 2], [3, 4], [5]]|[[1, 2, 3], [4, 5]]"},
      {"{{ 'hello world foo'|truncate(9) }}|{{ 'a b c'|wordcount }}|{{ '%s=%d'|format('x', 3) "
       "}}|{{ 'ab'|center(6) }}|",
       "hello...|3|x=3|  ab  |"},
      {"{{ {'a': {'b': 1}}|attr('items') is defined }}|{{ {'a': 1}|attr('a') is defined }}",
       "True|False"},
  });
}

// Where jinja2's own machinery shows through, as it does in transformers.
TEST(ChatTemplateTest, Jinja2Quirks) {
  ExpectAll({
      // A for's else runs unless an iteration reached the end of the body.
      {"{% for x in [1, 2] %}a{% break %}{% else %}E{% endfor %}|{% for x in [1, 2] %}{% if x == 1 "
       "%}"
       "{% continue %}{% endif %}b{% else %}E{% endfor %}|{% for x in [1, 2] %}{% continue %}{% "
       "else %}"
       "E{% endfor %}",
       "aE|b|E"},
      // Generator filters fail only when iterated; a generator is always true.
      {"{% if none|items %}lazy{% endif %}|{{ 5|batch(2) is iterable }}", "lazy|True"},
      // A loop's `if` runs as the loop advances (and ahead of it for loop.last).
      {"{% set ns = namespace(stop=false) %}{% for x in [1, 2, 3] if not ns.stop %}{{ x }}"
       "{% set ns.stop = true %}{% endfor %}",
       "1"},
      {"{% set ns = namespace(n=0) %}{% for x in [1, 2, 3] if ns.n < 2 %}{{ x }}{{ loop.last }}"
       "{% set ns.n = ns.n + 1 %}{% endfor %}",
       "1False2False3True"},
      // Constant expressions are folded when the template compiles, where a
      // failed slice is an undefined value instead of an error.
      {"{{ (true)[:2] }}|{{ ((true)[:2] and x)|length }}|{{ (1, (2)[:1]) }}", "|0|(1, Undefined)"},
      {"{{ '%s|' % x }}{{ 'a' % [1] }}{{ '%s' % [1] }}", "|a[1]"},
      {"{{ range(10)[2:8:3] }}|{{ range(3)[::-1] }}", "range(2, 8, 3)|range(2, -1, -1)"},
  });
  // Not folded (a variable), the same slice is Python's TypeError.
  EXPECT_EQ(Render("{% set t = true %}{{ t[:2] }}").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, Tojson) {
  ExpectAll({
      {"{{ {'b': 1, 'a': [1, 2.0, none, true, 'x']}|tojson }}",
       "{\"b\": 1, \"a\": [1, 2.0, null, true, \"x\"]}"},
      {"{{ {'b': 1, 'a': [1, {}], 'c': []}|tojson(indent=2) }}",
       "{\n  \"b\": 1,\n  \"a\": [\n    1,\n    {}\n  ],\n  \"c\": []\n}"},
      {"{{ 'q\"\\\\\\n\\t\\x01\xC3\xA9\xE2\x80\xA8'|tojson }}",
       "\"q\\\"\\\\\\n\\t\\u0001\xC3\xA9\xE2\x80\xA8\""},
      {"{{ '\xC3\xA9\xF0\x9F\x98\x80'|tojson(true) }}", "\"\\u00e9\\ud83d\\ude00\""},
      {"{{ [1, 2]|tojson(separators=(',', ':')) }}|{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}",
       "[1,2]|{\"a\": 2, \"b\": 1}"},
      {"{{ {1: 2, none: 3, 1.5: 4, true: 5}|tojson }}", "{\"1\": 5, \"null\": 3, \"1.5\": 4}"},
      {"{{ messages[0]|tojson }}", "{\"role\": \"system\", \"content\": \"You are terse.\"}"},
      {"{{ 1e16|tojson }}|{{ (1, 2)|tojson }}|{{ 'x'|safe|tojson }}", "1e+16|[1, 2]|\"x\""},
  });
  for (const char* source :
       {"{{ x|tojson }}", "{{ namespace()|tojson }}", "{{ {(1, 2): 1}|tojson }}"}) {
    EXPECT_EQ(Render(source).status().code(), absl::StatusCode::kInvalidArgument) << source;
  }
}

TEST(ChatTemplateTest, Tests) {
  ExpectAll({
      {"{{ 'x' is string }}{{ 1 is string }}{{ {} is mapping }}{{ [] is mapping }}{{ 1.0 is float "
       "}}"
       "{{ 1 is float }}{{ 1 is integer }}{{ true is integer }}{{ true is number }}{{ 'a' is "
       "number }}",
       "TrueFalseTrueFalseTrueFalseTrueFalseTrueFalse"},
      {"{{ none is none }}{{ x is undefined }}{{ 3 is odd }}{{ 4 is even }}{{ true is boolean }}"
       "{{ false is false }}{{ true is true }}{{ 1 is true }}",
       "TrueTrueTrueTrueTrueTrueTrueFalse"},
      {"{{ 'ab' is lower }}{{ 'AB' is upper }}{{ 'Ab' is lower }}", "TrueTrueFalse"},
      {"{{ 1 is eq 1 }}{{ 1 is equalto 1 }}{{ [1, 2]|select('==', 1)|list == [1] }}{{ 1 is ne 2 "
       "}}{{ 2 is gt 1 }}{{ 1 is lt 2 }}"
       "{{ 2 is ge 2 }}{{ 2 is le 2 }}{{ 1 is in [1] }}{{ 10 is divisibleby 5 }}{{ 10 is "
       "divisibleby(3) }}",
       "TrueTrueTrueTrueTrueTrueTrueTrueTrueTrueFalse"},
      {"{{ none is sameas none }}{{ 'x'|safe is escaped }}{{ range is callable }}{{ 'upper' is "
       "filter }}"
       "{{ 'odd' is test }}",
       "TrueTrueTrueTrueTrue"},
      {"{{ [] is sequence }}{{ 'a' is sequence }}{{ {} is sequence }}{{ 5 is sequence }}{{ (1,) is "
       "iterable }}"
       "{{ 5 is iterable }}{{ none is iterable }}{{ 'x' is iterable }}{{ x is iterable }}",
       "TrueTrueTrueFalseTrueFalseFalseTrueTrue"},
      {"{{ 'x' is not string }}{{ x is not defined }}", "FalseTrue"},
  });
}

TEST(ChatTemplateTest, StringDictAndListMethods) {
  ExpectAll({
      {"{{ ' x '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '  x'.lstrip() }}|{{ 'x  '.rstrip() }}|{{ "
       "'ab'.rstrip('b') }}",
       "x|hi|x|x|a"},
      {"{{ 'a b  c'.split() }}{{ 'a,b,,c'.split(',') }}{{ ' a  b '.split(' ') }}{{ 'a b "
       "c'.split(none, 1) }}"
       "{{ 'a b c'.rsplit(' ', 1) }}",
       "['a', 'b', 'c']['a', 'b', '', 'c']['', 'a', '', 'b', '']['a', 'b c']['a b', 'c']"},
      {"{{ 'abc'.startswith('ab') }}{{ 'abc'.startswith(('x', 'a')) }}{{ 'abc'.endswith('bc') }}"
       "{{ 'abc'.endswith(('x', 'y')) }}",
       "TrueTrueTrueFalse"},
      {"{{ 'Hello'.upper() }}{{ 'Hello'.lower() }}{{ 'hello there'.title() }}{{ "
       "'hELLO'.capitalize() }}",
       "HELLOhelloHello ThereHello"},
      {"{{ 'aaa'.replace('a', 'b', 2) }}{{ 'ab'.replace('', '-') }}{{ ', '.join(['a', 'b']) }}",
       "bba-a-b-a, b"},
      {"{{ 'abcabc'.find('c') }}{{ 'abcabc'.rfind('c') }}{{ 'abcabc'.count('b') }}{{ 'x'.find('y') "
       "}}",
       "252-1"},
      {"{{ '{}-{:>4}|{!r}|{:.2f}|{name}'.format(1, 'ab', 'c', 3.14159, name='n') }}",
       "1-  ab|'c'|3.14|n"},
      {"{{ '%s-%05.1f|%r|%d%%' % ('x', 3.14159, 'y', 7) }}|{{ '%(a)s' % {'a': 1} }}",
       "x-003.1|'y'|7%|1"},
      {"{{ 'a\\nb\\r\\nc'.splitlines() }}{{ 'a-b'.partition('-') }}{{ '42'.zfill(5) }}{{ "
       "'x'.ljust(3, '.') }}",
       "['a', 'b', 'c']('a', '-', 'b')00042x.."},
      {"{{ 'abc'.isalpha() }}{{ '123'.isdigit() }}{{ ' '.isspace() }}{{ 'Ab Cd'.istitle() }}",
       "TrueTrueTrueTrue"},
      {"{{ {'a': 1}.get('a') }}{{ {'a': 1}.get('b') }}{{ {'a': 1}.get('b', 5) }}{{ {'a': 1, 'b': "
       "2}.values()|list }}",
       "1None5[1, 2]"},
      {"{{ [1, 2, 1].count(1) }}{{ [1, 2].index(2) }}{{ (1, 2).index(1) }}", "210"},
  });
}

TEST(ChatTemplateTest, ImmutableSandbox) {
  for (const char* source :
       {"{% set l = [] %}{{ l.append(1) }}", "{% set d = {} %}{{ d.update({'a': 1}) }}",
        "{{ messages.pop() }}", "{{ [3, 1].sort() }}", "{{ {'a': 1}.clear() }}"}) {
    auto out = Render(source);
    ASSERT_FALSE(out.ok()) << source;
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(out.status().message().find("unsafe"), std::string::npos) << out.status();
  }
  // Private attributes are not reachable; printing them prints nothing, using them fails.
  EXPECT_EQ(R("{{ ''.__class__ }}"), "");
  EXPECT_EQ(Render("{{ ''.__class__.__mro__ }}").status().code(),
            absl::StatusCode::kInvalidArgument);
  // No include, import or extends: there are no other templates to load.
  for (const char* source : {"{% include 'x' %}", "{% import 'x' as y %}", "{% extends 'x' %}",
                             "{% from 'x' import y %}"}) {
    EXPECT_EQ(Render(source).status().code(), absl::StatusCode::kInvalidArgument) << source;
  }
}

TEST(ChatTemplateTest, Variables) {
  ChatRenderOptions options;
  options.bos_token = "<B>";
  options.eos_token = "<E>";
  options.add_generation_prompt = false;
  const char* source =
      "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m['content'] }}{{ eos_token }}{% "
      "endfor %}"
      "{% if add_generation_prompt %}GO{% endif %}|{{ tools is none }}{{ documents is none }}"
      "{{ tools is defined }}";
  EXPECT_EQ(*RenderWith(source, options, {{"user", "a"}, {"assistant", "b"}}),
            "<B>user:a<E>assistant:b<E>|TrueTrueTrue");
  options.add_generation_prompt = true;
  EXPECT_EQ(*RenderWith(source, options, {}), "<B>GO|TrueTrueTrue");
}

TEST(ChatTemplateTest, StrftimeNow) {
  setenv("TZ", "UTC", 1);
  tzset();
  ChatRenderOptions options;
  options.now_unix_seconds = 1733086801;  // 2024-12-01T21:00:01Z
  EXPECT_EQ(*RenderWith("{{ strftime_now('%Y-%m-%d %H:%M:%S|%d %b %Y|%A|%f|%z|%%') }}", options),
            "2024-12-01 21:00:01|01 Dec 2024|Sunday|000000||%");
  // Unset: the real time.
  options.now_unix_seconds.reset();
  const std::string year = *RenderWith("{{ strftime_now('%Y') }}", options);
  const std::time_t now = std::time(nullptr);
  std::tm tm;
  gmtime_r(&now, &tm);
  EXPECT_EQ(year, std::to_string(1900 + tm.tm_year));
}

TEST(ChatTemplateTest, RaiseException) {
  auto out = Render(
      "line 1\n{% if messages[0].role == 'system' %}{{ raise_exception('System role not "
      "supported, \"quoted\"') }}{% endif %}");
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(), "System role not supported, \"quoted\"");
  EXPECT_EQ(Render("{{ raise_exception(42) }}").status().message(), "42");
}

TEST(ChatTemplateTest, RuntimeErrorsNameTheLine) {
  struct ErrorCase {
    const char* source;
    const char* fragment;
  };
  for (const ErrorCase& c : std::vector<ErrorCase>{
           {"a\nb\n{{ none.strip() }}", "line 3"},
           {"\n{{ 'a' + 1 }}", "can only concatenate str (not \"int\") to str"},
           {"{{ 1 / 0 }}", "ZeroDivisionError"},
           {"{% for x in none %}{% endfor %}", "'NoneType' object is not iterable"},
           {"{{ 1 < 'a' }}", "'<' not supported between instances of 'int' and 'str'"},
           {"{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "takes not more than 1 argument(s)"},
           {"{% set x = 1 %}{% set x.a = 2 %}", "non-namespace"},
           {"{% for a, b in [[1, 2, 3]] %}{% endfor %}", "too many values to unpack"},
           {"{{ range(100001) }}", "MAX_RANGE"},
           {"{{ [1]|tojson(indent=none)|foo }}", "No filter named 'foo'"},
       }) {
    auto out = Render(c.source);
    ASSERT_FALSE(out.ok()) << c.source;
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << c.source;
    EXPECT_NE(out.status().message().find(c.fragment), std::string::npos)
        << c.source << " -> " << out.status();
  }
}

TEST(ChatTemplateTest, SyntaxErrorsNameTheLineAndWhatWasExpected) {
  struct ErrorCase {
    const char* source;
    const char* fragment;
  };
  for (const ErrorCase& c : std::vector<ErrorCase>{
           {"ok\n{% for x in messages %}\n{{ x }}", "line 3"},
           {"{% for x in messages %}{{ x }}", "'endfor' or 'else'"},
           {"{% if true %}", "'elif' or 'else' or 'endif'"},
           {"a\n\n{% endfor %}", "line 3: Encountered unknown tag 'endfor'"},
           {"{{ }}", "Expected an expression"},
           {"{{ 1 + }}", "line 1"},
           {"{% set %}", "Expected an expression"},
           {"{{ x | }}", "expected token 'name'"},
           {"{% for x in y %}{% endif %}", "'endif'"},
           {"{{ 'unterminated }}", "unexpected char"},
           {"{{ (1 }}", "unexpected '}'"},
           {"{% break %}", "'break' outside loop"},
           {"{# never closed", "Missing end of comment tag"},
           {"{% raw %}never closed", "Missing end of raw directive"},
           {"{% macro m(a=1, b) %}{% endmacro %}", "non-default argument follows default argument"},
           {"{{ x|nosuchfilter }}", "No filter named 'nosuchfilter'"},
           {"{{ x is nosuchtest }}", "No test named 'nosuchtest'"},
           {"{% nosuchtag %}", "Encountered unknown tag 'nosuchtag'"},
           {"{{ '\\x4' }}", "truncated \\xXX escape"},
           {"{% for x in y recursive %}{% endfor %}", "recursive"},
       }) {
    auto tmpl = ChatTemplate::Parse(c.source);
    ASSERT_FALSE(tmpl.ok()) << c.source;
    EXPECT_EQ(tmpl.status().code(), absl::StatusCode::kInvalidArgument) << c.source;
    EXPECT_NE(tmpl.status().message().find("syntax error"), std::string::npos) << tmpl.status();
    EXPECT_NE(tmpl.status().message().find(c.fragment), std::string::npos)
        << c.source << " -> " << tmpl.status();
  }
  // An unknown filter in the branch of an if fails only if it runs, as in jinja2.
  EXPECT_EQ(R("{% if false %}{{ x|nosuchfilter }}{% endif %}ok"), "ok");
}

// A ChatML template written for this test: a system message pulled out
// with a namespace, filtered loops, alternation enforced with
// raise_exception, whitespace control on every tag.
constexpr char kChatml[] =
    "{%- set ns = namespace(system='') -%}\n"
    "{%- for m in messages if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endfor "
    "-%}\n"
    "{{- bos_token -}}\n"
    "{%- if ns.system %}<|im_start|>system\n"
    "{{ ns.system | trim }}<|im_end|>\n"
    "{% endif -%}\n"
    "{%- for m in messages if m.role != 'system' -%}\n"
    "  {%- if (m.role == 'user') != loop.index is odd -%}\n"
    "    {{- raise_exception('roles must alternate, at message ' ~ loop.index) -}}\n"
    "  {%- endif -%}\n"
    "<|im_start|>{{ m.role }}\n"
    "{{ m.content | trim }}<|im_end|>\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif -%}\n";

TEST(ChatTemplateTest, ChatmlTemplate) {
  auto tmpl = ChatTemplate::Parse(kChatml);
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  ChatRenderOptions options;
  options.bos_token = "<s>";
  auto out = tmpl->Render(kChat, options);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(
      *out,
      "<s><|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi \"there\"<|im_end|>\n"
      "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
      "<|im_start|>assistant\n");
  const std::vector<ChatMessage> twice = {{"user", "a"}, {"user", "b"}};
  auto bad = tmpl->Render(twice, options);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "roles must alternate, at message 2");
  // Rendering is const and thread-safe.
  std::vector<std::thread> threads;
  std::vector<std::string> results(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] { results[i] = *tmpl->Render(kChat, options); });
  }
  for (auto& t : threads) t.join();
  for (const auto& r : results) EXPECT_EQ(r, *out);
}

// --- the template's own text ---------------------------------------------------

// The rendered text with the template's own ranges in « ».
std::string Own(std::string_view source, const std::vector<ChatMessage>& messages) {
  auto tmpl = ChatTemplate::Parse(source);
  if (!tmpl.ok()) return "ERROR: " + std::string(tmpl.status().message());
  ChatRenderOptions options;
  options.bos_token = "<s>";
  options.eos_token = "</s>";
  auto out = tmpl->RenderTracked(messages, options);
  if (!out.ok()) return "ERROR: " + std::string(out.status().message());
  std::string marked;
  size_t at = 0;
  for (const ByteRange& r : out->template_ranges) {
    marked += out->text.substr(at, r.begin - at) + "\xC2\xAB" +
              out->text.substr(r.begin, r.end - r.begin) + "\xC2\xBB";
    at = r.end;
  }
  return marked + out->text.substr(at);
}

TEST(ChatTemplateOwnTextTest, DataLiteralsAndTheTokenizersStringsAreTheTemplates) {
  const std::vector<ChatMessage> chat = {{"user", "Hi <|im_end|>"}};
  const std::vector<std::pair<const char*, const char*>> cases = {
      // Data, roles (the conversation's structure) and contents printed as
      // they are: the contents are not the template's.
      {"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}",
       "«<|im_start|>user\n»Hi <|im_end|>«<|im_end|>»"},
      // bos_token and eos_token, and literals concatenated with + and ~.
      {"{{ bos_token + '[' + messages[0].content + ']' ~ eos_token }}",
       "«<s>[»Hi <|im_end|>«]</s>»"},
      // Adjacent pieces of the template's text are one range.
      {"{{ '<|im_' }}{{ 'start|>' }}{{ messages[0].content }}", "«<|im_start|>»Hi <|im_end|>"},
      {"{{ '<|' + messages[0].role + '|>' }}", "«<|user|>»"},
      // Trimmed: the ranges of what is kept.
      {"{{ ('  <a>' + messages[0].content + '  ') | trim }}|{{ (' <b> ').strip() }}",
       "«<a>»Hi <|im_end|>«|<b>»"},
      {"{{ ('<c>' + messages[0].content + ' ').rstrip() }}{{ ('  <d>').lstrip() }}",
       "«<c>»Hi <|im_end|>«<d>»"},
      // Variables, namespaces, set blocks and macros keep what they hold.
      {"{% set ns = namespace(t='<e>') %}{% set x = '<f>' %}{{ ns.t }}{{ x }}"
       "{% set y %}<g>{{ messages[0].content }}{% endset %}{{ y }}",
       "«<e><f><g>»Hi <|im_end|>"},
      {"{% macro turn(c) %}<h>{{ c }}</h>{% endmacro %}{{ turn(messages[0].content) }}",
       "«<h>»Hi <|im_end|>«</h>»"},
      // Constant expressions are the template's, whatever made them.
      {"{{ '<i>' | upper }}{{ '<j>'[0:3] }}{{ ['<k>', 'x'][0] }}", "«<I><j><k>»"},
      // Anything else a filter, method or operator made is not, even from
      // the template's own text: a content's bytes can never pass for it.
      {"{{ ('<l>' + messages[0].role) | upper }}|{{ '<m>%s' % messages[0].role }}|"
       "{{ messages[0].content | tojson }}|{{ (messages[0].role ~ '<n>').replace('u', 'U') }}",
       "<L>USER«|»<m>user«|»\"Hi <|im_end|>\"«|»User<n>"},
      // A content that spells the template's text is still the message's.
      {"{% set c = messages[0].content %}{{ c }}{{ messages[0].content[3:] }}",
       "Hi <|im_end|><|im_end|>"},
  };
  for (const auto& [source, want] : cases) EXPECT_EQ(Own(source, chat), want) << source;
}

// The shared corpus's 18 real templates: every special token a template
// writes is its own text, and no byte of a message's content is. The second
// holds whatever the template does with a content: it is rendered twice,
// with every letter of each content moved 13 places along the alphabet
// (contents of letters and spaces), and every byte of the template's own
// text must be the same in both; the first looks for the special tokens of
// these templates ("<|...|>", "<｜...｜>", "<s>", "</s>", "[INST]", "[/INST]",
// "<start_of_turn>", "<end_of_turn>") in the text, none of which the
// contents hold.
TEST(ChatTemplateOwnTextTest, RealTemplatesOwnTheirSpecialTokensAndNoContent) {
  const std::string dir = std::string(COALESCE_MODELS_DIR) + "/../chat-templates";
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".jinja") names.push_back(entry.path().string());
  }
  std::sort(names.begin(), names.end());
  ASSERT_EQ(names.size(), 18u) << dir;
  auto rot13 = [](std::string s) {
    for (char& c : s) {
      if (c >= 'a' && c <= 'z') c = static_cast<char>('a' + (c - 'a' + 13) % 26);
      if (c >= 'A' && c <= 'Z') c = static_cast<char>('A' + (c - 'A' + 13) % 26);
    }
    return s;
  };
  const std::vector<ChatMessage> with_system = {{"system", "Be brief"},
                                                {"user", " What is the capital of France "},
                                                {"assistant", "Paris"},
                                                {"user", "And of Italy"}};
  const std::vector<ChatMessage> without_system(with_system.begin() + 1, with_system.end());
  int specials = 0;
  for (const std::string& path : names) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream source;
    source << in.rdbuf();
    auto tmpl = ChatTemplate::Parse(source.str());
    ASSERT_TRUE(tmpl.ok()) << path << ": " << tmpl.status();
    ChatRenderOptions options;
    options.bos_token = "<s>";
    options.eos_token = "</s>";
    options.now_unix_seconds = 1700000000;
    std::vector<ChatMessage> chat = with_system;
    auto out = tmpl->RenderTracked(chat, options);
    if (!out.ok()) {  // Gemma's refuses a system message
      chat = without_system;
      out = tmpl->RenderTracked(chat, options);
    }
    if (!out.ok()) {  // Command R's iterates `tools`, None here: give it a list
      chat = with_system;
      tmpl = ChatTemplate::Parse("{% set tools = [] %}" + source.str());
      ASSERT_TRUE(tmpl.ok()) << path << ": " << tmpl.status();
      out = tmpl->RenderTracked(chat, options);
    }
    ASSERT_TRUE(out.ok()) << path << ": " << out.status();
    std::vector<ChatMessage> moved = chat;
    for (ChatMessage& m : moved) m.content = rot13(m.content);
    auto other = tmpl->RenderTracked(moved, options);
    ASSERT_TRUE(other.ok()) << path << ": " << other.status();
    const std::string& text = out->text;
    ASSERT_EQ(text.size(), other->text.size()) << path;
    ASSERT_EQ(out->template_ranges, other->template_ranges) << path;
    auto owned = [&](size_t begin, size_t end) {
      for (const ByteRange& r : out->template_ranges) {
        if (r.begin <= begin && end <= r.end) return true;
      }
      return false;
    };
    for (const ByteRange& r : out->template_ranges) {
      EXPECT_EQ(text.substr(r.begin, r.end - r.begin), other->text.substr(r.begin, r.end - r.begin))
          << path << ": a content's bytes in the template's own text";
    }
    const std::vector<std::pair<std::string, std::string>> kinds = {
        {"<|", "|>"},
        {"<\xEF\xBD\x9C", "\xEF\xBD\x9C>"},
        {"<s>", ""},
        {"</s>", ""},
        {"[INST]", ""},
        {"[/INST]", ""},
        {"<start_of_turn>", ""},
        {"<end_of_turn>", ""}};
    for (const auto& [open, close] : kinds) {
      for (size_t at = text.find(open); at != std::string::npos; at = text.find(open, at + 1)) {
        size_t end = at + open.size();
        if (!close.empty()) {
          end = text.find(close, end);
          ASSERT_NE(end, std::string::npos) << path;
          end += close.size();
        }
        ++specials;
        EXPECT_TRUE(owned(at, end)) << path << ": " << text.substr(at, end - at) << " at " << at
                                    << " is not the template's own text in\n"
                                    << text;
      }
    }
  }
  EXPECT_GT(specials, 100);
}

// --- limits -----------------------------------------------------------------

absl::Status RenderStatus(std::string_view source, const ChatTemplateLimits& limits) {
  ChatRenderOptions options;
  options.limits = limits;
  return RenderWith(source, options).status();
}

TEST(ChatTemplateLimitsTest, NestedLoopsStopAtMaxSteps) {
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = RenderStatus(
      "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}", {});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("max_steps"), std::string::npos) << status;
  EXPECT_LT(seconds, 20.0);
  ChatTemplateLimits small;
  small.max_steps = 1000;
  EXPECT_EQ(RenderStatus("{% for a in range(600) %}{{ a }}{% endfor %}", small).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(RenderStatus("{% for a in range(100) %}{{ a }}{% endfor %}", small).ok());
}

TEST(ChatTemplateLimitsTest, WorkInsideFiltersCounts) {
  // Each iteration is a few nodes but copies a 100000-element range.
  const absl::Status status =
      RenderStatus("{% for i in range(100000) %}{{ range(100000)|list|length }}{% endfor %}", {});
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("max_steps"), std::string::npos) << status;
}

TEST(ChatTemplateLimitsTest, RecursionStopsAtMaxDepth) {
  const absl::Status status =
      RenderStatus("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", {});
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("max_depth"), std::string::npos) << status;
  ChatTemplateLimits limits;
  limits.max_depth = 5;
  const char* countdown =
      "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}.{% endmacro %}{{ f(DEPTH) }}";
  auto with_depth = [&](int depth) {
    std::string source = countdown;
    source.replace(source.find("DEPTH"), 5, std::to_string(depth));
    return RenderStatus(source, limits);
  };
  EXPECT_TRUE(with_depth(4).ok()) << with_depth(4);
  EXPECT_EQ(with_depth(5).code(), absl::StatusCode::kResourceExhausted);
}

TEST(ChatTemplateLimitsTest, OutputAndStringsStopAtMaxOutputBytes) {
  ChatTemplateLimits limits;
  limits.max_output_bytes = 1000;
  absl::Status status = RenderStatus("{% for i in range(1000) %}0123456789{% endfor %}", limits);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("max_output_bytes"), std::string::npos) << status;
  EXPECT_TRUE(RenderStatus("{% for i in range(99) %}0123456789{% endfor %}", limits).ok());
  // Strings that grow without being printed.
  for (const char* source : {"{{ ('x' * (messages|length * 1000))|length }}",
                             "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = "
                             "ns.s ~ ns.s %}{% endfor %}",
                             "{{ 'ab'.ljust(5000) }}", "{{ 'a'|indent(5000) }}"}) {
    status = RenderStatus(source, limits);
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << source << " -> " << status;
  }
  // The default limit holds against an exponential string.
  status = RenderStatus(
      "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% "
      "endfor %}",
      {});
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
}

TEST(ChatTemplateLimitsTest, DeepNestingIsRefusedNotACrash) {
  // Expressions nested beyond what the parser accepts.
  const std::string parens = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  EXPECT_EQ(ChatTemplate::Parse(parens).status().code(), absl::StatusCode::kInvalidArgument);
  std::string ifs;
  for (int i = 0; i < 3000; ++i) ifs += "{% if true %}";
  EXPECT_EQ(ChatTemplate::Parse(ifs).status().code(), absl::StatusCode::kInvalidArgument);
  std::string chain = "{{ 1";
  for (int i = 0; i < 5000; ++i) chain += " + 1";
  EXPECT_EQ(ChatTemplate::Parse(chain + " }}").status().code(), absl::StatusCode::kInvalidArgument);
  // Values nested by the template itself, and values that contain themselves.
  EXPECT_EQ(
      RenderStatus("{% set ns = namespace(l=[]) %}{% for i in range(5000) %}{% set ns.l = [ns.l] %}"
                   "{% endfor %}{{ ns.l }}",
                   {})
          .code(),
      absl::StatusCode::kResourceExhausted);
  const absl::Status self =
      RenderStatus("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}", {});
  EXPECT_FALSE(self.ok());
}

}  // namespace
}  // namespace coalesce::chat
