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
#   CONNS=512 bench/ab.sh 20ee176       # wrk's connections (64): at 512 each request's
#                                       # state is colder (bench/README.md)
#   SMOKE=1 bench/ab.sh                 # seconds, the debug build against itself
#   AB_PASSES=1 bench/ab.sh 20ee176     # also print each pass's CPU µs a request
#   SPILLGATE_BIN=target/pgo/release/spillgate bench/ab.sh HEAD
#                                       # that binary (bench/pgo.sh's) in place of the
#                                       # working tree's plain release build
#   FIRST_EVENT=1 ROUNDS=20 bench/ab.sh 20ee176
#                                       # time to a stream's first event instead
#   FIRST_EVENT=1 SMOKE=1 bench/ab.sh   # seconds, the debug build against itself
#
# The other commit is built in a git worktree, into target/ab (kept between runs: after
# the first, only the gateway's own crates build again). wrk (CONNS connections, two
# threads) against each build in turn, the order swapped every round, after a 1 s
# warm-up of each.
#
# With FIRST_EVENT, each round starts both gateways again (the two taking turns to be
# started first), sends 5 uncounted stream rounds, then STREAMS (100) stream rounds of
# bench/streams.py's `ttfb`: one SSE stream (chunks 10 ms apart) to each build, a new
# connection each, as bench/overhead.sh measures the first event, in an order that
# streams.py shuffles with a fixed seed (the same orders every round, each build first in
# half of them). What a round gives is the median, over its stream rounds, of the working
# tree's time to the first event less the other build's in the same stream round; the
# script prints the median of the rounds' values, their range and 95% confidence
# interval, and in how many rounds it was below 0.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
ROUNDS=${ROUNDS:-6}
PASS_SECS=${PASS_SECS:-4}
CONNS=${CONNS:-64}
STREAMS=${STREAMS:-100}
if [[ -n ${SMOKE:-} ]]; then
    ROUNDS=1; PASS_SECS=1; STREAMS=5
    # Two rounds, so that the gateways' restart runs too.
    [[ -n ${FIRST_EVENT:-} ]] && ROUNDS=2
