"""Two gateway processes sharing backend state through a real redis-server
(with a password, given by reference), driven with the official SDK: a 429
seen through one spares the backend on the other; `spillgate check --probe`
connects; an unreachable Redis is one warning in the log, not one per request,
and never a failed request."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterable

import pytest

from conftest import (
    CHAT_MODEL,
    CLIENT_KEY_VAR,
    MOCK_KEY_VAR,
    PAYGO_KEY_VAR,
    PTU_KEY_VAR,
    Mock,
    Process,
    _key,
    child_env,
    gateway_toml,
    http_json,
    run_check,
    throttled_reply,
)

MESSAGES = [{"role": "user", "content": "Say hello"}]
REDIS_PASSWORD_VAR = "SPILLGATE_TEST_REDIS_PASSWORD"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """redis-server on a free loopback port, persistence off, with a password."""

    def __init__(self, tmp: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("SKIPPED: redis-server is not installed (./test.sh installs it)")
        self.password = f"pw-{_key('redis')}"
        # The port was free when picked; something else may bind it before the server
        # does. The server then exits without logging that it is ready (an answer on the
        # port would not tell, as the other process answers too), and another port is
        # tried.
        logs = []
        for _ in range(3):
            self.port = free_port()
            log = tmp / f"redis-{self.port}.log"
            with open(log, "wb") as out:
                self.proc = subprocess.Popen(
                    [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(tmp), "--requirepass", self.password],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL,
                )
            deadline = time.monotonic() + 5
            while self.proc.poll() is None and time.monotonic() < deadline:
                if "Ready to accept connections" in log.read_text(errors="replace"):
                    return
                time.sleep(0.02)
            self.stop()
            logs.append(f"--- port {self.port}:\n{log.read_text(errors='replace')}")
        raise RuntimeError("redis-server did not start on any of 3 free ports:\n" + "\n".join(logs))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=5)


def state_toml(url: str) -> str:
    return f"""
