"""Prints the per-round side-by-side table, the agentq/Celery ratios and a final JSON line."""

import json
import statistics
import sys

TARGET = 2.0  # issue 10: agentq end to end >= 2x Celery's reliable setting in the same run

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
scenario = sys.argv[2] if len(sys.argv) > 2 else "throughput"
rounds = sorted({r["round"] for r in rows})
by = {(r["system"], r["round"]): r for r in rows}

cols = [("jobs_per_s", "jobs/s", "{:.0f}"), ("enqueue_per_s", "enqueue/s", "{:.0f}"),
        ("done_p50_ms", "done p50 ms", "{:.1f}"), ("done_p99_ms", "done p99 ms", "{:.1f}"),
        ("commits_per_job", "commits/job", "{:.2f}")]
per_round = []
for rnd in rounds:
    a, c = by.get(("agentq", rnd)), by.get(("celery", rnd))
    if not (a and c):
        continue
    print(f"round {rnd}  ({'agentq' if rnd % 2 else 'celery'} first)")
    print(f"  {'':<18}" + "".join(f"{label:>13}" for _, label, _ in cols))
    for name, r in (("agentq", a), ("celery", c)):
        print(f"  {name:<18}" + "".join(f"{fmt.format(r[k]):>13}" for k, _, fmt in cols))
    ratio = {
        "round": rnd,
        "jobs_per_s": a["jobs_per_s"] / c["jobs_per_s"],
        "done_p50": a["done_p50_ms"] / c["done_p50_ms"],
        "done_p99": a["done_p99_ms"] / c["done_p99_ms"],
    }
    per_round.append(ratio)
    print(f"  {'agentq / celery':<18}{ratio['jobs_per_s']:>12.2f}x{'':>13}"
          f"{ratio['done_p50']:>12.2f}x{ratio['done_p99']:>12.2f}x")
    print()

if not per_round:
    sys.exit("no complete round")
med = {k: statistics.median(r[k] for r in per_round) for k in ("jobs_per_s", "done_p50", "done_p99")}
worst = min(r["jobs_per_s"] for r in per_round)
met = worst >= TARGET
print(f"agentq/celery jobs/s per round: "
      + ", ".join(f"{r['jobs_per_s']:.2f}x" for r in per_round)
      + f"   median {med['jobs_per_s']:.2f}x")
print(f"agentq/celery done latency p50 median {med['done_p50']:.2f}x, "
      f"p99 median {med['done_p99']:.2f}x   (below 1 = agentq finishes sooner)")
print(f"target agentq >= {TARGET:.0f}x celery jobs/s in every round: {'met' if met else 'NOT met'}")


def median_of(system, key):
    return statistics.median(by[(system, r["round"])][key] for r in per_round)


print(json.dumps({
    "scenario": scenario,
    "jobs": rows[0]["jobs"],
    "rounds": len(per_round),
    "agentq_jobs_per_s": [by[("agentq", r["round"])]["jobs_per_s"] for r in per_round],
    "celery_jobs_per_s": [by[("celery", r["round"])]["jobs_per_s"] for r in per_round],
    "ratio_jobs_per_s": [round(r["jobs_per_s"], 2) for r in per_round],
    "ratio_jobs_per_s_median": round(med["jobs_per_s"], 2),
    "ratio_done_p50_median": round(med["done_p50"], 2),
    "ratio_done_p99_median": round(med["done_p99"], 2),
    "agentq_done_p50_ms_median": median_of("agentq", "done_p50_ms"),
    "celery_done_p50_ms_median": median_of("celery", "done_p50_ms"),
    "target_2x_met": met,
}))
