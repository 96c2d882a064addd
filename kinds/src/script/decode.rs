//! How a `script` step is read: by the key that says which instruction it is (`work_ms`,
//! `tool`, `fail`, …), so a refusal names the step and what it lacks (`steps[1]: a "fail" step
//! needs "times"`) rather than serde's "did not match any variant of untagged enum". Each
//! value is read under its own key, so a wrong one is refused at its place
//! (`steps[0].work_ms: …`), durations included.

use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

use agentq_worker::context::check_park_length;
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;

use super::{FailClass, MAX_STEP_MS, OnTimeout, ReplayName, ScriptStep, ToolName};

/// Each instruction: the key naming it, the keys it needs besides, and the ones it may have.
const SHAPES: [(&str, &[&str], &[&str]); 10] = [
    ("work_ms", &[], &["deferred"]),
    ("tool", &["replay", "label"], &["after_ms", "reconcile"]),
    ("model", &[], &[]),
    ("sleep_ms", &[], &[]),
    ("wait_signal", &["timeout_ms"], &["on_timeout"]),
    ("fail", &["times"], &["not_before_ms"]),
    ("panic", &[], &["times"]),
    ("spawn", &["input"], &[]),
    ("join", &[], &[]),
    ("patched", &["then"], &["else"]),
];

/// Every key a step may have, in the order `SHAPES` gives them.
fn every_key() -> Vec<&'static str> {
    let mut keys = Vec::new();
    for (name, needs, may) in SHAPES {
        for k in std::iter::once(name)
            .chain(needs.iter().copied())
            .chain(may.iter().copied())
        {
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
    }
    keys
}

/// The fields of one step as read, before the instruction is decided.
#[derive(Default)]
struct Fields {
    present: Vec<&'static str>,
    work_ms: Option<u64>,
    deferred: Option<bool>,
    tool: Option<ToolName>,
    replay: Option<ReplayName>,
    label: Option<String>,
    after_ms: Option<u64>,
    reconcile: Option<bool>,
    model: Option<String>,
    sleep_ms: Option<u64>,
    wait_signal: Option<String>,
    timeout_ms: Option<u64>,
    on_timeout: Option<OnTimeout>,
    fail: Option<FailClass>,
    times: Option<i32>,
    not_before_ms: Option<u64>,
    panic: Option<bool>,
    spawn: Option<String>,
    input: Option<Value>,
    join: Option<bool>,
    patched: Option<String>,
    then: Option<Vec<ScriptStep>>,
    otherwise: Option<Vec<ScriptStep>>,
}

/// A value read with a check of its own, refused at its place.
struct Checked<T>(fn(&T) -> Result<(), String>, PhantomData<T>);

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for Checked<T> {
    type Value = T;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        let v = T::deserialize(d)?;
        (self.0)(&v).map_err(de::Error::custom)?;
        Ok(v)
    }
}

fn checked<T>(check: fn(&T) -> Result<(), String>) -> Checked<T> {
    Checked(check, PhantomData)
}

/// A key no step has: refused at its place, with the keys there are.
struct Unknown;

impl<'de> DeserializeSeed<'de> for Unknown {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        IgnoredAny::deserialize(d)?;
        Err(de::Error::custom(format!(
            "no step has this field; a step's fields are: {}",
            every_key().join(", ")
        )))
    }
}

/// How long a step may hold its worker slot.
fn held(ms: &u64) -> Result<(), String> {
    if *ms > MAX_STEP_MS {
        return Err(format!(
            "{ms} ms is longer than a script step may hold a worker, 1 hour ({MAX_STEP_MS} ms)"
        ));
    }
    Ok(())
}

/// How long a sleep or a wait may last.
fn parked(ms: &u64) -> Result<(), String> {
    check_park_length(Duration::from_millis(*ms))
}

/// The value of `key` in `map`, once.
fn once<'de, A: MapAccess<'de>, T>(
    map: &mut A,
    slot: &mut Option<T>,
    seed: impl DeserializeSeed<'de, Value = T>,
) -> Result<(), A::Error> {
    *slot = Some(map.next_value_seed(seed)?);
    Ok(())
}

struct StepVisitor;

