//! RabbitMQ cluster variant: a private three-node cluster on this machine (three nodes on their
//! own ports, one Erlang cookie), agentq's processes given all three nodes in `AMQP_URL`, and
//! operations flowing while the node the workers are connected to is SIGKILLed, restarted, and
//! then the node that leads the lanes' quorum queues is SIGKILLed and restarted. Checks: no
//! operation lost, no safe effect twice or missing, every operation finished, and throughput
//! back after each kill (the recovery time is printed).

use std::collections::HashMap;
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use agentq_core::db;
use agentq_testkit::process;
use serde_json::json;
use sqlx::PgPool;
use tokio::time::Instant;

use crate::services::{Postgres, Rabbit, Scratch};

/// Operations of the run.
const OPERATIONS: i64 = 1200;
/// Completions after a kill that count as "throughput resumed".
const RESUMED_AFTER: i64 = 20;
/// Operations a throughput figure is measured over.
const RATE_OVER: i64 = 100;

/// The agentq processes of the run, killed on drop.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        self.0.iter_mut().for_each(process::stop);
    }
}

async fn finished(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE status IN ('succeeded', 'dead', 'cancelled')",
    )
    .fetch_one(pool)
    .await
    .unwrap_or(0)
}

/// How many agentq workers (connections named `agentq-worker`) are connected to each node
/// (by the node's AMQP port), as a cluster member reports it.
fn workers_by_port(any: &Rabbit) -> HashMap<u16, usize> {
    let mut count: HashMap<u16, usize> = HashMap::new();
    for row in any.rows(&["list_connections", "port", "client_properties"]) {
        if row.len() >= 2
            && row[1].contains("agentq-worker")
            && let Ok(port) = row[0].trim().parse()
        {
            *count.entry(port).or_default() += 1;
        }
    }
    count
}

/// The node leading the quorum queue `queue`.
fn leader_of(any: &Rabbit, queue: &str) -> String {
    any.rows(&["list_queues", "name", "leader"])
        .into_iter()
        .find(|r| r.first().map(String::as_str) == Some(queue))
        .and_then(|r| r.get(1).cloned())
        .expect("the queue and its leader")
}

/// Operations finished per second, measured over the next `RATE_OVER` operations to finish
/// (or the rest of the workload), however long they take: a count of events, not a window.
async fn rate(pool: &PgPool) -> f64 {
    let (t, f) = (Instant::now(), finished(pool).await);
    let target = (f + RATE_OVER).min(OPERATIONS);
    let end = t + Duration::from_secs(120);
    let mut now = f;
    while now < target && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
        now = finished(pool).await;
    }
    (now - f) as f64 / t.elapsed().as_secs_f64()
}

