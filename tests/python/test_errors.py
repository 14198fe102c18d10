"""Requests the gateway refuses itself raise the SDK's usual exceptions, and
never reach a backend."""

from __future__ import annotations

import openai
import pytest

from conftest import CHAT_MODEL, Stack

MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.mark.parametrize("client_kind", ["openai", "azure"])
def test_wrong_client_key(stack: Stack, client_kind: str) -> None:
    wrong = stack.client_key + "-wrong"
    client = stack.openai(api_key=wrong) if client_kind == "openai" else stack.azure(api_key=wrong)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, stream=True)
    with pytest.raises(openai.AuthenticationError):
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert stack.ptu.hits() == 0 and stack.paygo.hits() == 0


def test_backend_key_is_not_a_client_key(stack: Stack) -> None:
    """A backend's key does not open the gateway."""
    for key in stack.backend_keys:
        with pytest.raises(openai.AuthenticationError):
            stack.openai(api_key=key).chat.completions.create(model=CHAT_MODEL, messages=MESSAGES)
    assert stack.ptu.hits() == 0 and stack.paygo.hits() == 0


@pytest.mark.parametrize("client_kind", ["openai", "azure"])
def test_unknown_model(stack: Stack, client_kind: str) -> None:
    client = stack.openai() if client_kind == "openai" else stack.azure()
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, stream=True)
    assert info.value.code == "model_not_found"
    assert stack.ptu.hits() == 0 and stack.paygo.hits() == 0
