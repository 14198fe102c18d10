#!/usr/bin/env bash
# Gateway overhead: the same load, in alternation, against the mock backend directly,
# nginx as a plain reverse proxy, and spillgate with two tiers, on loopback only.
#
#   bench/overhead.sh            # full run (DURATION=10 s per measurement, then
#                                # PASSES=6 passes of PASS_SECS=4 s for the headline case)
#   DURATION=3 bench/overhead.sh # shorter
#   SMOKE=1 bench/overhead.sh    # a few seconds, one case of each part, debug build
#                                # (what ./test.sh runs, so the script cannot rot)
#   SPILLGATE_BIN=target/pgo/release/spillgate bench/overhead.sh  # measure that gateway
#                                # binary (bench/pgo.sh's build) instead of the release build
#   ONLY=streams bench/overhead.sh  # the stream measurements only (first event, RSS)
#   ONLY=passes bench/overhead.sh   # the headline passes only (json, sse, sdk)
#   PASSES=48 PASS_SECS=3 PASS_BODIES="json sdk" ONLY=passes bench/overhead.sh
#                                # more passes of fewer bodies: a narrower interval
#   TTFB_CLIENT=ttfb-kept ONLY=streams bench/overhead.sh  # first event from a blocking
#                                # client on kept-alive connections (bench/streams.py)
#
# Installs wrk and nginx with apt-get when missing. Prints markdown tables:
# - requests/s, p50 / p99 / p99.9 latency, p99 added over direct, throughput relative
#   to nginx and to direct, and for each proxy its CPU time per request (user+sys of its
#   process over the run) and peak RSS;
# - the 0 ms, 64-connection figures again, in PASSES short passes (PASS_SECS each) that
#   alternate nginx and spillgate: medians and ranges of throughput, CPU per request
#   (also split into user and kernel time) and their ratios, the figures to quote on a
#   shared machine; for the JSON and SSE bodies as wrk sends them, and for `sdk`: the
#   JSON body with the OpenAI Python SDK's headers, to a backend that answers with
#   Azure's six `x-ratelimit-*` headers; with the CPU ratio's 95% confidence interval
#   (of the median the passes are drawn from) and how many passes the gateway was lower;
# - one connection with wrk pinned to one core (the added-latency floor), in PIN_PASSES
#   passes of PASS_SECS, the targets taking turns to go first: medians and ranges of
#   p50, p99 and what each proxy adds to direct's in the same pass;
# - time to the first event of a stream, one stream at a time, against each target, in
#   passes (medians and ranges of the passes' p50, p99 and what each adds to direct);
# - 5,000 SSE streams open at once through nginx and through spillgate: how many
#   completed, peak RSS.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

DURATION=${DURATION:-10}
# The headline figures (0 ms backend, 64 connections): PASSES passes of PASS_SECS
# seconds each, nginx and spillgate taking turns to go first.
PASSES=${PASSES:-6}
PASS_SECS=${PASS_SECS:-4}
# The 1-connection added-latency floor: PIN_PASSES passes of PASS_SECS per target.
PIN_PASSES=${PIN_PASSES:-5}
# The first-event client: ttfb (asyncio, a new connection each stream), ttfb-blocking
# (a blocking socket, a new connection each) or ttfb-kept (a blocking socket, one
# kept-alive connection); see bench/streams.py.
TTFB_CLIENT=${TTFB_CLIENT:-ttfb}
case $TTFB_CLIENT in
    ttfb | ttfb-blocking | ttfb-kept) ;;
    *) echo "overhead.sh: TTFB_CLIENT must be ttfb, ttfb-blocking or ttfb-kept" >&2; exit 2 ;;
esac
if [[ -n ${SMOKE:-} ]]; then
    DURATION=2; PASSES=2; PASS_SECS=1; PIN_PASSES=1; PASS_BODIES=${PASS_BODIES:-json sdk}
