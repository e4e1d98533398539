#!/usr/bin/env python3
"""A model-server stand-in that measures its own requests and reports them to suanli
(docs/services.md, "Latency and success rate").

It serves HTTP on 127.0.0.1:$SUANLI_PORT (--port):

  GET /infer?ms=N&fail=1  a request: it takes N ms (default 0) and answers 200, or 500 with
                          fail=1. Every request is timed and counted; a failure is a 5xx answer.
  GET / and GET /healthz  200, for readiness and liveness checks (not counted).
  GET /metrics            Prometheus text (not counted): suanli_latency_ms (the p99 latency of
                          the window, in ms), suanli_success_ratio (successes / requests in the
                          window), suanli_requests_total and suanli_request_failures_total.

The window is the requests of the last --window-s seconds. Every --write-every-s seconds it
also writes the p99 latency and the success ratio into $SUANLI_ALLOC_DIR/latency_ms and
$SUANLI_ALLOC_DIR/success_ratio (one number each, replaced atomically), the files the agent
reads with `source = "file"`. While the window holds no request there is nothing to report:
the two files are removed and the two samples are left out of /metrics.
Python 3 standard library only.
"""

import argparse
import collections
import http.server
import math
import os
import sys
import threading
import time
import urllib.parse


class Stats:
    """The requests of the window, and totals since the start."""

    def __init__(self, window_s):
        self.window_s = window_s
        self.lock = threading.Lock()
        self.recent = collections.deque()  # (monotonic end time, latency ms, succeeded)
        self.total = 0
        self.failures = 0

    def record(self, latency_ms, ok):
        with self.lock:
            self.recent.append((time.monotonic(), latency_ms, ok))
            self.total += 1
            self.failures += 0 if ok else 1

    def summary(self):
        """(p99 latency in ms, success ratio) over the window; None when it is empty."""
        with self.lock:
            cut = time.monotonic() - self.window_s
            while self.recent and self.recent[0][0] < cut:
                self.recent.popleft()
            if not self.recent:
                return None
            latencies = sorted(r[1] for r in self.recent)
            ok = sum(1 for r in self.recent if r[2])
            n = len(self.recent)
        # Nearest rank: the smallest latency at or above 99% of the requests.
        p99 = latencies[max(0, math.ceil(0.99 * n) - 1)]
        return p99, ok / n

    def totals(self):
        with self.lock:
            return self.total, self.failures


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def writer(stats, alloc_dir, every_s):
    latency_file = os.path.join(alloc_dir, "latency_ms")
    success_file = os.path.join(alloc_dir, "success_ratio")
    while True:
        s = stats.summary()
        try:
            if s is None:
                remove(latency_file)
                remove(success_file)
            else:
                write_atomic(latency_file, "%.3f\n" % s[0])
                write_atomic(success_file, "%.6f\n" % s[1])
        except OSError as e:
            print("cannot write the report files: %s" % e, file=sys.stderr, flush=True)
        time.sleep(every_s)


def handler(stats):
    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, code, body, content_type="text/plain"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            if url.path in ("/", "/healthz"):
                self.answer(200, "ok\n")
            elif url.path == "/metrics":
                self.answer(200, metrics(stats), "text/plain; version=0.0.4")
            elif url.path == "/infer":
                start = time.monotonic()
                query = urllib.parse.parse_qs(url.query)
                try:
                    ms = float(query.get("ms", ["0"])[0])
                except ValueError:
                    ms = 0.0
                time.sleep(max(0.0, min(ms, 60_000.0)) / 1000.0)
                code = 500 if query.get("fail", ["0"])[0] == "1" else 200
                self.answer(code, "failed\n" if code >= 500 else "done\n")
                stats.record((time.monotonic() - start) * 1000.0, code < 500)
            else:
                self.answer(404, "no such path\n")

        def log_message(self, *args):
            pass  # one line per request and per check would only fill the task's stderr

    return Handler


def metrics(stats):
    total, failures = stats.totals()
    lines = [
        "# TYPE suanli_requests_total counter",
        "suanli_requests_total %d" % total,
        "# TYPE suanli_request_failures_total counter",
        "suanli_request_failures_total %d" % failures,
    ]
    s = stats.summary()
    if s is not None:
        lines += [
            "# TYPE suanli_latency_ms gauge",
            "suanli_latency_ms %.3f" % s[0],
            "# TYPE suanli_success_ratio gauge",
            "suanli_success_ratio %.6f" % s[1],
        ]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=int(os.environ.get("SUANLI_PORT", "8080")))
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--write-every-s", type=float, default=1.0)
    args = p.parse_args()
    stats = Stats(args.window_s)
    alloc_dir = os.environ.get("SUANLI_ALLOC_DIR", "")
    if alloc_dir:
        threading.Thread(target=writer, args=(stats, alloc_dir, args.write_every_s), daemon=True).start()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler(stats))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
