# Shared by the bench/*.sh scripts (sourced, not run): tools, build, cleanup, ports, and
# the configs of the mock, nginx and spillgate they run.
# Expects ROOT (the repository) to be set and `set -euo pipefail` in the caller.

APT_UPDATED=0
# need <command> <Debian package>: installs the package when the command is missing.
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

# Builds the gateway and the mock and sets BIN: the release build, or with SMOKE (numbers
# from a smoke run mean nothing) the debug build ./test.sh already has. GATEWAY is the
# gateway measured: SPILLGATE_BIN when set (such as bench/pgo.sh's build), else BIN's.
build_bins() {
    if [[ -n ${SMOKE:-} ]]; then
        cargo build -q -p spillgate -p spillgate-mock
        BIN=${CARGO_TARGET_DIR:-$ROOT/target}/debug
    else
        cargo build -q --release -p spillgate -p spillgate-mock
        BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
    fi
    GATEWAY=${SPILLGATE_BIN:-$BIN/spillgate}
}

# No core dumps from the processes the scripts start: a gateway that gdb left with a
# breakpoint in it (bench/copies.sh) dies of SIGTRAP, and its core, hundreds of MB, would
# land in the repository.
ulimit -c 0

# WORK is removed and every process in PIDS ended when the script exits.
WORK=$(mktemp -d)
PIDS=()
cleanup() {
    end_processes "${PIDS[@]}"
    rm -rf "$WORK"
}
trap cleanup EXIT

# end_processes <pid>...: SIGTERM to those still running that this script started, then
# SIGKILL to any still there after 5 s, then waits for them. SIGCONT goes with the
# SIGTERM: a stopped process (a debugger that detached can leave one stopped) only acts
# on SIGTERM once it runs, and waiting for it would never end. A pid whose process has
# ended and been reaped may be another process's by now: only processes whose parent is
# this shell are signalled.
end_processes() {
    local p mine
    running_after 0 "$@"
    mine=("${LEFT[@]}")
    for p in "${mine[@]}"; do
        kill "$p" 2>/dev/null || true
        kill -CONT "$p" 2>/dev/null || true
    done
    running_after 5 "${mine[@]}"
    for p in "${LEFT[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
    for p in "$@"; do wait "$p" 2>/dev/null || true; done
}

