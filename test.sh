#!/usr/bin/env bash
# The project's one test command: formatting, lints, build, Rust tests, a demo
# smoke run and the end-to-end tests with the official OpenAI SDK.
#
# Works on a fresh Debian machine with Rust installed: missing system packages
# (redis-server, chromium, openssl, python3-venv) are installed with apt-get, the Python tools go
# into .venv. Exits non-zero on the first failure.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$PWD

START=$SECONDS
STEP="setup"
STEP_START=$SECONDS

# Set by the last line: an exit before it (a signal, say, which leaves $? at the last
# command's 0) is never reported as a pass.
COMPLETED=0
# The `timeout` of the step that runs under `bounded`, for the exit trap to end.
BOUNDED_PID=""
finish() {
    local code=$?
    local total=$((SECONDS - START))
    if [[ -n $BOUNDED_PID ]]; then
        # timeout passes the signal on to the step's processes, and kills them 30 s later
        # if they are still there.
        kill "$BOUNDED_PID" 2>/dev/null || true
        wait "$BOUNDED_PID" 2>/dev/null || true
    fi
    echo
    if [[ $code -eq 0 && $COMPLETED -eq 1 ]]; then
        echo "test.sh: ALL CHECKS PASSED in ${total}s"
    else
        echo "test.sh: FAILED at step '${STEP}' (exit code ${code}) after ${total}s" >&2
    fi
}
trap finish EXIT
for sig in HUP INT TERM; do
    # shellcheck disable=SC2064 # the signal's name is meant to be fixed here
    trap "echo 'test.sh: stopped by SIG${sig}' >&2; exit 1" "$sig"
done

# bounded <seconds> [--log <file>] <command>...: runs a command with a time limit, so
# that one that hangs fails here, named, instead of holding the whole run until CI's own
# limit. timeout(1) gives the command a process group of its own and, at the limit,
# sends SIGTERM to all of it, then SIGKILL 30 s later. The command runs in the background
# and is waited for: `wait` gives way to a signal's trap at once (Ctrl-C included, which
# the command's own group does not get), where a command in the foreground would hold
# the trap until it ended. With --log, its output goes to the file as well.
bounded() {
    local limit=$1 code=0 began=$SECONDS log=""
    shift
    if [[ $1 == --log ]]; then
        log=$2
        shift 2
    fi
    local out tee_pid=""
    if [[ -n $log ]]; then
        exec {out}> >(tee "$log")
        tee_pid=$!
        timeout --kill-after=30 "$limit" "$@" >&"$out" 2>&1 &
        BOUNDED_PID=$!
        exec {out}>&-
    else
        timeout --kill-after=30 "$limit" "$@" &
        BOUNDED_PID=$!
    fi
    wait "$BOUNDED_PID" || code=$?
    BOUNDED_PID=""
    if [[ -n $tee_pid ]]; then
        # tee ends when the last of the command's processes has closed the pipe: its
        # output comes before the next step's, unless something left behind holds it.
        for _ in $(seq 1 100); do
            kill -0 "$tee_pid" 2>/dev/null || break
            sleep 0.1
        done
    fi
    if [[ $code -ne 0 && $((SECONDS - began)) -ge $limit ]]; then
        echo "test.sh: '$*' did not end within ${limit}s" >&2
    fi
    return "$code"
}

step() {
    if [[ $STEP != "setup" ]]; then
        echo "    (${STEP}: $((SECONDS - STEP_START))s)"
    fi
    STEP=$1
    STEP_START=$SECONDS
    echo
    echo "==> ${STEP}"
}

# ---------------------------------------------------------------------------
# System packages
# ---------------------------------------------------------------------------

