"""Operators see where traffic goes: after a scripted scenario the admin
listener's /metrics has exactly the expected counters, and it parses with the
Prometheus project's own parser."""

from __future__ import annotations

import time
import urllib.request

import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from conftest import CHAT_MODEL, Stack, throttled_reply

MESSAGES = [{"role": "user", "content": "hi"}]

PRIORITY = """
[priority]
stale_after = "1h"
[[priority.models]]
models = ["gpt-4o"]
low_priority_tpm_threshold = 1000000000
low_priority_rp10s_threshold = 1
"""


def scrape(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(stack.admin_url + "/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("application/openmetrics-text")
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    """A sample's value; a missing series is an error, not 0."""
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"no series {key}"
    return samples[key]


def absent(samples, name: str, **labels: str) -> bool:
    return (name, tuple(sorted(labels.items()))) not in samples


def reload_with(stack: Stack, extra: str, cooldown: str) -> None:
    """Edits the config file (more lines in [cooldown], a table appended) and waits
    until the gateway runs it."""
    text = stack.config_path.read_text().replace("[cooldown]\n", "[cooldown]\n" + cooldown, 1)
    stack.config_path.write_text(text + extra)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with urllib.request.urlopen(stack.admin_url + "/admin/state", timeout=10) as resp:
            import json

            if json.load(resp)["config"]["version"] >= 2:
                return
        time.sleep(0.05)
    pytest.fail("the config change did not take effect within 10 s")


def test_metrics_after_a_scripted_scenario(stack: Stack) -> None:
    client = stack.openai()
    # One 429 failover: ptu throttles, paygo serves.
    stack.ptu.script([throttled_reply(30)])
    client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES)
    # One 5xx: paygo fails (asking for 1 s) while ptu is cooling; nothing else to try.
    stack.paygo.script([{"status": 500, "headers": [["Retry-After", "1"]]}])
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES)
    # Request priority is turned on by editing the config file (hot reload); then N
    # successes on paygo once its 1 s cooldown (plus at most 0.1 s of jitter) is over.
    reload_with(stack, PRIORITY, "")
    # Successes now report the deployment's remaining capacity, as Azure's do.
    stack.paygo.set_default(
        {
            "status": 200,
            "headers": [
                ["x-ratelimit-remaining-tokens", "90000"],
                ["x-ratelimit-remaining-requests", "90"],
            ],
        }
    )
    time.sleep(1.2)
    n = 5
    for _ in range(n):
        client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES)
    # One low-priority refusal: the reserve (a billion tokens) is never available once
    # the deployment's capacity is known from its headers.
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, extra_headers={"x-priority": "low"})
    assert refused.value.code == "low_priority_refused"

    m = scrape(stack)
    req = "spillgate_requests_total"
    assert value(m, req, backend="paygo", status_class="2xx", priority="high", model=CHAT_MODEL) == 1 + n
    assert value(m, req, backend="-", status_class="5xx", priority="high", model=CHAT_MODEL) == 1
    assert value(m, req, backend="-", status_class="4xx", priority="low", model=CHAT_MODEL) == 1
    att = "spillgate_upstream_attempts_total"
    assert value(m, att, backend="ptu", outcome="429") == 1
    assert value(m, att, backend="paygo", outcome="5xx") == 1
    assert value(m, att, backend="paygo", outcome="2xx") == 1 + n
    assert value(m, "spillgate_failovers_total", backend="ptu", reason="429") == 1
    # paygo's 5xx had nowhere to go (ptu cooling): not a failover.
    assert absent(m, "spillgate_failovers_total", backend="paygo", reason="5xx")
    assert value(m, "spillgate_cooldowns_total", backend="ptu", reason="429") == 1
    assert value(m, "spillgate_cooldowns_total", backend="paygo", reason="5xx") == 1
    assert value(m, "spillgate_low_priority_requests_total", decision="refused", model=CHAT_MODEL) == 1
    # ptu is still cooling (30 s): its deployment's gauge shows the seconds left.
    left = value(m, "spillgate_backend_cooldown_seconds", backend="ptu", deployment="gpt4o-ptu")
    assert 20 < left <= 31
    assert value(m, "spillgate_backend_cooldown_seconds", backend="paygo", deployment="*") == 0
    # Tokens from the responses' usage, per backend and client (the key's variable name).
    tokens = [v for (name, labels), v in m.items() if name == "spillgate_tokens_total" and ("backend", "paygo") in labels]
    assert tokens and tokens[0] > 0
    # The time-to-first-byte histogram counts the high-priority requests a backend's
    # response answered: the failover and the n successes, not the 5xx the gateway
    # answered itself.
    ttfb = value(m, "spillgate_time_to_first_byte_seconds_count", priority="high")
    assert ttfb == 1 + n
    # Bounded labels: no request ids, no prompts.
    text = "\n".join(name + str(labels) for (name, labels) in m)
    assert "hi" not in text.replace("high", "")
