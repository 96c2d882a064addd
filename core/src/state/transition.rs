//! The named transitions of an operation: every status change agentq writes, each with the
//! statuses it starts from and the one it leads to.
//!
//! Invariant kept here: every statement (and trigger) that writes `operations.status` is one
//! of these transitions, its SQL guard (`status IN …`) is the transition's from-set as
//! `from_sql!` spells it, and the status it writes is `to_sql!`'s (or the bound
//! [`Transition::to`]). The from-sets and targets are edges of [`can_transition`]'s table, and
//! every edge of that table is one of these (tests below check both, and that every status
//! writer in `db` and in the migrations names its transition).
//!
//! [`can_transition`]: super::can_transition

use super::Status;
use Status::*;

pub mod batch;

/// One named status change: from any of `from` to `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    /// Its name (`claim`, `complete`…), the const's in lower case.
    pub name: &'static str,
    /// The statuses it may start from: the SQL guard of its statement.
    pub from: &'static [Status],
    /// The status it writes.
    pub to: Status,
}

impl Transition {
    /// Whether the transition may start from `status`.
    pub fn starts_from(&self, status: Status) -> bool {
        self.from.contains(&status)
    }

    /// The from-set as an SQL list (`('queued', 'sleeping')`): what `from_sql!` must spell.
    pub fn from_sql(&self) -> String {
        sql_list(self.from)
    }

    /// The target as an SQL literal (`'running'`): what `to_sql!` must spell.
    pub fn to_sql(&self) -> String {
        format!("'{}'", self.to)
    }
}

/// `statuses` as an SQL list, `('a', 'b')`.
pub(crate) fn sql_list(statuses: &[Status]) -> String {
    let names: Vec<String> = statuses.iter().map(|s| format!("'{s}'")).collect();
    format!("({})", names.join(", "))
}

/// A worker claims a queued, due operation (`db::claim::claim_operations`).
pub const CLAIM: Transition = Transition {
    name: "claim",
    from: &[Queued],
    to: Running,
};
/// A run succeeds (`db::settle::write_runs`).
pub const COMPLETE: Transition = Transition {
    name: "complete",
    from: &[Running],
    to: Succeeded,
};
/// A failed attempt goes back to the queue: a retry after a backoff, or an overloaded
/// provider's park (`db::settle::fail_operation`).
pub const FAIL_RETRY: Transition = Transition {
    name: "fail_retry",
    from: &[Running],
    to: Queued,
};
/// A failed attempt ends the operation, with an open dead letter (`fail_operation`).
pub const FAIL_DEAD: Transition = Transition {
    name: "fail_dead",
    from: &[Running],
    to: Dead,
};
/// A run stops on a cancel it was asked for (`fail_operation`).
pub const FAIL_CANCEL: Transition = Transition {
    name: "fail_cancel",
    from: &[Running],
    to: Cancelled,
};
/// A run parks in a durable sleep (`db::timers::suspend_operation`).
pub const PARK_SLEEP: Transition = Transition {
    name: "park_sleep",
    from: &[Running],
    to: Sleeping,
};
/// A run parks waiting for a signal or its children (`db::timers::suspend_operation`).
pub const PARK_WAIT: Transition = Transition {
    name: "park_wait",
    from: &[Running],
    to: Waiting,
};
/// The scheduler wakes a parked operation: due, signalled, or its joined children finished
/// (`db::timers::wake_due`).
pub const WAKE: Transition = Transition {
    name: "wake",
    from: &[Sleeping, Waiting],
    to: Queued,
};
/// A signal wakes the operation waiting for it (`db::signals::send_signal`).
pub const SIGNAL: Transition = Transition {
    name: "signal",
    from: &[Waiting],
    to: Queued,
};
/// An operator raises (or lets through once) the budget an operation waits on
/// (`db::budgets::lift`).
pub const BUDGET: Transition = Transition {
    name: "budget",
    from: &[Waiting],
    to: Queued,
};
/// The reaper restarts a run whose lease expired (`db::settle::reap_expired_leases`).
pub const REAP: Transition = Transition {
    name: "reap",
    from: &[Running],
    to: Queued,
};
/// The reaper ends a run whose lease expired once too often (`crash_loop`, same statement).
pub const CRASH_LOOP: Transition = Transition {
    name: "crash_loop",
    from: &[Running],
    to: Dead,
};
/// A worker shutting down hands its runs back (`db::settle::release_leases`).
pub const RELEASE: Transition = Transition {
    name: "release",
    from: &[Running],
    to: Queued,
};
/// A worker hands a run back, its attempt given back, for fair shares or at a step boundary
/// for an operator's pause (`db::settle::hand_back`).
pub const HAND_BACK: Transition = Transition {
    name: "hand_back",
    from: &[Running],
    to: Queued,
};
/// An operator cancels an operation no worker holds (`db::cancel::cancel_operation`,
/// `db::batches::cancel_operations`); a running one is stopped by its worker ([`FAIL_CANCEL`]).
pub const CANCEL: Transition = Transition {
    name: "cancel",
    from: Status::IDLE,
    to: Cancelled,
};
/// A cancelled operation's idle children are cancelled with it (the trigger
/// `agentq_cancel_children`, migration 17).
pub const CASCADE: Transition = Transition {
    name: "cascade",
    from: Status::IDLE,
    to: Cancelled,
};
/// The deadline of an operation no worker holds passes (`db::timers::expire_deadlines`).
pub const EXPIRE: Transition = Transition {
    name: "expire",
    from: Status::IDLE,
    to: Dead,
};
/// An operator retries or resolves a dead letter (`db::dead_letters::act`).
pub const RETRY: Transition = Transition {
    name: "retry",
    from: &[Dead],
    to: Queued,
};
/// An operator discards a dead letter (`db::dead_letters::act`).
pub const DISCARD: Transition = Transition {
    name: "discard",
    from: &[Dead],
    to: Discarded,
};

