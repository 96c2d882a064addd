//! End-to-end tests of agentq on real PostgreSQL and RabbitMQ: the real binary as child
//! processes wherever a process boundary matters (crashes are real SIGKILLs), the library
//! crates where a test needs to look inside a job.

mod harness;

mod access;
mod api;
mod api_backpressure;
mod api_hostile;
mod api_list;
mod approval_context;
mod batch;
#[cfg(feature = "bench")]
mod bench_cli;
mod budgets;
mod capacity;
mod children;
mod console;
mod crash_cost;
mod debounce;
mod doc_migration;
mod durability;
mod failures;
mod fake_model;
mod flows;
mod foundation;
mod hostile_producer;
mod hostile_tenant;
mod limits;
mod messages;
mod metrics;
mod models;
mod pauses;
mod rate_limits;
mod real_model;
mod remote;
mod schedules;
mod timers;
mod traces;
mod usecase_webhook;
mod versions;
mod why;
