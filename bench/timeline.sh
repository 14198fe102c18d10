#!/usr/bin/env bash
# Where a stream's time to its first event goes, in each proxy: nginx and spillgate in
# front of the mock backend, one SSE stream at a time (a new connection each, the two
# proxies in an order shuffled each round, as in bench/overhead.sh's first-event
# measurement), with every system call of the proxies traced by `perf record` (the
# kernel's `raw_syscalls` tracepoints, which record a call and go on, where strace stops
# the process at each), on loopback only.
#
#   bench/timeline.sh             # 100 streams to each proxy, release build
#   STREAMS=300 bench/timeline.sh
#   SPILLGATE_BIN=target/pgo/release/spillgate bench/timeline.sh  # that gateway binary
#   SMOKE=1 bench/timeline.sh     # 5 streams each, debug build (what ./test.sh runs)
#
# For each stream, from the calls of the thread that accepted its connection: the
# client's request read (the first read of the accepted socket that brings bytes), the
# request written to the backend (the first write, after it, to a socket whose answer
# the thread then reads), the backend's answer read (that socket's first read that
# brings bytes) and the first write to the client (for both proxies, the response head
# with the first event). Prints a markdown table, medians over the streams in µs:
# - accepted: from the accept's return to the request read's return (mostly the
#   client's own time to send it);
# - request: from the request read's return to the entry of its write upstream (the
#   proxy's work on it);
# - backend: from the return of that write to the answer read's return (the backend's
#   time, and the proxy's wake-up when the answer arrives);
# - answer: from the answer read's return to the entry of the first write to the client
#   (the proxy's work on it);
# - woken to read: from the return of the wait for events (epoll_wait) before the
#   request's read, and before the answer's, to the entry of that read: the proxy's
#   dispatch of the wake-up to the connection (streams whose read came without a wait
#   before it are left out of that median);
# - system calls: those the thread made between the request's read and the first write
#   to the client.
# The write upstream itself is in no phase. Tracing adds to each call's time, so a proxy
# that makes more calls has longer phases for it. A stream is timed only when all four
# calls are on the accepting thread, before its next accept; the run fails when fewer
# than nine in ten of a proxy's streams are timed, or when perf lost events. x86-64
# only (the system call numbers).
#
# Installs nginx-light and perf (linux-perf) with apt-get when missing. Needs permission
# to trace another process's system calls (root, or kernel.perf_event_paranoid at -1
# with access to the kernel's tracing files): without it the smoke run says so and
# skips, and a full run fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

STREAMS=${STREAMS:-100}
[[ -n ${SMOKE:-} ]] && STREAMS=5

. bench/lib.sh
need nginx nginx-light
need perf linux-perf
export PATH=$PATH:/usr/sbin
if [[ $(uname -m) != x86_64 ]]; then
    echo "timeline.sh: reads x86-64 system call numbers, and this is $(uname -m)" >&2
    [[ -n ${SMOKE:-} ]] && exit 0
    exit 1
fi
EVENTS=raw_syscalls:sys_enter,raw_syscalls:sys_exit
perf record -q -e "$EVENTS" -o "$WORK/check.data" -- true >"$WORK/check.log" 2>&1 ||
    cannot timeline.sh "trace system calls"
build_bins

# Three chunks 10 ms apart: only the first matters here.
start_both 0 3 10
# The gateway's threads (a connection thread accepts and serves its own connections),
# all started by now: its runtimes start them at start-up.
sthreads=$(ls "/proc/$spid/task" | paste -sd, -)
urls="http://127.0.0.1:$nport/v1/chat/completions,http://127.0.0.1:$sport/v1/chat/completions"

# A few streams first, so that both proxies hold a kept-alive connection to the backend.
python3 bench/streams.py ttfb "$urls" 5 >/dev/null

# Traced while the streams run (perf's command only times the recording: the client is
# not traced).
if ! res=$(perf record -q -e "$EVENTS" -p "$spid,$nworkers" -o "$WORK/trace.data" -- \
    python3 bench/streams.py ttfb "$urls" "$STREAMS" 2>"$WORK/record.log"); then
    echo "timeline.sh: perf record, or the streams it timed, failed:" >&2
    cat "$WORK/record.log" >&2
    exit 1
fi
complete=$(python3 -c 'import json, sys; print(sum(r["complete"] for r in json.load(sys.stdin)))' <<<"$res")
if [[ $complete -ne $((2 * STREAMS)) ]]; then
    echo "timeline.sh: $complete of $((2 * STREAMS)) streams completed" >&2
    exit 1
fi
lost=$(perf report -i "$WORK/trace.data" --stats 2>/dev/null | awk '/LOST events/ {n += $3} END {print n + 0}')
if [[ $lost -ne 0 ]]; then
    echo "timeline.sh: perf lost $lost events: the calls' order cannot be trusted" >&2
    exit 1
