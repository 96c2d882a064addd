//! The typed states of agentq, the legal transitions between operation states, and the pure
//! decisions over them.
//!
//! Every state agentq stores as text is an enum here ([`Status`], [`StepStatus`], [`Replay`],
//! [`StepKind`], [`DeadLetterStatus`], [`BatchStatus`], [`Overlap`], [`ErrorClass`]): each has `as_str`,
//! a `FromStr` that refuses an unknown string (never a default), serde as that string, a JSON
//! Schema listing the strings (the HTTP API's document), and sqlx `Type`/`Encode`/`Decode` as
//! PostgreSQL `text`, so a corrupt value in a row is a decoding error where it is read, never a
//! guess.
//!
//! Invariant kept here: the terminal set ([`Status::is_terminal`]), the idle set
//! ([`Status::IDLE`]), the legal operation transitions ([`can_transition`]) and the named
//! transitions that write them ([`transition`]) are written once; SQL that needs a set takes it
//! from `terminal_sql!`, `idle_sql!` or a transition's `from_sql!`/`to_sql!`, which tests
//! compare with the Rust values.
//!
//! Where each decision lives:
//! - what a failed attempt leads to: [`failure::after_failure`], pure; called by
//!   `worker::executor::settle`, which gathers the facts and writes the result with
//!   `db::settle::fail_operation`;
//! - what an expired lease leads to (restart or `crash_loop`): [`failure::after_lease_expiry`],
//!   mirrored by the `CASE` of `db::settle::reap_expired_leases` (one statement for many rows), and a
//!   test there checks the SQL names the same statuses, classes and boundary;
//! - what a passed deadline leads to for an operation no worker holds: SQL in
//!   `db::timers::expire_deadlines`, checked against [`failure::after_failure`] by a test there
//!   (a running one is stopped by its worker and decided by `after_failure` itself); an
//!   operator's cancel of one no worker holds: SQL in `db::cancel::cancel_operation` (which
//!   asks [`transition::CANCEL`]) and `db::batches::cancel_operations`;
//! - what replay does with a journal entry: [`replay::resume`], pure; called by
//!   `worker::context` for every step (and its nondeterminism check for sleeps and waits);
//! - what an operator action does to a dead letter: [`DlqAction`], used by
//!   `db::dead_letters::act`.

use std::fmt;
use std::str::FromStr;

pub mod failure;
pub mod replay;
pub mod transition;

/// A string that names no value of a state enum (a corrupt row, or a user's typo).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value:?} (expected one of: {})", expected.join(", "))]
pub struct Unknown {
    /// What was being parsed (`operation status`, `error class`…).
    pub what: &'static str,
    /// The string as found.
    pub value: String,
    /// Every accepted string.
    pub expected: &'static [&'static str],
}

/// Declares a state stored as text: the enum, `ALL`, `NAMES`, `as_str`, `FromStr`, `Display`,
/// serde, JSON Schema and sqlx (PostgreSQL `text`) impls, all from one list of `Variant =
/// "name"` pairs.
macro_rules! text_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident ($what:literal) {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// Every stored name, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The stored name.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }
        }

        impl FromStr for $name {
            type Err = Unknown;
            fn from_str(s: &str) -> Result<Self, Unknown> {
                match s {
                    $( $text => Ok($name::$variant), )+
                    other => Err(Unknown {
                        what: $what,
                        value: other.to_string(),
                        expected: Self::NAMES,
                    }),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }

        /// The stored names as a string enum, written inline where a type uses it.
        impl schemars::JsonSchema for $name {
            fn inline_schema() -> bool {
                true
            }
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }
            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!({ "type": "string", "enum": Self::NAMES })
            }
        }

        #[cfg(feature = "engine")]
        impl sqlx::Type<sqlx::Postgres> for $name {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <str as sqlx::Type<sqlx::Postgres>>::type_info()
            }
            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        #[cfg(feature = "engine")]
        impl sqlx::postgres::PgHasArrayType for $name {
            fn array_type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::postgres::PgHasArrayType>::array_type_info()
            }
            fn array_compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <&str as sqlx::postgres::PgHasArrayType>::array_compatible(ty)
            }
        }

        #[cfg(feature = "engine")]
        impl sqlx::Encode<'_, sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        #[cfg(feature = "engine")]
        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $name {
            fn decode(
                value: sqlx::postgres::PgValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                let s = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
                Ok(s.parse::<$name>()?)
            }
        }
    };
}

