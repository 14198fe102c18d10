#!/usr/bin/env bash
# Instructions per request: spillgate and nginx, each run under valgrind's callgrind in
# front of the mock backend, on loopback only. Unlike requests/s or CPU time, the count
# is the same from run to run whatever else the machine is doing, so it is the figure to
# compare builds by.
#
#   bench/instructions.sh          # JSON, sdk and SSE, release build
#   TOP=15 bench/instructions.sh   # also list spillgate's 15 costliest functions (with
#                                  # CACHE=1, each one's code-cache misses too)
#   SMOKE=1 bench/instructions.sh  # seconds, `sdk` only (ONLY is ignored), debug build
#                                  # (what ./test.sh runs)
#   KEEP=/tmp/cg bench/instructions.sh  # also keep the callgrind dumps (for callgrind_annotate)
#   ONLY=json bench/instructions.sh  # one body only (json, sdk or sse)
#   SPILLGATE_BIN=target/pgo/release/spillgate bench/instructions.sh  # that gateway binary
#   CACHE=1 bench/instructions.sh  # also simulated cache misses per request (below)
#   LOCKS=1 bench/instructions.sh  # also atomic read-modify-write instructions (below)
#
# `sdk` is the JSON request with the headers the OpenAI Python SDK sends, answered with
# the six `x-ratelimit-*` headers Azure sends: what a gateway in production parses.
#
# Installs valgrind, wrk and nginx-light with apt-get when missing. Prints a markdown
# table: requests counted, user-space instructions per request (per 100-chunk stream for
# SSE), and the ratio to nginx. Kernel time (the TCP path both pay) is not counted.
# For spillgate it also gives the instructions its tasks ran per request (the runtime's
# task polls and all they call): without the runtime's idle work (parking, the timer
# wheel), which follows the run's wall time and is shared by however many requests the
# run served, it repeated within 0.25% (one build's pair: 1.3%) where the whole count
# moved by 2%. Compare builds by it, in two runs each.
#
# With CACHE=1, callgrind also simulates the first-level caches (the sizes it reads from
# this CPU, printed under the table) and the table gives, per request, the instruction
# cache's misses (I1, a 64-byte line of code fetched again) and the data cache's (D1,
# reads and writes). They repeat less closely than the tasks' instructions: I1 within
# about 2% between runs of one build, D1 within about 15% on one VM and by 2× on another
# (the runtime's idle work is in them, and how the connections' turns interleave; see
# bench/README.md for comparing builds by the tasks' share of them). They tell
# why a build's CPU time can move more than its instructions: code spread over more
# lines, or data over more lines, waits for the next cache level more often.
#
# With LOCKS=1, the table also gives the atomic read-modify-write instructions each
# request ran (those with a `lock` prefix, and `xchg` with memory, which locks without
# one): in the program and in the libraries it calls. Each is counted as one
# instruction, but costs 15-20 cycles even when no other core holds the line (about
# 6.5 ns on the 2.5 GHz Xeon VM, `lock xadd` in a loop), so a build can run fewer
# instructions and still take longer. With TOP, the spillgate functions that ran them.
set -euo pipefail
# Relative to where the script was called from, not to the repository it moves to.
KEEP=${KEEP:+$(realpath -m "$KEEP")}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

. bench/lib.sh
need valgrind valgrind
need wrk wrk
need nginx nginx-light
if [[ -n ${LOCKS:-} ]]; then
    need objdump binutils
fi
export PATH=$PATH:/usr/sbin

WARM=2
DURATION=${DURATION:-5}
BODIES=(json sdk sse)
case ${ONLY:-} in
    "") ;;
    json | sdk | sse) BODIES=("$ONLY") ;;
    *)
        echo "instructions.sh: ONLY must be json, sdk or sse, not '$ONLY'" >&2
        exit 2
        ;;
esac
if [[ -n ${SMOKE:-} ]]; then
    WARM=1
    DURATION=1
    BODIES=(sdk)
fi
build_bins

start_mock 0
MPORT=$PORT
MOCK_LIMITS=1 start_mock 0
LIMITED_PORT=$PORT
wait_port "$MPORT"
wait_port "$LIMITED_PORT"