impl<'de> Visitor<'de> for StepVisitor {
    type Value = ScriptStep;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a step: an object such as {\"work_ms\": 100} (docs/kinds.md lists them)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ScriptStep, A::Error> {
        let mut f = Fields::default();
        let keys = every_key();
        while let Some(key) = map.next_key::<String>()? {
            let Some(known) = keys.iter().copied().find(|k| *k == key) else {
                map.next_value_seed(Unknown)?;
                continue;
            };
            if f.present.contains(&known) {
                return Err(de::Error::custom(format!("\"{known}\" is given twice")));
            }
            f.present.push(known);
            match known {
                "work_ms" => once(&mut map, &mut f.work_ms, checked(held))?,
                "deferred" => once(&mut map, &mut f.deferred, PhantomData)?,
                "tool" => once(&mut map, &mut f.tool, PhantomData)?,
                "replay" => once(&mut map, &mut f.replay, PhantomData)?,
                "label" => once(&mut map, &mut f.label, PhantomData)?,
                "after_ms" => once(&mut map, &mut f.after_ms, checked(held))?,
                "reconcile" => once(&mut map, &mut f.reconcile, PhantomData)?,
                "model" => once(&mut map, &mut f.model, PhantomData)?,
                "sleep_ms" => once(&mut map, &mut f.sleep_ms, checked(parked))?,
                "wait_signal" => once(&mut map, &mut f.wait_signal, PhantomData)?,
                "timeout_ms" => once(&mut map, &mut f.timeout_ms, checked(parked))?,
                "on_timeout" => once(&mut map, &mut f.on_timeout, PhantomData)?,
                "fail" => once(&mut map, &mut f.fail, PhantomData)?,
                "times" => f.times = map.next_value::<Option<i32>>()?,
                "not_before_ms" => f.not_before_ms = map.next_value::<Option<u64>>()?,
                "panic" => once(&mut map, &mut f.panic, PhantomData)?,
                "spawn" => once(&mut map, &mut f.spawn, PhantomData)?,
                "input" => once(&mut map, &mut f.input, PhantomData)?,
                "join" => once(&mut map, &mut f.join, PhantomData)?,
                "patched" => once(&mut map, &mut f.patched, PhantomData)?,
                "then" => once(&mut map, &mut f.then, PhantomData)?,
                "else" => once(&mut map, &mut f.otherwise, PhantomData)?,
                _ => unreachable!("every key of SHAPES is read"),
            }
        }
        f.into_step().map_err(de::Error::custom)
    }
}

impl Fields {
    /// The instruction the fields make, or what is wrong with them, in words.
    fn into_step(self) -> Result<ScriptStep, String> {
        let names: Vec<&str> = SHAPES
            .iter()
            .map(|(n, _, _)| *n)
            .filter(|n| self.present.contains(n))
            .collect();
        let (name, needs, may) = match names.as_slice() {
            [one] => SHAPES.iter().find(|(n, _, _)| n == one).copied().unwrap(),
            [] => {
                let all: Vec<String> = SHAPES.iter().map(|(n, _, _)| format!("\"{n}\"")).collect();
                return Err(format!(
                    "a step needs one of {} to say what it does (docs/kinds.md#script)",
                    all.join(", ")
                ));
            }
            [a, b, ..] => {
                return Err(format!(
                    "a step is one instruction, and \"{a}\" and \"{b}\" are two: make them two \
                     steps"
                ));
            }
        };
        if let Some(missing) = needs.iter().find(|k| match **k {
            "times" => self.times.is_none(),
            _ => !self.present.contains(k),
        }) {
            return Err(format!("a \"{name}\" step needs \"{missing}\""));
        }
        if let Some(extra) = self
            .present
            .iter()
            .find(|k| **k != name && !needs.contains(k) && !may.contains(k))
        {
            let takes: Vec<&str> = std::iter::once(name)
                .chain(needs.iter().copied())
                .chain(may.iter().copied())
                .collect();
            return Err(format!(
                "\"{extra}\" is not a field of a \"{name}\" step, which takes: {}",
                takes.join(", ")
            ));
        }
        Ok(self.build(name))
    }

    /// The step `name`, whose needed fields are present.
    fn build(self, name: &str) -> ScriptStep {
        match name {
            "work_ms" => ScriptStep::Work {
                work_ms: self.work_ms.unwrap_or_default(),
                deferred: self.deferred.unwrap_or_default(),
            },
            "tool" => ScriptStep::Tool {
                tool: self.tool.unwrap_or(ToolName::Ledger),
                replay: self.replay.unwrap_or(ReplayName::Safe),
                label: self.label.unwrap_or_default(),
                after_ms: self.after_ms.unwrap_or_default(),
                reconcile: self.reconcile.unwrap_or_default(),
            },
            "model" => ScriptStep::Model {
                model: self.model.unwrap_or_default(),
            },
            "sleep_ms" => ScriptStep::Sleep {
                sleep_ms: self.sleep_ms.unwrap_or_default(),
            },
            "wait_signal" => ScriptStep::WaitSignal {
                wait_signal: self.wait_signal.unwrap_or_default(),
                timeout_ms: self.timeout_ms.unwrap_or_default(),
                on_timeout: self.on_timeout.unwrap_or_default(),
            },
            "fail" => ScriptStep::Fail {
                fail: self.fail.unwrap_or(FailClass::Retryable),
                times: self.times.unwrap_or_default(),
                not_before_ms: self.not_before_ms,
            },
            "panic" => ScriptStep::Panic {
                panic: self.panic.unwrap_or_default(),
                times: self.times,
            },
            "spawn" => ScriptStep::Spawn {
                spawn: self.spawn.unwrap_or_default(),
                input: self.input.unwrap_or_default(),
            },
            "join" => ScriptStep::Join {
                join: self.join.unwrap_or_default(),
            },
            _ => ScriptStep::Patched {
                patched: self.patched.unwrap_or_default(),
                then: self.then.unwrap_or_default(),
                otherwise: self.otherwise.unwrap_or_default(),
            },
        }
    }
}

impl<'de> Deserialize<'de> for ScriptStep {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(StepVisitor)
    }
}
