"""Conversations through the real server: Generate's `messages`,
ApplyChatTemplate, GetModelInfo's has_chat_template, --chat_template, and the
errors: no template (FAILED_PRECONDITION), a template that refuses the
conversation (INVALID_ARGUMENT carrying the template's own message), more
than one kind of input, and limits. The rendered text itself is compared
with transformers in test_gguf_server_parity.py and, template by template, in
tests/chat/test_chat_template_parity.py.

The model is stories260K-hf (its tokenizer_config.json has no chat template,
and its bos_token is "<s>"); the templates are a ChatML one written here and
Gemma 2's from ../shared/chat-templates.
"""

import os

import grpc
import pytest

from e2e_support import MODELS, start_server

HF_DIR = os.path.join(MODELS, "stories260K-hf")
GEMMA = os.path.join(MODELS, "..", "chat-templates", "google-gemma-2-2b-it.jinja")
CHATML = ("{% for m in messages %}"
          "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Once upon a time"}]


def expected_chatml(messages, add_generation_prompt):
    # CHATML, written out: each message "<|im_start|>ROLE\nCONTENT<|im_end|>\n".
    text = "".join("<|im_start|>%s\n%s<|im_end|>\n" % (m["role"], m["content"]) for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def chatml(pb, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    path.write_text(CHATML)
    server, client = start_server([], model_flags=["--model=" + HF_DIR,
                                                   "--chat_template=" + str(path)])
    client.bind(pb)
    yield client
    client.close()
    server.kill()


def test_model_info_says_there_is_a_template(chatml):
    assert chatml.info().has_chat_template


def test_apply_chat_template_renders_and_tokenizes_without_special_tokens(chatml):
    for add in (True, False):
        text, ids = chatml.apply_chat_template(CONVERSATION, add_generation_prompt=add)
        assert text == expected_chatml(CONVERSATION, add)
        assert ids == chatml.tokenize(text, False)


def test_generate_with_messages_is_generate_with_the_rendered_ids(chatml):
    _, ids = chatml.apply_chat_template(CONVERSATION)
    by_messages = chatml.generate(chatml.request(messages=CONVERSATION, max_new_tokens=24))
    by_ids = chatml.generate(chatml.request(ids=ids, max_new_tokens=24))
    assert by_messages.code is None, by_messages
    assert by_messages.ids == by_ids.ids and by_messages.text == by_ids.text
    assert by_messages.usage.prompt_tokens == len(ids)


def test_more_than_one_kind_of_input_is_refused(chatml):
    for kwargs in (dict(prompt="Hi"), dict(ids=[1, 2])):
        res = chatml.generate(chatml.request(messages=CONVERSATION, **kwargs))
        assert res.code == grpc.StatusCode.INVALID_ARGUMENT, res
        assert "exactly one of prompt, prompt_token_ids and messages" in res.details


def test_message_limits(chatml):
    res = chatml.generate(chatml.request(messages=[{"role": "", "content": "x"}]))
    assert res.code == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].role" in res.details
    many = [{"role": "user", "content": "x"}] * 1025
    res = chatml.generate(chatml.request(messages=many))
    assert res.code == grpc.StatusCode.INVALID_ARGUMENT and "at most 1024" in res.details
    with pytest.raises(grpc.RpcError) as e:
        chatml.apply_chat_template([])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in e.value.details()
    # A conversation longer than the context is refused like a long prompt.
    long = [{"role": "user", "content": "Once upon a time " * 400}]
    res = chatml.generate(chatml.request(messages=long, max_new_tokens=8))
    assert res.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the context length" in res.details, res.details
    # The server still serves.
    assert chatml.generate(chatml.request(messages=CONVERSATION, max_new_tokens=2)).code is None


def test_without_a_template_conversations_are_a_failed_precondition(pb):
    server, c = start_server([], model_flags=["--model=" + HF_DIR])
    try:
        c.bind(pb)
        assert not c.info().has_chat_template
        res = c.generate(c.request(messages=CONVERSATION))
        assert res.code == grpc.StatusCode.FAILED_PRECONDITION, res
        assert "no chat template" in res.details and "--chat_template" in res.details
        with pytest.raises(grpc.RpcError) as e:
            c.apply_chat_template(CONVERSATION)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert c.generate(c.request(prompt="Once", max_new_tokens=2)).code is None
    finally:
        c.close()
        server.kill()


def test_raise_exception_is_invalid_argument_with_the_templates_message(pb):
    server, c = start_server([], model_flags=["--model=" + HF_DIR, "--chat_template=" + GEMMA])
    try:
        c.bind(pb)
        res = c.generate(c.request(messages=CONVERSATION))  # gemma takes no system message
        assert res.code == grpc.StatusCode.INVALID_ARGUMENT, res
        assert res.details == "System role not supported", res.details
        user_only = [{"role": "user", "content": "Hi"}]
        text, _ = c.apply_chat_template(user_only)
        assert text == "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", text
    finally:
        c.close()
        server.kill()


def test_a_template_that_does_not_parse_stops_the_start(pb, tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    with pytest.raises(BaseException) as e:
        start_server([], model_flags=["--model=" + HF_DIR, "--chat_template=" + str(bad)])
    assert "cannot use the chat template" in str(e.value), str(e.value)
