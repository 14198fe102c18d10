#!/usr/bin/env bash
# A profile-guided (PGO) release build of the gateway: an instrumented build serves a
# training load in front of the mock backend on loopback, and the release build is
# compiled again with the profile it wrote, so that the compiler lays out and inlines
# the request path for how it runs. Same code, same behaviour as `cargo build --release`;
# 0.905× its CPU a JSON request in bench/README's A/B.
#
#   bench/pgo.sh                  # writes target/pgo/release/spillgate (the plain release
#                                 # build for the mock, then the instrumented and the
#                                 # profile-guided ones: about 13 minutes on 2 cores; the
#                                 # instrumented one is kept in target/pgo-gen for the next run)
#   TRAIN_SECS=10 bench/pgo.sh    # seconds of each training load (5)
#   SMOKE=1 bench/pgo.sh          # the training load only, one second each, against the
#                                 # debug build (what ./test.sh runs; no profile, no build)
#
# Measure it with the other scripts: `SPILLGATE_BIN=target/pgo/release/spillgate
# bench/overhead.sh`, or against a plain build of a commit with bench/ab.sh.
#
# Needs the toolchain's llvm-profdata (`rustup component add llvm-tools`, done here when
# missing) and wrk (installed with apt-get when missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
TRAIN_SECS=${TRAIN_SECS:-5}
[[ -n ${SMOKE:-} ]] && TRAIN_SECS=1

. bench/lib.sh
need wrk wrk
# The mock (and, in a smoke run, the gateway trained against): the plain build.
build_bins
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
[[ $TARGET = /* ]] || TARGET=$ROOT/$TARGET

# spillgate_azure_toml <file> <listen_port> <backend_port>: one Azure OpenAI backend
# (classic deployment paths, an `api-key`), as most deployments have.
spillgate_azure_toml() {
    {
        spillgate_server_toml "$2"
        cat <<EOF
[[backends]]
name = "azure"
kind = "azure"
url = "http://127.0.0.1:$3"
api_key = "env:SPILLGATE_PGO_KEY"
deployments = { "gpt-4o" = "gpt4o" }
EOF
    } >"$1"
}

# train <gateway binary>: JSON, JSON with the OpenAI SDK's headers answered with Azure's
# rate-limit headers, and SSE streams, through the bench's two tiers of OpenAI backends
# and through an Azure backend; each load TRAIN_SECS at 64 connections. Fails on any
# error, so that a profile is never taken from a load that was refused.
train() {
    local gw=$1 config mock port pid body headers out requests errors
    start_mock 0
    local plain=$PORT
    MOCK_LIMITS=1 start_mock 0
    local limited=$PORT
    wait_port "$plain"
    wait_port "$limited"
    for config in openai:$plain openai:$limited azure:$limited; do
        mock=${config#*:}
        port=$(free_port)
        if [[ ${config%%:*} == azure ]]; then
            spillgate_azure_toml "$WORK/train.toml" "$port" "$mock"
        else
            spillgate_toml "$WORK/train.toml" "$port" "$mock"
        fi
        SPILLGATE_PGO_KEY=training "$gw" --config "$WORK/train.toml" >/dev/null 2>"$WORK/train.log" &
        pid=$!
        # Killed by lib.sh's cleanup too when the script fails before it stops it.
        PIDS+=("$pid")
        wait_port "$port" 10
        for body in "$JSON" "$SSE"; do
            headers=""
            [[ $mock == "$limited" && $body == "$JSON" ]] && headers=$SDK_HEADERS
            out=$(BODY=$body HEADERS=$headers wrk -t1 -c64 -d"${TRAIN_SECS}s" --timeout 10s \
                -s "$WORK/post.lua" "http://127.0.0.1:$port/v1/chat/completions" | grep '^RESULT')
            read -r _ requests _ _ _ _ errors <<<"$out"
            if [[ $errors != 0 || $requests == 0 ]]; then
                echo "pgo.sh: training load ($config): $errors errors in $requests requests" >&2
                cat "$WORK/train.log" >&2
                exit 1
            fi
            echo "trained: ${config%%:*} backend, $( [[ $body == "$SSE" ]] && echo SSE || echo JSON)$( [[ -n $headers ]] && echo ' with the SDK headers'), $requests requests" >&2
        done
        # A clean stop: the profile is written when the process exits.
        kill -TERM "$pid"
        await_exit "$pid" 60 "the training gateway"
    done
}

if [[ -n ${SMOKE:-} ]]; then
    train "$BIN/spillgate"
    echo "pgo.sh smoke: training load served"
    exit 0
fi

# find_profdata: the toolchain's llvm-profdata, or nothing.
find_profdata() {
    find "$(rustc --print sysroot)" -name llvm-profdata -type f 2>/dev/null | head -1 || true
}
PROFDATA=$(find_profdata)
if [[ -z $PROFDATA ]]; then
    rustup component add llvm-tools >&2
    PROFDATA=$(find_profdata)
fi
if [[ -z $PROFDATA ]]; then
    echo "pgo.sh: no llvm-profdata in $(rustc --print sysroot) after 'rustup component add llvm-tools'" >&2
    exit 1
fi

# A fixed place, so that the instrumented build (whose flags name it) is built once and
# kept; the profile-guided build's flags name this run's profile, so it is always built.
RAW=$TARGET/pgo-gen/profiles
echo "building the instrumented gateway (target/pgo-gen)" >&2
CARGO_TARGET_DIR=$TARGET/pgo-gen RUSTFLAGS="-Cprofile-generate=$RAW" \
    cargo build -q --release -p spillgate
# Build scripts and proc macros of that build wrote profiles of their own.
rm -rf "$RAW"
train "$TARGET/pgo-gen/release/spillgate"
"$PROFDATA" merge -o "$WORK/spillgate.profdata" "$RAW"
echo "building the gateway with the profile (target/pgo)" >&2
CARGO_TARGET_DIR=$TARGET/pgo RUSTFLAGS="-Cprofile-use=$WORK/spillgate.profdata" \
    cargo build -q --release -p spillgate
echo "$TARGET/pgo/release/spillgate"
