"""Keyless backends through the real binary: the gateway runs with a managed
identity the way it does on App Service or Container Apps (IDENTITY_ENDPOINT
and IDENTITY_HEADER in its environment), here pointed at a mock token service
on loopback that is also the backend, and the official SDK calls it as usual.
A second backend keeps an API key."""

from __future__ import annotations

import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import openai
import pytest

from conftest import (
    AZURE_API_VERSION,
    CHAT_MODEL,
    CLIENT_KEY_VAR,
    MOCK_KEY_VAR,
    PAYGO_KEY_VAR,
    REQUEST_TIMEOUT,
    Mock,
    Process,
    child_env,
    header,
    http_json,
    run_check,
)

MESSAGES = [{"role": "user", "content": "Say hello"}]
#: The variable the mock reads the platform's identity header secret from.
MOCK_IDENTITY_HEADER_VAR = "SPILLGATE_MOCK_IDENTITY_HEADER"


def entra_toml(ptu_url: str, paygo_url: str) -> str:
    return f"""\
[server]
listen = "127.0.0.1:0"

[admin]
listen = "127.0.0.1:0"

[auth]
client_keys = ["env:{CLIENT_KEY_VAR}"]

[log]
level = "debug"

[[backends]]
name = "ptu"
kind = "azure"
url = "{ptu_url}"
priority = 1
auth = {{ entra = "managed-identity" }}

[[backends]]
name = "paygo"
kind = "azure"
url = "{paygo_url}"
priority = 2
api_key = "env:{PAYGO_KEY_VAR}"
"""


@dataclass
class EntraStack:
    ptu: Mock
    paygo: Mock
    identity_header: str
    config_path: Path
    env: dict[str, str]
    spillgate_bin: Path
    tmp_path: Path
    client_key: str
    gateway: Process | None = None
    url: str = ""
    admin_url: str = ""

    def start_gateway(self) -> None:
        self.gateway = Process(
            [str(self.spillgate_bin), "--config", str(self.config_path)],
            env=self.env,
            stderr_path=self.tmp_path / "gateway.stderr.log",
            banner="spillgate listening on ",
        )
        self.url = self.gateway.url
        self.admin_url = self.gateway._wait_for_banner("spillgate admin on ")

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=self.client_key,
            max_retries=0,
            timeout=REQUEST_TIMEOUT,
        )

    def azure(self) -> openai.AzureOpenAI:
        return openai.AzureOpenAI(
            azure_endpoint=self.url,
            api_key=self.client_key,
            api_version=AZURE_API_VERSION,
            max_retries=0,
            timeout=REQUEST_TIMEOUT,
        )

    def identity(self) -> dict:
        return self.ptu.state()["identity"]

    def wait_for(self, what, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.05)


@pytest.fixture
def entra(tmp_path: Path, spillgate_bin: Path, mock_bin: Path) -> Iterable[EntraStack]:
    started: list[Process] = []
    identity_header = f"sg-test-identity-header-{secrets.token_hex(16)}"
    paygo_key = f"sg-test-paygo-{secrets.token_hex(16)}"
    client_key = f"sg-test-client-{secrets.token_hex(16)}"
    stack = None
    try:
        ptu_proc = Process(
            [
                str(mock_bin),
                "--name",
                "ptu",
                "--identity",
                "--identity-header-env",
                MOCK_IDENTITY_HEADER_VAR,
            ],
            env=child_env({MOCK_IDENTITY_HEADER_VAR: identity_header}),
            stderr_path=tmp_path / "mock-ptu.stderr.log",
            banner="spillgate-mock listening on ",
        )
        started.append(ptu_proc)
        paygo_proc = Process(
            [str(mock_bin), "--name", "paygo", "--expect-api-key-env", MOCK_KEY_VAR],
            env=child_env({MOCK_KEY_VAR: paygo_key}),
            stderr_path=tmp_path / "mock-paygo.stderr.log",
            banner="spillgate-mock listening on ",
        )
        started.append(paygo_proc)
        config_path = tmp_path / "spillgate.toml"
        config_path.write_text(entra_toml(ptu_proc.url, paygo_proc.url))
        env = child_env(
            {
                CLIENT_KEY_VAR: client_key,
                PAYGO_KEY_VAR: paygo_key,
                # What App Service and Container Apps put in the environment.
                "IDENTITY_ENDPOINT": ptu_proc.url + "/msi/token",
                "IDENTITY_HEADER": identity_header,
            }
        )
        stack = EntraStack(
            ptu=Mock(ptu_proc, "ptu", ""),
            paygo=Mock(paygo_proc, "paygo", paygo_key),
            identity_header=identity_header,
            config_path=config_path,
            env=env,
            spillgate_bin=spillgate_bin,
            tmp_path=tmp_path,
            client_key=client_key,
        )
        yield stack
    finally:
        if stack is not None and stack.gateway is not None:
            stack.gateway.stop()
        for proc in reversed(started):
            proc.stop()