/// Every named transition.
pub const ALL: &[Transition] = &[
    CLAIM,
    COMPLETE,
    FAIL_RETRY,
    FAIL_DEAD,
    FAIL_CANCEL,
    PARK_SLEEP,
    PARK_WAIT,
    WAKE,
    SIGNAL,
    BUDGET,
    REAP,
    CRASH_LOOP,
    RELEASE,
    HAND_BACK,
    CANCEL,
    CASCADE,
    EXPIRE,
    RETRY,
    DISCARD,
];

/// The triggers (PL/pgSQL functions of `migrations/`) that write `operations.status`, each
/// with its transition.
pub const TRIGGERS: &[(&str, Transition)] = &[("agentq_cancel_children", CASCADE)];

/// The from-set of a named transition as an SQL list, for `concat!` into its statement's guard
/// (`status IN …`). A test checks each is [`Transition::from_sql`].
#[cfg(feature = "engine")]
macro_rules! from_sql {
    (CLAIM) => {
        "('queued')"
    };
    (COMPLETE) => {
        "('running')"
    };
    (FAIL_RETRY) => {
        "('running')"
    };
    (FAIL_DEAD) => {
        "('running')"
    };
    (FAIL_CANCEL) => {
        "('running')"
    };
    (PARK_SLEEP) => {
        "('running')"
    };
    (PARK_WAIT) => {
        "('running')"
    };
    (WAKE) => {
        "('sleeping', 'waiting')"
    };
    (SIGNAL) => {
        "('waiting')"
    };
    (BUDGET) => {
        "('waiting')"
    };
    (REAP) => {
        "('running')"
    };
    (CRASH_LOOP) => {
        "('running')"
    };
    (RELEASE) => {
        "('running')"
    };
    (HAND_BACK) => {
        "('running')"
    };
    (CANCEL) => {
        "('queued', 'sleeping', 'waiting')"
    };
    (CASCADE) => {
        "('queued', 'sleeping', 'waiting')"
    };
    (EXPIRE) => {
        "('queued', 'sleeping', 'waiting')"
    };
    (RETRY) => {
        "('dead')"
    };
    (DISCARD) => {
        "('dead')"
    };
}
#[cfg(feature = "engine")]
pub(crate) use from_sql;

/// The target of a named transition as an SQL literal, for `concat!` into its statement's
/// `SET status = …`. A test checks each is [`Transition::to_sql`].
#[cfg(feature = "engine")]
macro_rules! to_sql {
    (CLAIM) => {
        "'running'"
    };
    (COMPLETE) => {
        "'succeeded'"
    };
    (FAIL_RETRY) => {
        "'queued'"
    };
    (FAIL_DEAD) => {
        "'dead'"
    };
    (FAIL_CANCEL) => {
        "'cancelled'"
    };
    (PARK_SLEEP) => {
        "'sleeping'"
    };
    (PARK_WAIT) => {
        "'waiting'"
    };
    (WAKE) => {
        "'queued'"
    };
    (SIGNAL) => {
        "'queued'"
    };
    (BUDGET) => {
        "'queued'"
    };
    (REAP) => {
        "'queued'"
    };
    (CRASH_LOOP) => {
        "'dead'"
    };
    (RELEASE) => {
        "'queued'"
    };
    (HAND_BACK) => {
        "'queued'"
    };
    (CANCEL) => {
        "'cancelled'"
    };
    (CASCADE) => {
        "'cancelled'"
    };
    (EXPIRE) => {
        "'dead'"
    };
    (RETRY) => {
        "'queued'"
    };
    (DISCARD) => {
        "'discarded'"
    };
}
#[cfg(feature = "engine")]
pub(crate) use to_sql;

#[cfg(test)]
mod tests;
