#!/usr/bin/env bash
# Side by side: the same no-op workload on agentq and on Celery (RabbitMQ broker, acks_late,
# publisher confirms, Postgres result backend) in one run, alternating and repeated, printing
# the ratios. Usage: bash bench/compare/run.sh [N=5000] [ROUNDS=3]
#
# Environment: PG_URL (server, no database; default postgres://postgres@127.0.0.1:5432),
# AMQP_HOST_URL (default amqp://guest:guest@127.0.0.1:5672), CONCURRENCY (64) and PRODUCERS (32)
# for both systems, CELERY_CONCURRENCY (to try another Celery pool size; default CONCURRENCY),
# CELERY_POOL (prefork), CELERY_QUEUE_TYPE (quorum | classic),
# AGENTQ_BENCH_CACHE=1 to keep the virtualenv in ~/.cache/agentq-bench, RESULTS=file to keep
# the raw JSON lines.
set -euo pipefail

N=${1:-5000}
ROUNDS=${2:-3}
CONCURRENCY=${CONCURRENCY:-64}
PRODUCERS=${PRODUCERS:-32}
CELERY_POOL=${CELERY_POOL:-prefork}
CELERY_CONCURRENCY=${CELERY_CONCURRENCY:-$CONCURRENCY}
CELERY_QUEUE_TYPE=${CELERY_QUEUE_TYPE:-quorum}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
AMQP_HOST_URL=${AMQP_HOST_URL:-amqp://guest:guest@127.0.0.1:5672}
PYTHON=${PYTHON:-python3.11}

# Pinned: the newest releases that install on Python 3.11 and talk to RabbitMQ 3.10.
PINS=(celery==5.7.0 kombu==5.7.0 amqp==5.4.2 billiard==4.3.2 vine==5.1.0
      sqlalchemy==2.1.9 psycopg2-binary==2.9.13)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
TAG=$(date +%s)$$
WORK=$(mktemp -d "${TMPDIR:-/tmp}/agentq-compare.XXXXXX")
VHOST="agentq-compare-$TAG"
DATABASES=()
WORKER_PIDFILE="$WORK/celery-worker.pid"

psql_admin() { psql "$PG_URL/postgres" -X -q -v ON_ERROR_STOP=1 "$@"; }

cleanup() {
    local rc=$?
    set +e
    if [[ -s $WORKER_PIDFILE ]]; then
        local pid
        pid=$(cat "$WORKER_PIDFILE")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
            kill -KILL "$pid" 2>/dev/null
        fi
    fi
    for db in "${DATABASES[@]}"; do
        psql_admin -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" 2>/dev/null
    done
    rabbitmqctl -q delete_vhost "$VHOST" >/dev/null 2>&1
    [[ -n ${RESULTS:-} && -s $WORK/results.jsonl ]] && cp "$WORK/results.jsonl" "$RESULTS"
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== setup"
if [[ ${AGENTQ_BENCH_CACHE:-0} == 1 ]]; then
    VENV="$HOME/.cache/agentq-bench/venv-$(printf '%s\n' "${PINS[@]}" | sha1sum | cut -c1-12)"
else
    VENV="$WORK/venv"
fi
if [[ ! -x $VENV/bin/celery ]]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet "${PINS[@]}"
fi
PY="$VENV/bin/python"

(cd "$ROOT" && cargo build --release --quiet --features bench)
AGENTQ="$ROOT/target/release/agentq"
if "$AGENTQ" bench --help | grep -q '\be2e\b'; then SCENARIO=e2e; else SCENARIO=throughput; fi

rabbitmqctl -q add_vhost "$VHOST" >/dev/null
rabbitmqctl -q set_permissions -p "$VHOST" guest '.*' '.*' '.*' >/dev/null

versions=$("$PY" -c 'import celery, kombu, amqp, sqlalchemy, psycopg2, platform
print(f"celery {celery.__version__}, kombu {kombu.__version__}, py-amqp {amqp.__version__}, "
      f"SQLAlchemy {sqlalchemy.__version__}, psycopg2 {psycopg2.__version__.split()[0]}, "
      f"Python {platform.python_version()}")')
echo "agentq $("$AGENTQ" --version 2>/dev/null | awk '{print $NF}') ($(git -C "$ROOT" rev-parse --short HEAD)), scenario $SCENARIO"
echo "$versions"
echo "PostgreSQL $(psql_admin -tAc 'SHOW server_version' | awk '{print $1}'), RabbitMQ $(rabbitmqctl -q version)"
echo "$(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "N=$N rounds=$ROUNDS concurrency=$CONCURRENCY producers=$PRODUCERS celery pool=$CELERY_POOL -c $CELERY_CONCURRENCY queue=$CELERY_QUEUE_TYPE"

run_agentq() {
    local round=$1 out="$WORK/agentq-$1.out"
    echo "-- round $round: agentq ($SCENARIO)"
    DATABASE_URL="$PG_URL/agentq" AMQP_URL="$AMQP_HOST_URL/%2f" RUST_LOG=warn \
        "$AGENTQ" bench --scenario "$SCENARIO" --jobs "$N" \
        --concurrency "$CONCURRENCY" --producers "$PRODUCERS" | tee "$out"
    tail -n 1 "$out" | "$PY" -c 'import json, sys
line = json.loads(sys.stdin.read()); line.update(system="agentq", round=int(sys.argv[1]))
print(json.dumps(line))' "$round" >>"$WORK/results.jsonl"
}

run_celery() {
    local round=$1 out="$WORK/celery-$1.out" db="agentq_compare_${TAG}_$1"
    echo "-- round $round: celery ($CELERY_POOL -c $CELERY_CONCURRENCY, $CELERY_QUEUE_TYPE queue)"
    DATABASES+=("$db")
    psql_admin -c "CREATE DATABASE \"$db\""
    COMPARE_BROKER_URL="$AMQP_HOST_URL/$VHOST" \
    COMPARE_RESULT_URL="db+postgresql+psycopg2://${PG_URL#postgres://}/$db" \
    COMPARE_QUEUE="compare-$TAG-$round" COMPARE_QUEUE_TYPE="$CELERY_QUEUE_TYPE" \
        PYTHONWARNINGS=ignore "$PY" "$HERE/celery_bench.py" --jobs "$N" --concurrency "$CELERY_CONCURRENCY" \
        --producers "$PRODUCERS" --pool "$CELERY_POOL" --pidfile "$WORKER_PIDFILE" \
        2> >(grep -v -e 'native delayed delivery' -e 'ETA tasks published' -e '^$' >&2) \
        | tee "$out"
    rm -f "$WORKER_PIDFILE"
    tail -n 1 "$out" | "$PY" -c 'import json, sys
line = json.loads(sys.stdin.read()); line.update(system="celery", round=int(sys.argv[1]))
print(json.dumps(line))' "$round" >>"$WORK/results.jsonl"
    psql_admin -c "DROP DATABASE \"$db\" WITH (FORCE)"
}

for round in $(seq "$ROUNDS"); do
    # Alternate who goes first, so a noisy stretch of the machine hits both.
    if ((round % 2)); then run_agentq "$round"; run_celery "$round"
    else run_celery "$round"; run_agentq "$round"; fi
done

echo
"$PY" "$HERE/summarize.py" "$WORK/results.jsonl" "$SCENARIO"