# Starts one target under callgrind; sets PORT and VG (valgrind's pid).
start_target() { # target out backend_port
    PORT=$(free_port)
    local instr=no
    [[ -n ${LOCKS:-} ]] && instr=yes
    local cg=(valgrind --tool=callgrind --callgrind-out-file="$2" --dump-instr=$instr
        --compress-strings=no --compress-pos=no)
    [[ -n ${CACHE:-} ]] && cg+=(--cache-sim=yes)
    case $1 in
        spillgate)
            spillgate_toml "$WORK/spillgate.toml" "$PORT" "$3"
            "${cg[@]}" "$GATEWAY" --config "$WORK/spillgate.toml" >/dev/null 2>"$WORK/spillgate.log" &
            ;;
        nginx)
            nginx_conf "$WORK/nginx" "$PORT" "$3" single
            "${cg[@]}" nginx -c "$WORK/nginx/nginx.conf" -p "$WORK/nginx" >/dev/null 2>"$WORK/nginx.log" &
            ;;
    esac
    VG=$!
    PIDS+=($VG)
    wait_port "$PORT" 60
}

# wrk for a while -> "requests errors"
load() { # port body seconds [headers]
    BODY="$2" HEADERS="${4:-}" wrk -t1 -c4 -d"$3s" --timeout 30s -s "$WORK/post.lua" "http://127.0.0.1:$1/v1/chat/completions" 2>/dev/null |
        awk '/^RESULT/ {print $2, $7}'
}

# Self cost per function of a callgrind dump, costliest first, as a markdown table with
# its header. With a dump made with --cache-sim=yes, also each function's
# instruction-cache misses a request and its instructions per miss: how densely the code
# a request runs lies in the lines it fetches (a line of 64 bytes holds about 16
# instructions of x86-64; a loop runs the lines it fetched again, and counts more).
top_functions() { # file requests count
    python3 - "$@" <<'EOF'
import collections, sys
path, n, top = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cost = collections.Counter()
miss = collections.Counter()
fn, call, ir, i1 = None, False, 1, None
for line in open(path, errors="replace"):
    if line.startswith("positions:"):
        # The events follow the positions: "line", or "instr line" (LOCKS).
        ir = len(line.split()) - 1
    elif line.startswith("events:"):
        names = line.split()[1:]
        i1 = ir + names.index("I1mr") if "I1mr" in names else None
    elif line.startswith("fn="):
        fn = line[3:].strip()
    elif line.startswith("calls="):
        call = True
    elif line[:1].isdigit() or line[:1] in "+-*":
        if call:
            call = False
        elif fn is not None:
            fields = line.split()
            cost[fn] += int(fields[ir])
            # Trailing events that are 0 are left out of a line.
            if i1 is not None and len(fields) > i1:
                miss[fn] += int(fields[i1])
total = sum(cost.values())
if i1 is None:
    print("| per request | share | function |")
    print("|---:|---:|---|")
else:
    print("| per request | share | I1 misses per request | instructions per miss | function |")
    print("|---:|---:|---:|---:|---|")
for f, c in cost.most_common(top):
    row = f"| {c / n:,.0f} | {100 * c / total:.1f}% |"
    if i1 is not None:
        m = miss[f]
        row += f" {m / n:,.1f} | {c / m:.1f} |" if m else " 0 | - |"
    print(f"{row} `{f[:110]}` |")
EOF
}

# Instructions of the runtime's task polls (inclusive) in a callgrind dump.
task_polls() { # file
    callgrind_annotate --inclusive=yes --threshold=100 "$1" 2>/dev/null |
        awk '!found && /tokio::runtime::task::raw::poll \[/ { gsub(",", "", $1); print $1; found = 1 }'
}

# The simulated misses per request in a dump made with --cache-sim=yes: "I1 D1" (D1:
# reads and writes).
misses() { # file requests
    awk -v n="$2" '/^events:/ { for (i = 2; i <= NF; i++) col[$i] = i }
        /^totals:/ { printf "%.0f %.0f", $col["I1mr"] / n, ($col["D1mr"] + $col["D1mw"]) / n }' "$1"
}

