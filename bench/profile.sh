#!/usr/bin/env bash
# Where each proxy's CPU time goes, by function: spillgate and nginx in front of the mock
# backend, each sampled with `perf record` (the `cpu-clock` software event, once per
# 200 µs of a thread's CPU time; it needs no hardware counters, so it works on virtual
# machines too) while wrk sends the same JSON load at 64 connections (CONNS), on
# loopback only.
# The two take turns, ROUNDS times.
#
#   bench/profile.sh              # 3 rounds of 6 s per proxy, release build, top 25
#   ROUNDS=5 SECS=8 TOP=40 bench/profile.sh
#   CONNS=512 bench/profile.sh    # at 512 connections
#   SPILLGATE_BIN=target/pgo/release/spillgate bench/profile.sh  # that gateway binary
#   SMOKE=1 bench/profile.sh      # one round of a second, debug build (what ./test.sh runs)
#
# Prints two markdown tables, figures in µs a request (the samples' time over the
# requests the pass served), medians of the rounds:
# - for each proxy: the time sampled in all, in the kernel and in user space (the program
#   and the libraries it calls), with the rounds' range;
# - the TOP user-space functions of both, side by side, by the larger of the two.
# Unlike bench/instructions.sh's counts, these are times: they take in cache misses and
# pipeline stalls that an instruction count cannot weigh, and move with the machine's
# speed from pass to pass, as CPU time does. Sampling adds to the time of each proxy
# (both are sampled alike). A sample that lands just after a system call returns is
# charged to the user-space instruction it returned to, so the C library's system
# call wrappers carry some of the kernel's exit time.
#
# Installs wrk, nginx-light and perf (linux-perf) with apt-get when missing. Needs
# permission to sample another process and the kernel (root, or
# kernel.perf_event_paranoid at 1 or below): without it the smoke run says so and
# skips, and a full run fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

ROUNDS=${ROUNDS:-3}
SECS=${SECS:-6}
TOP=${TOP:-25}
CONNS=${CONNS:-64}
# A sample every PERIOD_NS of a thread's CPU time (a fixed period: perf would lower a
# frequency the kernel does not allow, and the figures would then be wrong).
PERIOD_NS=200000
if [[ -n ${SMOKE:-} ]]; then
    ROUNDS=1; SECS=1; TOP=5
fi

. bench/lib.sh
need wrk wrk
need nginx nginx-light
need perf linux-perf
export PATH=$PATH:/usr/sbin
# The kernel's part is sampled too only for root or with kernel.perf_event_paranoid at
# 1 or below (above, perf would sample user space alone and say nothing).
paranoid=$(cat /proc/sys/kernel/perf_event_paranoid 2>/dev/null || echo 3)
sampling=yes
if [[ $(id -u) -ne 0 && $paranoid -gt 1 ]]; then
    echo "kernel.perf_event_paranoid is $paranoid, and this is not root" >"$WORK/check.log"
    sampling=no
elif ! perf record -q -e cpu-clock -o "$WORK/check.data" -- true >"$WORK/check.log" 2>&1; then
    sampling=no
fi
[[ $sampling == yes ]] || cannot profile.sh sample
build_bins

start_both 0