# running_after <seconds> <pid>...: waits up to the seconds given (0: not at all) for the
# processes to end, and sets LEFT to those still running (see own_running). In this
# shell, not in $(...): own_running knows the children of the shell it runs in.
running_after() {
    local limit=$1 i p
    shift
    for ((i = 0; ; i++)); do
        LEFT=()
        for p in "$@"; do
            own_running "$p" && LEFT+=("$p")
        done
        [[ ${#LEFT[@]} -gt 0 && $i -lt $((limit * 10)) ]] || break
        sleep 0.1
    done
}

# own_running <pid>: whether the process is this shell's child and has not ended (its
# state in /proc/<pid>/stat, the field after the name, is not Z).
own_running() {
    local stat state ppid
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    read -r state ppid _ <<<"${stat##*) }"
    [[ $state != Z && $ppid == "$BASHPID" ]]
}

# stop <name> <pid> <log>: ends a process this script started (and takes it out of
# PIDS, so that the cleanup cannot hit a later process given the same pid); fails, with
# its log, when it had already ended.
stop() {
    if ! kill "$2" 2>/dev/null; then
        echo "$1 (pid $2) ended before it was stopped; its log:" >&2
        cat "$3" >&2 || true
        exit 1
    fi
    end_processes "$2"
    forget "$2"
}

# await_exit <pid> <seconds> <what>: waits for a process that was asked to end (one whose
# clean exit matters: it writes something as it goes) and takes it out of PIDS; fails,
# saying so, when it is still there after the seconds given, and the cleanup then ends it.
await_exit() {
    running_after "$2" "$1"
    if [[ ${#LEFT[@]} -gt 0 ]]; then
        echo "$3 (pid $1) did not end within $2 s of being asked to" >&2
        return 1
    fi
    wait "$1" 2>/dev/null || true
    forget "$1"
}

# forget <pid>: takes an ended process out of PIDS, so that the cleanup cannot hit a
# later process given the same pid.
forget() {
    local kept=() p
    for p in "${PIDS[@]}"; do [[ $p == "$1" ]] || kept+=("$p"); done
    PIDS=("${kept[@]}")
}

# positive <name> <value> <what>: fails (exit 2, before anything is built or started)
# unless value is a whole number above 0; the message names the setting and what it counts.
positive() {
    [[ $2 =~ ^[1-9][0-9]*$ ]] && return 0
    echo "$(basename "$0"): $1 must be a number of $3, not '$2'" >&2
    exit 2
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The processes `pids` together (none: zeros): their user and system CPU seconds
# ("user sys"), and their CPU seconds.
cpu_of() { # pids
    local p
    for p in $1; do cat "/proc/$p/stat"; done |
        awk -v t="$(getconf CLK_TCK)" '{u += $14; s += $15} END {print u/t, s/t}'
}
cpu_total() { cpu_of "$1" | awk '{print $1 + $2}'; }

# median_range <format> <values...>: "median (min to max)", each in the printf format;
# with a format ending in ×, the × follows the median only.
median_range() {
    local fmt=$1; shift
    printf '%s\n' "$@" | sort -g | awk -v f="$fmt" '{v[NR]=$1} END {
        m = (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2
        g = f; sub(/×$/, "", g)
        printf f " (" g " to " g ")", m, v[1], v[NR] }'
}

# median_ci <format> <values...>: a 95% confidence interval for the median the values are
# drawn from, "low to high" in the printf format, or "-" for fewer than six values (the
# fewest for which one exists). Distribution-free: the k-th lowest and k-th highest
# values, k the largest for which the chance that fewer than k of the values fall below
# the median is at most 2.5% (the binomial distribution with p = 1/2; with sixteen
# values, the 4th and the 13th). It takes the values as drawn independently from one
# run's conditions; a ratio's interval that holds 1.00 means the passes cannot tell the
# two apart.
median_ci() {
    local fmt=$1; shift
    printf '%s\n' "$@" | sort -g | awk -v f="$fmt" '{v[NR]=$1} END {
        n = NR; k = 0; p = 0.5 ^ n; cdf = 0
        for (j = 0; j < n; j++) {
            cdf += p
            if (2 * cdf > 0.05) break
            k = j + 1
            p = p * (n - j) / (j + 1)
        }
        g = f; sub(/×$/, "", g)
        if (k == 0) print "-"; else printf g " to " f "\n", v[k], v[n - k + 1] }'
}

# below_count <bound> <values...>: "k of n", k the values below bound (1 for a ratio's
# passes in which the gateway measured less than nginx, 0 for differences).
below_count() {
    local bound=$1; shift
    printf '%s\n' "$@" | awk -v b="$bound" '$1 < b {k++} END {printf "%d of %d\n", k, NR}'
}

# json_fields <keys...>: the values of `keys` in the JSON object on stdin (a line of
# bench/streams.py), space-separated.
json_fields() {
    python3 -c 'import json, sys; r = json.load(sys.stdin); print(*(r[k] for k in sys.argv[1:]))' "$@"
}
# json_item <index>: item <index> of the JSON list on stdin, as JSON (for json_fields).
json_item() {
    python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)[int(sys.argv[1])]))' "$1"
}

# wait_port <port> [seconds]: until something listens there (5 s by default).
wait_port() {
    local tries=$(( ${2:-5} * 20 ))
    for _ in $(seq 1 "$tries"); do
        (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.05
    done
    echo "port $1 did not open" >&2
    return 1
}

JSON='{"model":"gpt-4o","messages":[{"role":"user","content":"Summarise the quarterly report in three bullet points."}],"max_tokens":70}'
SSE='{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"Summarise the quarterly report in three bullet points."}],"max_tokens":70}'

# wrk's script: POSTs $BODY and prints
# "RESULT requests duration_us p50_ms p99_ms p99.9_ms errors".
cat >"$WORK/post.lua" <<'EOF'
wrk.method = "POST"
wrk.body = os.getenv("BODY")
wrk.headers["Content-Type"] = "application/json"
for line in string.gmatch(os.getenv("HEADERS") or "", "[^\n]+") do
  local name, value = string.match(line, "^([^:]+):%s*(.*)$")
  if name then wrk.headers[name] = value end
end
done = function(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status + summary.errors.timeout
  io.write(string.format("RESULT %d %d %.3f %.3f %.3f %d\n", summary.requests, summary.duration,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency:percentile(99.9) / 1000, errors))
end
EOF

# The headers the official OpenAI Python SDK sends with each request (beside Host,
# Content-Type and Content-Length), for the `sdk` runs: `HEADERS="$SDK_HEADERS"` in
# wrk's environment. The key is a placeholder: the gateway's `auth.mode = "none"` and
# nginx ignore it, and the gateway does not forward it.
SDK_HEADERS='Accept: application/json
Accept-Encoding: gzip, deflate
User-Agent: OpenAI/Python 1.109.1
X-Stainless-Lang: python
X-Stainless-Package-Version: 1.109.1
X-Stainless-OS: Linux
X-Stainless-Arch: x64
X-Stainless-Runtime: CPython
X-Stainless-Runtime-Version: 3.11.2
Authorization: Bearer sk-placeholder
X-Stainless-Async: false
x-stainless-retry-count: 0
x-stainless-read-timeout: 600'

# start_mock <latency_ms> [stream_chunks [chunk_interval_ms]]: sets PORT. Run in this
# shell (not in $(...)) so that PIDS keeps the process, as with the other start_*.
# `MOCK_LIMITS=1` turns on the mock's limiter with limits never reached, so that every
# answer carries Azure's six `x-ratelimit-*` headers.
start_mock() {
    local port; port=$(free_port)
    local limits=()
    [[ -n ${MOCK_LIMITS:-} ]] && limits=(--rpm 4000000000 --tpm 4000000000)
    "$BIN/spillgate-mock" --listen "127.0.0.1:$port" --name bench --latency-ms "$1" \
        --stream-chunks "${2:-100}" --chunk-interval-ms "${3:-0}" --no-record-requests \
        "${limits[@]}" >/dev/null 2>"$WORK/mock-$port.log" &
    PIDS+=($!)
    PORT=$port
}

# nginx_conf <dir> <listen_port> <backend_port> [single]: a plain keepalive reverse proxy
# (proxy_buffering off) in <dir>/nginx.conf; one worker in the foreground with `single`
# (to run under valgrind), else a worker per core.
nginx_conf() {
    local head="worker_processes auto;"
    [[ ${4:-} == single ]] && head=$'worker_processes 1;\nmaster_process off;\ndaemon off;'
    mkdir -p "$1"
    cat >"$1/nginx.conf" <<EOF
$head
worker_rlimit_nofile 65536;
pid $1/nginx.pid;
error_log $1/error.log warn;
events { worker_connections 20000; }
http {
    access_log off;
    upstream backend { server 127.0.0.1:$3; keepalive 256; }
    server {
        listen 127.0.0.1:$2;
        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
EOF
}

# start_nginx <backend_port>: nginx_conf's proxy in front of the backend, a worker per
# core; sets PORT. Run in this shell (not in $(...)), so that PIDS keeps it for cleanup.
start_nginx() {
    local port; port=$(free_port)
    nginx_conf "$WORK/nginx-$1" "$port" "$1"
    nginx -c "$WORK/nginx-$1/nginx.conf" -p "$WORK/nginx-$1" -g 'daemon off;' >/dev/null 2>&1 &
    PIDS+=($!)
    PORT=$port
}

# start_spillgate <backend_port>: the gateway measured (GATEWAY) with spillgate_toml's
# two tiers in front of the backend; sets PORT. Run in this shell, as start_nginx.
start_spillgate() {
    local port; port=$(free_port)
    spillgate_toml "$WORK/spillgate-$1.toml" "$port" "$1"
    "$GATEWAY" --config "$WORK/spillgate-$1.toml" >/dev/null 2>>"$WORK/spillgate-$1.log" &
    PIDS+=($!)
    PORT=$port
}

# cannot <script> <what>: ends a script that needs perf where perf cannot do `what`, the
# reason in $WORK/check.log: a smoke run says so and succeeds (so that ./test.sh passes
# on machines without the permission), a full run fails.
cannot() {
    if [[ -n ${SMOKE:-} ]]; then
        echo "$1: perf cannot $2 here ($(head -1 "$WORK/check.log")); smoke run skipped" >&2
        exit 0
    fi
    echo "$1: perf cannot $2 here:" >&2
    cat "$WORK/check.log" >&2
    exit 1
}

# start_both <start_mock's arguments...>: the mock, and nginx and the gateway each in
# front of it, all listening; sets mport, nport, sport, spid (the gateway's pid) and
# nworkers (nginx's worker pids, comma-separated, as perf takes them). Run in this
# shell, as the start_* it calls.
start_both() {
    start_mock "$@"
    mport=$PORT
    wait_port "$mport"
    start_nginx "$mport"
    nport=$PORT
    local nmaster=${PIDS[-1]}
    start_spillgate "$mport"
    sport=$PORT
    spid=${PIDS[-1]}
    wait_port "$nport"
    wait_port "$sport"
    # Assigned first, so that a failure to find them stops the script.
    nworkers=$(worker_pids "$nmaster")
    nworkers=$(tr -s ' ' ',' <<<"${nworkers% }")
}

# worker_pids <master_pid>: nginx's worker processes, space-separated, once there is one
# a core (`worker_processes auto`): the master listens before it has forked them all.
worker_pids() {
    local pids="" cores; cores=$(nproc)
    for _ in $(seq 1 100); do
        pids=$(pgrep -P "$1" | tr '\n' ' ' || true)
        [[ $(wc -w <<<"$pids") -ge $cores ]] && { echo "$pids"; return 0; }
        sleep 0.05
    done
    echo "nginx ($1) started ${pids:-no workers}, not $cores workers" >&2
    return 1
}

# spillgate_server_toml <listen_port>: the gateway's settings in every bench config: no
# admin listener, no client keys, warnings only; with CONFIG_POLL set (`0s`: only on SIGHUP),
# the config file is polled that often rather than the default.
spillgate_server_toml() {
    cat <<EOF
[server]
listen = "127.0.0.1:$1"
max_connections = 20000
EOF
    [[ -z ${CONFIG_POLL:-} ]] || echo "config_poll = \"$CONFIG_POLL\""
    cat <<EOF
[admin]
enabled = false
[auth]
mode = "none"
[log]
level = "warn"
EOF
}

# spillgate_toml <file> <listen_port> <backend_port>: two tiers on the same backend, no
# admin listener, no client keys.
spillgate_toml() {
    {
        spillgate_server_toml "$2"
        cat <<EOF
[[backends]]
name = "tier1"
kind = "openai"
url = "http://127.0.0.1:$3/v1"
priority = 1
[[backends]]
name = "tier2"
kind = "openai"
url = "http://127.0.0.1:$3/v1"
priority = 2
EOF
    } >"$1"
}