# Atomic read-modify-write instructions per request in a dump made with
# --dump-instr=yes: "total in-program in-libraries"; with a count for `top`, then the
# program's functions that ran the most, one "per-request function" line each. Each
# object's code is read with objdump; callgrind gives addresses in it as objdump does.
locked() { # file requests [top]
    python3 - "$@" <<'EOF'
import collections, os, re, subprocess, sys
path, n = sys.argv[1], int(sys.argv[2])
top = int(sys.argv[3]) if len(sys.argv) > 3 else 0
runs = collections.defaultdict(collections.Counter)  # object -> address -> count
names = {}
ob = fn = main = None
call, ir = False, 2
for line in open(path, errors="replace"):
    if line.startswith("positions:"):
        # "instr line": the address, then the line, then Ir.
        ir = len(line.split()) - 1
    elif line.startswith("ob="):
        ob = line[3:].strip()
    elif line.startswith("fn="):
        fn = line[3:].strip()
    elif line.startswith("cmd:"):
        main = os.path.basename(line.split()[1])
    elif line.startswith("calls="):
        call = True
    elif line.startswith("0x"):
        if call:
            call = False
            continue
        parts = line.split()
        if len(parts) > ir and ob:
            addr = int(parts[0], 16)
            runs[ob][addr] += int(parts[ir])
            names[(ob, addr)] = fn
lock = re.compile(r"^\s*([0-9a-f]+):\s+(lock |xchg\s+\S*\()")
total = in_main = 0
by_fn = collections.Counter()
for obj, counts in runs.items():
    try:
        dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        continue
    for l in dis.splitlines():
        m = lock.match(l)
        if not m:
            continue
        addr = int(m.group(1), 16)
        if addr in counts:
            total += counts[addr]
            if os.path.basename(obj) == main:
                in_main += counts[addr]
                by_fn[names[(obj, addr)]] += counts[addr]
print(f"{total / n:.0f} {in_main / n:.0f} {(total - in_main) / n:.0f}")
for f, c in by_fn.most_common(top):
    print(f"{c / n:.1f} {f[:110]}")
EOF
}

# vs <a> <b>: a/b as a ratio ("-" without b).
vs() { awk -v a="$1" -v b="$2" 'BEGIN{ if (b>0) printf "%.2f×", a/b; else print "-" }'; }

FAILED=0
declare -A IR=()
declare -A MISS=()
declare -A LK=()
if [[ -n ${CACHE:-} ]]; then
    echo "| body | target | requests counted | instructions per request | vs nginx | tasks' own per request | I1 misses per request | vs nginx | D1 misses per request | vs nginx |"
    echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
else
    echo "| body | target | requests counted | instructions per request | vs nginx | tasks' own per request |"
    echo "|---|---|---:|---:|---:|---:|"