fi
# The bodies of the headline passes: any of json, sse and sdk (all three by default; sdk
# runs last, in front of a mock of its own).
read -r -a PASS_LIST <<<"${PASS_BODIES:-json sse sdk}"
PASS_SDK=0
for body in "${PASS_LIST[@]}"; do
    case $body in
        json | sse) ;;
        sdk) PASS_SDK=1 ;;
        *) echo "overhead.sh: PASS_BODIES takes json, sse and sdk, not '$body'" >&2; exit 2 ;;
    esac
done

. bench/lib.sh
need wrk wrk
need nginx nginx-light
export PATH=$PATH:/usr/sbin

build_bins
FAILED=0

# The processes `pids` together: their peak RSS in MB.
rss_of() { # pids
    local p
    for p in $1; do awk '/VmHWM/ {print $2}' "/proc/$p/status"; done | awk '{kb += $1} END {print kb/1024}'
}
pid_on() { ss -ltnp "sport = :$1" | grep -o 'pid=[0-9]*' | awk -F= 'NR == 1 {print $2}'; }

# measure <url> <body> <connections> [pin] -> "rps p50 p99 p999 errors requests"
measure() {
    local pin=()
    [[ ${4:-} == pin ]] && pin=(taskset -c 0)
    local out
    out=$(BODY="$2" "${pin[@]}" wrk -t"$([[ $3 -ge 2 ]] && echo 2 || echo 1)" -c"$3" -d"${DURATION}s" --timeout 10s -s "$WORK/post.lua" "$1" 2>/dev/null | grep '^RESULT')
    read -r _ req dur p50 p99 p999 err <<<"$out"
    awk -v r="$req" -v d="$dur" -v a="$p50" -v b="$p99" -v c="$p999" -v e="$err" 'BEGIN {printf "%.0f %.3f %.3f %.3f %d %d\n", r/(d/1e6), a, b, c, e, r}'
}

# In a smoke run, any error fails the script.
check_errors() { # errors what
    if [[ -n ${SMOKE:-} && $1 != 0 ]]; then echo "smoke: $2 had $1 errors" >&2; FAILED=1; fi
}

# over <values> <bases>: each of the space-separated values less the base of the same
# pass (what a proxy adds to direct's figure), space-separated.
over() {
    awk -v a="$1" -v b="$2" 'BEGIN {
        n = split(a, x, " "); split(b, y, " ")
        for (i = 1; i <= n; i++) printf "%s%s", (i > 1 ? " " : ""), x[i] - y[i] }'
}

# The headline figures, measured again in short passes that alternate nginx and
# spillgate (each goes first in every other pass), against the 0 ms backend at 64
# connections: on a shared machine one pass of each moves by 10-30%, so the median of
# the passes' ratios, with their range, is what to quote. Rows go to $WORK/passes.md.
# `body` is json, sse, or sdk: the JSON body with the headers the OpenAI Python SDK
# sends, to a backend that answers with Azure's six `x-ratelimit-*` headers (what a
# gateway in production parses; the proxies in front of a mock started with MOCK_LIMITS).
alternate() { # body nginx_port nginx_pids spillgate_port spillgate_pids
    local body=$1 payload=$JSON headers="" r order target port pids before after n rps err cpu user sys
    local nr nc nu nsys sr sc su ssys
    [[ $body == sse ]] && payload=$SSE
    [[ $body == sdk ]] && headers=$SDK_HEADERS
    shift
    local rn=() rs=() cn=() cs=() ratio=() cratio=() un=() us=() sn=() ss=()
    for r in $(seq 1 "$PASSES"); do
        order="nginx spillgate"; (( r % 2 == 0 )) && order="spillgate nginx"
        declare -A M=()
        for target in $order; do
            if [[ $target == nginx ]]; then port=$1; pids=$2; else port=$3; pids=$4; fi
            before=$(cpu_of "$pids")
            read -r rps _ _ _ err n <<<"$(HEADERS=$headers DURATION=$PASS_SECS measure "http://127.0.0.1:$port/v1/chat/completions" "$payload" 64)"
            after=$(cpu_of "$pids")
            if [[ -z $n || $n -le 0 ]]; then
                echo "overhead.sh: $target served nothing in a pass ($body)" >&2
                exit 1
            fi
            check_errors "$err" "$target passes $body"
            # Microseconds a request (n > 0, checked above): user+sys, user, sys.
            read -r cpu user sys <<<"$(echo "$before $after" | awk -v n="$n" '{
                printf "%.2f %.2f %.2f", ($3+$4-$1-$2)*1e6/n, ($3-$1)*1e6/n, ($4-$2)*1e6/n }')"
            M[$target]="$rps $cpu $user $sys"
        done
        read -r nr nc nu nsys <<<"${M[nginx]}"; read -r sr sc su ssys <<<"${M[spillgate]}"
        rn+=("$nr"); rs+=("$sr"); cn+=("$nc"); cs+=("$sc")
        un+=("$nu"); us+=("$su"); sn+=("$nsys"); ss+=("$ssys")
        ratio+=("$(awk -v a="$sr" -v b="$nr" 'BEGIN{ if (b>0) print a/b; else print 0 }')")
        cratio+=("$(awk -v a="$sc" -v b="$nc" 'BEGIN{ if (b>0) print a/b; else print 0 }')")
        unset M
    done
    echo "| $body | $PASSES × ${PASS_SECS} s | $(median_range %.0f "${rn[@]}") | $(median_range %.0f "${rs[@]}") | $(median_range %.2f× "${ratio[@]}") | $(median_range %.1f "${cn[@]}") | $(median_range %.1f "${cs[@]}") | $(median_range %.2f× "${cratio[@]}") | $(median_ci %.2f× "${cratio[@]}") | $(below_count 1 "${cratio[@]}") | $(median_range %.1f "${un[@]}") | $(median_range %.1f "${us[@]}") | $(median_range %.1f "${sn[@]}") | $(median_range %.1f "${ss[@]}") |" >>"$WORK/passes.md"
}

