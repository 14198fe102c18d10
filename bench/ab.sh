#!/usr/bin/env bash
# Two builds of the gateway, in alternation, in front of one mock backend: each build's
# CPU time per request (user+sys of its process over a pass, divided by the requests it
# served) and requests/s, as medians of the passes with their range. What a change to the
# request path does to the gateway's own cost, on a machine whose speed moves more
# between runs of bench/overhead.sh than the change does.
#
#   bench/ab.sh 20ee176                 # that commit against the working tree, JSON
#   SDK=1 bench/ab.sh 20ee176           # with the OpenAI SDK's headers, answered with
#                                       # Azure's x-ratelimit-* headers
#   ROUNDS=8 PASS_SECS=4 bench/ab.sh 20ee176  # passes of each build (6), seconds each (4)
#   SMOKE=1 bench/ab.sh                 # seconds, the debug build against itself
#   AB_PASSES=1 bench/ab.sh 20ee176     # also print each pass's CPU µs a request
#   SPILLGATE_BIN=target/pgo/release/spillgate bench/ab.sh HEAD
#                                       # that binary (bench/pgo.sh's) in place of the
#                                       # working tree's plain release build
#
# The other commit is built in a git worktree, into target/ab (kept between runs: after
# the first, only the gateway's own crates build again). wrk -c64 (two threads) against
# each build in turn, the order swapped every round, after a 1 s warm-up of each.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
ROUNDS=${ROUNDS:-6}
PASS_SECS=${PASS_SECS:-4}
if [[ -n ${SMOKE:-} ]]; then
    ROUNDS=1; PASS_SECS=1
elif [[ $# -ne 1 ]]; then
    echo "usage: bench/ab.sh <commit>  (or SMOKE=1 bench/ab.sh)" >&2
    exit 2
fi

. bench/lib.sh
need wrk wrk
build_bins
NEW=$GATEWAY
if [[ -n ${SMOKE:-} ]]; then
    OLD=$NEW
    OLD_NAME="the same build"
else
    OLD_NAME=$(git rev-parse --short "$1^{commit}")
    git worktree add -q --detach "$WORK/old" "$OLD_NAME"
    # Removed before lib.sh's cleanup deletes its directory.
    trap 'git worktree remove --force "$WORK/old" 2>/dev/null || true; cleanup' EXIT
    AB_TARGET=${CARGO_TARGET_DIR:-$ROOT/target}/ab
    [[ $AB_TARGET = /* ]] || AB_TARGET=$ROOT/$AB_TARGET
    (cd "$WORK/old" && CARGO_TARGET_DIR=$AB_TARGET cargo build -q --release -p spillgate)
    OLD=$AB_TARGET/release/spillgate
fi

[[ -n ${SDK:-} ]] && export MOCK_LIMITS=1 HEADERS=$SDK_HEADERS
export BODY=$JSON
start_mock 0
MOCK_PORT=$PORT
wait_port "$MOCK_PORT"

declare -A GW_PORT GW_PID CPU RPS
for build in old new; do
    GW_PORT[$build]=$(free_port)
    spillgate_toml "$WORK/$build.toml" "${GW_PORT[$build]}" "$MOCK_PORT"
    bin=$OLD
    [[ $build == new ]] && bin=$NEW
    "$bin" --config "$WORK/$build.toml" >/dev/null 2>"$WORK/$build.log" &
    PIDS+=($!)
    GW_PID[$build]=$!
    wait_port "${GW_PORT[$build]}" 10
done

# pass <build> <seconds>: one wrk run against it; appends its CPU µs a request and its
# requests/s to CPU[build] and RPS[build].
pass() {
    local url="http://127.0.0.1:${GW_PORT[$1]}/v1/chat/completions" before after out req dur err
    before=$(cpu_total "${GW_PID[$1]}")
    out=$(wrk -t2 -c64 -d"$2s" --timeout 10s -s "$WORK/post.lua" "$url" 2>/dev/null | grep '^RESULT')
    after=$(cpu_total "${GW_PID[$1]}")
    read -r _ req dur _ _ _ err <<<"$out"
    if [[ $err != 0 || $req == 0 ]]; then
        echo "ab.sh: $1 build: $err errors in $req requests" >&2
        exit 1
    fi
    CPU[$1]="${CPU[$1]:-} $(awk -v a="$before" -v b="$after" -v r="$req" 'BEGIN {printf "%.2f", (b - a) * 1e6 / r}')"
    RPS[$1]="${RPS[$1]:-} $(awk -v r="$req" -v d="$dur" 'BEGIN {printf "%.0f", r / (d / 1e6)}')"
}

for build in old new; do wrk -t2 -c64 -d1s -s "$WORK/post.lua" "http://127.0.0.1:${GW_PORT[$build]}/v1/chat/completions" >/dev/null; done
for round in $(seq 1 "$ROUNDS"); do
    order=(old new)
    (( round % 2 == 0 )) && order=(new old)
    for build in "${order[@]}"; do pass "$build" "$PASS_SECS"; done
done

# The working tree's build against the other one, median against median.
read -r -a old_cpu <<<"${CPU[old]}"; read -r -a new_cpu <<<"${CPU[new]}"
read -r -a old_rps <<<"${RPS[old]}"; read -r -a new_rps <<<"${RPS[new]}"
ratio=$(awk -v a="$(median_range %s "${new_cpu[@]}" | cut -d' ' -f1)" -v b="$(median_range %s "${old_cpu[@]}" | cut -d' ' -f1)" 'BEGIN {printf "%.3f", a / b}')
echo "| build | body | passes | requests/s | CPU µs a request |"
echo "|---|---|---:|---:|---:|"
body=json
[[ -n ${SDK:-} ]] && body=sdk
echo "| $OLD_NAME | $body | $ROUNDS × $PASS_SECS s | $(median_range %.0f "${old_rps[@]}") | $(median_range %.2f "${old_cpu[@]}") |"
NEW_NAME="working tree"
[[ -n ${SPILLGATE_BIN:-} ]] && NEW_NAME=$SPILLGATE_BIN
echo "| $NEW_NAME | $body | $ROUNDS × $PASS_SECS s | $(median_range %.0f "${new_rps[@]}") | $(median_range %.2f "${new_cpu[@]}") |"
# Each round's two passes ran back to back: their ratio leaves out what the machine's
# speed did between rounds, which on a busy VM moved both builds by 2-3× within a run.
paired=()
for i in "${!new_cpu[@]}"; do
    paired+=("$(awk -v a="${new_cpu[$i]}" -v b="${old_cpu[$i]}" 'BEGIN {printf "%.4f", a / b}')")
done
echo
echo "CPU a request, $NEW_NAME against $OLD_NAME (medians): ${ratio}×"
echo "The same, round by round (median of the rounds' ratios, with their range): $(median_range %.3f× "${paired[@]}"); its 95% confidence interval $(median_ci %.3f× "${paired[@]}"); lower in $(below_count "${paired[@]}") rounds"
if [[ -n ${AB_PASSES:-} ]]; then
    echo "old CPU: ${CPU[old]}"
    echo "new CPU: ${CPU[new]}"
fi
