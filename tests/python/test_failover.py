"""Throttling: a 429 from the priority-1 backend sends the same request on to
the next tier at once, the throttled backend is skipped for as long as its
Retry-After says, and when every backend is throttled the client gets one 429
it can act on."""

from __future__ import annotations

import json
import math

import openai
import pytest

from conftest import CHAT_MODEL, STREAM_CHUNKS, Stack, header, http_json, throttled_reply

MESSAGES = [{"role": "user", "content": "Say hello"}]


def stream_text(stream) -> str:
    parts = []
    with stream:
        for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
    return "".join(parts)


def paygo_text() -> str:
    return "Hello from paygo" + "".join(f" {i}" for i in range(1, STREAM_CHUNKS))


def test_throttled_ptu_fails_over_to_paygo(stack: Stack) -> None:
    stack.ptu.script([throttled_reply(20)])
    client = stack.openai()

    raw = client.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=MESSAGES)
    assert raw.status_code == 200
    assert raw.headers["x-spillgate-backend"] == "paygo"
    assert raw.headers["x-spillgate-attempts"] == "2"
    assert raw.parse().choices[0].message.content == "Hello from paygo"

    ptu = stack.ptu.state()
    assert (ptu["hits"], ptu["hits_429"]) == (1, 1)
    paygo_reqs = stack.paygo.requests()
    assert len(paygo_reqs) == 1
    req = paygo_reqs[0]
    # The same request, rewritten for an OpenAI-kind backend.
    assert req["path"] == "/v1/chat/completions"
    assert header(req, "authorization") == f"Bearer {stack.paygo.key}"
    assert header(req, "api-key") is None
    body = json.loads(req["body"])
    assert body["model"] == CHAT_MODEL
    assert body["messages"] == MESSAGES
    # The body paygo got is the body ptu got, apart from the model name.
    ptu_body = json.loads(ptu["requests"][0]["body"])
    assert {k: v for k, v in ptu_body.items() if k != "model"} == {
        k: v for k, v in body.items() if k != "model"
    }


def test_throttled_ptu_is_skipped_while_cooling(stack: Stack) -> None:
    stack.ptu.script([throttled_reply(20)])
    oai = stack.openai()
    azure = stack.azure()

    first = oai.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=MESSAGES)
    assert first.headers["x-spillgate-backend"] == "paygo"
    assert first.headers["x-spillgate-attempts"] == "2"
    assert stack.ptu.hits() == 1

    # Every following request goes straight to paygo: one attempt, and the
    # ptu mock sees nothing more, whatever the client and whether streaming.
    for client, label in ((oai, "openai"), (azure, "azure")):
        raw = client.chat.completions.with_raw_response.create(
            model=CHAT_MODEL, messages=MESSAGES
        )
        assert raw.headers["x-spillgate-backend"] == "paygo", label
        assert raw.headers["x-spillgate-attempts"] == "1", label
        assert raw.parse().choices[0].message.content == "Hello from paygo", label

        raw = client.chat.completions.with_raw_response.create(
            model=CHAT_MODEL, messages=MESSAGES, stream=True
        )
        assert raw.headers["x-spillgate-backend"] == "paygo", label
        assert raw.headers["x-spillgate-attempts"] == "1", label
        assert stream_text(raw.parse()) == paygo_text(), label

        # And through the plain SDK calls, as applications make them.
        assert (
            client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES)
            .choices[0]
            .message.content
            == "Hello from paygo"
        ), label
        assert (
            stream_text(
                client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, stream=True)
            )
            == paygo_text()
        ), label

    assert stack.ptu.hits() == 1
    paygo = stack.paygo.wait_for(lambda s: s["streams_completed"] == 4)
    assert paygo["hits"] == 9
    assert paygo["streams_completed"] == 4
    assert paygo["streams_cancelled"] == 0
    # The Azure client's requests reached paygo in OpenAI's shape: the last 4 of the
    # 9 (the failover and the OpenAI client's 4 came first).
    assert len(paygo["requests"]) == 9
    azure_reqs = paygo["requests"][5:]
    for r in azure_reqs:
        assert r["path"] == "/v1/chat/completions"
        assert "api-version" not in (r["query"] or "")
        assert json.loads(r["body"])["model"] == CHAT_MODEL


def test_cooldown_follows_retry_after(stack: Stack) -> None:
    """The configured default is 10 s; the backend said 20 s, which wins."""
    stack.ptu.script([throttled_reply(20)])
    stack.openai().chat.completions.create(model=CHAT_MODEL, messages=MESSAGES)
    status, _, ready = http_json("GET", stack.url + "/readyz")
    assert status == 200, ready
    by_name = {b["name"]: b for b in ready["backends"]}
    # A 429 is the deployment's: the resource itself stays ready.
    assert by_name["ptu"]["state"] == "ready"
    deployments = {d["name"]: d for d in by_name["ptu"]["deployments"]}
    ptu_chat = deployments["gpt4o-ptu"]
    assert ptu_chat["state"] == "cooling"
    assert ptu_chat["reason"] == "429"
    # Retry-After: 20 plus at most 1 s of jitter (10% of the cooldown, capped).
    assert 15_000 < ptu_chat["cooling_ms"] <= 21_000
    assert all(d["state"] == "ready" for d in by_name["paygo"]["deployments"])


@pytest.mark.parametrize("client_kind", ["openai", "azure"])
def test_all_backends_throttled(stack: Stack, client_kind: str) -> None:
    stack.ptu.set_default(throttled_reply(20))
    stack.paygo.set_default(throttled_reply(5))
    client = stack.openai() if client_kind == "openai" else stack.azure()

    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES)
    err = info.value
    assert err.status_code == 429
    assert err.code == "all_backends_throttled"
    assert err.type == "rate_limit_error"
    body = err.response.json()
    assert body["error"]["code"] == "all_backends_throttled"
    assert body["error"]["type"] == "rate_limit_error"
    assert body["error"]["message"]
    headers = err.response.headers
    assert headers["x-spillgate-attempts"] == "2"
    # The soonest recovery: paygo's 5 s (plus at most 0.5 s of jitter), in whole
    # seconds (rounded up) and in ms.
    retry_after_ms = int(headers["retry-after-ms"])
    assert 3_000 < retry_after_ms <= 5_500
    assert int(headers["retry-after"]) == math.ceil(retry_after_ms / 1000)
    assert (stack.ptu.hits(), stack.paygo.hits()) == (1, 1)

    # While both cool down the gateway answers at once, without asking either.
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, stream=True)
    assert info.value.code == "all_backends_throttled"
    assert info.value.response.headers["x-spillgate-attempts"] == "0"
    assert int(info.value.response.headers["retry-after-ms"]) <= retry_after_ms
    assert "retry-after" in info.value.response.headers
    assert (stack.ptu.hits(), stack.paygo.hits()) == (1, 1)
