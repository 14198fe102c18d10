"""SIGTERM: a stream in progress completes, new connections are refused, and the
process exits 0."""

from __future__ import annotations

import signal
import socket
import time

from conftest import CHAT_MODEL, Stack


def test_sigterm_lets_a_stream_finish_and_refuses_new_connections(stack: Stack) -> None:
    # A slow stream: 15 chunks, 100 ms apart.
    stack.ptu.script([{"status": 200, "body": {"type": "stream", "chunks": 15, "interval_ms": 100}}])
    client = stack.openai()
    stream = client.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    it = iter(stream)
    first = next(it)
    assert first.choices
    stack.gateway.proc.send_signal(signal.SIGTERM)
    # New connections are refused once the gateway stops accepting.
    host, port = stack.url.removeprefix("http://").split(":")
    deadline = time.monotonic() + 5
    refused = False
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                pass
        except OSError:
            refused = True
            break
        time.sleep(0.05)
    assert refused, "new connections must be refused after SIGTERM"
    # The stream in progress completes.
    rest = list(it)
    assert len(rest) == 14
    assert stack.gateway.proc.wait(timeout=10) == 0
    assert "draining in-flight requests" in stack.gateway_log()
