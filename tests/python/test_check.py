"""`spillgate check` validates a config before anything starts and names the
field that is wrong."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import (
    CLIENT_KEY_VAR,
    PAYGO_KEY_VAR,
    PTU_KEY_VAR,
    child_env,
    gateway_toml,
    run_check,
)

ENV = child_env(
    {
        CLIENT_KEY_VAR: "client-key-for-check",
        PTU_KEY_VAR: "ptu-key-for-check",
        PAYGO_KEY_VAR: "paygo-key-for-check",
    }
)


def check(
    spillgate_bin: Path, config: Path, env: dict[str, str] = ENV
) -> subprocess.CompletedProcess:
    return run_check(spillgate_bin, config, env)


def valid_toml() -> str:
    return gateway_toml("http://127.0.0.1:9", "http://127.0.0.1:10")


def test_valid_config_passes(tmp_path: Path, spillgate_bin: Path) -> None:
    config = tmp_path / "ok.toml"
    config.write_text(valid_toml())
    out = check(spillgate_bin, config)
    assert out.returncode == 0, out.stderr
    assert "config OK" in out.stdout
    # The routing table names both tiers.
    assert "ptu" in out.stdout and "paygo" in out.stdout


def test_priority_zero_is_rejected_with_its_path(tmp_path: Path, spillgate_bin: Path) -> None:
    text = valid_toml()
    assert text.count("priority = 2") == 1
    config = tmp_path / "bad.toml"
    config.write_text(text.replace("priority = 2", "priority = 0"))
    out = check(spillgate_bin, config)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "backends[1].priority: must be >= 1, got 0" in out.stderr
    assert "config OK" not in out.stdout


def test_missing_key_variable_is_rejected(tmp_path: Path, spillgate_bin: Path) -> None:
    config = tmp_path / "ok.toml"
    config.write_text(valid_toml())
    env = {k: v for k, v in ENV.items() if k != PAYGO_KEY_VAR}
    out = check(spillgate_bin, config, env)
    assert out.returncode == 2
    assert f"backends[1].api_key: environment variable {PAYGO_KEY_VAR} is not set" in out.stderr


def test_gateway_refuses_to_start_on_an_invalid_config(tmp_path: Path, spillgate_bin: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(valid_toml().replace("priority = 2", "priority = 0"))
    out = subprocess.run(
        [str(spillgate_bin), "--config", str(config)],
        env=ENV,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "backends[1].priority: must be >= 1, got 0" in out.stderr
    assert "listening" not in out.stdout


REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.toml")) + [REPO / "spillgate.example.toml"]


def test_every_shipped_example_config_is_valid(spillgate_bin: Path) -> None:
    """The files users copy must load: each is checked with its env: variables set."""
    import re
    import tomllib

    assert len(EXAMPLES) >= 4
    for path in EXAMPLES:
        text = path.read_text("utf-8")
        env = child_env({var: f"value-of-{var}" for var in re.findall(r'"env:([A-Z0-9_]+)"', text)})
        result = check(spillgate_bin, path, env)
        assert result.returncode == 0, f"{path.name}: {result.stderr}"
        out = result.stdout
        assert out.rstrip().endswith("config OK"), out
        # The routing table: at least one route, and every backend of the file in a
        # route's tier list with its priority and weight.
        assert re.search(r'^route ".+" for models .+:$', out, re.M), out
        names = [b["name"] for b in tomllib.loads(text)["backends"]]
        assert names, path.name
        for name in names:
            line = rf"^ +priority \d+ +{re.escape(name)} +weight \d+ "
            assert re.search(line, out, re.M), f"{path.name}: {name} not routed\n{out}"