# The 1-connection passes (see where it is called); rows go to $WORK/pinned.md.
pinned() { # mock_port nginx_port spillgate_port
    local targets=(direct nginx spillgate) r i target port rps p50 p99 err
    declare -A P=()
    for r in $(seq 1 "$PIN_PASSES"); do
        for i in 0 1 2; do
            target=${targets[$(( (i + r - 1) % 3 ))]}
            case $target in direct) port=$1 ;; nginx) port=$2 ;; spillgate) port=$3 ;; esac
            read -r rps p50 p99 _ err _ <<<"$(DURATION=$PASS_SECS measure "http://127.0.0.1:$port/v1/chat/completions" "$JSON" 1 pin)"
            check_errors "$err" "$target pinned"
            if [[ -n ${SMOKE:-} && ${rps:-0} -le 0 ]]; then echo "smoke: $target served nothing pinned" >&2; FAILED=1; fi
            P[$target.rps]="${P[$target.rps]:-} $rps"; P[$target.p50]="${P[$target.p50]:-} $p50"
            P[$target.p99]="${P[$target.p99]:-} $p99"; P[$target.err]=$(( ${P[$target.err]:-0} + err ))
        done
    done
    local v50 v99 vr a50 a99
    for target in "${targets[@]}"; do
        read -r -a vr <<<"${P[$target.rps]}"; read -r -a v50 <<<"${P[$target.p50]}"; read -r -a v99 <<<"${P[$target.p99]}"
        read -r -a a50 <<<"$(over "${P[$target.p50]}" "${P[direct.p50]}")"
        read -r -a a99 <<<"$(over "${P[$target.p99]}" "${P[direct.p99]}")"
        echo "| $target | $PIN_PASSES × ${PASS_SECS} s | $(median_range %.0f "${vr[@]}") | $(median_range %.3f "${v50[@]}") | $(median_range %.3f "${v99[@]}") | $(median_range %.3f "${a50[@]}") | $(median_range %.3f "${a99[@]}") | ${P[$target.err]} |" >>"$WORK/pinned.md"
    done
}

LATENCIES=(0 50)
BODIES=(json sse)
CONNS=(64 512)
if [[ -n ${SMOKE:-} ]]; then LATENCIES=(0); BODIES=(json); CONNS=(64); fi
if [[ ${ONLY:-} == streams ]]; then LATENCIES=(); fi
if [[ ${ONLY:-} == passes ]]; then LATENCIES=(0); CONNS=(); fi

