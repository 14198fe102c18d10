#!/usr/bin/env python3
"""SSE stream load for bench/overhead.sh (standard library only, loopback only).

  streams.py concurrent URL N   open N streams at once; report how many completed
  streams.py ttfb URL[,URL...] N
                                N streams one after the other to each URL; time to first event
  streams.py ttfb-blocking URL[,URL...] N
                                the same with a blocking socket, a new connection each
  streams.py ttfb-kept URL[,URL...] N
                                the same with a blocking socket, one kept-alive connection
                                per URL

Each stream is one POST, read to the end; `Connection: close` except in ttfb-kept. A
stream counts as complete when its status is 200 and its body ends with `data: [DONE]`
(and the chunked body's last chunk, when chunked). The blocking modes take the event loop
out of what is timed. Output is one line of JSON.

With several URLs, the ttfb modes take them in turns, one stream each (a round), each
round's order shuffled, so that every target meets the same moments of a shared, noisy
machine; output is then a list, one result per URL, each with what it added to the
first URL's time (0 for the first): `added_p50_ms`, the median over the rounds of its
time less the first URL's in the same round, and `added_p99_ms`, its p99 less the
first's.
"""

import asyncio
import json
import math
import random
import resource
import socket
import sys
import time
from urllib.parse import urlsplit

BODY = json.dumps(
    {
        "model": "gpt-4o",
        "stream": True,
        "messages": [{"role": "user", "content": "Summarise the quarterly report in three bullet points."}],
        "max_tokens": 70,
    }
).encode()


def request_bytes(url, connection="close"):
    u = urlsplit(url)
    head = (
        f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\nConnection: {connection}\r\n\r\n"
    ).encode()
    return u.hostname, u.port, head + BODY


# The last chunk of a chunked body, after the CRLF that ends the chunk before it.
CHUNKED_END = b"\r\n0\r\n\r\n"


def completed(data):
    """Whether a response read to its end is a whole stream: status 200, and `data:
    [DONE]` in its body's last bytes (before the chunked body's end, if chunked)."""
    body = data.split(b"\r\n\r\n", 1)[-1]
    return data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in body[-64:]


def percentiles(times_ms, n, complete):
    """p50 and p99 of the times, by nearest rank: the smallest time that at least that
    share of the streams took no longer than."""
    times = sorted(times_ms)

    def pct(p):
        rank = max(1, math.ceil(len(times) * p))
        return round(times[rank - 1], 3) if times else None

    return dict(n=n, complete=complete, p50_ms=pct(0.5), p99_ms=pct(0.99))


async def one_stream(url, state, timeout):
    host, port, req = request_bytes(url)
    start = time.monotonic()
    ttfb = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        state["connect_errors"] += 1
        return None
    try:
        writer.write(req)
        await writer.drain()
        data = b""
        headers_done = False
        opened = False
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
            if not chunk:
                break
            data += chunk
            if not headers_done and b"\r\n\r\n" in data:
                headers_done = True
                if data.startswith(b"HTTP/1.1 200"):
                    opened = True
                    state["open"] += 1
                    state["peak_open"] = max(state["peak_open"], state["open"])
            if headers_done and ttfb is None and b"data:" in data:
                ttfb = time.monotonic() - start
        if opened:
            state["open"] -= 1
        if completed(data):
            state["complete"] += 1
        else:
            state["incomplete"] += 1
    except (OSError, asyncio.TimeoutError):
        state["incomplete"] += 1
    finally:
        writer.close()
    return ttfb


async def concurrent(url, n):
    state = dict(open=0, peak_open=0, complete=0, incomplete=0, connect_errors=0)
    start = time.monotonic()
    tasks = []
    # Open in batches so the listen backlog is not the thing measured.
    for i in range(0, n, 250):
        for _ in range(min(250, n - i)):
            tasks.append(asyncio.create_task(one_stream(url, state, 120)))
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    state["streams"] = n
    state["seconds"] = round(time.monotonic() - start, 2)
    return state


