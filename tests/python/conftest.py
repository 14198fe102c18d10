"""Fixtures for the end-to-end tests: real `spillgate-mock` backends and a real
`spillgate` gateway, each started as its own process on a free port of
127.0.0.1, driven with the official `openai` SDK.

Every test gets a fresh set of processes (two mocks and one gateway), because
the gateway keeps cooldowns in memory and a throttling test must not change
what the next test sees. Keys are random per test.

Binaries come from `SPILLGATE_BIN` / `SPILLGATE_MOCK_BIN`, by default
`target/debug/spillgate` and `target/debug/spillgate-mock`.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Seconds a process gets to print its "listening on" line.
STARTUP_TIMEOUT = 10.0
#: Timeout (seconds) for every SDK call and every control-API call.
REQUEST_TIMEOUT = 10.0
#: Content chunks in the mocks' default SSE stream.
STREAM_CHUNKS = 5

CLIENT_KEY_VAR = "SPILLGATE_TEST_CLIENT_KEY"
PTU_KEY_VAR = "SPILLGATE_TEST_BACKEND_KEY_PTU"
PAYGO_KEY_VAR = "SPILLGATE_TEST_BACKEND_KEY_PAYGO"
#: The variable a mock reads the key it requires from.
MOCK_KEY_VAR = "SPILLGATE_MOCK_EXPECTED_KEY"

AZURE_API_VERSION = "2024-10-21"
CHAT_MODEL = "gpt-4o"
EMBEDDING_MODEL = "text-embedding-3-small"
#: What each backend calls the models, as configured in `gateway_toml`.
PTU_DEPLOYMENTS = {CHAT_MODEL: "gpt4o-ptu", EMBEDDING_MODEL: "emb-ptu"}
PAYGO_DEPLOYMENTS = {CHAT_MODEL: CHAT_MODEL, EMBEDDING_MODEL: EMBEDDING_MODEL}


# Everything here talks to 127.0.0.1 only: make sure no proxy configured in the
# environment (CI runners often have one) sits in between.
for _var in ("NO_PROXY", "no_proxy"):
    os.environ[_var] = ",".join(
        p for p in [os.environ.get(_var, ""), "127.0.0.1", "localhost"] if p
    )


def _binary(var: str, default: str) -> Path:
    path = Path(os.environ.get(var) or REPO_ROOT / "target" / "debug" / default)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"{path} is not an executable file; run `cargo build --workspace --bins` "
            f"or set {var}",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def spillgate_bin() -> Path:
    return _binary("SPILLGATE_BIN", "spillgate")


@pytest.fixture(scope="session")
def mock_bin() -> Path:
    return _binary("SPILLGATE_MOCK_BIN", "spillgate-mock")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a child process: ours without anything that could
    change its behaviour (log filters, keys of other runs), plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "RUST_LOG"
        and not k.startswith("SPILLGATE_")
        and not k.startswith("OPENAI_")
        and not k.startswith("AZURE_OPENAI_")
    }
    env.update(extra)
    return env


class Process:
    """A child process that announces its URL with one "... listening on URL"
    line on stdout. stderr goes to a file, kept for the test to inspect."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        stderr_path: Path,
        banner: str,
    ) -> None:
        self.argv = argv
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "wb")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            cwd=REPO_ROOT,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        # A reader thread keeps stdout drained for the whole life of the
        # process and lets the banner wait have a deadline.
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        self.url = self._wait_for_banner(banner)

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode("utf-8", "replace").rstrip("\r\n"))
        self._lines.put(None)

    def _wait_for_banner(self, banner: str) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        seen: list[str] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise RuntimeError(
                    f"{self.argv[0]} did not print {banner!r} within {STARTUP_TIMEOUT} s; "
                    f"stdout: {seen!r}; stderr: {self.stderr_text()[-2000:]!r}"
                )
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait(timeout=5)
                raise RuntimeError(
                    f"{self.argv[0]} exited with {code} before listening; "
                    f"stdout: {seen!r}; stderr: {self.stderr_text()[-2000:]!r}"
                )
            seen.append(line)
            if line.startswith(banner):
                url = line[len(banner) :].strip()
                assert url.startswith("http://127.0.0.1:"), line
                return url.rstrip("/")

    def stderr_text(self) -> str:
        # The child writes to the file directly; nothing is buffered here.
        return self.stderr_path.read_text("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


def http_json(
    method: str,
    url: str,
    payload: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    """A small JSON request with the standard library, for the mocks' control
    API and the gateway's health endpoints. Returns (status, headers, body)."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as resp:
            status, hdrs, body = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        status, hdrs, body = err.code, dict(err.headers), err.read()
    text = body.decode("utf-8", "replace")
    try:
        return status, hdrs, json.loads(text) if text else None
    except ValueError:
        return status, hdrs, text


class Mock:
    """One `spillgate-mock` process and its control API."""

    def __init__(self, process: Process, name: str, key: str) -> None:
        self.process = process
        self.name = name
        self.key = key
        self.url = process.url

    def _control(self, method: str, path: str, payload: Any = None) -> Any:
        status, _, body = http_json(method, self.url + path, payload)
        assert status == 200, f"{self.name} {method} {path}: {status} {body}"
        return body

    def state(self) -> dict[str, Any]:
        return self._control("GET", "/_mock/state")

    def hits(self) -> int:
        return self.state()["hits"]

    def requests(self) -> list[dict[str, Any]]:
        return self.state()["requests"]

    def script(self, replies: list[dict[str, Any]]) -> None:
        """The next requests get these replies, in order."""
        self._control("POST", "/_mock/script", replies)

    def set_default(self, reply: dict[str, Any] | None) -> None:
        """Every request gets this reply until it is set back to None."""
        self._control("POST", "/_mock/default", reply)

    def reset(self) -> None:
        self._control("POST", "/_mock/reset")

    def wait_for(
        self, what: Callable[[dict[str, Any]], bool], timeout: float = 3.0
    ) -> dict[str, Any]:
        """Polls the state until `what(state)` holds (counters of a stream are
        updated when the mock finishes writing it, just after the client has
        read the last byte)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            if what(st) or time.monotonic() > deadline:
                return st
            time.sleep(0.02)


def throttled_reply(retry_after: int) -> dict[str, Any]:
    """Azure's answer when a deployment is over its limit."""
    return {
        "status": 429,
        "headers": [["Retry-After", str(retry_after)]],
        "body": {"type": "auto"},
        "delay_ms": 0,
    }


def header(request: dict[str, Any], name: str) -> str | None:
    """First value of a header in a request the mock recorded."""
    for k, v in request["headers"]:
        if k.lower() == name.lower():
            return v
    return None


def gateway_toml(ptu_url: str, paygo_url: str, log_level: str = "debug") -> str:
    def table(d: dict[str, str]) -> str:
        return "{ " + ", ".join(f'"{k}" = "{v}"' for k, v in d.items()) + " }"

    return f"""\
[server]
listen = "127.0.0.1:0"

[admin]
listen = "127.0.0.1:0"

[auth]
client_keys = ["env:{CLIENT_KEY_VAR}"]

[cooldown]
default_429 = "10s"

[log]
level = "{log_level}"

[[backends]]
name = "ptu"
kind = "azure"
url = "{ptu_url}"
priority = 1
api_key = "env:{PTU_KEY_VAR}"
deployments = {table(PTU_DEPLOYMENTS)}

[[backends]]
name = "paygo"
kind = "openai"
url = "{paygo_url}/v1"
priority = 2
api_key = "env:{PAYGO_KEY_VAR}"
deployments = {table(PAYGO_DEPLOYMENTS)}
"""


@dataclass
class Stack:
    """Two mock backends ("ptu" at priority 1, "paygo" at priority 2) behind
    one gateway."""

    url: str
    client_key: str
    ptu: Mock
    paygo: Mock
    gateway: Process
    config_path: Path
    env: dict[str, str]
    spillgate_bin: Path
    admin_url: str = ""
    _clients: list[Any] = field(default_factory=list)

    @property
    def mocks(self) -> list[Mock]:
        return [self.ptu, self.paygo]

    @property
    def backend_keys(self) -> list[str]:
        return [self.ptu.key, self.paygo.key]

    def gateway_log(self) -> str:
        return self.gateway.stderr_text()

    def openai(self, api_key: str | None = None) -> Any:
        import openai

        client = openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=api_key or self.client_key,
            max_retries=0,
            timeout=REQUEST_TIMEOUT,
        )
        self._clients.append(client)
        return client

    def azure(self, api_key: str | None = None) -> Any:
        import openai

        client = openai.AzureOpenAI(
            azure_endpoint=self.url,
            api_key=api_key or self.client_key,
            api_version=AZURE_API_VERSION,
            max_retries=0,
            timeout=REQUEST_TIMEOUT,
        )
        self._clients.append(client)
        return client

    def close_clients(self) -> None:
        for c in self._clients:
            c.close()


def _key(label: str) -> str:
    return f"sg-test-{label}-{secrets.token_hex(16)}"


@pytest.fixture
def stack(tmp_path: Path, spillgate_bin: Path, mock_bin: Path) -> Iterable[Stack]:
    started: list[Process] = []
    client_key = _key("client")
    keys = {"ptu": _key("ptu"), "paygo": _key("paygo")}
    stack_obj = None
    try:
        mocks = {}
        for name in ("ptu", "paygo"):
            proc = Process(
                [
                    str(mock_bin),
                    "--listen",
                    "127.0.0.1:0",
                    "--name",
                    name,
                    "--stream-chunks",
                    str(STREAM_CHUNKS),
                    "--expect-api-key-env",
                    MOCK_KEY_VAR,
                ],
                # A mock knows only its own key.
                env=child_env({MOCK_KEY_VAR: keys[name]}),
                stderr_path=tmp_path / f"mock-{name}.stderr.log",
                banner="spillgate-mock listening on ",
            )
            started.append(proc)
            mocks[name] = Mock(proc, name, keys[name])

        config_path = tmp_path / "spillgate.toml"
        config_path.write_text(gateway_toml(mocks["ptu"].url, mocks["paygo"].url))
        env = child_env(
            {
                CLIENT_KEY_VAR: client_key,
                PTU_KEY_VAR: keys["ptu"],
                PAYGO_KEY_VAR: keys["paygo"],
            }
        )
        gateway = Process(
            [str(spillgate_bin), "--config", str(config_path)],
            env=env,
            stderr_path=tmp_path / "gateway.stderr.log",
            banner="spillgate listening on ",
        )
        started.append(gateway)
        stack_obj = Stack(
            url=gateway.url,
            client_key=client_key,
            ptu=mocks["ptu"],
            paygo=mocks["paygo"],
            gateway=gateway,
            config_path=config_path,
            env=env,
            spillgate_bin=spillgate_bin,
            # Printed right after the listening line.
            admin_url=gateway._wait_for_banner("spillgate admin on "),
        )
        yield stack_obj
    finally:
        if stack_obj is not None:
            stack_obj.close_clients()
        for proc in reversed(started):
            proc.stop()


def run_check(
    spillgate_bin: Path, config: Path, env: dict[str, str], probe: bool = False, timeout: float = 30
) -> subprocess.CompletedProcess:
    """`spillgate check [--probe] --config CONFIG` with `env`, its output captured."""
    args = [str(spillgate_bin), "check"] + (["--probe"] if probe else []) + ["--config", str(config)]
    return subprocess.run(
        args, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
