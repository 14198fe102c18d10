#!/usr/bin/env bash
# Copies a JSON request makes: every call the gateway makes to the C library's memcpy
# and memmove while it serves REQUESTS JSON requests on one kept-alive connection, in
# front of the mock on loopback, counted with gdb and listed by size and by where the
# gateway called them from. Moves of large values (futures, requests, results) are such
# calls: what the compiler does not copy inline, it copies through memcpy. Like
# callgrind's counts, a release build's repeat from run to run, whatever else the machine
# is doing, to within a call or two in 20 requests (a debug build's moved by about 1%).
#
#   bench/copies.sh                  # release build, 20 requests; about 15 s
#   REQUESTS=50 TOP=30 bench/copies.sh
#   BODY=sdk bench/copies.sh         # the JSON request with the OpenAI Python SDK's
#                                    # headers, answered with Azure's x-ratelimit-* headers
#   SPILLGATE_BIN=target/pgo/release/spillgate bench/copies.sh  # that gateway binary
#   SMOKE=1 bench/copies.sh          # debug build, 3 requests: what ./test.sh runs
#   WARM=10 bench/copies.sh          # requests before gdb attaches (5)
#
# Installs gdb with apt-get when missing. gdb attaches to the running gateway after WARM
# requests have warmed its connections (to the client and to the backend), and puts a
# breakpoint on the function both names resolved to in that process (the gateway calls
# them through its global offset table; glibc picks one by the processor). Each call's
# size (its third argument), its innermost caller and the innermost caller in the
# gateway's own code (among the seven innermost frames) are recorded. gdb must be
# allowed to attach to a process that is not its child (ptrace); where it is not, the
# script fails, and a smoke run says so and succeeds.
# The config file is not polled (`config_poll = "0s"`), so that nothing but the
# requests runs in the window. Prints markdown tables: calls and bytes per request in
# all and by size, and the TOP callers by bytes. A smoke run checks that the requests
# were answered and copies counted; its numbers (a debug build's) mean nothing.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
source bench/lib.sh

REQUESTS=${REQUESTS:-20}
WARM=${WARM:-5}
TOP=${TOP:-20}
BODY_KIND=${BODY:-json}
[[ -n ${SMOKE:-} ]] && REQUESTS=3
positive REQUESTS "$REQUESTS" requests
positive WARM "$WARM" requests
positive TOP "$TOP" callers
case $BODY_KIND in
    json) HEADERS=""; MOCK_LIMITS="" ;;
    sdk) HEADERS=$SDK_HEADERS; MOCK_LIMITS=1 ;;
    *) echo "BODY must be json or sdk, got '$BODY_KIND'" >&2; exit 2 ;;
esac
export MOCK_LIMITS

need gdb gdb
need readelf binutils
build_bins

start_mock 0
mport=$PORT
wait_port "$mport"
CONFIG_POLL=0s start_spillgate "$mport"
port=$PORT
gpid=${PIDS[-1]}
wait_port "$port"

# The client: WARM requests, then waits for gdb's breakpoint, then REQUESTS more on the
# same connection; any answer but 200 fails the run.
BODY=$JSON HEADERS=$HEADERS python3 - "$port" "$WARM" "$REQUESTS" "$WORK" >"$WORK/client.log" 2>&1 <<'EOF' &
import http.client, os, sys, time
port, warm, n, work = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
body = os.environ["BODY"].encode()
headers = {"Content-Type": "application/json"}
for line in os.environ["HEADERS"].splitlines():
    if ":" in line:
        k, v = line.split(":", 1)
        headers[k.strip()] = v.strip()
c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
def one():
    c.request("POST", "/v1/chat/completions", body, headers)
    r = c.getresponse()
    r.read()
    if r.status != 200:
        sys.exit(f"answered {r.status}")
for _ in range(warm):
    one()
open(os.path.join(work, "warm"), "w").close()
deadline = time.time() + 120
while not os.path.exists(os.path.join(work, "go")):
    if time.time() > deadline:
        sys.exit("gdb did not attach within 120 s")
    time.sleep(0.05)
for _ in range(n):
    one()
open(os.path.join(work, "done"), "w").close()
EOF
cpid=$!
PIDS+=($cpid)
for _ in $(seq 1 600); do [[ -e $WORK/warm ]] && break; kill -0 "$cpid" 2>/dev/null || break; sleep 0.1; done
[[ -e $WORK/warm ]] || { echo "the warm-up requests did not finish" >&2; cat "$WORK/client.log" >&2; exit 1; }

# no_ptrace <what gdb said>: gdb could not attach; a smoke run says so and succeeds.
no_ptrace() {
    if [[ -n ${SMOKE:-} ]]; then
        echo "copies.sh: gdb cannot attach to the gateway here ($1); smoke run skipped" >&2
        exit 0
    fi
    echo "gdb could not attach to the gateway (is ptrace allowed?): $1" >&2
    exit 1
}

# Where memcpy and memmove are: the global offset table's slots for them (their offsets
# in the binary, plus where it is loaded), read once the process has resolved them.
slots=$(readelf -rW "$GATEWAY" | awk '$5 ~ /^(memcpy|memmove)@/ {print $1}')
[[ -n $slots ]] || { echo "no memcpy or memmove relocation in $GATEWAY" >&2; exit 1; }
exe=$(readlink -f "/proc/$gpid/exe")
base=$(awk -v e="$exe" '$6 == e {split($1, a, "-"); print a[1]; exit}' "/proc/$gpid/maps")
[[ -n $base ]] || { echo "$exe is not mapped in process $gpid" >&2; exit 1; }
reads=()
for s in $slots; do reads+=(-ex "x/gx $(printf '0x%x' $((16#$base + 16#$s)))"); done
gdb -p "$gpid" -batch -nx "${reads[@]}" >"$WORK/got.out" 2>&1 || true
# "0x...:	0x..." or "0x... <memcpy@got.plt>:	0x...": the slot's address, then its value.
targets=$(awk '/^0x[0-9a-f]+( <[^>]*>)?:[ \t]+0x[0-9a-f]+$/ {print $NF}' "$WORK/got.out" | sort -u)
[[ -n $targets ]] || no_ptrace "$(grep -m1 -i 'ptrace\|not permitted\|cannot access' "$WORK/got.out" || tail -1 "$WORK/got.out")"