text_enum! {
    /// The operation state machine (ARCHITECTURE.md draws it; [`can_transition`] is its table).
    pub enum Status ("operation status") {
        /// Waiting for a worker (possibly not before `run_at`).
        Queued = "queued",
        /// Claimed by a worker holding a lease.
        Running = "running",
        /// In a durable sleep; the scheduler wakes it.
        Sleeping = "sleeping",
        /// Waiting for a signal (human approval) or its timeout.
        Waiting = "waiting",
        /// Finished with a result.
        Succeeded = "succeeded",
        /// Failed for good; has an open dead letter for a human.
        Dead = "dead",
        /// Stopped on request.
        Cancelled = "cancelled",
        /// Dropped from the DLQ by an operator.
        Discarded = "discarded",
    }
}

impl Status {
    /// True when nothing will move the operation again without a human. The one list of
    /// terminal statuses (`terminal_sql!` is its SQL form).
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            Status::Succeeded | Status::Dead | Status::Cancelled | Status::Discarded
        )
    }

    /// The statuses of an operation no worker holds that is not finished: queued, sleeping,
    /// waiting. What an operator's cancel, a cascade or a passed deadline ends at once, and
    /// what an upgrade moves (`idle_sql!` is its SQL form).
    pub const IDLE: &'static [Status] = &[Status::Queued, Status::Sleeping, Status::Waiting];
}

/// The terminal statuses as an SQL list, `('succeeded', 'dead', 'cancelled', 'discarded')`,
/// for `concat!` into statements (`status IN …`, `status NOT IN …`). A test checks it names
/// exactly the statuses of [`Status::is_terminal`].
#[cfg(feature = "engine")]
macro_rules! terminal_sql {
    () => {
        "('succeeded', 'dead', 'cancelled', 'discarded')"
    };
}
#[cfg(feature = "engine")]
pub(crate) use terminal_sql;

/// The idle statuses ([`Status::IDLE`]) as an SQL list, `('queued', 'sleeping', 'waiting')`, for
/// `concat!` into statements. A test checks it names exactly [`Status::IDLE`].
#[cfg(feature = "engine")]
macro_rules! idle_sql {
    () => {
        "('queued', 'sleeping', 'waiting')"
    };
}
#[cfg(feature = "engine")]
pub(crate) use idle_sql;

/// Whether an operation may move from `from` to `to`: the state diagram of ARCHITECTURE.md as
/// a table. Every transition agentq writes is a named [`transition`] whose edges are in this
/// table (each is one SQL statement guarded by its from-set), and every edge of the table is
/// one of them: a test checks both.
pub const fn can_transition(from: Status, to: Status) -> bool {
    use Status::*;
    match (from, to) {
        // Claim; an operator's cancel; the deadline passing while queued.
        (Queued, Running | Cancelled | Dead) => true,
        // Success; a retry, a parked overload, a release at shutdown or a reaped lease; a
        // failure for good or a crash loop; a durable sleep or wait; a cancel seen by the job.
        (Running, Succeeded | Queued | Dead | Sleeping | Waiting | Cancelled) => true,
        // Woken (due, signalled, timed out); cancelled; the deadline passing meanwhile.
        (Sleeping | Waiting, Queued | Cancelled | Dead) => true,
        // An operator's retry or resolve; an operator's discard.
        (Dead, Queued | Discarded) => true,
        _ => false,
    }
}

text_enum! {
    /// The state of one journal entry (`operation_steps.status`).
    pub enum StepStatus ("step status") {
        /// Begun and not finished: an unsafe step's row written before its call, or a sleep
        /// or wait not yet resolved. A crash leaves it so.
        Started = "started",
        /// Finished with a recorded output: replay returns it.
        Completed = "completed",
        /// Failed on an earlier attempt: nothing to keep, whatever the code asks runs fresh.
        Failed = "failed",
        /// An unsafe call whose outcome may or may not have happened: reconcile or fail closed.
        Unknown = "unknown",
    }
}

text_enum! {
    /// Whether a step may run again after a crash left its outcome unknown.
    pub enum Replay ("replay policy") {
        /// Idempotent, or called with its idempotency key: run again on recovery.
        Safe = "safe",
        /// A side effect that must not repeat: reconcile or fail closed on recovery.
        Unsafe = "unsafe",
    }
}

