//! `agentq tokens …`, `agentq webhooks …` and `agentq stores …`: API tokens (stored hashed,
//! shown once), Standard Webhooks sources with secret rotation and an optional per-source
//! config (checked against the source's kind before anything is written), and the stores
//! (directories, tables) a tenant's operations may read or write. All audited. The flows are
//! `agentq_app::access`; this module parses flags and prints.

use crate::wiring::Deployment;
use agentq_app::access;
use clap::Subcommand;
use serde_json::json;

use crate::wiring::{cli_app, done, refuse};

#[derive(Subcommand)]
pub enum TokensCommand {
    /// Create a token (printed once; only its SHA-256 is stored).
    Create {
        #[arg(long)]
        tenant: String,
        /// producer (enqueue, read, signal, cancel), operator (also the DLQ), admin (all tenants).
        #[arg(long)]
        role: String,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// List tokens (their prefixes, never the tokens).
    List {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Revoke a token by its id.
    Revoke {
        id: String,
        #[arg(long = "as")]
        actor: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum WebhooksCommand {
    /// Add a webhook source; prints its signing secret (`whsec_…`).
    Add {
        #[arg(long)]
        tenant: String,
        /// The source's name (the `{source}` of `POST /v1/webhooks/{source}`).
        #[arg(long)]
        source: String,
        /// The job kind each delivery creates.
        #[arg(long)]
        kind: String,
        /// A JSON object handed to each operation: the input becomes `{"event": body, "source",
        /// "webhook_id", "config"}` (without it, the body is the input). `triage` needs
        /// `{"callback_url": "https://…", "labels": […]}`.
        #[arg(long)]
        config: Option<String>,
        /// Debounce deliveries on the key their body holds at this JSON pointer (e.g.
        /// /document/id; with --debounce): a delivery of a key whose operation is pending
        /// replaces its input and pushes its start back.
        #[arg(long, value_name = "POINTER")]
        debounce_pointer: Option<String>,
        #[command(flatten)]
        debounce: crate::debounce::DebounceFlags,
        /// A token budget each delivery's operation is born with.
        #[command(flatten)]
        budget: crate::budgets::BudgetFlags,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Add a new secret; the current ones stay valid for the grace period.
    Rotate {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        source: String,
        /// How long the old secrets stay valid (e.g. 24h, 30m, 0s).
        #[arg(long, default_value = "24h")]
        grace: String,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// List webhook sources (never their secrets).
    List {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum StoresCommand {
    /// Register a directory or a table under a name for a tenant; its operations name it
    /// (`"source": {"store": NAME}`) and may do with it what --access says.
    Add {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        name: String,
        /// An absolute directory (documents are files under it; symlinks leading out of it are
        /// refused when read or written).
        #[arg(long, conflicts_with = "table", required_unless_present = "table")]
        dir: Option<String>,
        /// A table of agentq's database, `[schema.]name` (never one of agentq's own tables).
        #[arg(long)]
        table: Option<String>,
        /// A source table's key column (compared as text).
        #[arg(long, requires = "table", default_value = "id")]
        id_column: String,
        /// A source table's text column.
        #[arg(long, requires = "table", default_value = "body")]
        body_column: String,
        /// read (a source), write (a target) or read_write.
        #[arg(long)]
        access: String,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// List stores, of one tenant or all.
    List {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Remove a store: operations naming it that have not read or written it yet then fail.
    Remove {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        name: String,
        #[arg(long = "as")]
        actor: Option<String>,
    },
}

pub async fn tokens(config: Deployment, cmd: TokensCommand) -> anyhow::Result<()> {
    match cmd {
        TokensCommand::Create {
            tenant,
            role,
            actor,
            json,
        } => {
            let (app, caller) = cli_app(&config, &actor).await?;
            let created = access::create_token(&app, &caller, &tenant, &role).await;
            let t = done(app, created).await?;
            if json {
                println!(
                    "{}",
                    json!({ "id": t.id, "token": t.token, "tenant": tenant, "role": role })
                );
            } else {
                println!(
                    "token {} for tenant {tenant} ({role}) — shown once, store it now:",
                    t.id
                );
                println!("{}", t.token);
            }
        }
        TokensCommand::List { tenant, json } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let listed = access::list_tokens(&app, &caller, tenant.as_deref()).await;
            for t in done(app, listed).await? {
                if json {
                    println!("{}", serde_json::to_string(&t)?);
                } else {
                    println!(
                        "{}  {}…  {:<20} {:<9} {}",
                        t.id,
                        t.prefix,
                        t.tenant,
                        t.role,
                        t.revoked_at
                            .map(|r| format!("revoked {r}"))
                            .unwrap_or_else(|| "active".into())
                    );
                }
            }
        }
        TokensCommand::Revoke { id, actor } => {
            let id = uuid::Uuid::parse_str(&id)
                .map_err(|_| refuse(format!("{id:?} is not a token id (a UUID)")))?;
            let (app, caller) = cli_app(&config, &actor).await?;
            let revoked = access::revoke_token(&app, &caller, id).await;
            done(app, revoked).await?;
            println!("token {id} revoked");
        }
    }
    Ok(())
}

pub async fn webhooks(config: Deployment, cmd: WebhooksCommand) -> anyhow::Result<()> {
    match cmd {
        WebhooksCommand::Add {
            tenant,
            source,
            kind,
            config: source_config,
            debounce_pointer,
            debounce,
            budget,
            actor,
            json,
        } => {
            let budget = budget.request()?;
            let (app, caller) = cli_app(&config, &actor).await?;
            let new = access::SourceRequest {
                tenant: &tenant,
                source: &source,
                kind: &kind,
                config: source_config.as_deref(),
                debounce: &debounce.request(debounce_pointer),
                budget: budget.as_ref(),
            };
            let added = access::add_source(&app, &caller, &new).await;
            let secret = done(app, added).await?;
            // The same check a worker makes, against this process's AGENTQ_AGENT_HTTP_ALLOW.
            let source_config: Option<serde_json::Value> = source_config
                .as_deref()
                .and_then(|c| serde_json::from_str(c).ok());
            let callback = source_config
                .as_ref()
                .and_then(|c| c.get("callback_url")?.as_str())
                .and_then(|u| reqwest::Url::parse(u).ok());
            if let Some(url) = callback {
                let allowed = config.agent_http_allow().and_then(|o| o.check(&url));
                if let Err(why) = allowed {
                    eprintln!(
                        "note: {why} (here); workers refuse callbacks to origins missing from theirs"
                    );
                }
            }
            if json {
                println!(
                    "{}",
                    json!({ "tenant": tenant, "source": source, "kind": kind, "config": source_config, "secret": secret })
                );
            } else {
                println!(
                    "webhook source {source} (tenant {tenant}) creates {kind} operations; its secret, shown once:"
                );
                println!("{secret}");
            }
        }
        WebhooksCommand::Rotate {
            tenant,
            source,
            grace,
            actor,
            json,
        } => {
            let until = agentq_app::time::parse_since(&grace, "--grace").map_err(|_| {
                refuse(format!(
                    "--grace {grace:?}: use a duration like 24h, 30m, 0s"
                ))
            })?;
            let grace = chrono::Utc::now() - until;
            let (app, caller) = cli_app(&config, &actor).await?;
            let rotated = access::rotate_secret(&app, &caller, &tenant, &source, grace).await;
            let secret = done(app, rotated).await?;
            if json {
                println!(
                    "{}",
                    json!({ "tenant": tenant, "source": source, "secret": secret })
                );
            } else {
                println!(
                    "new secret for {source} (the old ones stay valid for the grace period), shown once:"
                );
                println!("{secret}");
            }
        }
        WebhooksCommand::List { tenant, json } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let listed = access::list_sources(&app, &caller, tenant.as_deref()).await;
            for s in done(app, listed).await? {
                if json {
                    println!("{}", serde_json::to_string(&s)?);
                } else {
                    println!(
                        "{:<20} {:<20} {:<10} {} active secret(s)",
                        s.tenant, s.name, s.kind, s.active_secrets
                    );
                }
            }
        }
    }
    Ok(())
}

/// The store as `agentq stores list --json` shows it.
fn store_json(s: &agentq_app::access::Store) -> serde_json::Value {
    let (kind, location, id, body) = s.location.parts();
    let columns = id
        .zip(body)
        .map(|(id, body)| json!({ "id": id, "body": body }));
    json!({
        "tenant": s.tenant, "name": s.name, "kind": kind, "location": location,
        "columns": columns, "access": s.access, "created_by": s.created_by,
        "created_at": s.created_at,
    })
}

pub async fn stores(config: Deployment, cmd: StoresCommand) -> anyhow::Result<()> {
    match cmd {
        StoresCommand::Add {
            tenant,
            name,
            dir,
            table,
            id_column,
            body_column,
            access: grant,
            actor,
            json,
        } => {
            let place = match (&dir, &table) {
                (Some(dir), None) => access::Place::Dir(dir),
                (None, Some(table)) => access::Place::Table {
                    table,
                    id_column: &id_column,
                    body_column: &body_column,
                },
                _ => return Err(refuse("give exactly one of --dir and --table")),
            };
            let (app, caller) = cli_app(&config, &actor).await?;
            let added = access::add_store(&app, &caller, &tenant, &name, place, &grant).await;
            let store = done(app, added).await?;
            if json {
                println!("{}", store_json(&store));
            } else {
                println!(
                    "store {name} (tenant {tenant}): {} for {}",
                    store.location.describe(),
                    store.access.as_str()
                );
            }
        }
        StoresCommand::List { tenant, json } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let listed = access::list_stores(&app, &caller, tenant.as_deref()).await;
            for s in done(app, listed).await? {
                if json {
                    println!("{}", store_json(&s));
                } else {
                    println!(
                        "{:<20} {:<24} {:<10} {}",
                        s.tenant,
                        s.name,
                        s.access.as_str(),
                        s.location.describe()
                    );
                }
            }
        }
        StoresCommand::Remove {
            tenant,
            name,
            actor,
        } => {
            let (app, caller) = cli_app(&config, &actor).await?;
            let removed = access::remove_store(&app, &caller, &tenant, &name).await;
            done(app, removed).await?;
            println!("store {name} of tenant {tenant} removed");
        }
    }
    Ok(())
}