fi
for body in "${BODIES[@]}"; do
    payload=$JSON headers="" backend=$MPORT
    [[ $body == sse ]] && payload=$SSE
    [[ $body == sdk ]] && headers=$SDK_HEADERS backend=$LIMITED_PORT
    for target in nginx spillgate; do
        out="$WORK/cg-$target-$body.out"
        start_target "$target" "$out" "$backend"
        # A warm-up that fails (wrk exits 1 when its first connection does) is said, not
        # a silent exit: the measured load after it reports what it served.
        load "$PORT" "$payload" "$WARM" "$headers" >/dev/null ||
            echo "instructions.sh: $target $body: the warm-up load failed" >&2
        callgrind_control -z "$VG" >/dev/null 2>&1 || true
        read -r requests errors <<<"$(load "$PORT" "$payload" "$DURATION" "$headers")"
        callgrind_control -d "$VG" >/dev/null 2>&1 || true
        kill -INT "$VG" 2>/dev/null || true
        await_exit "$VG" 120 "valgrind ($target)"
        # The dump asked for with -d is "$out.1"; the one written at exit is "$out".
        total=""
        [[ -f $out.1 ]] && total=$(awk '/^totals:/ {print $2}' "$out.1")
        if [[ -z $total || ${requests:-0} -le 0 || ${errors:-1} -ne 0 ]]; then
            echo "instructions.sh: $target $body: ${requests:-0} requests, ${errors:-?} errors" >&2
            FAILED=1
            continue
        fi
        IR[$target.$body]=$((total / requests))
        ratio="1.00×"
        [[ $target != nginx ]] && ratio=$(awk -v a="${IR[$target.$body]}" -v b="${IR[nginx.$body]:-0}" 'BEGIN{ if (b>0) printf "%.2f×", a/b; else print "-" }')
        tasks="-"
        if [[ $target == spillgate ]]; then
            polls=$(task_polls "$out.1") || polls=""
            [[ -n $polls ]] && tasks=$((polls / requests))
        fi
        if [[ -n ${CACHE:-} ]]; then
            MISS[$target.$body]=$(misses "$out.1" "$requests")
            read -r i1 d1 <<<"${MISS[$target.$body]}"
            read -r ni1 nd1 <<<"${MISS[nginx.$body]:-0 0}"
            echo "| $body | $target | $requests | ${IR[$target.$body]} | $ratio | $tasks | $i1 | $(vs "$i1" "$ni1") | $d1 | $(vs "$d1" "$nd1") |"
            [[ -f $WORK/caches ]] || grep -E '^desc: (I1|D1) cache' "$out.1" | sed 's/^desc: //' >"$WORK/caches"
        else
            echo "| $body | $target | $requests | ${IR[$target.$body]} | $ratio | $tasks |"
        fi
        if [[ -n ${LOCKS:-} ]]; then
            locked "$out.1" "$requests" "$([[ $target == spillgate ]] && echo "${TOP:-0}" || echo 0)" >"$WORK/locked-$target-$body"
            LK[$target.$body]=$(head -1 "$WORK/locked-$target-$body")
            # The gateway always runs some (reference counts): none found means the
            # dump's addresses were not matched to its code.
            if [[ $target == spillgate && $(cut -d' ' -f2 <<<"${LK[$target.$body]}") == 0 ]]; then
                echo "instructions.sh: no atomic instructions found in $GATEWAY's dump" >&2
                FAILED=1
            fi
        fi
        if [[ -n ${KEEP:-} ]]; then
            mkdir -p "$KEEP"
            cp "$out.1" "$KEEP/$target-$body.callgrind"
        fi
        if [[ $target == spillgate && -n ${TOP:-} ]]; then
            cp "$out.1" "$WORK/top-$body.out"
            echo "$requests" >"$WORK/top-$body.n"
        fi
    done
done

if [[ -f $WORK/caches ]]; then
    echo
    echo "Simulated caches (callgrind, from this CPU): $(paste -sd ';' "$WORK/caches" | sed 's/;/; /')."
fi

if [[ -n ${LOCKS:-} ]]; then
    echo
    echo "Atomic read-modify-write instructions per request (per stream for SSE):"
    echo
    echo "| body | target | in all | in the program | in libraries | vs nginx |"
    echo "|---|---|---:|---:|---:|---:|"
    for body in "${BODIES[@]}"; do
        for target in nginx spillgate; do
            [[ -n ${LK[$target.$body]:-} ]] || continue
            read -r all own libs <<<"${LK[$target.$body]}"
            read -r nall _ <<<"${LK[nginx.$body]:-0 0}"
            echo "| $body | $target | $all | $own | $libs | $(vs "$all" "$nall") |"
        done
    done
    if [[ -n ${TOP:-} ]]; then
        for body in "${BODIES[@]}"; do
            [[ -f $WORK/locked-spillgate-$body ]] || continue
            echo
            echo "spillgate's functions that ran them, $body:"
            echo
            echo "| per request | function |"
            echo "|---:|---|"
            tail -n +2 "$WORK/locked-spillgate-$body" | awk '{c = $1; $1 = ""; sub(/^ /, ""); printf "| %s | `%s` |\n", c, $0}'
        done
    fi
fi

if [[ -n ${TOP:-} ]]; then
    for body in "${BODIES[@]}"; do
        [[ -f $WORK/top-$body.out ]] || continue
        echo
        echo "spillgate's costliest functions, $body (own instructions, not counting callees):"
        echo
        top_functions "$WORK/top-$body.out" "$(cat "$WORK/top-$body.n")" "$TOP"
    done
fi

if [[ $FAILED -ne 0 ]]; then
    echo "instructions.sh: failed" >&2
    exit 1
fi