text_enum! {
    /// What a journal entry is (`operation_steps.kind`).
    pub enum StepKind ("step kind") {
        /// A model call.
        Model = "model",
        /// A tool call.
        Tool = "tool",
        /// A durable sleep.
        Sleep = "sleep",
        /// A wait for a signal.
        Signal = "signal",
        /// A journaled clock read or random id.
        Now = "now",
        /// A job's own `ctx.step`.
        Custom = "custom",
        /// A `ctx.patched` marker: the code that recorded the journal had the patch.
        Patch = "patch",
        /// A `ctx.spawn`: its output is the child operation's id.
        Spawn = "spawn",
        /// A `ctx.join`: parks until the children finish; its output is how each ended.
        Join = "join",
    }
}

text_enum! {
    /// A dead letter's state (`dead_letters.status`).
    pub enum DeadLetterStatus ("dead-letter status") {
        /// Waiting for a human.
        Open = "open",
        /// Re-queued by an operator.
        Retried = "retried",
        /// Dropped by an operator.
        Discarded = "discarded",
        /// An unknown step's outcome stated by an operator, then re-queued.
        Resolved = "resolved",
    }
}

text_enum! {
    /// A batch campaign's state (`batches.status`).
    pub enum BatchStatus ("batch status") {
        /// Only the canary documents run until an operator promotes it.
        Canary = "canary",
        /// Every document may run.
        Running = "running",
        /// Nothing starts (an operator or auto-pause); resuming re-publishes the queue.
        Paused = "paused",
        /// Stopped for good.
        Cancelled = "cancelled",
        /// Every document has an outcome (succeeded, or dead and counted as a failure); a DLQ
        /// retry of one of its operations reopens it.
        Completed = "completed",
    }
}

impl BatchStatus {
    /// Whether nothing of the batch runs any more and nothing will unless a person acts.
    pub fn is_finished(self) -> bool {
        matches!(self, BatchStatus::Cancelled | BatchStatus::Completed)
    }
}

text_enum! {
    /// What a schedule does with a tick that comes while the operation of its previous firing
    /// is unfinished (`schedules.overlap`).
    pub enum Overlap ("overlap policy") {
        /// Do not fire it (counted as skipped).
        Skip = "skip",
        /// Keep it, at most one such tick, and fire it once the previous operation ends; more
        /// are skipped.
        BufferOne = "buffer_one",
        /// Fire it regardless.
        Allow = "allow",
    }
}

text_enum! {
    /// Why an attempt or an operation failed: every class agentq writes to
    /// `operations.error_class` and `dead_letters.class`. Stable names; README.md has a line on
    /// each (a test checks).
    pub enum ErrorClass ("error class") {
        /// Transient: retried after a backoff while attempts are left.
        Retryable = "retryable",
        /// A provider is overloaded: parked longer, the attempt given back.
        Overloaded = "overloaded",
        /// A retryable failure with no attempt left: dead.
        RetriesExhausted = "retries_exhausted",
        /// Can never succeed as is: dead on the spot.
        NonRetryable = "non_retryable",
        /// An unsafe step's outcome is unknown and cannot be reconciled: dead.
        UnknownSideEffect = "unknown_side_effect",
        /// The job asked for other steps than its journal recorded: dead.
        Nondeterminism = "nondeterminism",
        /// The operation's deadline passed: dead.
        DeadlineExceeded = "deadline_exceeded",
        /// The operation's token budget refused a model call and was not raised in time: dead.
        BudgetExceeded = "budget_exceeded",
        /// The reaper recovered more crashes than the restart limit allows: dead.
        CrashLoop = "crash_loop",
        /// The reaper recovered an expired lease (its worker died or hung): queued again.
        LeaseExpired = "lease_expired",
        /// Stopped on request.
        Cancelled = "cancelled",
        /// A broker message that is not a usable pointer: a dead letter with no operation.
        PoisonMessage = "poison_message",
    }
}

text_enum! {
    /// An operator's action on a dead letter.
    pub enum DlqAction ("dead-letter action") {
        /// Re-queue from the failed step (completed steps replay).
        Retry = "retry",
        /// State an unknown step's outcome, then re-queue.
        Resolve = "resolve",
        /// Drop it for good.
        Discard = "discard",
    }
}

impl DlqAction {
    /// The dead letter's status after the action.
    pub const fn dead_letter_after(self) -> DeadLetterStatus {
        match self {
            DlqAction::Retry => DeadLetterStatus::Retried,
            DlqAction::Resolve => DeadLetterStatus::Resolved,
            DlqAction::Discard => DeadLetterStatus::Discarded,
        }
    }

