//! A deployment's own state for its kinds and tools: its database pool, HTTP clients,
//! configuration. Given to the registry once (`Registry::provide`),
//! one value per type, and handed back typed to every run
//! ([`JobContext::state`](crate::JobContext::state)) and tool call
//! ([`ToolContext::state`](crate::ToolContext::state)).

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Arc;

use crate::error::JobError;

/// The values given to a registry, by type (kept by the registry, lent to a run by its
/// backend).
#[doc(hidden)]
#[derive(Clone, Default)]
pub struct Provided(HashMap<TypeId, Arc<dyn Any + Send + Sync>>);

impl Provided {
    /// Keeps `value`; false (and nothing kept) if a value of its type is there already.
    pub fn insert<T: Send + Sync + 'static>(&mut self, value: T) -> bool {
        let id = TypeId::of::<T>();
        if self.0.contains_key(&id) {
            return false;
        }
        self.0.insert(id, Arc::new(value));
        true
    }

    /// The value of type `T`, or a non-retryable error saying how to provide it.
    pub fn get<T: Send + Sync + 'static>(&self) -> Result<&T, JobError> {
        self.0
            .get(&TypeId::of::<T>())
            .and_then(|v| v.downcast_ref::<T>())
            .ok_or_else(|| {
                JobError::NonRetryable(format!(
                    "this worker was given no {}: call registry.provide(…) with one in the \
                     binary that runs this kind",
                    std::any::type_name::<T>()
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_comes_back_by_its_type_and_a_missing_one_says_how_to_give_it() {
        struct Outbox(&'static str);
        let mut p = Provided::default();
        assert!(p.insert(Outbox("mail")));
        assert!(!p.insert(Outbox("again")), "one value per type");
        assert_eq!(p.get::<Outbox>().unwrap().0, "mail");
        let missing = p.get::<String>().unwrap_err().to_string();
        assert!(missing.contains("alloc::string::String") && missing.contains("registry.provide"));
    }
}
