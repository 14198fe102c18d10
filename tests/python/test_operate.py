"""Operating the binary: JSON log lines that carry the request id, and SIGHUP
reloading the config."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

from conftest import CHAT_MODEL, Process, Stack


def admin_state(url: str) -> dict:
    with urllib.request.urlopen(url + "/admin/state", timeout=10) as resp:
        return json.load(resp)


def test_json_logs_with_request_ids_and_sighup_reload(stack: Stack, tmp_path) -> None:
    # Restart the gateway with JSON logs.
    stack.gateway.stop()
    # JSON logs, and no polling of the file: only SIGHUP can apply the edit below.
    text = (
        stack.config_path.read_text()
        .replace("[log]\n", '[log]\nformat = "json"\n', 1)
        .replace("[server]\n", '[server]\nconfig_poll = "0s"\n', 1)
    )
    stack.config_path.write_text(text)
    gateway = Process(
        [str(stack.spillgate_bin), "--config", str(stack.config_path)],
        env=stack.env,
        stderr_path=tmp_path / "json-gateway.stderr.log",
        banner="spillgate listening on ",
    )
    try:
        admin = gateway._wait_for_banner("spillgate admin on ")
        stack.url = gateway.url
        raw = stack.openai().chat.completions.with_raw_response.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        request_id = raw.headers["x-request-id"]
        assert admin_state(admin)["config"]["version"] == 1

        # SIGHUP reloads at once (weights changed in the file).
        stack.config_path.write_text(text.replace("priority = 2\n", "priority = 2\nweight = 7\n", 1))
        gateway.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        state = admin_state(admin)
        while state["config"]["version"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            state = admin_state(admin)
        assert state["config"]["version"] == 2
        assert {b["name"]: b["weight"] for b in state["backends"]}["paygo"] == 7

        # Every log line is one JSON object; the request's line carries its id.
        lines = [l for l in gateway.stderr_text().splitlines() if l.strip()]
        records = [json.loads(l) for l in lines]
        assert any(r.get("message") == "config reloaded" for r in records), lines
        request_lines = [r for r in records if r.get("message") == "request"]
        assert request_lines, lines
        spans = json.dumps(request_lines)
        assert request_id in spans, spans
    finally:
        gateway.stop()