    /// Its (dead) operation's status after the action.
    pub const fn operation_after(self) -> Status {
        match self {
            DlqAction::Retry | DlqAction::Resolve => Status::Queued,
            DlqAction::Discard => Status::Discarded,
        }
    }

    /// Whether the action fits a dead letter of `class`: `resolve` is for unknown steps only,
    /// and `retry` would stop at the same unknown step, so an `unknown_side_effect` is resolved.
    pub fn fits(self, class: ErrorClass) -> bool {
        let unknown = class == ErrorClass::UnknownSideEffect;
        match self {
            DlqAction::Retry => !unknown,
            DlqAction::Resolve => unknown,
            DlqAction::Discard => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks the string round trips of one state enum: `as_str`, `FromStr`, serde and that an
    /// unknown string is an error naming what was parsed.
    fn round_trips<T>(all: &[T], names: &[&str])
    where
        T: Copy + PartialEq + fmt::Debug + fmt::Display + FromStr<Err = Unknown>,
        T: serde::Serialize + serde::de::DeserializeOwned,
    {
        assert_eq!(all.len(), names.len());
        for (v, name) in all.iter().zip(names) {
            assert_eq!(v.to_string(), *name);
            assert_eq!(name.parse::<T>().unwrap(), *v);
            assert_eq!(serde_json::to_value(v).unwrap(), serde_json::json!(name));
            assert_eq!(
                serde_json::from_value::<T>(serde_json::json!(name)).unwrap(),
                *v
            );
        }
        for bad in ["", "Queued", "nope", " queued"] {
            if !names.contains(&bad) {
                let e = bad.parse::<T>().unwrap_err();
                assert_eq!(e.value, bad);
                assert_eq!(e.expected, names);
                assert!(serde_json::from_value::<T>(serde_json::json!(bad)).is_err());
            }
        }
    }

    #[test]
    fn every_state_round_trips_and_refuses_unknown_strings() {
        round_trips(Status::ALL, Status::NAMES);
        round_trips(StepStatus::ALL, StepStatus::NAMES);
        round_trips(Replay::ALL, Replay::NAMES);
        round_trips(StepKind::ALL, StepKind::NAMES);
        round_trips(DeadLetterStatus::ALL, DeadLetterStatus::NAMES);
        round_trips(BatchStatus::ALL, BatchStatus::NAMES);
        round_trips(Overlap::ALL, Overlap::NAMES);
        round_trips(ErrorClass::ALL, ErrorClass::NAMES);
        round_trips(DlqAction::ALL, DlqAction::NAMES);
        assert_eq!(
            "queud".parse::<Status>().unwrap_err().to_string(),
            "unknown operation status \"queud\" (expected one of: queued, running, sleeping, \
             waiting, succeeded, dead, cancelled, discarded)"
        );
    }

    /// The names a CHECK constraint of the first migration allows, in `column IN (…)`.
    fn checked_names(migration: &str, column: &str) -> Vec<String> {
        let at = migration
            .find(&format!("CHECK ({column} IN ("))
            .unwrap_or_else(|| panic!("no CHECK on {column}"));
        let list = &migration[at..];
        let list = &list[list.find("IN (").unwrap() + 4..list.find(')').unwrap()];
        list.split(',')
            .map(|s| s.trim().trim_matches('\'').to_string())
            .collect()
    }

    #[test]
    fn the_enums_name_what_the_schema_allows() {
        let initial = include_str!("../../migrations/20261130000001_initial.sql");
        // Migration 20261203000003 added `completed` to the batches' statuses.
        let batches =
            include_str!("../../migrations/20261203000003_batch_completion_and_names.sql");
        let children = include_str!("../../migrations/20261130000017_child_operations.sql");
        let schedules = include_str!("../../migrations/20261130000014_schedules.sql");
        let sorted = |mut v: Vec<String>| {
            v.sort();
            v
        };
        let names = |n: &[&str]| sorted(n.iter().map(|s| s.to_string()).collect());
        assert_eq!(
            sorted(checked_names(initial, "status")),
            names(Status::NAMES)
        );
        // Migration 13 added `patch` to the journal's kinds, 17 `spawn` and `join`.
        assert_eq!(
            sorted(checked_names(children, "kind")),
            names(StepKind::NAMES)
        );
        assert_eq!(
            sorted(checked_names(initial, "replay")),
            names(Replay::NAMES)
        );
        // The journal's and the DLQ's status checks come after their CREATE TABLE.
        let steps = &initial[initial.find("CREATE TABLE operation_steps").unwrap()..];
        assert_eq!(
            sorted(checked_names(steps, "status")),
            names(StepStatus::NAMES)
        );
        let letters = &initial[initial.find("CREATE TABLE dead_letters").unwrap()..];
        assert_eq!(
            sorted(checked_names(letters, "status")),
            names(DeadLetterStatus::NAMES)
        );
        assert_eq!(
            sorted(checked_names(batches, "status")),
            names(BatchStatus::NAMES)
        );
        assert_eq!(
            sorted(checked_names(schedules, "overlap")),
            names(Overlap::NAMES)
        );
    }

    #[test]
    fn the_sql_terminal_list_is_the_terminal_set() {
        let rust: Vec<String> = Status::ALL
            .iter()
            .filter(|s| s.is_terminal())
            .map(|s| format!("'{s}'"))
            .collect();
        assert_eq!(terminal_sql!(), format!("({})", rust.join(", ")));
    }

    #[test]
    fn terminal_statuses_move_only_by_a_human() {
        for &from in Status::ALL {
            let next: Vec<Status> = Status::ALL
                .iter()
                .copied()
                .filter(|&to| can_transition(from, to))
                .collect();
            match from {
                // An operator's retry, resolve or discard.
                Status::Dead => assert_eq!(next, [Status::Queued, Status::Discarded]),
                s if s.is_terminal() => assert!(next.is_empty(), "{s} → {next:?}"),
                s => assert!(next.iter().any(|t| t.is_terminal()), "{s} can never finish"),
            }
            assert!(!can_transition(from, from), "{from} → itself");
        }
    }

    #[test]
    fn the_sql_idle_list_is_the_idle_set() {
        assert_eq!(idle_sql!(), transition::sql_list(Status::IDLE));
        for &s in Status::ALL {
            assert_eq!(
                Status::IDLE.contains(&s),
                !s.is_terminal() && s != Status::Running
            );
        }
    }

    /// The table is the named transitions' edges, no more and no less.
    #[test]
    fn the_state_diagram() {
        for &from in Status::ALL {
            for &to in Status::ALL {
                let named: Vec<&str> = transition::ALL
                    .iter()
                    .filter(|t| t.starts_from(from) && t.to == to)
                    .map(|t| t.name)
                    .collect();
                assert_eq!(
                    can_transition(from, to),
                    !named.is_empty(),
                    "{from} → {to}: named by {named:?}"
                );
            }
        }
    }

    #[test]
    fn every_error_class_has_a_line_in_the_failures_page() {
        let page = include_str!("../../docs/dlq.md");
        for class in ErrorClass::ALL {
            assert!(
                page.contains(&format!("| `{class}` |")),
                "docs/dlq.md's failure table has no line for {class}"
            );
        }
    }

    #[test]
    fn dlq_actions() {
        use DlqAction::*;
        use ErrorClass::*;
        #[rustfmt::skip]
        let table = [
            // action,  class,              fits,  dead letter after,            operation after
            (Retry,   RetriesExhausted,  true,  DeadLetterStatus::Retried,   Status::Queued),
            (Retry,   UnknownSideEffect, false, DeadLetterStatus::Retried,   Status::Queued),
            (Resolve, UnknownSideEffect, true,  DeadLetterStatus::Resolved,  Status::Queued),
            (Resolve, NonRetryable,      false, DeadLetterStatus::Resolved,  Status::Queued),
            (Discard, UnknownSideEffect, true,  DeadLetterStatus::Discarded, Status::Discarded),
            (Discard, PoisonMessage,     true,  DeadLetterStatus::Discarded, Status::Discarded),
        ];
        for (action, class, fits, letter, op) in table {
            assert_eq!(action.fits(class), fits, "{action} on {class}");
            assert_eq!(action.dead_letter_after(), letter, "{action}");
            assert_eq!(action.operation_after(), op, "{action}");
            assert!(can_transition(Status::Dead, op));
            let named = match action {
                Retry | Resolve => transition::RETRY,
                Discard => transition::DISCARD,
            };
            assert_eq!(
                (named.from, named.to),
                (&[Status::Dead][..], op),
                "{action}"
            );
        }
    }
}