{
    echo "set pagination off"
    echo "set confirm off"
    n=0
    for t in $targets; do
        n=$((n + 1))
        echo "break *$t"
        echo "commands $n"
        echo "silent"
        echo 'printf "COPY %lu\n", $rdx'
        echo "bt 8"
        echo "continue"
        echo "end"
    done
    echo "shell touch $WORK/go"
    echo "continue"
} >"$WORK/gdb.cmd"
gdb -p "$gpid" -batch -nx -x "$WORK/gdb.cmd" >"$WORK/gdb.out" 2>&1 &
gdbpid=$!
PIDS+=($gdbpid)
# Until the client is done (each request stops at every copy: about a second a request
# in a debug build), then gdb, which must still be attached: copies it missed would be
# counted as none.
for _ in $(seq 1 $((1200 + REQUESTS * 50))); do
    [[ -e $WORK/done ]] && break
    kill -0 "$cpid" 2>/dev/null || break
    kill -0 "$gdbpid" 2>/dev/null || break
    sleep 0.1
done
if ! kill -0 "$gdbpid" 2>/dev/null; then
    echo "gdb ended before the requests did; it said:" >&2
    tail -5 "$WORK/gdb.out" >&2
    exit 1
fi
# The counting is done. SIGINT stops the gateway under gdb, which ends gdb's script: gdb
# takes its breakpoints out and detaches, in a fraction of a second. (On SIGTERM gdb
# ends where it is: in 5 of 22 smoke runs here that left the gateway stopped, or with a
# breakpoint that killed it with SIGTRAP.)
kill -INT "$gdbpid" 2>/dev/null || true
running_after 10 "$gdbpid"
end_processes "$gdbpid"
forget "$gdbpid"
if ! wait "$cpid"; then
    echo "the client failed:" >&2
    cat "$WORK/client.log" >&2
    echo "gdb said:" >&2
    tail -5 "$WORK/gdb.out" >&2
    exit 1
fi
forget "$cpid"
[[ -e $WORK/done ]] || { echo "the requests did not finish; gdb said:" >&2; tail -5 "$WORK/gdb.out" >&2; exit 1; }
grep -q '^COPY ' "$WORK/gdb.out" || { echo "no copy was counted; gdb said:" >&2; tail -5 "$WORK/gdb.out" >&2; exit 1; }

# One line a call: its size, its innermost caller, and the innermost caller in the
# gateway's own code (crates/) when that is another ("function at file:line", generic
# arguments, call arguments and addresses taken out).
awk '
    function flush() { if (size != "") print size "\t" inner "\t" (own == inner ? "" : own) }
    /^COPY / { flush(); size = $2; inner = "-"; own = "-"; next }
    size != "" && /^#[1-7] / {
        line = $0
        sub(/^#[1-7] +(0x[0-9a-f]+ in )?/, "", line)
        gsub(/->/, "→", line)
        while (gsub(/<[^<>]*>/, "", line)) {}
        sub(/ \(.*\) at /, " at ", line)
        sub(/ at .*\/(rustc|registry)\/[^ ]*\//, " at ", line)
        sub(/ at .*\/crates\//, " at crates/", line)
        if ($1 == "#1") inner = line
        if (own == "-" && line ~ / at crates\//) own = line
    }
    END { flush() }
' "$WORK/gdb.out" >"$WORK/copies.tsv"

echo "| ${BODY_KIND} body, kept-alive connection | requests | memcpy/memmove calls a request | bytes a request | of them in calls of 128 bytes or more |"
echo "|---|---:|---:|---:|---:|"
awk -F'\t' -v n="$REQUESTS" -v b="$BODY_KIND" '{c++; s += $1; if ($1 >= 128) big += $1}
    END {printf "| %s | %d | %.1f | %.0f | %.0f |\n", b, n, c / n, s / n, big / n}' "$WORK/copies.tsv"
echo
echo "| size of a call | calls a request | bytes a request |"
echo "|---|---:|---:|"
awk -F'\t' -v n="$REQUESTS" '{
        k = ($1 < 64) ? "1: under 64" : ($1 < 128) ? "2: 64-127" : ($1 < 256) ? "3: 128-255" : ($1 < 512) ? "4: 256-511" : ($1 < 1024) ? "5: 512-1023" : "6: 1024 or more"
        c[k]++; s[k] += $1 }
    END { for (k in c) printf "%s\t| %s bytes | %.1f | %.0f |\n", k, substr(k, 4), c[k] / n, s[k] / n }' "$WORK/copies.tsv" |
    sort | cut -f2
echo
echo "| called from (innermost frame; after ←, the innermost in the gateway's code) | size | calls a request | bytes a request |"
echo "|---|---:|---:|---:|"
awk -F'\t' -v n="$REQUESTS" '{k = $2 ($3 == "" ? "" : " ← " $3) "\t" $1; c[k]++; s[k] += $1}
    END { for (k in c) { split(k, p, "\t"); printf "%d\t| `%s` | %d | %.1f | %.0f |\n", s[k], p[1], p[2], c[k] / n, s[k] / n } }' "$WORK/copies.tsv" |
    sort -t$'\t' -k1,1nr | awk -v t="$TOP" 'NR <= t' | cut -f2-
