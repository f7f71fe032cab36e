#!/usr/bin/python3
"""Operator deletes beside workers' claims: what a bulk DEL costs idemd's other clients.

Starts idemd (durability sync) on a temporary directory, then:
  1. alone: redis-benchmark, 50 clients, pipeline 1, `SET key:<rand> v NX PX 86400000` for
     --secs seconds (the workers' baseline);
  2. the same again while this script deletes --keys preloaded keys over the unix socket (an
     admin), as `DEL` commands of --per-del keys each, --depth commands pipelined (size --keys
     so that the deletes last as long as the workers' run: the overlap is printed);
and prints, per phase: the workers' ops/s, p50 and p99, the deletes per second, and the bytes
the audit trail grew per deleted key. Talks to 127.0.0.1 and a unix socket only; stops idemd
by its pid and removes the directory at the end.

usage: bench/server/operator_load.py [--idemd PATH] [--keys N] [--per-del K] [--depth D]
                                     [--secs S]        (K at most 63: idemd's argument limit)
Needs redis-benchmark (redis-tools) and Debian's python3-redis.
"""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import redis

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(port, n):
    """redis-benchmark SET NX at pipeline 1, n requests: (ops/s over the wall time, p50 ms,
    p99 ms, seconds)."""
    cmd = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", "50", "-P", "1",
           "-r", "1000000000", "-n", str(n), "--csv",
           "SET", "key:__rand_int__", "v", "NX", "PX", "86400000"]
    t = time.monotonic()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    secs = time.monotonic() - t
    for line in out.splitlines():
        f = [x.strip('"') for x in line.split('","')]
        if len(f) >= 8 and f[0].startswith("SET"):
            return n / secs, float(f[3]), float(f[6]), secs
    raise RuntimeError("no result from redis-benchmark: " + out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--idemd", default=os.path.join(ROOT, "build-rel", "idemd"))
    ap.add_argument("--keys", type=int, default=300000)
    ap.add_argument("--per-del", type=int, default=1)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--secs", type=float, default=8)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="idem-oplo-")
    port = free_port()
    sock = os.path.join(d, "idemd.sock")
    log = open(os.path.join(d, "idemd.log"), "w")
    p = subprocess.Popen([a.idemd, "--dir", os.path.join(d, "data"), "--socket", sock,
                          "--port", str(port)], stdout=log, stderr=log)
    try:
        r = None
        for _ in range(200):
            try:
                r = redis.Redis(unix_socket_path=sock)
                if r.ping():
                    break
            except (redis.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
        audit = os.path.join(d, "data", "audit.log")
        pipe = r.pipeline(transaction=False)
        for i in range(a.keys):
            pipe.execute_command("SET", "op:%d" % i, "v", "NX", "PX", "86400000")
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()
        ops, _, _, secs = bench(port, 2000)  # sizes the runs to about --secs
        n = max(20000, int(ops * a.secs))
        ops, p50, p99, secs = bench(port, n)
        print("alone:        workers %.0f ops/s p50 %.3f ms p99 %.3f ms (%d requests in %.1f s)" %
              (ops, p50, p99, n, secs))

        result = {}

        def deleter():
            try:
                delete_all()
            except redis.RedisError as e:
                result["error"] = str(e)[-200:]

        def delete_all():
            before = os.path.getsize(audit) if os.path.exists(audit) else 0
            t = time.monotonic()
            deleted, i = 0, 0
            pl = r.pipeline(transaction=False)
            while i < a.keys:
                for _ in range(a.depth):
                    if i >= a.keys:
                        break
                    keys = ["op:%d" % k for k in range(i, min(i + a.per_del, a.keys))]
                    i += len(keys)
                    pl.execute_command("DEL", *keys)
                deleted += sum(pl.execute())
            result["secs"] = time.monotonic() - t
            result["deleted"] = deleted
            result["audit"] = os.path.getsize(audit) - before

        th = threading.Thread(target=deleter)
        th.start()
        ops, p50, p99, workers_secs = bench(port, n)
        th.join()
        if "error" in result:
            print("error: the deletes failed: " + result["error"])
            return 1
        print("with deletes: workers %.0f ops/s p50 %.3f ms p99 %.3f ms (deletes ran %.1f s of "
              "their %.1f s)" % (ops, p50, p99, min(result["secs"], workers_secs), workers_secs))
        print("deletes: %d keys in %.1f s = %.0f keys/s (DEL of %d keys, %d pipelined); "
              "audit trail %.1f bytes per key" %
              (result["deleted"], result["secs"], result["deleted"] / result["secs"], a.per_del,
               a.depth, result["audit"] / max(result["deleted"], 1)))
        if result["deleted"] != a.keys:
            print("error: deleted %d of %d keys" % (result["deleted"], a.keys))
            return 1
        return 0
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
