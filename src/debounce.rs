//! The flags of a debounce (`agentq enqueue --debounce-key`, `agentq webhooks add
//! --debounce-pointer`): their checks and the flow are `agentq_app::debounce`.

/// A debounce's window, cap and policy as flags (`agentq enqueue`, `agentq webhooks add`).
#[derive(clap::Args)]
pub struct DebounceFlags {
    /// The debounce window: start once no newer arrival came for this long (500ms, 2s, 5m;
    /// more than 0, at most 24h).
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub debounce: Option<String>,
    /// Start no later than the key's first arrival + this (at least the window; default 10
    /// windows).
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub max_delay: Option<String>,
    /// When the key's operation has started: queue (default: a new pending operation), skip
    /// (answer with the started one) or cancel_running (cancel it, then a new pending one).
    #[arg(long, value_name = "POLICY")]
    pub on_running: Option<String>,
}

impl DebounceFlags {
    /// These flags with the key (or a source's pointer), for `agentq_app::debounce`.
    pub fn request(self, key: Option<String>) -> agentq_app::debounce::Request {
        agentq_app::debounce::Request {
            key,
            window: self.debounce,
            max_delay: self.max_delay,
            on_running: self.on_running,
        }
    }
}