def test_managed_identity_token_reaches_the_backend_through_the_official_sdk(
    entra: EntraStack,
) -> None:
    entra.start_gateway()
    seen = []
    for client in (entra.openai(), entra.azure()):
        raw = client.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=MESSAGES)
        assert raw.headers["x-spillgate-backend"] == "ptu"
        seen.append(str(dict(raw.headers)) + raw.text)
        chunks = list(
            client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, stream=True)
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert entra.paygo.hits() == 0

    # The backend got a token from the platform's identity endpoint as a bearer token,
    # and no api-key header; the client's key never reached it.
    requests = entra.ptu.requests()
    assert len(requests) == 4
    tokens = {header(r, "authorization") for r in requests}
    assert len(tokens) == 1, tokens
    token = tokens.pop()
    assert token.startswith("Bearer mock-entra-token-ptu-")
    for r in requests:
        assert header(r, "api-key") is None
        assert entra.client_key not in str(r)

    # One token request: the App Service protocol, with the platform's secret header,
    # for the Azure OpenAI resource.
    identity = entra.identity()
    assert identity["requests"] == 1
    msi = identity["recorded"][0]
    assert msi["method"] == "GET" and msi["path"] == "/msi/token"
    assert header(msi, "x-identity-header") == entra.identity_header
    assert "resource=https%3A%2F%2Fcognitiveservices.azure.com" in msi["query"]
    assert "api-version=2019-08-01" in msi["query"]

    # Neither the token nor the platform's secret reaches a client or the log.
    status, _, readyz = http_json("GET", entra.url + "/readyz")
    assert status == 200 and readyz["backends_without_token"] == []
    status, _, state = http_json("GET", entra.admin_url + "/admin/state")
    ptu = next(b for b in state["backends"] if b["name"] == "ptu")
    assert ptu["credential"]["credential"].startswith("managed identity (system-assigned)")
    assert "(App Service / Container Apps identity endpoint)" in ptu["credential"]["endpoint"]
    assert ptu["token"] == "ready"
    seen += [str(readyz), str(state)]
    secret_token = token.removeprefix("Bearer ")
    assert entra.gateway is not None
    entra.gateway.stop()
    log = entra.gateway.stderr_text()
    assert "request" in log, "the log is written"
    for text in seen + [log]:
        assert secret_token not in text
        assert entra.identity_header not in text
        assert entra.client_key not in text


def test_identity_endpoint_down_cools_the_backend_and_the_keyed_one_serves(
    entra: EntraStack,
) -> None:
    status, _, _ = http_json("POST", entra.ptu.url + "/_mock/identity", {"failing": True})
    assert status == 200
    entra.start_gateway()
    entra.wait_for(lambda: entra.identity()["requests"] >= 1)
    for _ in range(3):
        raw = entra.azure().chat.completions.with_raw_response.create(
            model=CHAT_MODEL, messages=MESSAGES
        )
        assert raw.headers["x-spillgate-backend"] == "paygo"
    assert entra.ptu.hits() == 0

    status, _, readyz = http_json("GET", entra.url + "/readyz")
    assert status == 200
    assert readyz["backends_without_token"] == ["ptu"]
    status, _, state = http_json("GET", entra.admin_url + "/admin/state")
    ptu = next(b for b in state["backends"] if b["name"] == "ptu")
    assert (ptu["state"], ptu["reason"], ptu["token"]) == ("cooling", "auth", "missing")
    status, _, metrics = http_json("GET", entra.admin_url + "/metrics")
    assert 'spillgate_cooldowns_total{backend="ptu",reason="auth"} 1' in metrics

    # Retried in the background; the failure is logged once, with its cause.
    entra.wait_for(lambda: entra.identity()["requests"] >= 2)
    assert entra.gateway is not None
    log = entra.gateway.stderr_text()
    lines = [l for l in log.splitlines() if "could not obtain an Entra ID token" in l]
    assert len(lines) == 1, log
    assert "/msi/token" in lines[0] and "managed identity" in lines[0]
    assert entra.identity_header not in log

    # The identity endpoint recovers: the backend gets its token and serves again.
    http_json("POST", entra.ptu.url + "/_mock/identity", {"failing": False})
    entra.wait_for(
        lambda: http_json("GET", entra.url + "/readyz")[2]["backends_without_token"] == []
    )
    raw = entra.openai().chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=MESSAGES
    )
    assert raw.headers["x-spillgate-backend"] == "ptu"


def probe(entra: EntraStack, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run_check(entra.spillgate_bin, entra.config_path, env, probe=True, timeout=60)


def test_check_shows_credentials_and_probe_obtains_a_token(entra: EntraStack) -> None:
    out = run_check(entra.spillgate_bin, entra.config_path, entra.env)
    assert out.returncode == 0, out.stderr
    assert "Entra ID token (Authorization: Bearer): managed identity (system-assigned)" in out.stdout
    assert "API key (api-key header)" in out.stdout
    assert entra.identity()["requests"] == 0, "check alone asks for no token"

    out = probe(entra, entra.env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"token endpoint: {entra.ptu.url}/msi/token" in out.stdout
    assert "OK: token obtained, valid for" in out.stdout
    assert entra.identity()["requests"] == 1

    # A wrong platform secret: the probe fails, says why, exits 1, and prints neither
    # the secret it sent nor a token.
    wrong = dict(entra.env, IDENTITY_HEADER="sg-test-wrong-identity-header-0123")
    out = probe(entra, wrong)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAILED: " in out.stdout and "x-identity-header" in out.stdout
    assert "sg-test-wrong-identity-header-0123" not in out.stdout + out.stderr
    assert "mock-entra-token" not in out.stdout + out.stderr