APT_UPDATED=0
apt_install() {
    local sudo=()
    if [[ $(id -u) -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1; then
            sudo=(sudo -n)
        else
            echo "error: need to install $*, but not running as root and sudo is not available" >&2
            return 1
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: need to install $*, but apt-get is not available; install it by hand" >&2
        return 1
    fi
    if [[ $APT_UPDATED -eq 0 ]]; then
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null
        APT_UPDATED=1
    fi
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" </dev/null
}

step "system packages"
if ! command -v redis-server >/dev/null 2>&1; then
    echo "redis-server not found; installing it"
    apt_install redis-server
fi
echo "redis-server: $(command -v redis-server)"
# The dashboard test drives Debian's chromium with Playwright (no browser download).
if ! command -v chromium >/dev/null 2>&1; then
    echo "chromium not found; installing it"
    apt_install chromium
fi
echo "chromium: $(command -v chromium)"
# The TLS tests (a rediss:// Redis, an HTTPS backend) make their certificates with it.
if ! command -v openssl >/dev/null 2>&1; then
    echo "openssl not found; installing it"
    apt_install openssl
fi
if ! command -v python3 >/dev/null 2>&1; then
    echo "python3 not found; installing it"
    apt_install python3 python3-venv
fi
echo "python3: $(command -v python3) ($(python3 --version 2>&1))"

# ---------------------------------------------------------------------------
# Python environment for the end-to-end tests
# ---------------------------------------------------------------------------

step "python venv (.venv)"
VENV=$ROOT/.venv
PY=$VENV/bin/python
if [[ -d $VENV ]] && ! "$PY" -c 'import sys' >/dev/null 2>&1; then
    echo ".venv exists but does not work; recreating it"
    rm -rf "$VENV"
fi
if [[ ! -x $PY ]]; then
    if ! python3 -m venv "$VENV"; then
        # Debian ships venv (ensurepip) as a separate package.
        rm -rf "$VENV"
        echo "python3 -m venv failed; installing python3-venv"
        apt_install python3-venv
        python3 -m venv "$VENV"
    fi
fi
if ! "$PY" -c 'import openai, pytest, prometheus_client, playwright' >/dev/null 2>&1; then
    "$PY" -m pip install -q --disable-pip-version-check openai pytest prometheus_client playwright </dev/null
fi
"$PY" -c 'import openai, pytest; print(f"openai {openai.__version__}, pytest {pytest.__version__}")'

# ---------------------------------------------------------------------------
# Rust
# ---------------------------------------------------------------------------

if [[ ${CI:-} == true ]]; then
    # A clean build that is thrown away: incremental artifacts only cost time.
    export CARGO_INCREMENTAL=0
fi
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

if command -v rustup >/dev/null 2>&1; then
    missing=()
    cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
    cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
    if [[ ${#missing[@]} -gt 0 ]]; then
        step "rustup components"
        rustup component add "${missing[@]}"
    fi
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo build"
cargo build --workspace --bins

step "cargo test"
LOGDIR=$(mktemp -d)
bounded 2400 --log "$LOGDIR/cargo-test.log" cargo test --workspace

step "benchmark smoke runs"
# Each benchmark runs a few seconds under `cargo test --bench` so it cannot rot.
bounded 900 cargo test --workspace --bench '*'
# The overhead benchmark (wrk, nginx and the gateway on loopback), one short case of each
# part, on the debug build: it fails on any error, not on any number.
SMOKE=1 bounded 900 bench/overhead.sh
# Two builds in alternation (here the debug build against itself), a pass of each, in
# CPU time a JSON request and in time to a stream's first event.
SMOKE=1 bounded 900 bench/ab.sh
SMOKE=1 FIRST_EVENT=1 bounded 900 bench/ab.sh
# Instructions (and simulated cache misses, and atomic instructions) per request under
# callgrind, nginx and the gateway, one short run.
SMOKE=1 CACHE=1 LOCKS=1 TOP=5 bounded 900 bench/instructions.sh
# Each proxy's CPU time by function, sampled with perf: one round of a second.
SMOKE=1 bounded 900 bench/profile.sh
# A stream's first event, call by call, in each proxy (perf's system call tracing).
SMOKE=1 bounded 900 bench/timeline.sh
# The copies (memcpy and memmove calls) a JSON request makes, counted with gdb.
SMOKE=1 bounded 900 bench/copies.sh
# Reading request bodies for their model: each kind of prompt read once.
SMOKE=1 bounded 900 bench/body.sh
# The profile-guided build's training load, a second of each, against the debug build.
SMOKE=1 bounded 900 bench/pgo.sh

TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
[[ $TARGET_DIR = /* ]] || TARGET_DIR=$ROOT/$TARGET_DIR
export SPILLGATE_BIN=$TARGET_DIR/debug/spillgate
export SPILLGATE_MOCK_BIN=$TARGET_DIR/debug/spillgate-mock

# ---------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------

step "demo smoke run"
# --exit: stop when the load ends (without it the demo serves on until Ctrl-C).
bounded 60 "$SPILLGATE_BIN" demo --load --exit --seconds 3 --listen 127.0.0.1:0 </dev/null

step "pytest tests/python"
bounded 1200 --log "$LOGDIR/pytest.log" "$PY" -m pytest tests/python -q </dev/null

echo "    (${STEP}: $((SECONDS - STEP_START))s)"

# One closing line for the whole run: the Rust and Python counts added up.
rust_passed=$(grep -Eo 'test result: ok\. [0-9]+ passed' "$LOGDIR/cargo-test.log" | awk '{s += $4} END {print s + 0}')
py_passed=$(grep -Eo '[0-9]+ passed' "$LOGDIR/pytest.log" | tail -n 1 | awk '{print $1 + 0}')
echo
echo "rust: ${rust_passed} passed, python: ${py_passed:-0} passed"
echo "summary: $((rust_passed + ${py_passed:-0})) passed, 0 failed"
rm -rf "$LOGDIR"
COMPLETED=1
