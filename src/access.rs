//! `agentq tokens …`, `agentq webhooks …` and `agentq stores …`: API tokens (stored hashed,
//! shown once), Standard Webhooks sources with secret rotation and an optional per-source
//! config (checked against the source's kind before anything is written), and the stores
//! (directories, tables) a tenant's operations may read or write. All audited.

use agentq_core::operation::TenantId;
use agentq_core::webhook::Secret;
use agentq_core::{Config, db};
use anyhow::Context;
use clap::Subcommand;
use serde_json::json;

use crate::wiring::{connect, refuse};

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

fn name_ok(what: &str, s: &str) -> anyhow::Result<()> {
    if s.is_empty()
        || s.len() > 64
        || !s
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        return Err(refuse(format!(
            "{what} {s:?}: use 1-64 characters of letters, digits, '_', '-', '.'"
        )));
    }
    Ok(())
}

/// Parses `--config` and checks that the kind accepts a delivery wrapped with it (an input
/// `{"event", "source", "webhook_id", "config"}`), so a bad config is refused now rather than
/// at every delivery.
fn check_source_config(
    registry: &agentq_worker::Registry,
    kind: &str,
    source: &str,
    raw: &str,
) -> anyhow::Result<serde_json::Value> {
    let config: serde_json::Value = serde_json::from_str(raw)
        .map_err(|e| refuse(format!("--config is not valid JSON: {e}")))?;
    if !config.is_object() {
        return Err(refuse(
            "--config must be a JSON object, e.g. '{\"callback_url\": \"https://…\"}'",
        ));
    }
    let sample = json!({ "event": {}, "source": source, "webhook_id": "check", "config": config });
    registry.check_input(kind, &sample).map_err(|e| {
        refuse(format!(
            "--config does not fit kind {kind:?} ({e}); kinds that take a config read \
             {{\"event\", \"source\", \"webhook_id\", \"config\"}}, e.g. triage"
        ))
    })?;
    Ok(config)
}