# The main table, when there is one (not with ONLY).
if [[ ${#LATENCIES[@]} -gt 0 && ${#CONNS[@]} -gt 0 ]]; then
    echo "| backend latency | body | conns | target | req/s | p50 ms | p99 ms | p99.9 ms | p99 added ms | vs nginx | vs direct | proxy CPU µs/req | proxy CPU s/10k req | proxy peak RSS MB | errors |"
    echo "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
fi

for lat in "${LATENCIES[@]}"; do
    start_mock "$lat"; mport=$PORT; wait_port "$mport"
    start_nginx "$mport"; nport=$PORT; wait_port "$nport"
    start_spillgate "$mport"; sport=$PORT; wait_port "$sport"
    npid=$(worker_pids "${PIDS[-2]}")
    spid=$(pid_on "$sport")
    for body in "${BODIES[@]}"; do
        payload=$JSON; [[ $body == sse ]] && payload=$SSE
        for c in "${CONNS[@]}"; do
            declare -A R=()
            # In alternation: direct, nginx, spillgate, one after the other.
            for target in direct nginx spillgate; do
                case $target in
                    direct) url="http://127.0.0.1:$mport/v1/chat/completions"; pids="" ;;
                    nginx) url="http://127.0.0.1:$nport/v1/chat/completions"; pids=$npid ;;
                    spillgate) url="http://127.0.0.1:$sport/v1/chat/completions"; pids=$spid ;;
                esac
                before=$(cpu_total "$pids")
                R[$target]=$(measure "$url" "$payload" "$c")
                after=$(cpu_total "$pids")
                rss=$(rss_of "$pids")
                R[$target.cpu]=$(awk -v a="$before" -v b="$after" -v n="$(echo "${R[$target]}" | awk '{print $6}')" 'BEGIN{ if (n>0) printf "%.1f", (b-a)*1e6/n; else print "-" }')
                R[$target.rss]=$rss
            done
            read -r drps _ dp99 _ _ _ <<<"${R[direct]}"
            read -r nrps _ _ _ _ _ <<<"${R[nginx]}"
            for target in direct nginx spillgate; do
                read -r rps p50 p99 p999 err _ <<<"${R[$target]}"
                added=$(awk -v a="$p99" -v b="$dp99" 'BEGIN{printf "%.3f", a-b}')
                vsn=$(awk -v a="$rps" -v b="$nrps" 'BEGIN{ if (b>0) printf "%.2f×", a/b; else print "-" }')
                vsd=$(awk -v a="$rps" -v b="$drps" 'BEGIN{ if (b>0) printf "%.2f×", a/b; else print "-" }')
                cpu="-"; cpu10k="-"; rss="-"
                if [[ $target != direct ]]; then
                    cpu=${R[$target.cpu]}; rss=$(printf "%.1f" "${R[$target.rss]}")
                    cpu10k=$(awk -v c="$cpu" 'BEGIN{ if (c != "-") printf "%.3f", c/100; else print "-" }')
                fi
                check_errors "$err" "$target ${lat}ms $body c$c"
                if [[ -n ${SMOKE:-} && ${rps:-0} -le 0 ]]; then echo "smoke: $target served nothing" >&2; FAILED=1; fi
                echo "| ${lat} ms | $body | $c | $target | $rps | $p50 | $p99 | $p999 | $added | $vsn | $vsd | $cpu | $cpu10k | $rss | $err |"
            done
            unset R
        done
    done
    # One connection, load generator pinned to one core: the added-latency floor. One
    # run's p99 moves by more than the 0.1 ms it is judged by (direct alone measured
    # 0.09-0.19 ms in three runs in a row), so it runs in PIN_PASSES passes of
    # PASS_SECS, each target going first in turn; what a proxy adds is its p99 (p50)
    # less direct's in the same pass, and the table gives medians and ranges.
    # Then the headline passes (see `alternate`) for each body, and for `sdk` in front of
    # a mock of their own that sends Azure's headers.
    if [[ $lat == 0 ]]; then
        [[ ${ONLY:-} == passes ]] || pinned "$mport" "$nport" "$sport"
        for body in "${PASS_LIST[@]}"; do
            [[ $body == sdk ]] || alternate "$body" "$nport" "$npid" "$sport" "$spid"
        done
        if [[ $PASS_SDK == 1 ]]; then
            MOCK_LIMITS=1 start_mock 0; lport=$PORT; wait_port "$lport"
            start_nginx "$lport"; lnport=$PORT; wait_port "$lnport"
            start_spillgate "$lport"; lsport=$PORT; wait_port "$lsport"
            # Assigned first, so that a failure to find them stops the script.
            lnpid=$(worker_pids "${PIDS[-2]}")
            lspid=$(pid_on "$lsport")
            alternate sdk "$lnport" "$lnpid" "$lsport" "$lspid"
        fi
    fi