fi
if ! perf script --ns -i "$WORK/trace.data" -F tid,time,event,trace >"$WORK/trace.txt" 2>"$WORK/script.log"; then
    echo "timeline.sh: perf script failed:" >&2
    cat "$WORK/script.log" >&2
    exit 1
fi

python3 - "$WORK/trace.txt" "$nworkers" "$sthreads" "$STREAMS" <<'EOF'
import collections, re, statistics, sys

trace, nginx_tids, spillgate_tids, wanted = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
# System call numbers (x86-64): reads (read, recvfrom, recvmsg), writes (write, writev,
# sendto, sendmsg), accepts (accept, accept4), waits for events (poll, select,
# epoll_wait, pselect6, ppoll, epoll_pwait).
READS = {0, 45, 47}
WRITES = {1, 20, 44, 46}
ACCEPT = {43, 288}
WAITS = {7, 23, 232, 270, 271, 281}
line_re = re.compile(r"\s*(\d+)\s+([\d.]+):\s+raw_syscalls:sys_(enter|exit):\s+NR (\d+) (.*)")

# Each thread's calls, in order: (number, first argument, entered, left, result).
calls = collections.defaultdict(list)
entered = {}
for line in open(trace):
    m = line_re.match(line)
    if not m:
        continue
    tid, at, kind, nr, rest = int(m[1]), float(m[2]), m[3], int(m[4]), m[5]
    if kind == "enter":
        args = rest.strip("() ").split(",")
        entered[tid] = (nr, int(args[0], 16) if args and args[0] else -1, at)
    elif tid in entered and entered[tid][0] == nr:
        _, fd, began = entered.pop(tid)
        calls[tid].append((nr, fd, began, at, int(rest.split("=")[-1])))

def streams(thread_calls):
    """Per stream accepted on this thread and timed: (accepted, request, backend,
    answer, woken for the request or None, woken for the answer or None) in µs, and
    the calls between the request's read and the first write to the client; and how
    many streams it accepted."""
    out, accepted_n = [], 0
    i = 0
    while i < len(thread_calls):
        nr, _, _, accepted, client = thread_calls[i]
        i += 1
        if nr not in ACCEPT or client < 0:
            continue
        accepted_n += 1
        # Writes to other sockets after the request's read, by descriptor: the one
        # whose answer is then read is the backend's.
        # Times of the four calls; the two wake-ups, in µs (None without a wait before).
        marks, writes, woke, woken, j = {}, {}, None, [None, None], i
        while j < len(thread_calls) and "client_write" not in marks:
            nr, fd, began, left, result = thread_calls[j]
            j += 1
            if nr in ACCEPT and result >= 0:
                j -= 1
                break  # the next connection before this one's first write: not timed
            if nr in WAITS:
                woke = left
            elif "request" not in marks:
                if nr in READS and fd == client and result > 0:
                    marks["request"], first = left, j
                    if woke and woke > accepted:
                        woken[0] = (began - woke) * 1e6
            elif "answer" not in marks:
                # A write() of 8 bytes is a runtime waking another thread (an
                # eventfd), not a request.
                if nr in WRITES and fd != client and result > 0 and not (nr == 1 and result == 8):
                    writes.setdefault(fd, (began, left))
                elif nr in READS and fd in writes and result > 0:
                    marks["upstream_write"], marks["upstream_written"] = writes[fd]
                    marks["answer"] = left
                    if woke and woke > marks["upstream_written"]:
                        woken[1] = (began - woke) * 1e6
            elif nr in WRITES and fd == client:
                marks["client_write"] = began
                us = lambda a, b: (marks[b] - marks[a]) * 1e6
                out.append((
                    (marks["request"] - accepted) * 1e6,
                    us("request", "upstream_write"),
                    us("upstream_written", "answer"),
                    us("answer", "client_write"),
                    *woken,
                    j - first - 1,
                ))
        i = j
    return out, accepted_n

def fmt(values):
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.1f}" if values else "-"

print("| one stream at a time, a new connection each | streams timed | accepted µs | request µs | backend µs | answer µs | request + answer µs | woken to read, request µs | woken to read, answer µs | system calls |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
failed = []
for target, tids in (("nginx", nginx_tids), ("spillgate", spillgate_tids)):
    # nginx's workers have one thread each, whose id is the worker's pid.
    owned = {int(t) for t in tids.split(",")}
    timed, accepted = [], 0
    for tid, thread_calls in calls.items():
        if tid in owned:
            t, n = streams(thread_calls)
            timed += t
            accepted += n
    if len(timed) * 10 < wanted * 9:
        failed.append(f"{target}: {len(timed)} of {wanted} streams timed ({accepted} accepted)")
    if not timed:
        continue
    cols = list(zip(*timed))
    both = [t[1] + t[3] for t in timed]
    cells = [fmt(c) for c in cols[:4]] + [fmt(both)] + [fmt(c) for c in cols[4:]]
    print(f"| {target} | {len(timed)} of {accepted} | " + " | ".join(cells) + " |")
if failed:
    sys.exit("timeline.sh: " + "; ".join(failed))
EOF