[state]
redis_url = "{url}"
username = "default"
password = "env:{REDIS_PASSWORD_VAR}"
timeout = "100ms"
"""


class Cluster:
    def __init__(self, tmp: Path, spillgate_bin: Path, mock_bin: Path, redis_url: str, password: str) -> None:
        self.procs: list[Process] = []
        self.password = password
        keys = {"ptu": _key("ptu"), "paygo": _key("paygo")}
        self.client_key = _key("client")
        self.mocks: dict[str, Mock] = {}
        for name in ("ptu", "paygo"):
            proc = Process(
                [str(mock_bin), "--listen", "127.0.0.1:0", "--name", name,
                 "--expect-api-key-env", MOCK_KEY_VAR],
                env=child_env({MOCK_KEY_VAR: keys[name]}),
                stderr_path=tmp / f"mock-{name}.stderr.log",
                banner="spillgate-mock listening on ",
            )
            self.procs.append(proc)
            self.mocks[name] = Mock(proc, name, keys[name])
        self.config = tmp / "spillgate.toml"
        self.config.write_text(
            gateway_toml(self.mocks["ptu"].url, self.mocks["paygo"].url) + state_toml(redis_url)
        )
        self.env = child_env({
            CLIENT_KEY_VAR: self.client_key,
            PTU_KEY_VAR: keys["ptu"],
            PAYGO_KEY_VAR: keys["paygo"],
            REDIS_PASSWORD_VAR: password,
        })
        self.gateways: list[tuple[Process, str]] = []
        for i in range(2):
            gw = Process(
                [str(spillgate_bin), "--config", str(self.config)],
                env=self.env,
                stderr_path=tmp / f"gateway-{i}.stderr.log",
                banner="spillgate listening on ",
            )
            self.procs.append(gw)
            admin = gw._wait_for_banner("spillgate admin on ")
            self.gateways.append((gw, admin))

    def client(self, i: int):
        import openai

        return openai.OpenAI(
            base_url=self.gateways[i][0].url + "/v1",
            api_key=self.client_key,
            max_retries=0,
            timeout=10,
        )

    def readyz(self, i: int) -> dict:
        status, _, body = http_json("GET", self.gateways[i][0].url + "/readyz")
        assert status == 200, body
        return body

    def wait_connected(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.readyz(i)["state_store"]["connected"] for i in range(2)):
            assert time.monotonic() < deadline, [self.readyz(i)["state_store"] for i in range(2)]
            time.sleep(0.05)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture
def redis(tmp_path: Path) -> Iterable[Redis]:
    r = Redis(tmp_path)
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def cluster(tmp_path: Path, spillgate_bin: Path, mock_bin: Path, redis: Redis) -> Iterable[Cluster]:
    c = Cluster(tmp_path, spillgate_bin, mock_bin, redis.url, redis.password)
    try:
        yield c
    finally:
        c.stop()


def test_a_429_through_one_gateway_spares_the_backend_on_the_other(cluster: Cluster) -> None:
    cluster.wait_connected()
    ptu = cluster.mocks["ptu"]
    ptu.script([throttled_reply(20)])
    a, b = cluster.client(0), cluster.client(1)
    raw = a.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=MESSAGES)
    assert raw.status_code == 200
    assert raw.headers["x-spillgate-backend"] == "paygo"
    assert ptu.hits() == 1

    # B's view: the ptu deployment cooling, within two seconds.
    deadline = time.monotonic() + 2
    while True:
        backends = {x["name"]: x for x in cluster.readyz(1)["backends"]}
        if any(d["state"] == "cooling" for d in backends["ptu"]["deployments"]):
            break
        assert time.monotonic() < deadline, backends["ptu"]
        time.sleep(0.02)
    for _ in range(20):
        raw = b.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=MESSAGES)
        assert raw.status_code == 200
        assert raw.headers["x-spillgate-backend"] == "paygo"
    assert ptu.hits() == 1, "gateway B sent nothing to the throttled backend"

    # Both show the store; the admin view says where, never with the password.
    status, _, state = http_json("GET", cluster.gateways[1][1] + "/admin/state")
    assert status == 200
    store = state["state_store"]
    assert store["kind"] == "redis" and store["connected"] is True
    assert store["url"].startswith("redis://127.0.0.1:")
    assert store["received"] >= 1
    status, _, metrics = http_json("GET", cluster.gateways[1][1] + "/metrics")
    assert 'spillgate_state_store_connected{store="redis"} 1' in metrics
    a.close()
    b.close()
    for gw, _ in cluster.gateways:
        log = gw.stderr_text()
        assert cluster.password not in log
        assert "sharing backend state through Redis" in log


def test_check_probe_connects_with_the_password_from_env(
    tmp_path: Path, spillgate_bin: Path, redis: Redis
) -> None:
    config = tmp_path / "spillgate.toml"
    config.write_text(gateway_toml("http://127.0.0.1:9", "http://127.0.0.1:9") + state_toml(redis.url))
    base = {CLIENT_KEY_VAR: "c", PTU_KEY_VAR: "p", PAYGO_KEY_VAR: "q"}

    def probe(password: str) -> subprocess.CompletedProcess:
        return run_check(
            spillgate_bin, config, child_env({**base, REDIS_PASSWORD_VAR: password}), probe=True
        )

    ok = probe(redis.password)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"shared through Redis at {redis.url}" in ok.stdout
    assert f"password from {REDIS_PASSWORD_VAR}" in ok.stdout
    assert "OK: connected, Redis " in ok.stdout
    bad = probe("wrong-password")
    assert bad.returncode == 1, bad.stdout
    assert "FAILED:" in bad.stdout
    for out in (ok, bad):
        assert redis.password not in out.stdout + out.stderr
        assert "wrong-password" not in out.stdout + out.stderr


def test_an_unreachable_redis_is_one_warning_and_no_failed_request(
    tmp_path: Path, spillgate_bin: Path, mock_bin: Path
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    c = Cluster(tmp_path, spillgate_bin, mock_bin, url, "unused")
    try:
        client = c.client(0)
        for _ in range(20):
            raw = client.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=MESSAGES)
            assert raw.status_code == 200
        client.close()
        assert c.readyz(0)["state_store"] == {"kind": "redis", "connected": False}
        time.sleep(1.5)  # a few reconnection attempts
        log = c.gateways[0][0].stderr_text()
        warnings = [l for l in log.splitlines() if "Redis" in l and "WARN" in l]
        assert len(warnings) == 1, warnings
        assert "cannot reach Redis" in warnings[0]
    finally:
        c.stop()