done

if [[ -s $WORK/passes.md ]]; then
    echo
    echo "| 0 ms backend, 64 connections, in passes | passes | nginx req/s | spillgate req/s | spillgate vs nginx | nginx CPU µs/req | spillgate CPU µs/req | CPU vs nginx | its 95% CI | spillgate lower in | nginx user µs/req | spillgate user µs/req | nginx sys µs/req | spillgate sys µs/req |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    cat "$WORK/passes.md"
fi
if [[ -s $WORK/pinned.md ]]; then
    echo
    echo "| 0 ms backend, 1 connection, wrk pinned to one core, in passes | passes | req/s | p50 ms | p99 ms | p50 added ms | p99 added ms | errors |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|"
    cat "$WORK/pinned.md"
fi
[[ ${ONLY:-} == passes ]] && exit "$FAILED"

# ---------------------------------------------------------------------------
# Streams: time to the first event, and many streams open at once.
# ---------------------------------------------------------------------------
TTFB_PASSES=${TTFB_PASSES:-5}; TTFB_N=${TTFB_N:-100}; STREAMS=5000; SCHUNKS=20; SINTERVAL=250
if [[ -n ${SMOKE:-} ]]; then TTFB_PASSES=2; TTFB_N=10; STREAMS=100; SCHUNKS=5; SINTERVAL=20; fi

# One stream at a time, chunks 10 ms apart: what a proxy adds before the first event.
# TTFB_PASSES passes of TTFB_N rounds; a round is one stream to each target, in an order
# shuffled each round (bench/streams.py), so that each meets the same moments of a shared
# machine and follows each other as often. What a proxy adds is the median over a pass's
# rounds of its time less direct's in the same round (its p99 less direct's, for p99);
# the table gives the median over the passes, with their range.
# Both proxies are started again for each pass, the two taking turns to be started
# first: two processes started once may differ through a whole run (see bench/HISTORY.md,
# the thirty-fourth round), by as much as the differences measured here.
start_mock 0 10 10; mport=$PORT; wait_port "$mport"
echo
echo "| stream, chunks 10 ms apart, one at a time, targets in turns ($TTFB_CLIENT) | streams | complete | first event p50 ms | p99 ms | p50 added ms | p99 added ms |"
echo "|---|---:|---:|---:|---:|---:|---:|"
declare -A T=()
targets=(direct nginx spillgate)
fe_nginx=""; fe_gateway=""
for pass in $(seq 1 "$TTFB_PASSES"); do
    if [[ -n $fe_nginx ]]; then
        stop nginx "$fe_nginx" "$WORK/nginx-$mport/error.log"
        stop "the gateway" "$fe_gateway" "$WORK/spillgate-$mport.log"
    fi
    if (( pass % 2 )); then
        start_nginx "$mport"; nport=$PORT; fe_nginx=${PIDS[-1]}
        start_spillgate "$mport"; sport=$PORT; fe_gateway=${PIDS[-1]}
    else
        start_spillgate "$mport"; sport=$PORT; fe_gateway=${PIDS[-1]}
        start_nginx "$mport"; nport=$PORT; fe_nginx=${PIDS[-1]}
    fi
    wait_port "$nport"; wait_port "$sport"
    urls=""
    for port in "$mport" "$nport" "$sport"; do
        urls+="${urls:+,}http://127.0.0.1:$port/v1/chat/completions"
    done
    # The proxies' first streams (their connections to the backend) are not counted.
    python3 bench/streams.py "$TTFB_CLIENT" "$urls" 3 >/dev/null
    res=$(python3 bench/streams.py "$TTFB_CLIENT" "$urls" "$TTFB_N")
    for i in 0 1 2; do
        target=${targets[$i]}
        read -r n complete p50 p99 a50 a99 <<<"$(json_item "$i" <<<"$res" |
            json_fields n complete p50_ms p99_ms added_p50_ms added_p99_ms)"
        if [[ $complete -le 0 ]]; then
            echo "overhead.sh: no stream through $target completed" >&2
            exit 1
        fi
        check_errors "$((n - complete))" "$target first-event streams"
        T[$target.n]=$(( ${T[$target.n]:-0} + n )); T[$target.complete]=$(( ${T[$target.complete]:-0} + complete ))
        T[$target.p50]="${T[$target.p50]:-} $p50"; T[$target.p99]="${T[$target.p99]:-} $p99"
        T[$target.a50]="${T[$target.a50]:-} $a50"; T[$target.a99]="${T[$target.a99]:-} $a99"
    done
