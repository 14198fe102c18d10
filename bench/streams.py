#!/usr/bin/env python3
"""SSE stream load for bench/overhead.sh (standard library only, loopback only).

  streams.py concurrent URL N   open N streams at once; report how many completed
  streams.py ttfb URL N         N streams one after the other; time to first event
  streams.py ttfb-blocking URL N
                                the same with a blocking socket, a new connection each
  streams.py ttfb-kept URL N    the same with a blocking socket, one kept-alive connection

Each stream is one POST, read to the end; `Connection: close` except in ttfb-kept. A
stream counts as complete when its status is 200 and its body ends with `data: [DONE]`
(and the chunked body's last chunk, when chunked). The blocking modes take the event loop
out of what is timed. Output is one line of JSON.
"""

import asyncio
import json
import math
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


async def ttfb(url, n):
    state = dict(open=0, peak_open=0, complete=0, incomplete=0, connect_errors=0)
    times = []
    for _ in range(n):
        t = await one_stream(url, state, 30)
        if t is not None:
            times.append(t * 1000)
    return percentiles(times, n, state["complete"])


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


def ttfb_blocking(url, n, kept):
    host, port, req = request_bytes(url, "keep-alive" if kept else "close")
    times, complete, sock = [], 0, None
    for _ in range(n):
        try:
            if sock is None:
                sock = socket.create_connection((host, port), timeout=30)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t, ok = blocking_stream(sock, req, kept)
        except OSError:
            t, ok = None, False
        if t is not None:
            times.append(t * 1000)
        complete += ok
        if not (kept and ok) and sock is not None:
            sock.close()
            sock = None
    if sock is not None:
        sock.close()
    return percentiles(times, n, complete)


def main():
    modes = ("concurrent", "ttfb", "ttfb-blocking", "ttfb-kept")
    if len(sys.argv) != 4 or sys.argv[1] not in modes:
        sys.exit(__doc__)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    mode, url, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode.startswith("ttfb-"):
        result = ttfb_blocking(url, n, kept=mode == "ttfb-kept")
    elif mode == "concurrent":
        result = asyncio.run(concurrent(url, n))
    else:
        result = asyncio.run(ttfb(url, n))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