elif [[ $# -ne 1 ]]; then
    echo "usage: bench/ab.sh <commit>  (or SMOKE=1 bench/ab.sh)" >&2
    exit 2
fi

. bench/lib.sh
positive CONNS "$CONNS" connections
[[ -n ${FIRST_EVENT:-} ]] || need wrk wrk
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

if [[ -n ${FIRST_EVENT:-} ]]; then
    if [[ -n ${SDK:-} ]]; then
        echo "ab.sh: FIRST_EVENT measures streams (bench/streams.py's request); SDK is for JSON" >&2
        exit 2
    fi
    start_mock 0 10 10
else
    [[ -n ${SDK:-} ]] && export MOCK_LIMITS=1 HEADERS=$SDK_HEADERS
    export BODY=$JSON
    start_mock 0
fi
MOCK_PORT=$PORT
wait_port "$MOCK_PORT"

declare -A GW_PORT GW_PID CPU RPS
# start_gateways <build...>: each build's gateway, in that order, on a port of its own,
# in front of the mock; sets GW_PORT and GW_PID.
start_gateways() {
    local build bin
    for build in "$@"; do
        GW_PORT[$build]=$(free_port)
        spillgate_toml "$WORK/$build.toml" "${GW_PORT[$build]}" "$MOCK_PORT"
        bin=$OLD
        [[ $build == new ]] && bin=$NEW
        "$bin" --config "$WORK/$build.toml" >/dev/null 2>>"$WORK/$build.log" &
        PIDS+=($!)
        GW_PID[$build]=$!
        wait_port "${GW_PORT[$build]}" 10
    done
}
start_gateways old new

NEW_NAME="working tree"
[[ -n ${SPILLGATE_BIN:-} ]] && NEW_NAME=$SPILLGATE_BIN

if [[ -n ${FIRST_EVENT:-} ]]; then
    declare -A P50=()
    diffs=()
    for round in $(seq 1 "$ROUNDS"); do
        # Both gateways are started again each round, the two taking turns to be started
        # first: two processes started once may differ through a whole run (see
        # bench/README.md), by as much as the changes this measures.
        if (( round > 1 )); then
            stop "the $OLD_NAME gateway" "${GW_PID[old]}" "$WORK/old.log"
            stop "the $NEW_NAME gateway" "${GW_PID[new]}" "$WORK/new.log"
            if (( round % 2 == 0 )); then start_gateways new old; else start_gateways old new; fi
        fi
        urls="http://127.0.0.1:${GW_PORT[old]}/v1/chat/completions,http://127.0.0.1:${GW_PORT[new]}/v1/chat/completions"
        # Each gateway's first streams (its connections to the backend, its code's first
        # run): 5 stream rounds, not counted.
        python3 bench/streams.py ttfb "$urls" 5 >/dev/null
        res=$(python3 bench/streams.py ttfb "$urls" "$STREAMS")
        for i in 0 1; do
            build=old
            [[ $i == 1 ]] && build=new
            # Assigned first, so that a parse that fails stops the script.
            fields=$(json_item "$i" <<<"$res" | json_fields n complete p50_ms)
            read -r n complete p50 <<<"$fields"
            if [[ $complete != "$n" || $n == 0 ]]; then
                echo "ab.sh: $build build: $complete of $n streams complete" >&2
                exit 1
            fi
            P50[$build]="${P50[$build]:-} $p50"
        done
        # The second URL's time less the first's, stream round by stream round.
        added=$(json_item 1 <<<"$res" | json_fields added_p50_ms)
        diffs+=("$added")
    done
    read -r -a old_p50 <<<"${P50[old]}"; read -r -a new_p50 <<<"${P50[new]}"
    echo "| build | rounds × streams | first event p50 ms |"
    echo "|---|---:|---:|"
    echo "| $OLD_NAME | $ROUNDS × $STREAMS | $(median_range %.3f "${old_p50[@]}") |"
    echo "| $NEW_NAME | $ROUNDS × $STREAMS | $(median_range %.3f "${new_p50[@]}") |"
    echo
    echo "First event, $NEW_NAME less $OLD_NAME (median of the rounds' medians of the paired differences): $(median_range %+.3f "${diffs[@]}") ms; its 95% confidence interval $(median_ci %+.3f "${diffs[@]}") ms; below 0 in $(below_count 0 "${diffs[@]}") rounds"
    exit 0
fi

# pass <build> <seconds>: one wrk run against it; appends its CPU µs a request and its
# requests/s to CPU[build] and RPS[build].
pass() {
    local url="http://127.0.0.1:${GW_PORT[$1]}/v1/chat/completions" before after out req dur err
    before=$(cpu_total "${GW_PID[$1]}")
    out=$(wrk -t2 -c"$CONNS" -d"$2s" --timeout 10s -s "$WORK/post.lua" "$url" 2>/dev/null | grep '^RESULT')
    after=$(cpu_total "${GW_PID[$1]}")
    read -r _ req dur _ _ _ err <<<"$out"
    if [[ $err != 0 || $req == 0 ]]; then
        echo "ab.sh: $1 build: $err errors in $req requests" >&2
        exit 1
    fi
    CPU[$1]="${CPU[$1]:-} $(awk -v a="$before" -v b="$after" -v r="$req" 'BEGIN {printf "%.2f", (b - a) * 1e6 / r}')"
    RPS[$1]="${RPS[$1]:-} $(awk -v r="$req" -v d="$dur" 'BEGIN {printf "%.0f", r / (d / 1e6)}')"
}

for build in old new; do wrk -t2 -c"$CONNS" -d1s -s "$WORK/post.lua" "http://127.0.0.1:${GW_PORT[$build]}/v1/chat/completions" >/dev/null; done
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
echo "| $OLD_NAME | $body | $ROUNDS × $PASS_SECS s, $CONNS connections | $(median_range %.0f "${old_rps[@]}") | $(median_range %.2f "${old_cpu[@]}") |"
echo "| $NEW_NAME | $body | $ROUNDS × $PASS_SECS s, $CONNS connections | $(median_range %.0f "${new_rps[@]}") | $(median_range %.2f "${new_cpu[@]}") |"
# Each round's two passes ran back to back: their ratio leaves out what the machine's
# speed did between rounds, which on a busy VM moved both builds by 2-3× within a run.
paired=()
for i in "${!new_cpu[@]}"; do
    paired+=("$(awk -v a="${new_cpu[$i]}" -v b="${old_cpu[$i]}" 'BEGIN {printf "%.4f", a / b}')")
done
echo
echo "CPU a request, $NEW_NAME against $OLD_NAME (medians): ${ratio}×"
echo "The same, round by round (median of the rounds' ratios, with their range): $(median_range %.3f× "${paired[@]}"); its 95% confidence interval $(median_ci %.3f× "${paired[@]}"); lower in $(below_count 1 "${paired[@]}") rounds"
if [[ -n ${AB_PASSES:-} ]]; then
    echo "old CPU: ${CPU[old]}"
    echo "new CPU: ${CPU[new]}"
fi
