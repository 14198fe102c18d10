"""Credentials stay where they belong: the client key ends at the gateway, and
each backend key goes to its own backend only, never back to a client and
never into the gateway's log."""

from __future__ import annotations

from typing import Any

import openai

from conftest import CHAT_MODEL, EMBEDDING_MODEL, Stack, http_json, run_check, throttled_reply

MESSAGES = [{"role": "user", "content": "Say hello"}]


class Seen:
    """Everything the gateway sent back to clients, as text."""

    def __init__(self) -> None:
        self.responses: list[str] = []
        self.statuses: list[int] = []

    def add_http(self, resp: Any) -> None:
        """The SDK's HTTP response: status line, every header, the whole body."""
        headers = resp.headers
        items = headers.multi_items() if hasattr(headers, "multi_items") else headers.items()
        self.statuses.append(resp.status_code)
        lines = [f"HTTP {resp.status_code}"]
        lines += [f"{k}: {v}" for k, v in items]
        lines.append(resp.read().decode("utf-8", "replace"))
        self.responses.append("\n".join(lines))

    def add(self, status: int, headers: dict[str, str], body: object) -> None:
        self.statuses.append(status)
        lines = [f"HTTP {status}"] + [f"{k}: {v}" for k, v in headers.items()]
        lines.append(str(body))
        self.responses.append("\n".join(lines))

    def raw(self, call: Any, **kwargs: Any) -> None:
        """Makes a `with_raw_response` call and keeps its response (an error
        response too)."""
        try:
            raw = call(**kwargs)
        except openai.APIStatusError as err:
            self.add_http(err.response)
            return
        self.add_http(raw.http_response)


def exercise(stack: Stack) -> Seen:
    """Successes, streams, a failover, refusals and an all-throttled answer
    through both SDK clients."""
    seen = Seen()
    for client in (stack.openai(), stack.azure()):
        chat = client.chat.completions.with_raw_response.create
        seen.raw(chat, model=CHAT_MODEL, messages=MESSAGES)
        seen.raw(chat, model=CHAT_MODEL, messages=MESSAGES, stream=True)
        seen.raw(client.embeddings.with_raw_response.create, model=EMBEDDING_MODEL, input="x")
        seen.raw(chat, model="no-such-model", messages=MESSAGES)
    for client in (stack.openai(api_key="wrong"), stack.azure(api_key="wrong")):
        chat = client.chat.completions.with_raw_response.create
        seen.raw(chat, model=CHAT_MODEL, messages=MESSAGES)

    oai_chat = stack.openai().chat.completions.with_raw_response.create
    azure_chat = stack.azure().chat.completions.with_raw_response.create
    # Failover: ptu throttles, paygo serves.
    stack.ptu.script([throttled_reply(20)])
    seen.raw(oai_chat, model=CHAT_MODEL, messages=MESSAGES)
    # A backend's own error is passed through as it is.
    stack.paygo.script([{"status": 400}])
    seen.raw(azure_chat, model=CHAT_MODEL, messages=MESSAGES)
    # All throttled (ptu is still cooling; paygo now throttles too).
    stack.paygo.set_default(throttled_reply(5))
    seen.raw(oai_chat, model=CHAT_MODEL, messages=MESSAGES)
    seen.raw(oai_chat, model=CHAT_MODEL, messages=MESSAGES, stream=True)
    # The gateway's own endpoints.
    for path in ("/healthz", "/readyz", "/v1/models", "/nope"):
        seen.add(*http_json("GET", stack.url + path, headers={"api-key": stack.client_key}))
    # Each case did what it is here for; otherwise the checks below prove little.
    assert seen.statuses == [200, 200, 200, 404] * 2 + [401, 401] + [200, 400, 429, 429] + [
        200,
        200,  # /readyz: ready even with both backends cooling (it answers 429s)
        200,
        404,
    ]
    return seen


def test_client_key_never_reaches_a_backend(stack: Stack) -> None:
    exercise(stack)
    total = 0
    for mock in stack.mocks:
        for req in mock.requests():
            total += 1
            text = "\n".join(
                [req["path"], req["query"] or "", req["body"]]
                + [f"{k}: {v}" for k, v in req["headers"]]
            )
            assert stack.client_key not in text, f"client key sent to {mock.name}: {req}"
            # Nor the other backend's key.
            for other in stack.mocks:
                if other is not mock:
                    assert other.key not in text, f"{other.name}'s key sent to {mock.name}: {req}"
    assert total >= 10


def test_backend_keys_never_reach_a_client(stack: Stack) -> None:
    seen = exercise(stack)
    assert len(seen.responses) >= 15
    for text in seen.responses:
        for key in stack.backend_keys:
            assert key not in text, f"a backend key in a response:\n{text}"


def test_backend_keys_never_reach_the_log(stack: Stack) -> None:
    exercise(stack)
    stack.gateway.stop()  # flushes everything, including shutdown messages
    log = stack.gateway_log()
    assert "cooling" in log, "the log does not show the cooldowns: is it written at all?"
    for key in stack.backend_keys + [stack.client_key]:
        assert key not in log, "a key in the gateway's log"


def test_check_does_not_print_keys(stack: Stack) -> None:
    out = run_check(stack.spillgate_bin, stack.config_path, stack.env)
    assert out.returncode == 0, out.stderr
    for key in stack.backend_keys + [stack.client_key]:
        assert key not in out.stdout + out.stderr
