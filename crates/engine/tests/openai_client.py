"""The official `openai` Python client against `kvserve serve` (the tiny model).

Usage: python3 openai_client.py BASE_URL API_KEY   (BASE_URL like http://127.0.0.1:30000/v1)

Completes a chat, streams a chat and a completion (with usage), and checks that a wrong key
is refused. Prints "openai client: ok" at the end; any failure raises.
"""

import sys

import openai

base_url, api_key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)

models = client.models.list()
model = models.data[0].id
print("models:", [m.id for m in models.data])

chat = client.chat.completions.create(
    model=model,
    messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Say hello."},
    ],
    max_tokens=8,
    temperature=0,
    extra_body={"ignore_eos": True},
)
assert chat.object == "chat.completion", chat
assert chat.id.startswith("chatcmpl-"), chat.id
assert chat.choices[0].message.role == "assistant", chat
assert isinstance(chat.choices[0].message.content, str), chat
assert chat.choices[0].finish_reason == "length", chat
assert chat.usage.completion_tokens == 8, chat.usage
print("chat:", repr(chat.choices[0].message.content), chat.usage)

pieces, roles, finish = [], [], None
for chunk in client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Say hello."}],
    max_tokens=8,
    temperature=0,
    stream=True,
):
    for c in chunk.choices:
        if c.delta.role:
            roles.append(c.delta.role)
        if c.delta.content:
            pieces.append(c.delta.content)
        finish = c.finish_reason or finish
assert roles == ["assistant"], roles
assert finish in ("length", "stop"), finish
print("chat stream:", repr("".join(pieces)), finish)

# Longer than two KV pages (16 tokens each), so that the repeat below hits the prefix cache.
prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid. The capital of Germany is"
text, usage, finish = [], None, None
stream = client.completions.create(
    model=model,
    prompt=prompt,
    max_tokens=12,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"ignore_eos": True},
)
for chunk in stream:
    assert chunk.object == "text_completion", chunk
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        text.append(c.text)
        finish = c.finish_reason or finish
assert finish == "length", finish
assert usage is not None and usage.completion_tokens == 12, usage
plain = client.completions.create(
    model=model, prompt=prompt, max_tokens=12, temperature=0,
    extra_body={"ignore_eos": True},
)
assert plain.choices[0].text == "".join(text), (plain.choices[0].text, text)
assert plain.usage.prompt_tokens_details.cached_tokens > 0, plain.usage
print("completion stream:", repr("".join(text)), usage)

try:
    openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    raise AssertionError("a wrong key was accepted")
except openai.AuthenticationError as e:
    assert e.status_code == 401
    print("wrong key refused:", e.body)

print("openai client: ok")
