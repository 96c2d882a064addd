"""Runs N no-op Celery tasks end to end and prints a report and a final JSON line.

Same shape as `agentq bench`: `--producers` threads enqueue one task per call (each publish
awaits its confirm), a separate worker process with `--concurrency` prefork children runs them,
and the clock stops when the result backend holds N SUCCESS rows. Done latency is the send time
(taken just before apply_async) to the row's date_done.

Expects COMPARE_BROKER_URL, COMPARE_RESULT_URL (db+postgresql+psycopg2://...), COMPARE_QUEUE set; the
caller creates and removes the vhost and the database.
"""

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timezone

import psycopg2

HERE = os.path.dirname(os.path.abspath(__file__))


def percentiles(ms):
    """Nearest-rank p50/p99, the same rule as agentq's bench."""
    if not ms:
        return 0.0, 0.0
    ms = sorted(ms)
    at = lambda q: ms[round((len(ms) - 1) * q)]  # noqa: E731
    return at(0.50), at(0.99)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--producers", type=int, default=32)
    p.add_argument("--pool", default="prefork")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--pidfile", help="write the worker's pid here (for the caller's cleanup)")
    args = p.parse_args()

    os.environ["COMPARE_PRODUCERS"] = str(args.producers)
    sys.path.insert(0, HERE)
    from compare_celery_app import QUEUE, QUEUE_TYPE, app, noop  # noqa: E402

    # The result tables, created once here rather than raced by 64 worker children.
    app.backend.ResultSession().close()
    dsn = os.environ["COMPARE_RESULT_URL"].removeprefix("db+").replace("+psycopg2", "", 1)

    def connect():
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        return conn, conn.cursor()

    db, cur = connect()

    def count_success():
        cur.execute("SELECT count(*) FROM celery_taskmeta WHERE status = 'SUCCESS'")
        return cur.fetchone()[0]

    def commits():
        """Committed transactions in the result database, read on a fresh connection after
        the polling connection is closed (a backend flushes its statistics when it exits)."""
        db.close()
        time.sleep(0.2)
        conn, c = connect()
        c.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        n = c.fetchone()[0]
        conn.close()
        return n

    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    worker = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "celery"),
            "-A", "compare_celery_app", "worker",
            "--pool", args.pool,
            "--concurrency", str(args.concurrency),
            "--prefetch-multiplier", "1",
            "-Q", QUEUE,
            "-n", f"compare-{os.getpid()}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--loglevel", "WARNING",
        ],
        cwd=HERE,
        env=env,
        stdout=sys.stderr,  # the worker's banner is not part of the report
    )
    if args.pidfile:
        with open(args.pidfile, "w") as f:
            f.write(str(worker.pid))

    def stop_worker():
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)  # warm shutdown
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()

    try:
        deadline = time.monotonic() + 120
        while not app.control.ping(timeout=0.5):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the Celery worker did not come up")

        # Warm-up: one task per producer thread, so every pooled broker connection is open
        # (agentq's bench opens its broker link before its clock starts too).
        warm = args.producers
        warm_ids = set()
        lock = threading.Lock()

        def run_producers(count, sent_log):
            nxt = itertools.count()

            def loop():
                while True:
                    i = next(nxt)
                    if i >= count:
                        return
                    sent = time.time()
                    r = noop.apply_async(args=(i, sent))
                    with lock:
                        sent_log[r.id] = sent

            threads = [threading.Thread(target=loop) for _ in range(args.producers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        warm_log = {}
        run_producers(warm, warm_log)
        warm_ids.update(warm_log)
        while count_success() < warm:
            if time.monotonic() > deadline:
                raise SystemExit("warm-up tasks did not finish")
            time.sleep(0.02)

        commits_before = commits()
        db, cur = connect()
        polls = 0
        sent_log = {}
        started = time.monotonic()
        run_producers(args.jobs, sent_log)
        enqueue_elapsed = time.monotonic() - started
        deadline = started + args.timeout
        while True:
            polls += 1
            if count_success() >= warm + args.jobs:
                break
            cur.execute("SELECT count(*) FROM celery_taskmeta WHERE status <> 'SUCCESS'")
            if cur.fetchone()[0]:
                raise SystemExit("a task failed (see the worker's log above)")
            if time.monotonic() > deadline or worker.poll() is not None:
                raise SystemExit(f"only {count_success() - warm}/{args.jobs} tasks succeeded")
            time.sleep(0.02)
        elapsed = time.monotonic() - started

        cur.execute("SELECT task_id, date_done FROM celery_taskmeta WHERE status = 'SUCCESS'")
        done = []
        for task_id, date_done in cur.fetchall():
            sent = sent_log.get(task_id)
            if sent is not None:
                done_at = date_done.replace(tzinfo=timezone.utc).timestamp()
                done.append((done_at - sent) * 1000.0)
        # Worker children flush their statistics when their connections close.
        stop_worker()
        time.sleep(0.7)
        commits_after = commits()
        commits_per_job = max(0, commits_after - commits_before - (2 * polls + 1)) / args.jobs
    finally:
        stop_worker()
        db.close()

    p50, p99 = percentiles(done)
    jobs_per_s = args.jobs / elapsed
    enqueue_per_s = args.jobs / enqueue_elapsed
    print(
        f"celery bench: {args.jobs} no-op tasks, {args.pool} pool, concurrency "
        f"{args.concurrency}, {args.producers} producers, {QUEUE_TYPE} queue"
    )
    for label, value in [
        ("jobs/s (end to end)", f"{jobs_per_s:10.0f}"),
        ("enqueue/s", f"{enqueue_per_s:10.0f}"),
        ("done p50 ms", f"{p50:10.1f}"),
        ("done p99 ms", f"{p99:10.1f}"),
        ("result-db commits/job", f"{commits_per_job:10.2f}"),
        ("elapsed s", f"{elapsed:10.1f}"),
    ]:
        print(f"  {label:<22} {value}")
    print(json.dumps({
        "jobs": args.jobs,
        "pool": args.pool,
        "concurrency": args.concurrency,
        "producers": args.producers,
        "queue_type": QUEUE_TYPE,
        "elapsed_s": round(elapsed, 3),
        "jobs_per_s": round(jobs_per_s),
        "enqueue_per_s": round(enqueue_per_s),
        "done_p50_ms": round(p50, 1),
        "done_p99_ms": round(p99, 1),
        "commits_per_job": round(commits_per_job, 2),
        "measured": len(done),
    }))


if __name__ == "__main__":
    main()