/// Waits until `RESUMED_AFTER` more operations finished than at `since`; returns how long
/// that took from `from`.
async fn resumed(pool: &PgPool, from: Instant, what: &str) -> Duration {
    let base = finished(pool).await;
    let target = (base + RESUMED_AFTER).min(OPERATIONS);
    let end = Instant::now() + Duration::from_secs(120);
    while finished(pool).await < target {
        assert!(
            Instant::now() < end,
            "throughput did not resume within 120 s after {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    from.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_cluster_loses_the_workers_node_then_the_queues_leader() {
    let _serial = crate::SERIAL.lock().await;
    let started = std::time::Instant::now();
    let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_string();
    let scratch = Scratch::new(&format!("{tag}-cluster"));
    let pg = Postgres::start(&scratch.path);
    let mut nodes: Vec<Rabbit> = ["a", "b", "c"]
        .iter()
        .map(|n| {
            Rabbit::start_named(
                &scratch.path,
                &format!("rabbit-{n}"),
                &format!("agentq-chaos-{tag}-{n}@localhost"),
            )
        })
        .collect();
    nodes[1].join(&nodes[0]);
    nodes[2].join(&nodes[0]);
    println!(
        "cluster: 3 nodes up and clustered in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let db_url = format!("postgres://postgres@127.0.0.1:{}/agentq_cluster", pg.port);
    db::migrate(&db_url).await.unwrap();
    let pool = db::connect(&db_url, 4).await.unwrap();
    let amqp_url = nodes
        .iter()
        .map(|n| format!("amqp://guest:guest@127.0.0.1:{}/%2f?heartbeat=2", n.port))
        .collect::<Vec<_>>()
        .join(",");
    let namespace = format!("cluster-{tag}");
    let env: Vec<(&str, String)> = vec![
        ("DATABASE_URL", db_url.clone()),
        ("AMQP_URL", amqp_url.clone()),
        ("AGENTQ_NAMESPACE", namespace.clone()),
        ("AGENTQ_LEASE_TTL_SECS", "4".into()),
        ("AGENTQ_DISPATCH_GRACE_SECS", "1".into()),
        ("AGENTQ_DB_TIMEOUT_SECS", "2".into()),
        ("RUST_LOG", "warn".into()),
    ];
    let logs = scratch.path.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let spawn = |role: &str, i: usize| {
        let mut cmd = process::command(crate::AGENTQ, &[role], env.iter().cloned());
        process::spawn_logged(&mut cmd, &logs.join(format!("{role}-{i}.log")))
    };
    let _procs = Procs(vec![
        spawn("worker", 1),
        spawn("worker", 2),
        spawn("scheduler", 1),
    ]);
    // The workers declare the lanes (3 replicas: AMQP_URL lists 3 nodes) before anything else.
    let deadline = Instant::now() + Duration::from_secs(60);
    while workers_by_port(&nodes[0]).values().sum::<usize>() < 2 {
        assert!(
            Instant::now() < deadline,
            "workers did not connect: {:?}\n{}",
            nodes[0].rows(&["list_connections", "port", "client_properties"]),
            std::fs::read_to_string(logs.join("worker-1.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let members = nodes[0].rows(&["list_queues", "name", "members"]);
    println!("cluster: lanes and their members {members:?}");

    // The producer: the library on the same node list, a dedupe key per operation so a retry
    // after an ambiguous failure (a node killed mid-publish) never creates a second one.
    let enqueued = Arc::new(AtomicI64::new(0));
    let producer = {
        let pool = pool.clone();
        let enqueued = enqueued.clone();
        let dispatcher = Arc::new(agentq_core::dispatch::Dispatcher::new(
            pool.clone(),
            &amqp_url,
            agentq_core::broker::Names::new(&namespace),
            "cluster-producer",
        ));
        let producer = agentq_producer::Producer::new(
            pool.clone(),
            dispatcher.clone(),
            std::sync::Arc::new(agentq_kinds::registry()),
            3,
        );
        tokio::spawn(async move {
            for i in 0..OPERATIONS {
                // Paced so that the run spans the kills: ~100 operations a second.
                tokio::time::sleep(Duration::from_millis(10)).await;
                loop {
                    let req = agentq_producer::EnqueueRequest {
                        tenant: "t1".into(),
                        kind: "script".into(),
                        input: json!({ "steps": [{ "work_ms": 20 },
                            { "tool": "ledger", "replay": "safe", "label": "s", "after_ms": 10 }] }),
                        dedupe_key: Some(format!("cluster-{i}")),
                        ..Default::default()
                    };
                    match tokio::time::timeout(Duration::from_secs(10), producer.enqueue(req)).await
                    {
                        Ok(Ok(_)) => break,
                        _ => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
                enqueued.store(i + 1, Ordering::SeqCst);
            }
            dispatcher.close().await;
        })
    };

    // Steady state first: a throughput figure to compare the recoveries with.
    let deadline = Instant::now() + Duration::from_secs(120);
    while finished(&pool).await < 100 {
        assert!(Instant::now() < deadline, "no steady state");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let steady = rate(&pool).await;
    println!("cluster: steady throughput {steady:.0} operations/s (the producer's pace bounds it)");

    // Kill 1: the node most workers are connected to.
    let by_port = workers_by_port(&nodes[0]);
    let k = nodes
        .iter()
        .position(|n| by_port.get(&n.port) == by_port.values().max())
        .expect("workers connected to the cluster");
    let target = nodes[k].node.clone();
    let killed_at = Instant::now();
    tokio::task::block_in_place(|| nodes[k].kill());
    let after = resumed(&pool, killed_at, "killing the workers' node").await;
    println!(
        "cluster: SIGKILL of {target} (the workers' node): throughput resumed after {:.1} s, \
         then {:.0} operations/s",
        after.as_secs_f64(),
        rate(&pool).await
    );
    tokio::task::block_in_place(|| nodes[k].restart());
    println!("cluster: {target} restarted and rejoined");

    // Kill 2: the node leading the interactive lane's quorum queue.
    let alive = nodes.iter().find(|n| n.node != target).unwrap();
    let queue = format!("{namespace}.jobs.interactive");
    let leader = leader_of(alive, &queue);
    let l = nodes.iter().position(|n| n.node == leader).unwrap();
    let killed_at = Instant::now();
    tokio::task::block_in_place(|| nodes[l].kill());
    let after = resumed(&pool, killed_at, "killing the queue's leader").await;
    println!(
        "cluster: SIGKILL of {leader} (leader of {queue}): throughput resumed after {:.1} s, \
         then {:.0} operations/s",
        after.as_secs_f64(),
        rate(&pool).await
    );
    tokio::task::block_in_place(|| nodes[l].restart());

    // Everything finishes; nothing lost, nothing twice.
    producer.await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    while finished(&pool).await < OPERATIONS {
        assert!(
            Instant::now() < deadline,
            "{} of {OPERATIONS} finished 180 s after the last enqueue",
            finished(&pool).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let found: i64 = sqlx::query_scalar("SELECT count(*) FROM operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    let statuses: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM operations GROUP BY 1 ORDER BY 1")
            .fetch_all(&pool)
            .await
            .unwrap();
    let duplicated: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT op_id, label FROM ledger_effects
                                GROUP BY 1, 2 HAVING count(*) > 1) d",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let missing: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations o WHERE o.status = 'succeeded'
            AND NOT EXISTS (SELECT 1 FROM ledger_effects e WHERE e.op_id = o.id)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    println!(
        "cluster: enqueued {OPERATIONS}, found {found}, statuses {statuses:?}, safe effects \
         duplicated {duplicated}, missing {missing}; run {:.0} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(found, OPERATIONS, "operations lost");
    assert_eq!(statuses, vec![("succeeded".to_string(), OPERATIONS)]);
    assert_eq!(duplicated, 0, "a safe effect happened twice");
    assert_eq!(missing, 0, "a succeeded operation lacks its effect");
    pool.close().await;
}
