#!/usr/bin/env bash
# Instructions per request: spillgate and nginx, each run under valgrind's callgrind in
# front of the mock backend, on loopback only. Unlike requests/s or CPU time, the count
# is the same from run to run whatever else the machine is doing, so it is the figure to
# compare builds by.
#
#   bench/instructions.sh          # JSON and SSE, release build
#   TOP=15 bench/instructions.sh   # also list spillgate's 15 costliest functions
#   SMOKE=1 bench/instructions.sh  # seconds, JSON only, debug build (what ./test.sh runs)
#
# Installs valgrind, wrk and nginx-light with apt-get when missing. Prints a markdown
# table: requests counted, user-space instructions per request (per 100-chunk stream for
# SSE), and the ratio to nginx. Kernel time (the TCP path both pay) is not counted.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

APT_UPDATED=0
need() {
    if ! command -v "$1" >/dev/null 2>&1 && ! [[ -x /usr/sbin/$1 ]]; then
        echo "installing $2" >&2
        local sudo=()
        [[ $(id -u) -ne 0 ]] && sudo=(sudo -n)
        if [[ $APT_UPDATED -eq 0 ]]; then
            "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null >/dev/null
            APT_UPDATED=1
        fi
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" </dev/null >/dev/null
    fi
}
need valgrind valgrind
need wrk wrk
need nginx nginx-light
export PATH=$PATH:/usr/sbin

WARM=2
DURATION=${DURATION:-5}
BODIES=(json sse)
if [[ -n ${SMOKE:-} ]]; then
    cargo build -q -p spillgate -p spillgate-mock
    BIN=${CARGO_TARGET_DIR:-$ROOT/target}/debug
    WARM=1
    DURATION=1
    BODIES=(json)
else
    cargo build -q --release -p spillgate -p spillgate-mock
    BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
fi

WORK=$(mktemp -d)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 1 600); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 did not open" >&2; return 1; }

MPORT=$(free_port)
"$BIN/spillgate-mock" --listen "127.0.0.1:$MPORT" --name bench --latency-ms 0 \
    --stream-chunks 100 --no-record-requests >/dev/null 2>"$WORK/mock.log" &
PIDS+=($!)
wait_port "$MPORT"

cat >"$WORK/post.lua" <<'EOF'
wrk.method = "POST"
wrk.body = os.getenv("BODY")
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status + summary.errors.timeout
  io.write(string.format("RESULT %d %d\n", summary.requests, errors))
end
EOF

JSON='{"model":"gpt-4o","messages":[{"role":"user","content":"Summarise the quarterly report in three bullet points."}],"max_tokens":70}'
SSE='{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"Summarise the quarterly report in three bullet points."}],"max_tokens":70}'

# Starts one target under callgrind; sets PORT and VG (valgrind's pid).
start_target() { # target out
    PORT=$(free_port)
    local cg=(valgrind --tool=callgrind --callgrind-out-file="$2" --dump-instr=no
        --compress-strings=no --compress-pos=no)
    case $1 in
        spillgate)
            cat >"$WORK/spillgate.toml" <<EOF
[server]
listen = "127.0.0.1:$PORT"
[admin]
enabled = false
[auth]
mode = "none"
[log]
level = "warn"
[[backends]]
name = "tier1"
kind = "openai"
url = "http://127.0.0.1:$MPORT/v1"
priority = 1
[[backends]]
name = "tier2"
kind = "openai"
url = "http://127.0.0.1:$MPORT/v1"
priority = 2
EOF
            "${cg[@]}" "$BIN/spillgate" --config "$WORK/spillgate.toml" >/dev/null 2>"$WORK/spillgate.log" &
            ;;
        nginx)
            mkdir -p "$WORK/nginx"
            cat >"$WORK/nginx/nginx.conf" <<EOF
worker_processes 1;
master_process off;
daemon off;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    upstream backend { server 127.0.0.1:$MPORT; keepalive 256; }
    server {
        listen 127.0.0.1:$PORT;
        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
EOF
            "${cg[@]}" nginx -c "$WORK/nginx/nginx.conf" -p "$WORK/nginx" >/dev/null 2>"$WORK/nginx.log" &
            ;;
    esac
    VG=$!
    PIDS+=($VG)
    wait_port "$PORT"
}

# wrk for a while -> "requests errors"
load() { # port body seconds
    BODY="$2" wrk -t1 -c4 -d"$3s" --timeout 30s -s "$WORK/post.lua" "http://127.0.0.1:$1/v1/chat/completions" 2>/dev/null |
        awk '/^RESULT/ {print $2, $3}'
}

# Self cost per function of a callgrind dump, costliest first.
top_functions() { # file requests count
    python3 - "$@" <<'EOF'
import collections, sys
path, n, top = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cost = collections.Counter()
fn, call = None, False
for line in open(path, errors="replace"):
    if line.startswith("fn="):
        fn = line[3:].strip()
    elif line.startswith("calls="):
        call = True
    elif line[:1].isdigit() or line[:1] in "+-*":
        if call:
            call = False
        elif fn is not None:
            cost[fn] += int(line.split()[1])
total = sum(cost.values())
for f, c in cost.most_common(top):
    print(f"| {c / n:,.0f} | {100 * c / total:.1f}% | `{f[:110]}` |")
EOF
}

FAILED=0
declare -A IR=()
echo "| body | target | requests counted | instructions per request | vs nginx |"
echo "|---|---|---:|---:|---:|"
for body in "${BODIES[@]}"; do
    payload=$JSON; [[ $body == sse ]] && payload=$SSE
    for target in nginx spillgate; do
        out="$WORK/cg-$target-$body.out"
        start_target "$target" "$out"
        load "$PORT" "$payload" "$WARM" >/dev/null
        callgrind_control -z "$VG" >/dev/null 2>&1 || true
        read -r requests errors <<<"$(load "$PORT" "$payload" "$DURATION")"
        callgrind_control -d "$VG" >/dev/null 2>&1 || true
        kill -INT "$VG" 2>/dev/null || true
        wait "$VG" 2>/dev/null || true
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
        echo "| $body | $target | $requests | ${IR[$target.$body]} | $ratio |"
        if [[ $target == spillgate && -n ${TOP:-} ]]; then
            cp "$out.1" "$WORK/top-$body.out"
            echo "$requests" >"$WORK/top-$body.n"
        fi
    done
done

if [[ -n ${TOP:-} ]]; then
    for body in "${BODIES[@]}"; do
        [[ -f $WORK/top-$body.out ]] || continue
        echo
        echo "spillgate's costliest functions, $body (own instructions, not counting callees):"
        echo
        echo "| per request | share | function |"
        echo "|---:|---:|---|"
        top_functions "$WORK/top-$body.out" "$(cat "$WORK/top-$body.n")" "$TOP"
    done
fi

if [[ $FAILED -ne 0 ]]; then
    echo "instructions.sh: failed" >&2
    exit 1
fi