def turns(n, k):
    """`n` rounds of one stream to each of `k` targets, each round in an order of its own
    (shuffled, the same from run to run): the (round, target) pairs in the order the
    streams run. A target is still closing its stream's connection as the next stream
    starts, so each target should follow each other about equally often; a fixed
    rotation would put the same target after it every time."""
    rng = random.Random(0)
    order = []
    for r in range(n):
        targets = list(range(k))
        rng.shuffle(targets)
        order += [(r, i) for i in targets]
    return order


def summarise(rounds, complete, n):
    """Each target's result as `percentiles` gives it, from `rounds` (one row of times in
    ms or None per round, a column per target) and `complete` (a count per target), with
    what it added to the first's time (see the module's doc)."""
    results = []
    for i in range(len(complete)):
        res = percentiles([row[i] for row in rounds if row[i] is not None], n, complete[i])
        if i == 0:
            res["added_p50_ms"] = res["added_p99_ms"] = 0.0
        else:
            diffs = sorted(row[i] - row[0] for row in rounds if None not in (row[i], row[0]))
            res["added_p50_ms"] = round(diffs[(len(diffs) - 1) // 2], 3) if diffs else None
            first = results[0]["p99_ms"]
            res["added_p99_ms"] = (
                None if None in (first, res["p99_ms"]) else round(res["p99_ms"] - first, 3)
            )
        results.append(res)
    return results


async def ttfb(urls, n):
    state = dict(open=0, peak_open=0, complete=0, incomplete=0, connect_errors=0)
    rounds = [[None] * len(urls) for _ in range(n)]
    complete = [0] * len(urls)
    for r, i in turns(n, len(urls)):
        before = state["complete"]
        t = await one_stream(urls[i], state, 30)
        rounds[r][i] = None if t is None else t * 1000
        complete[i] += state["complete"] - before
    return summarise(rounds, complete, n)


def blocking_stream(sock, req, kept):
    """Send one stream's request on `sock` and read its response to the end: (ttfb in
    seconds or None, complete)."""
    start = time.monotonic()
    sock.sendall(req)
    data = b""
    ttfb = None
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        if ttfb is None:
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0 and b"data:" in data[head_end:]:
                ttfb = time.monotonic() - start
        if kept and data.endswith(CHUNKED_END):
            break
    return ttfb, completed(data)


def ttfb_blocking(urls, n, kept):
    reqs = [request_bytes(url, "keep-alive" if kept else "close") for url in urls]
    socks = [None] * len(urls)
    rounds = [[None] * len(urls) for _ in range(n)]
    complete = [0] * len(urls)
    for r, i in turns(n, len(urls)):
        host, port, req = reqs[i]
        try:
            if socks[i] is None:
                socks[i] = socket.create_connection((host, port), timeout=30)
                socks[i].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t, ok = blocking_stream(socks[i], req, kept)
        except OSError:
            t, ok = None, False
        rounds[r][i] = None if t is None else t * 1000
        complete[i] += ok
        if not (kept and ok) and socks[i] is not None:
            socks[i].close()
            socks[i] = None
    for sock in socks:
        if sock is not None:
            sock.close()
    return summarise(rounds, complete, n)


def main():
    modes = ("concurrent", "ttfb", "ttfb-blocking", "ttfb-kept")
    if len(sys.argv) != 4 or sys.argv[1] not in modes:
        sys.exit(__doc__)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    mode, url, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    urls = url.split(",")
    if mode == "concurrent":
        if len(urls) != 1:
            sys.exit("streams.py: concurrent takes one URL")
        result = asyncio.run(concurrent(url, n))
    else:
        if mode.startswith("ttfb-"):
            result = ttfb_blocking(urls, n, kept=mode == "ttfb-kept")
        else:
            result = asyncio.run(ttfb(urls, n))
        if len(urls) == 1:
            result = result[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