pub async fn tokens(config: Config, cmd: TokensCommand) -> anyhow::Result<()> {
    match cmd {
        TokensCommand::Create {
            tenant,
            role,
            actor,
            json,
        } => {
            TenantId::parse(&tenant).map_err(refuse)?;
            if !db::access::ROLES.contains(&role.as_str()) {
                return Err(refuse(format!(
                    "--role {role:?}: use producer, operator or admin"
                )));
            }
            let pool = connect(&config).await?;
            let actor = crate::wiring::actor_name(&actor);
            let (id, token) = db::access::create_token(&pool, &tenant, &role, &actor)
                .await
                .context("creating the token")?;
            if json {
                println!(
                    "{}",
                    json!({ "id": id, "token": token, "tenant": tenant, "role": role })
                );
            } else {
                println!("token {id} for tenant {tenant} ({role}) — shown once, store it now:");
                println!("{token}");
            }
        }
        TokensCommand::List { tenant, json } => {
            let pool = connect(&config).await?;
            for t in db::access::list_tokens(&pool, tenant.as_deref()).await? {
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
            let pool = connect(&config).await?;
            if !db::access::revoke_token(&pool, id, &crate::wiring::actor_name(&actor)).await? {
                return Err(refuse(format!("no active token {id}")));
            }
            println!("token {id} revoked");
        }
    }
    Ok(())
}

pub async fn webhooks(config: Config, cmd: WebhooksCommand) -> anyhow::Result<()> {
    match cmd {
        WebhooksCommand::Add {
            tenant,
            source,
            kind,
            config: source_config,
            actor,
            json,
        } => {
            TenantId::parse(&tenant).map_err(refuse)?;
            name_ok("--source", &source)?;
            let registry = agentq_kinds::registry();
            let known = registry.kinds();
            if !known.contains(&kind) {
                return Err(refuse(format!(
                    "unknown kind {kind:?}; this deployment runs: {}",
                    known.join(", ")
                )));
            }
            let source_config = source_config
                .map(|c| check_source_config(&registry, &kind, &source, &c))
                .transpose()?;
            if source_config.is_none() && kind == "triage" {
                return Err(refuse(
                    "kind triage needs --config '{\"callback_url\": \"https://…\"}' (and \
                     optionally \"labels\": [\"bug\", \"question\", …])",
                ));
            }
            // The same check a worker makes, against this process's AGENTQ_AGENT_HTTP_ALLOW.
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
            let pool = connect(&config).await?;
            let secret = Secret::generate().expose();
            let actor = crate::wiring::actor_name(&actor);
            if !db::access::add_source(
                &pool,
                &tenant,
                &source,
                &kind,
                source_config.as_ref(),
                &secret,
                &actor,
            )
            .await?
            {
                return Err(refuse(format!(
                    "tenant {tenant} already has a webhook source {source:?}; rotate its secret instead"
                )));
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
            let until = crate::dlq::parse_since(&grace).map_err(|_| {
                refuse(format!(
                    "--grace {grace:?}: use a duration like 24h, 30m, 0s"
                ))
            })?;
            let grace = chrono::Utc::now() - until;
            let pool = connect(&config).await?;
            let secret = Secret::generate().expose();
            let actor = crate::wiring::actor_name(&actor);
            if !db::access::rotate_secret(&pool, &tenant, &source, &secret, grace, &actor).await? {
                return Err(refuse(format!(
                    "tenant {tenant} has no webhook source {source:?}"
                )));
            }
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
            let pool = connect(&config).await?;
            for s in db::access::list_sources(&pool, tenant.as_deref()).await? {
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
fn store_json(s: &db::stores::Store) -> serde_json::Value {
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

pub async fn stores(config: Config, cmd: StoresCommand) -> anyhow::Result<()> {
    use db::docs::Ident;
    use db::stores::{self, Access, Location};
    match cmd {
        StoresCommand::Add {
            tenant,
            name,
            dir,
            table,
            id_column,
            body_column,
            access,
            actor,
            json,
        } => {
            TenantId::parse(&tenant).map_err(refuse)?;
            stores::check_name(&name).map_err(|e| refuse(format!("--name: {e}")))?;
            let access = Access::parse(&access).map_err(|e| refuse(format!("--{e}")))?;
            let location = match (dir, table) {
                (Some(dir), None) => Location::Dir(
                    stores::check_dir(&dir).map_err(|e| refuse(format!("--dir: {e}")))?,
                ),
                (None, Some(table)) => {
                    let table =
                        Ident::table(&table).map_err(|e| refuse(format!("--table: {e}")))?;
                    stores::check_table(&table).map_err(|e| refuse(format!("--table: {e}")))?;
                    Location::Table {
                        table,
                        id_column: Ident::column(&id_column)
                            .map_err(|e| refuse(format!("--id-column: {e}")))?,
                        body_column: Ident::column(&body_column)
                            .map_err(|e| refuse(format!("--body-column: {e}")))?,
                    }
                }
                _ => return Err(refuse("give exactly one of --dir and --table")),
            };
            let pool = connect(&config).await?;
            let actor = crate::wiring::actor_name(&actor);
            if !stores::add(&pool, &tenant, &name, &location, access, &actor).await? {
                return Err(refuse(format!(
                    "tenant {tenant} already has a store {name:?}; remove it first to change it"
                )));
            }
            if json {
                let store = stores::get(&pool, &tenant, &name)
                    .await?
                    .context("the store just added")?;
                println!("{}", store_json(&store));
            } else {
                println!(
                    "store {name} (tenant {tenant}): {} for {}",
                    location.describe(),
                    access.as_str()
                );
            }
        }
        StoresCommand::List { tenant, json } => {
            let pool = connect(&config).await?;
            for s in stores::list(&pool, tenant.as_deref()).await? {
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
            let pool = connect(&config).await?;
            if !stores::remove(&pool, &tenant, &name, &crate::wiring::actor_name(&actor)).await? {
                return Err(refuse(format!("tenant {tenant} has no store {name:?}")));
            }
            println!("store {name} of tenant {tenant} removed");
        }
    }
    Ok(())
}