done
for target in "${targets[@]}"; do
    read -r -a p50 <<<"${T[$target.p50]}"; read -r -a p99 <<<"${T[$target.p99]}"
    read -r -a a50 <<<"${T[$target.a50]}"; read -r -a a99 <<<"${T[$target.a99]}"
    echo "| $target | ${T[$target.n]} | ${T[$target.complete]} | $(median_range %.3f "${p50[@]}") | $(median_range %.3f "${p99[@]}") | $(median_range %.3f "${a50[@]}") | $(median_range %.3f "${a99[@]}") |"
done
unset T
if [[ -n ${SMOKE:-} ]]; then
    # The other first-event clients, a few streams each, so that they cannot rot.
    for client in ttfb-blocking ttfb-kept; do
        [[ $client == "$TTFB_CLIENT" ]] && continue
        res=$(python3 bench/streams.py "$client" "http://127.0.0.1:$sport/v1/chat/completions" 3)
        complete=$(json_fields complete <<<"$res")
        check_errors "$((3 - complete))" "$client first-event streams"
    done
fi

# Many streams open at once through a fresh proxy (so its peak RSS is theirs): nginx (the
# sum of its workers' peaks), then spillgate.
start_mock 0 "$SCHUNKS" "$SINTERVAL"; mport=$PORT; wait_port "$mport"
echo
echo "| SSE streams at once ($SCHUNKS chunks, $SINTERVAL ms apart) | streams | most open at once | complete | incomplete or refused | seconds | proxy peak RSS MB | proxy CPU s |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
for target in nginx spillgate; do
    if [[ $target == nginx ]]; then
        start_nginx "$mport"; port=$PORT; wait_port "$port"
        pids=$(worker_pids "${PIDS[-1]}")
    else
        start_spillgate "$mport"; port=$PORT; wait_port "$port"
        pids=$(pid_on "$port")
    fi
    before=$(cpu_total "$pids")
    res=$(python3 bench/streams.py concurrent "http://127.0.0.1:$port/v1/chat/completions" "$STREAMS")
    after=$(cpu_total "$pids")
    rss=$(rss_of "$pids")
    read -r streams peak complete incomplete cerr secs <<<"$(json_fields streams peak_open complete incomplete connect_errors seconds <<<"$res")"
    echo "| $target | $streams | $peak | $complete | $((incomplete + cerr)) | $secs | $(printf "%.1f" "$rss") | $(awk -v a="$before" -v b="$after" 'BEGIN{printf "%.2f", b-a}') |"
    check_errors "$((streams - complete))" "$target concurrent streams"
done

if [[ $FAILED -ne 0 ]]; then
    echo "overhead.sh: smoke run failed" >&2
    exit 1
fi
