#!/usr/bin/env python3
"""One tenant against another, measured (issue 47's runs): real `agentq` processes on a
throwaway database and broker namespace, removed at the end.

  python3 bench/hostile.py pause-flood [--victims 200] [--baseline 60] [--attack 300]
      tenant tb runs operations that sleep 1 s at a time; tenant ta's operator creates pauses as
      fast as the API lets it (16 connections, made-up and served kinds); prints tb's sleep lag
      (the time between a sleep's end and its next step's start) before and during the attack,
      and whether any of tb's operations was restarted, handed back or lost.

  python3 bench/hostile.py preemption [--window 120] [--every 15]
      tenant tb runs 16 batch operations of six 20 s steps on one worker (16 batch slots) for
      the window, alone, then again (a new database) with tenant ta enqueueing one batch `echo`
      every N s; prints tb's completed steps in each window and the echoes' latency.

AGENTQ (default ./target/release/agentq), DATABASE_URL's server (default
postgres://postgres@127.0.0.1:5432) and AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f).
"""

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import uuid

AGENTQ = os.environ.get("AGENTQ", "./target/release/agentq")
SERVER = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres").rsplit("/", 1)[0]
AMQP = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")


class World:
    """A database, a namespace and the agentq processes of one run."""

    def __init__(self, extra_env=None):
        tag = uuid.uuid4().hex[:12]
        self.db = f"agentq_bench_hostile_{tag}"
        self.url = f"{SERVER}/{self.db}"
        self.env = dict(os.environ, DATABASE_URL=self.url, AMQP_URL=AMQP,
                        AGENTQ_NAMESPACE=f"bench-hostile-{tag}", RUST_LOG="warn",
                        **(extra_env or {}))
        self.procs = []
        self.run(["migrate"])
        print(f"database {self.db} (removed when the run ends)", file=sys.stderr)

    def run(self, args):
        out = subprocess.run([AGENTQ, *args], env=self.env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"agentq {' '.join(args)} failed: {out.stderr}")
        return out.stdout

    def json(self, args):
        return json.loads(self.run([*args, "--json"]))

    def spawn(self, args):
        log = open(f"/tmp/{self.db}-{len(self.procs)}.log", "w")
        p = subprocess.Popen([AGENTQ, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((p, log))
        return p

    def serve(self):
        p = self.spawn(["serve", "--listen", "127.0.0.1:0"])
        log = f"/tmp/{self.db}-{len(self.procs) - 1}.log"
        deadline = time.time() + 60
        while time.time() < deadline:
            text = open(log).read()
            if "listening on http://" in text:
                return text.split("listening on http://")[1].split()[0]
            time.sleep(0.2)
        raise SystemExit("agentq serve did not start")

    def sql(self, query):
        out = subprocess.run(["psql", self.url, "-At", "-c", query], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"psql: {out.stderr}")
        return out.stdout.strip()

    def close(self):
        for p, log in self.procs:
            p.kill()
            p.wait()
            log.close()
        subprocess.run(["psql", f"{SERVER}/postgres", "-qc",
                        f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)'], capture_output=True)
        ns = self.env["AGENTQ_NAMESPACE"]
        for name in [f"{ns}.jobs.interactive", f"{ns}.jobs.batch", f"{ns}.dlq"]:
            subprocess.run(["rabbitmqctl", "-q", "delete_queue", name], capture_output=True)
        for name in [f"{ns}.jobs", f"{ns}.dlx"]:
            subprocess.run(["rabbitmqctl", "-q", "eval",
                            f'rabbit_exchange:delete(rabbit_misc:r(<<"/">>, exchange, <<"{name}">>), false, <<"bench">>).'],
                           capture_output=True)


def post(host, token, path, body):
    """One POST on a fresh connection; the status."""
    c = http.client.HTTPConnection(host, timeout=30)
    c.request("POST", path, json.dumps(body), {"authorization": f"Bearer {token}",
                                               "content-type": "application/json"})
    r = c.getresponse()
    r.read()
    c.close()
    return r.status


def lag(world, since, until):
    """p50, p99, max of the time (s) between a sleep's wake time and the next step's start, for
    tb's sleeps that woke in [since, until) (epoch seconds)."""
    row = world.sql(f"""
        WITH s AS (
            SELECT extract(epoch FROM lead(started_at) OVER w - wake_at) AS lag, wake_at
              FROM operation_steps st JOIN operations o ON o.id = st.op_id
             WHERE o.tenant_id = 'tb'
            WINDOW w AS (PARTITION BY st.op_id ORDER BY st.seq))
        SELECT count(*), round(percentile_cont(0.5) WITHIN GROUP (ORDER BY lag)::numeric, 3),
               round(percentile_cont(0.99) WITHIN GROUP (ORDER BY lag)::numeric, 3),
               round(max(lag)::numeric, 3)
          FROM s WHERE lag IS NOT NULL AND wake_at >= to_timestamp({since})
                   AND wake_at < to_timestamp({until})""")
    n, p50, p99, mx = row.split("|")
    return {"sleeps": int(n), "p50_s": float(p50 or 0), "p99_s": float(p99 or 0), "max_s": float(mx or 0)}


def pause_flood(args):
    w = World()
    try:
        host = w.serve()
        w.spawn(["scheduler"])
        w.spawn(["worker"])
        ta = w.json(["tokens", "create", "--tenant", "ta", "--role", "operator"])["token"]
        tb = w.json(["tokens", "create", "--tenant", "tb", "--role", "producer"])["token"]
        steps = [{"sleep_ms": 1000}] * 3000
        for _ in range(args.victims):
            status = post(host, tb, "/v1/operations", {"kind": "script", "input": {"steps": steps}})
            assert status in (200, 201, 202), status
        time.sleep(10)  # the victims reach their steady state
        t0 = time.time()
        time.sleep(args.baseline)
        t1 = time.time()
        baseline = lag(w, t0, t1)
        print(f"baseline ({args.baseline} s): {baseline}", flush=True)

        counts, lock, stop = {}, threading.Lock(), threading.Event()

        def flood(n):
            kinds = ["echo", "script", "agent", "triage", "doc_migration"]
            i = 0
            while not stop.is_set():
                i += 1
                kind = kinds[i % len(kinds)] if i % 4 == 0 else f"made-up-{n}-{i}"
                try:
                    status = post(host, ta, "/v1/pauses",
                                  {"scope": {"kind": kind, "lane": ["interactive", "batch"][i % 2]},
                                   "reason": "flood"})
                except OSError:
                    status = "error"
                with lock:
                    counts[status] = counts.get(status, 0) + 1

        threads = [threading.Thread(target=flood, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        start = time.time()
        windows = []
        while time.time() - start < args.attack:
            a = time.time()
            time.sleep(min(30, args.attack - (a - start)))
            b = time.time()
            windows.append(lag(w, a, b))
            with lock:
                print(f"attack {b - start:5.0f} s: {windows[-1]} answers {dict(counts)}", flush=True)
        stop.set()
        for t in threads:
            t.join()
        during = lag(w, start, time.time())
        hurt = w.sql("""SELECT count(*) FILTER (WHERE restarts > 0), count(*) FILTER (WHERE status = 'dead'),
                               count(*) FILTER (WHERE status NOT IN ('running', 'sleeping', 'queued'))
                          FROM operations WHERE tenant_id = 'tb'""")
        pauses = w.sql("SELECT count(*) FROM pauses")
        print(json.dumps({"scenario": "pause-flood", "victims": args.victims, "baseline": baseline,
                          "attack": during, "attack_windows": windows,
                          "answers": {str(k): v for k, v in counts.items()},
                          "pauses_stored": int(pauses),
                          "victims_restarted_dead_other": [int(x) for x in hurt.split("|")],
                          "p99_over_baseline_s": round(during["p99_s"] - baseline["p99_s"], 3)}))
    finally:
        w.close()


def preemption_window(args, echoes):
    w = World()
    try:
        w.spawn(["scheduler"])
        w.spawn(["worker"])
        steps = json.dumps({"steps": [{"work_ms": 20000}] * 6})
        for _ in range(16):
            w.run(["enqueue", "--tenant", "tb", "--kind", "script", "--lane", "batch", "--input", steps])
        t0 = time.time()
        latencies = []
        next_echo = t0 + args.every if echoes else None
        while time.time() - t0 < args.window:
            if next_echo and time.time() >= next_echo:
                op = w.json(["enqueue", "--tenant", "ta", "--kind", "echo", "--lane", "batch",
                             "--input", '{"text":"stray"}'])["op_id"]
                latencies.append((op, time.time()))
                next_echo += args.every
            time.sleep(0.1)
        done = int(w.sql(f"""SELECT count(*) FROM operation_steps s JOIN operations o ON o.id = s.op_id
                              WHERE o.tenant_id = 'tb' AND s.status = 'completed'
                                AND s.completed_at <= to_timestamp({t0 + args.window})"""))
        echo_s = []
        for op, sent in latencies:
            row = w.sql(f"SELECT extract(epoch FROM finished_at) FROM operations WHERE id = '{op}'")
            if row:
                echo_s.append(round(float(row) - sent, 2))
        handed = int(w.sql("""SELECT count(*) FROM operation_events e JOIN operations o ON o.id = e.op_id
                              WHERE o.tenant_id = 'tb' AND e.type = 'status' AND e.data->>'status' = 'queued'"""))
        return {"completed_steps": done, "echoes": len(latencies), "echo_latency_s": echo_s,
                "tb_handed_back": handed}
    finally:
        w.close()


def preemption(args):
    alone = preemption_window(args, False)
    print(f"alone: {alone}", flush=True)
    stray = preemption_window(args, True)
    print(f"with an echo every {args.every} s: {stray}", flush=True)
    print(json.dumps({"scenario": "preemption", "window_s": args.window, "alone": alone,
                      "with_echoes": stray,
                      "ratio": round(stray["completed_steps"] / max(alone["completed_steps"], 1), 3)}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="scenario", required=True)
    f = sub.add_parser("pause-flood")
    f.add_argument("--victims", type=int, default=200)
    f.add_argument("--baseline", type=int, default=60)
    f.add_argument("--attack", type=int, default=300)
    q = sub.add_parser("preemption")
    q.add_argument("--window", type=int, default=120)
    q.add_argument("--every", type=int, default=15)
    args = p.parse_args()
    {"pause-flood": pause_flood, "preemption": preemption}[args.scenario](args)


if __name__ == "__main__":
    main()
