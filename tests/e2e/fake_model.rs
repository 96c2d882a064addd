//! The fake OpenAI-compatible provider, from the testkit.

pub use agentq_testkit::fake_model::*;