# One pass: samples of `pids` while wrk loads `port`; writes the report's lines
# ("percent samples dso [.] symbol", `[k]` for the kernel's) to <out>.rep and prints the
# requests served. Run in $(...), where `set -e` does not hold: each step is checked.
pass() { # name pids port out
    perf record -q -e cpu-clock -c "$PERIOD_NS" -p "$2" -o "$4.data" -- sleep "$SECS" >"$4.log" 2>&1 &
    local rec=$!
    local res requests=0 errors=0
    res=$(BODY="$JSON" wrk -t2 -c"$CONNS" -d"${SECS}s" --timeout 10s -s "$WORK/post.lua" \
        "http://127.0.0.1:$3/v1/chat/completions" 2>/dev/null | grep '^RESULT' || true)
    if ! wait "$rec"; then
        echo "profile.sh: perf record of $1 failed:" >&2
        cat "$4.log" >&2
        exit 1
    fi
    if [[ -z $res ]]; then
        echo "profile.sh: wrk against $1 printed no result" >&2
        exit 1
    fi
    # bench/lib.sh's wrk script: "RESULT requests duration p50 p99 p99.9 errors".
    read -r _ requests _ _ _ _ errors <<<"$res"
    if [[ $errors -ne 0 || $requests -le 0 ]]; then
        echo "profile.sh: $1 answered $requests requests with $errors errors" >&2
        exit 1
    fi
    if ! perf report -i "$4.data" --sort=dso,sym --stdio -n 2>"$4.log" >"$4.txt"; then
        echo "profile.sh: perf report of $1 failed:" >&2
        cat "$4.log" >&2
        exit 1
    fi
    grep -E '^ +[0-9]' "$4.txt" >"$4.rep" || true
    echo "$requests"
}

runs=()
for r in $(seq 1 "$ROUNDS"); do
    # Each goes first in every other round.
    order=(spillgate nginx)
    (( r % 2 == 0 )) && order=(nginx spillgate)
    for t in "${order[@]}"; do
        if [[ $t == spillgate ]]; then pids=$spid; port=$sport; else pids=$nworkers; port=$nport; fi
        n=$(pass "$t" "$pids" "$port" "$WORK/$t-$r")
        runs+=("$t $r $n $WORK/$t-$r.rep")
    done
done

python3 - "$TOP" "$((PERIOD_NS / 1000))" "$CONNS" "${runs[@]}" <<'EOF'
import collections, statistics, sys

top, us_per_sample, conns = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
# target -> per round: (µs a request {"kernel", "user"}, µs a request {(dso, function)})
rounds = collections.defaultdict(list)
for run in sys.argv[4:]:
    target, _, requests, rep = run.split(maxsplit=3)
    requests = int(requests)
    side, functions = collections.Counter(), collections.Counter()
    for line in open(rep):
        parts = line.split()
        if len(parts) < 5:
            continue
        samples, dso, where, name = int(parts[1]), parts[2], parts[3], " ".join(parts[4:])
        us = samples * us_per_sample / requests
        if where == "[k]":
            side["kernel"] += us
        else:
            side["user"] += us
            functions[(dso, name)] += us
    side["all"] = side["kernel"] + side["user"]
    if not side["all"]:
        sys.exit(f"profile.sh: no samples of {target} in {rep}")
    rounds[target].append((side, functions))

def summary(values):
    med = statistics.median(values)
    return f"{med:.3f} ({min(values):.3f} to {max(values):.3f})"

print(f"| 0 ms backend, JSON, {conns} connections, sampled (cpu-clock) | rounds | µs a request in all | in the kernel | in user space |")
print("|---|---:|---:|---:|---:|")
for target in ("nginx", "spillgate"):
    rs = rounds[target]
    print(f"| {target} | {len(rs)} | " + " | ".join(summary([side[k] for side, _ in rs]) for k in ("all", "kernel", "user")) + " |")

def medians(target):
    rs = [functions for _, functions in rounds[target]]
    keys = {k for functions in rs for k in functions}
    return {k: statistics.median([functions.get(k, 0.0) for functions in rs]) for k in keys}

def name(key):
    dso, sym = key
    return sym if dso in ("spillgate", "nginx") else f"{sym} ({dso})"

med = {t: medians(t) for t in ("nginx", "spillgate")}
keys = set(med["nginx"]) | set(med["spillgate"])
ranked = sorted(keys, key=lambda k: -max(med["nginx"].get(k, 0.0), med["spillgate"].get(k, 0.0)))
print()
print(f"User-space functions, the {top} costliest of either (µs a request, medians of the rounds):")
print()
print("| function | nginx | spillgate |")
print("|---|---:|---:|")
for k in ranked[:top]:
    cells = [f"{med[t][k]:.3f}" if k in med[t] else "-" for t in ("nginx", "spillgate")]
    print(f"| `{name(k)}` | {cells[0]} | {cells[1]} |")
EOF
