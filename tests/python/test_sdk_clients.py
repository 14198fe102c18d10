"""The official SDK clients, unchanged, talk to the gateway as to OpenAI or
Azure OpenAI; the gateway maps the model to the right deployment of the
priority-1 backend and injects that backend's credential."""

from __future__ import annotations

import json

import pytest

from conftest import (
    AZURE_API_VERSION,
    CHAT_MODEL,
    EMBEDDING_MODEL,
    PTU_DEPLOYMENTS,
    STREAM_CHUNKS,
    Stack,
    header,
)

MESSAGES = [{"role": "user", "content": "Say hello"}]


def expected_stream_text(backend: str) -> str:
    """What the mock streams: "Hello from NAME" then " 1", " 2", ..."""
    return f"Hello from {backend}" + "".join(f" {i}" for i in range(1, STREAM_CHUNKS))


def collect_stream(stream) -> tuple[str, list[str | None]]:
    """Content and finish reasons of a chat completion stream, read to its end."""
    content, finish = [], []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            finish.append(choice.finish_reason)
    return "".join(content), finish


def only_request(stack: Stack) -> dict:
    """The single request the gateway sent, which must have gone to ptu."""
    assert stack.paygo.hits() == 0
    reqs = stack.ptu.requests()
    assert len(reqs) == 1, reqs
    return reqs[0]


def assert_ptu_credential(req: dict, stack: Stack) -> None:
    # Azure-kind backend: the backend key in `api-key`, and no other credential.
    assert header(req, "api-key") == stack.ptu.key
    assert header(req, "authorization") is None


# --- Both clients: OpenAI (base_url = gateway + /v1), AzureOpenAI (azure_endpoint
# = gateway) -------------------------------------------------------------------

# The query ptu gets: an OpenAI-shaped request gets the backend's api-version, an
# Azure classic one keeps the client's.
UPSTREAM_QUERY = {
    "openai": "api-version=2024-10-21",
    "azure": f"api-version={AZURE_API_VERSION}",
}


def sdk_client(stack: Stack, client_kind: str):
    return stack.openai() if client_kind == "openai" else stack.azure()


@pytest.mark.parametrize("client_kind", ["openai", "azure"])
def test_chat_completion(stack: Stack, client_kind: str) -> None:
    client = sdk_client(stack, client_kind)
    raw = client.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=MESSAGES)
    assert raw.headers["x-spillgate-backend"] == "ptu"
    assert raw.headers["x-spillgate-attempts"] == "1"
    completion = raw.parse()
    assert completion.choices[0].message.content == "Hello from ptu"
    assert completion.choices[0].finish_reason == "stop"

    req = only_request(stack)
    # To a (classic) Azure backend: the deployment in the path, the body as the SDK
    # sent it. From an OpenAI-shaped request that is a translation; Azure classic in,
    # Azure classic out, only the deployment name changes.
    assert req["method"] == "POST"
    assert req["path"] == "/openai/deployments/gpt4o-ptu/chat/completions"
    assert req["query"] == UPSTREAM_QUERY[client_kind]
    assert req["deployment"] == PTU_DEPLOYMENTS[CHAT_MODEL] == "gpt4o-ptu"
    body = json.loads(req["body"])
    assert body["model"] == CHAT_MODEL
    assert body["messages"] == MESSAGES
    assert_ptu_credential(req, stack)


@pytest.mark.parametrize("client_kind", ["openai", "azure"])
def test_chat_completion_stream(stack: Stack, client_kind: str) -> None:
    client = sdk_client(stack, client_kind)
    stream = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, stream=True)
    with stream:
        text, finish = collect_stream(stream)
    assert text == expected_stream_text("ptu")
    # Exactly one finishing chunk, and it is the last one with a choice.
    assert [f for f in finish if f is not None] == ["stop"]
    assert finish[-1] == "stop"

    st = stack.ptu.wait_for(lambda s: s["streams_completed"] == 1)
    assert st["streams_completed"] == 1
    assert st["streams_cancelled"] == 0
    req = only_request(stack)
    assert req["path"] == "/openai/deployments/gpt4o-ptu/chat/completions"
    assert req["query"] == UPSTREAM_QUERY[client_kind]
    body = json.loads(req["body"])
    assert body["model"] == CHAT_MODEL
    assert body["stream"] is True
    assert_ptu_credential(req, stack)


# --- OpenAI client, base_url = gateway + /v1 --------------------------------


def test_openai_stream_is_passed_through_to_done(stack: Stack) -> None:
    """The client gets the backend's SSE as sent, ending with `data: [DONE]`."""
    client = stack.openai()
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=MESSAGES, stream=True
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["x-spillgate-backend"] == "ptu"
    text = raw.http_response.read().decode()
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    assert len(events) == STREAM_CHUNKS + 1
    assert all(e.startswith("data: {") for e in events[:-1])


def test_openai_chat_completion_stream_with_usage(stack: Stack) -> None:
    client = stack.openai()
    stream = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    parts = []
    with stream:
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
    assert "".join(parts) == expected_stream_text("ptu")
    assert usage is not None and usage.completion_tokens == STREAM_CHUNKS


def test_openai_embeddings(stack: Stack) -> None:
    client = stack.openai()
    raw = client.embeddings.with_raw_response.create(
        model=EMBEDDING_MODEL, input=["first text", "second text"]
    )
    assert raw.headers["x-spillgate-backend"] == "ptu"
    result = raw.parse()
    assert [d.index for d in result.data] == [0, 1]
    assert all(len(d.embedding) == 8 for d in result.data)
    # Different inputs, different vectors: the response was not mixed up.
    assert result.data[0].embedding != result.data[1].embedding

    req = only_request(stack)
    assert req["path"] == f"/openai/deployments/{PTU_DEPLOYMENTS[EMBEDDING_MODEL]}/embeddings"
    assert req["deployment"] == PTU_DEPLOYMENTS[EMBEDDING_MODEL]
    body = json.loads(req["body"])
    assert body["model"] == EMBEDDING_MODEL
    assert body["input"] == ["first text", "second text"]
    assert_ptu_credential(req, stack)


def test_openai_list_models(stack: Stack) -> None:
    client = stack.openai()
    ids = {m.id for m in client.models.list()}
    assert {CHAT_MODEL, EMBEDDING_MODEL} <= ids
    # Answered from the config: no backend is asked.
    assert stack.ptu.hits() == 0 and stack.paygo.hits() == 0


# --- AzureOpenAI client, azure_endpoint = gateway ---------------------------


def test_azure_embeddings(stack: Stack) -> None:
    client = stack.azure()
    result = client.embeddings.create(model=EMBEDDING_MODEL, input="some text")
    assert len(result.data) == 1 and len(result.data[0].embedding) == 8
    req = only_request(stack)
    assert req["path"] == "/openai/deployments/emb-ptu/embeddings"
    assert_ptu_credential(req, stack)
