#!/usr/bin/env python3
# Helper of bench/server/run.sh: computes percentiles (pgbench per-transaction logs, idemd flush
# and claim latency histograms scraped before and after a run) and prints the report of a run:
# the table of ops/s, p50 and p99 per system and mode, the ratios at equal durability, memory per
# key, and which targets of the server benchmark hold. Standard library only.
import statistics
import sys


def pct(sorted_vals, q):
    if not sorted_vals:
        return float("nan")
    i = min(len(sorted_vals) - 1, max(0, int(round(q * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[i]


def cmd_pglog(paths):
    """p50 p99 (ms) and count of latencies (us, 3rd column) in pgbench -l logs."""
    vals = []
    for p in paths:
        with open(p) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    vals.append(int(parts[2]))
    vals.sort()
    print("%.3f %.3f %d" % (pct(vals, 0.50) / 1000.0, pct(vals, 0.99) / 1000.0, len(vals)))


def read_hist(path, name="flush_latency_us"):
    """idem_<name> buckets (cumulative, le upper bound, +Inf as None)."""
    buckets = []
    with open(path) as f:
        for line in f:
            if line.startswith("idem_%s_bucket" % name):
                le = line.split('le="')[1].split('"')[0]
                buckets.append((None if le == "+Inf" else int(le), int(line.split()[-1])))
    return buckets


def hist_quantile(before, after, q):
    """Quantile of what was counted between two scrapes, linear inside a power-of-two bucket."""
    deltas = [(le, a - b) for (le, a), (_, b) in zip(after, before)]  # cumulative deltas
    total = deltas[-1][1]
    if total <= 0:
        return float("nan"), 0
    rank = q * total
    prev_le, prev_cum = 0, 0
    for le, cum in deltas:
        if cum >= rank:
            if le is None:  # past the last finite bucket: report its bound
                return float(prev_le), total
            inside = cum - prev_cum
            frac = (rank - prev_cum) / inside if inside else 1.0
            return prev_le + frac * (le - prev_le), total
        prev_le, prev_cum = (le if le is not None else prev_le), cum
    return float(prev_le), total


def cmd_hist(before, after, name):
    """p50 p99 (us) and count of histogram idem_<name> between two scrapes."""
    b, a = read_hist(before, name), read_hist(after, name)
    if not a or len(a) != len(b):
        print("nan nan 0")
        return
    p50, n = hist_quantile(b, a, 0.50)
    p99, _ = hist_quantile(b, a, 0.99)
    print("%.0f %.0f %d" % (p50, p99, n))


# ---------------------------------------------------------------- report

def load_results(path):
    rows = []
    with open(path) as f:
        head = f.readline().rstrip("\n").split("\t")
        for line in f:
            r = dict(zip(head, line.rstrip("\n").split("\t")))
            extra = {}
            for kv in r.get("extra", "").split(";"):
                if "=" in kv:
                    k, v = kv.split("=", 1)
                    extra[k] = v
            r["extra"] = extra
            rows.append(r)
    return rows


def load_kv(path):
    kv = {}
    try:
        with open(path) as f:
            for line in f:
                if "=" in line:
                    k, v = line.rstrip("\n").split("=", 1)
                    kv[k] = v
    except FileNotFoundError:
        pass
    return kv


def fnum(x, nd=0):
    if x is None or x != x:
        return "-"
    if nd == 0:
        return "{:,}".format(int(round(x))).replace(",", " ")
    return ("%." + str(nd) + "f") % x


def med(vals):
    vals = [v for v in vals if v == v]
    return statistics.median(vals) if vals else float("nan")


def cmd_report(outdir):
    rows = load_results(outdir + "/results.tsv")
    mem = load_kv(outdir + "/memory.txt")
    meta = load_kv(outdir + "/meta.txt")

    groups = {}
    order = []
    for r in rows:
        key = (r["system"], r["mode"], r["cmd"], int(r["pipeline"]))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(r)

    agg = {}
    for key in order:
        rs = groups[key]
        ok = [r for r in rs if r["extra"].get("failed") is None]
        a = {
            "reps": len(ok),
            "failed": len(rs) - len(ok),
            "ops": med([float(r["ops"]) for r in ok]),
            "p50": med([float(r["p50_ms"]) for r in ok]),
            "p99": med([float(r["p99_ms"]) for r in ok]),
            "p99_all": [float(r["p99_ms"]) for r in ok],
            "ops_all": [float(r["ops"]) for r in ok],
            "n": sum(int(r["n"]) for r in ok),
            "flush_p50": med([float(r["extra"].get("flush_p50_us", "nan")) for r in ok]),
            "flush_p99": med([float(r["extra"].get("flush_p99_us", "nan")) for r in ok]),
            "rec_per_flush": med([float(r["extra"].get("rec_per_flush", "nan")) for r in ok]),
            "unanswered": sum(int(r["extra"].get("unanswered", "0")) for r in ok),
            "max": max([float(r["extra"].get("max_ms", "nan")) for r in ok] or [float("nan")]),
            "ckpts": sum(int(r["extra"].get("checkpoints", "0")) for r in ok),
            "load": med([float(r.get("load1", "nan")) for r in rs]),
        }
        agg[key] = a

    out = []
    w = out.append
    w("## Server benchmark report")
    w("")
    w("mode: %s, %s s per run, %s repetitions at pipeline 1, %s clients (redis-benchmark), "
      "%s clients (pgbench), keyspace %s, idemd %s" % (
          meta.get("mode", "?"), meta.get("secs", "?"), meta.get("reps", "?"),
          meta.get("clients", "?"), meta.get("pg_clients", "?"), meta.get("keyspace", "?"),
          meta.get("idemd_version", "?")))
    w("")
    w("| system | mode | command | pipeline | ops/s | p50 ms | p99 ms | max ms | runs | requests | flush p50/p99 us | records/flush | checkpoints | load1 |")
    w("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for key in order:
        s, m, c, p = key
        a = agg[key]
        fl = "-"
        if a["flush_p99"] == a["flush_p99"]:
            fl = "%s / %s" % (fnum(a["flush_p50"]), fnum(a["flush_p99"]))
        runs = str(a["reps"]) + (" (+%d failed)" % a["failed"] if a["failed"] else "")
        ck = str(a["ckpts"]) if s == "idemd" else "-"
        w("| %s | %s | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            s, m, c, p, fnum(a["ops"]), fnum(a["p50"], 3), fnum(a["p99"], 3),
            fnum(a["max"], 1), runs, fnum(a["n"]), fl, fnum(a["rec_per_flush"], 1), ck,
            fnum(a["load"], 1)))
    w("")
    w("checkpoints: store checkpoints taken during the runs. A checkpoint runs in steps on the "
      "store's flusher between batches (design.md section 8), so a run that contains one does "
      "more disk work and its batches wait for the steps; compare such runs with care.")
    w("")
    w("Figures with several runs are medians of the runs (p99 too). ops/s counts statements: a "
      "pgbench pipeline of 32 inserts counts 32. Latency is per request for redis-benchmark "
      "(at pipeline 32: from the batch's send to that reply) and per script for pgbench (at "
      "pipeline 32: the whole pipeline of 32 inserts).")
    w("")

    def ops(s, m, c, p):
        a = agg.get((s, m, c, p))
        return a["ops"] if a else float("nan")

    def ratio(x, y):
        return x / y if y and y == y and x == x else float("nan")

    w("### Ratios (ops/s)")
    w("")
    w("| idemd command | pipeline | idemd sync / Redis always | idemd sync / Redis appendonly no | idemd sync / PostgreSQL sync on | idemd batch / Redis everysec | idemd none / Redis appendonly no |")
    w("|---|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for c in ("SET NX", "IDEM.CLAIM"):
        for p in (1, 32):
            r1 = ratio(ops("idemd", "sync", c, p), ops("redis", "always", "SET NX", p))
            r2 = ratio(ops("idemd", "sync", c, p), ops("redis", "no", "SET NX", p))
            r3 = ratio(ops("idemd", "sync", c, p), ops("postgresql", "sync on", "INSERT", p))
            r4 = ratio(ops("idemd", "batch", c, p), ops("redis", "everysec", "SET NX", p))
            r5 = ratio(ops("idemd", "none", c, p), ops("redis", "no", "SET NX", p))
            ratios[(c, p)] = (r1, r2, r3, r4, r5)
            w("| %s | %d | %s | %s | %s | %s | %s |" % (
                c, p, fnum(r1, 2), fnum(r2, 2), fnum(r3, 1), fnum(r4, 2), fnum(r5, 2)))
    w("")

    w("### Memory per key")
    w("")
    ik = float(mem.get("idemd_keys", "nan"))
    rk = float(mem.get("redis_keys", "nan"))
    pk = float(mem.get("pg_rows", "nan"))

    def per(k, n):
        return float(mem.get(k, "nan")) / n if n and n == n else float("nan")

    idem_anon = per("idemd_anon_delta", ik)
    idem_rss = per("idemd_rss_delta", ik)
    idem_own = per("idemd_memory_bytes", ik)
    redis_used = per("redis_used_delta", rk)
    redis_rss = per("redis_rss_delta", rk)
    pg_total = per("pg_total_bytes", pk)
    pg_heap = per("pg_heap_bytes", pk)
    pg_index = per("pg_index_bytes", pk)
    w("| system | keys | measure | bytes/key |")
    w("|---|---:|---|---:|")
    w("| idemd (none) | %s | anonymous memory delta (smaps_rollup) | %s |" % (fnum(ik), fnum(idem_anon, 1)))
    w("| idemd (none) | %s | RSS delta | %s |" % (fnum(ik), fnum(idem_rss, 1)))
    w("| idemd (none) | %s | memory_bytes (INFO idem) at the end | %s |" % (fnum(ik), fnum(idem_own, 1)))
    w("| Redis (appendonly no) | %s | used_memory delta (INFO memory) | %s |" % (fnum(rk), fnum(redis_used, 1)))
    w("| Redis (appendonly no) | %s | RSS delta | %s |" % (fnum(rk), fnum(redis_rss, 1)))
    w("| PostgreSQL | %s | table + index (pg_total_relation_size) | %s |" % (fnum(pk), fnum(pg_total, 1)))
    w("| PostgreSQL | %s | heap / primary key index | %s / %s |" % (fnum(pk), fnum(pg_heap, 1), fnum(pg_index, 1)))
    w("")
    w("Absolute: idemd RSS %s MiB (file-backed %s MiB: the mapped log segments), anonymous %s MiB "
      "at the end of the load; Redis RSS %s MiB, used_memory %s MiB." % (
          fnum(float(mem.get("idemd_rss_after", "nan")) / 1048576, 1),
          fnum(float(mem.get("idemd_rssfile_after", "nan")) / 1048576, 1),
          fnum(float(mem.get("idemd_anon_after", "nan")) / 1048576, 1),
          fnum(float(mem.get("redis_rss_after", "nan")) / 1048576, 1),
          fnum(float(mem.get("redis_used_after", "nan")) / 1048576, 1)))
    w("")

    w("### Targets")
    w("")
    w("| target | measured | holds |")
    w("|---|---|---|")

    def yes(b):
        if b is None:
            return "no data"
        return "yes" if b else "**no**"

    for c in ("IDEM.CLAIM", "SET NX"):
        for p in (1, 32):
            r1, r2, r3, _, _ = ratios[(c, p)]
            w("| idemd sync (%s) >= 2x Redis always, pipeline %d | %sx | %s |" % (
                c, p, fnum(r1, 2), yes(None if r1 != r1 else r1 >= 2)))
            w("| idemd sync (%s) >= Redis appendonly no, pipeline %d | %sx | %s |" % (
                c, p, fnum(r2, 2), yes(None if r2 != r2 else r2 >= 1)))
        r3 = ratios[(c, 32)][2]
        w("| idemd sync (%s) >= 20x PostgreSQL synchronous_commit=on, pipeline 32 | %sx | %s |" % (
            c, fnum(r3, 1), yes(None if r3 != r3 else r3 >= 20)))
        a = agg.get(("idemd", "sync", c, 1))
        if a:
            bound = a["p50"] + 2 * a["flush_p99"] / 1000.0
            w("| idemd sync (%s) p99 <= p50 + 2x flush p99, pipeline 1 | p99 %s ms vs %s + 2 x %s = %s ms | %s |" % (
                c, fnum(a["p99"], 3), fnum(a["p50"], 3), fnum(a["flush_p99"] / 1000.0, 3),
                fnum(bound, 3), yes(None if bound != bound else a["p99"] <= bound)))
    mr = ratio(idem_anon, redis_used)
    w("| idemd memory per key < 1/3 of Redis's (anonymous delta vs used_memory delta) | %s vs %s B/key (%sx) | %s |" % (
        fnum(idem_anon, 1), fnum(redis_used, 1), fnum(mr, 2), yes(None if mr != mr else mr < 1 / 3)))
    mr2 = ratio(idem_rss, redis_rss)
    w("| the same by RSS delta | %s vs %s B/key (%sx) | %s |" % (
        fnum(idem_rss, 1), fnum(redis_rss, 1), fnum(mr2, 2), yes(None if mr2 != mr2 else mr2 < 1 / 3)))
    w("")
    p99s = agg.get(("idemd", "sync", "IDEM.CLAIM", 1))
    if p99s and len(p99s["p99_all"]) > 1:
        w("idemd sync IDEM.CLAIM pipeline 1, every run: ops/s %s; p99 ms %s." % (
            ", ".join(fnum(x) for x in p99s["ops_all"]),
            ", ".join(fnum(x, 3) for x in p99s["p99_all"])))
        w("")
    problems = [(k, a["unanswered"]) for k, a in agg.items() if a["unanswered"]]
    fails = [(k, a["failed"]) for k, a in agg.items() if a["failed"]]
    if problems or fails:
        w("Problems: " + "; ".join(
            ["%s %s %s P%d: %d requests not counted by INFO idem" % (k + (n,)) for k, n in problems] +
            ["%s %s %s P%d: %d runs failed (see raw/)" % (k + (n,)) for k, n in fails]))
        w("")
    print("\n".join(out))


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: report.py pglog FILE... | flush BEFORE AFTER | claim BEFORE AFTER | "
                 "report OUTDIR")
    c = sys.argv[1]
    if c == "pglog":
        cmd_pglog(sys.argv[2:])
    elif c == "flush":
        cmd_hist(sys.argv[2], sys.argv[3], "flush_latency_us")
    elif c == "claim":
        cmd_hist(sys.argv[2], sys.argv[3], "claim_latency_us")
    elif c == "report":
        cmd_report(sys.argv[2])
    else:
        sys.exit("unknown subcommand " + c)


if __name__ == "__main__":
    main()
