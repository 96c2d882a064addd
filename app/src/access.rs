//! Access: API tokens (stored hashed, shown once), webhook sources (their signing secrets and
//! an optional per-source config, checked against the source's kind), and the stores a
//! tenant's operations may read or write. Every act here is an admin's and is audited in
//! `operator_actions`; a refused one changes nothing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use agentq_core::db::access;
use agentq_core::db::batch_source::Ident;
pub use agentq_core::db::stores::Store;
use agentq_core::db::stores::{self, Access, Location};
use agentq_core::operation::TenantId;
use agentq_core::webhook::Secret;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::{App, AppError, Caller, Result, Role};

fn tenant(t: &str) -> Result<()> {
    TenantId::parse(t)
        .map(|_| ())
        .map_err(|e| AppError::invalid("tenant", e))
}

/// A token just created: its id and the token itself, which is stored nowhere.
pub struct NewToken {
    pub id: Uuid,
    pub token: String,
}

/// Creates a token of `role` for `tenant`.
pub async fn create_token(app: &App, caller: &Caller, t: &str, role: &str) -> Result<NewToken> {
    caller.require(Role::Admin)?;
    tenant(t)?;
    if Role::parse(role).is_none() {
        return Err(AppError::invalid(
            "role",
            format!("--role {role:?}: use producer, operator or admin"),
        ));
    }
    let (id, token) = access::create_token(&app.pool, t, role, &caller.actor).await?;
    Ok(NewToken { id, token })
}

/// Revokes the token `id`.
pub async fn revoke_token(app: &App, caller: &Caller, id: Uuid) -> Result<()> {
    caller.require(Role::Admin)?;
    if access::revoke_token(&app.pool, id, &caller.actor).await? {
        app.tokens.forget();
        Ok(())
    } else {
        Err(AppError::NotFound(format!("no active token {id}")))
    }
}

/// The tokens of one tenant or all (their prefixes, never the tokens).
pub async fn list_tokens(
    app: &App,
    caller: &Caller,
    t: Option<&str>,
) -> Result<Vec<access::TokenView>> {
    caller.require(Role::Admin)?;
    Ok(access::list_tokens(&app.pool, t).await?)
}

/// A webhook source as asked for (`agentq webhooks add`).
#[derive(Clone, Copy, Debug)]
pub struct SourceRequest<'a> {
    pub tenant: &'a str,
    pub source: &'a str,
    /// The kind each delivery creates.
    pub kind: &'a str,
    /// A JSON object handed to each operation, as given.
    pub config: Option<&'a str>,
    pub debounce: &'a crate::debounce::Request,
    pub budget: Option<&'a crate::budgets::BudgetRequest>,
}

/// Adds the webhook source `source` of `tenant`, creating `kind` operations, with an optional
/// config (a JSON object handed to each operation as `{"event", "source", "webhook_id",
/// "config"}`, checked against the kind now rather than at every delivery). Returns its
/// signing secret, stored for verification and shown once. With a debounce
/// (`--debounce-pointer` and `--debounce`), deliveries are debounced on the key their body
/// holds at the pointer (`crate::debounce`). With a budget, each delivery's operation is born
/// with that token budget of its own.
pub async fn add_source(app: &App, caller: &Caller, new: &SourceRequest<'_>) -> Result<String> {
    let SourceRequest {
        tenant: t,
        source,
        kind,
        config,
        debounce,
        budget,
    } = *new;
    caller.require(Role::Admin)?;
    let budget = budget.map(|b| b.spec()).transpose()?;
    let debounce = crate::debounce::SourceDebounce::from_flags(debounce)?
        .map(|d| serde_json::to_value(d).expect("a debounce is JSON"));
    tenant(t)?;
    stores::check_plain_name("--source", source).map_err(|e| AppError::invalid("--source", e))?;
    let config: Option<Value> = config
        .map(|raw| {
            let v: Value = serde_json::from_str(raw).map_err(|e| {
                AppError::invalid("--config", format!("--config is not valid JSON: {e}"))
            })?;
            if !v.is_object() {
                return Err(AppError::invalid(
                    "--config",
                    "--config must be a JSON object, e.g. '{\"callback_url\": \"https://…\"}'",
                ));
            }
            Ok(v)
        })
        .transpose()?;
    // A delivery's input as the source will build it; `triage` needs a config.
    let sample = match &config {
        Some(c) => json!({ "event": {}, "source": source, "webhook_id": "check", "config": c }),
        None => json!({}),
    };
    match app.producer.check_input(kind, &sample) {
        Err(agentq_producer::Error::Invalid { field, message }) if field == "/kind" => {
            return Err(AppError::invalid("--kind", message));
        }
        Err(e) if config.is_some() => {
            return Err(AppError::invalid(
                "--config",
                format!(
                    "--config does not fit kind {kind:?} ({e}); kinds that take a config read \
                     {{\"event\", \"source\", \"webhook_id\", \"config\"}}, e.g. triage"
                ),
            ));
        }
        _ => {}
    }
    crate::tenants::check_kind(app, t, kind).await?;
    // A kind that runs only for webhook deliveries reads its source's config: its deliveries
    // cannot run without one.
    let webhook_only = app
        .producer
        .catalog()
        .kinds()
        .into_iter()
        .any(|k| k.name == kind && k.webhook_only);
    if config.is_none() && webhook_only {
        return Err(AppError::invalid(
            "--config",
            format!(
                "kind {kind:?} runs only for webhook deliveries and reads its source's \
                 configuration: give --config (for triage '{{\"callback_url\": \"https://…\"}}', \
                 optionally with \"labels\": [\"bug\", \"question\", …]; `agentq kinds` shows \
                 each kind's input)"
            ),
        ));
    }
    let secret = Secret::generate().expose();
    let new = access::NewSource {
        tenant: t,
        name: source,
        kind,
        config: config.as_ref(),
        debounce: debounce.as_ref(),
        budget,
    };
    if !access::add_source(&app.pool, new, &secret, &caller.actor).await? {
        return Err(AppError::Conflict(format!(
            "tenant {t} already has a webhook source {source:?}; rotate its secret instead"
        )));
    }
    Ok(secret)
}

/// Adds a new secret to the source; the current ones stay valid for `grace`.
pub async fn rotate_secret(
    app: &App,
    caller: &Caller,
    t: &str,
    source: &str,
    grace: chrono::Duration,
) -> Result<String> {
    caller.require(Role::Admin)?;
    let secret = Secret::generate().expose();
    if access::rotate_secret(&app.pool, t, source, &secret, grace, &caller.actor).await? {
        Ok(secret)
    } else {
        Err(AppError::NotFound(format!(
            "tenant {t} has no webhook source {source:?}"
        )))
    }
}

/// The webhook sources of one tenant or all (never their secrets).
pub async fn list_sources(
    app: &App,
    caller: &Caller,
    t: Option<&str>,
) -> Result<Vec<access::SourceView>> {
    caller.require(Role::Admin)?;
    Ok(access::list_sources(&app.pool, t).await?)
}

/// Where a new store is, as a person names it: a directory, or a table with its columns.
pub enum Place<'a> {
    Dir(&'a str),
    Table {
        table: &'a str,
        id_column: &'a str,
        body_column: &'a str,
    },
}

/// Registers a store for `tenant`: never one of agentq's own tables or a system schema, a
/// directory only absolute and plain.
pub async fn add_store(
    app: &App,
    caller: &Caller,
    t: &str,
    name: &str,
    place: Place<'_>,
    access: &str,
) -> Result<Store> {
    caller.require(Role::Admin)?;
    tenant(t)?;
    stores::check_name(name).map_err(|e| AppError::invalid("--name", format!("--name: {e}")))?;
    let access =
        Access::parse(access).map_err(|e| AppError::invalid("--access", format!("--{e}")))?;
    let location = match place {
        Place::Dir(dir) => Location::Dir(
            stores::check_dir(dir)
                .map_err(|e| AppError::invalid("--dir", format!("--dir: {e}")))?,
        ),
        Place::Table {
            table,
            id_column,
            body_column,
        } => {
            let bad = |f: &'static str, e: String| AppError::invalid(f, format!("{f}: {e}"));
            let table = Ident::table(table).map_err(|e| bad("--table", e))?;
            stores::check_table(&table).map_err(|e| bad("--table", e))?;
            Location::Table {
                table,
                id_column: Ident::column(id_column).map_err(|e| bad("--id-column", e))?,
                body_column: Ident::column(body_column).map_err(|e| bad("--body-column", e))?,
            }
        }
    };
    if !stores::add(&app.pool, t, name, &location, access, &caller.actor).await? {
        return Err(AppError::Conflict(format!(
            "tenant {t} already has a store {name:?}; remove it first to change it"
        )));
    }
    stores::get(&app.pool, t, name)
        .await?
        .ok_or_else(|| AppError::Conflict(format!("store {name:?} was removed meanwhile")))
}

/// Removes a store: operations naming it that have not read or written it yet then fail.
pub async fn remove_store(app: &App, caller: &Caller, t: &str, name: &str) -> Result<()> {
    caller.require(Role::Admin)?;
    if stores::remove(&app.pool, t, name, &caller.actor).await? {
        Ok(())
    } else {
        Err(AppError::NotFound(format!(
            "tenant {t} has no store {name:?}"
        )))
    }
}

/// The stores of one tenant or all.
pub async fn list_stores(app: &App, caller: &Caller, t: Option<&str>) -> Result<Vec<Store>> {
    caller.require(Role::Admin)?;
    Ok(stores::list(&app.pool, t).await?)
}

/// A caller found by its API token: who it acts as, and the token's parts a front end keeps.
#[derive(Clone, Debug)]
pub struct Authenticated {
    /// The caller, audited as `token:<prefix>`.
    pub caller: Caller,
    /// The token's public prefix (`agq_` and 8 characters).
    pub prefix: String,
    /// The token's SHA-256 (the only form stored): a long request (an event stream) re-checks
    /// it with [`still_valid`].
    pub token_hash: String,
}

/// The caller an API token stands for: the one lookup of a token, for the HTTP API and the
/// console. `None` when the token is unknown or revoked (or names a role agentq does not know,
/// which the table's check constraint rules out).
pub async fn authenticate(app: &App, token: &str) -> Result<Option<Authenticated>> {
    let token_hash = access::token_hash(token);
    let Some((tenant, role)) = app.tokens.look_up(&app.pool, &token_hash).await? else {
        return Ok(None);
    };
    let Some(role) = Role::parse(&role) else {
        return Ok(None);
    };
    let prefix: String = token.chars().take(12).collect();
    Ok(Some(Authenticated {
        caller: Caller {
            tenant,
            role,
            actor: format!("token:{prefix}"),
        },
        prefix,
        token_hash,
    }))
}

/// The SHA-256 (hex) a token is stored and looked up under.
pub fn token_hash(token: &str) -> String {
    access::token_hash(token)
}

/// How long a process trusts a token's lookup (its tenant and role, or that it names none): a
/// token revoked elsewhere is refused by this process within this time (at once in the process
/// that revoked it), and a busy token costs one lookup a second, not one per request.
const TOKEN_TTL: Duration = Duration::from_secs(1);

/// A token's tenant and role as stored, or none when no valid token has its hash.
type Found = Option<(String, String)>;

/// Tokens as looked up, each at most `TOKEN_TTL` (a second) old.
#[derive(Default)]
pub struct Tokens {
    map: Mutex<HashMap<String, (Instant, Found)>>,
}

impl Tokens {
    async fn look_up(&self, pool: &sqlx::PgPool, hash: &str) -> Result<Found> {
        if let Some((at, found)) = self.map.lock().expect("tokens lock").get(hash)
            && at.elapsed() < TOKEN_TTL
        {
            return Ok(found.clone());
        }
        let found = access::authenticate_hash(pool, hash).await?;
        let mut map = self.map.lock().expect("tokens lock");
        if map.len() >= 10_000 {
            map.retain(|_, (at, _)| at.elapsed() < TOKEN_TTL);
        }
        map.insert(hash.to_string(), (Instant::now(), found.clone()));
        Ok(found)
    }

    fn forget(&self) {
        self.map.lock().expect("tokens lock").clear();
    }
}

/// Which of the token hashes `hashes` still name a valid (unrevoked) token, in one query under
/// the call deadline.
pub async fn still_valid(app: &App, hashes: &[String]) -> Result<Vec<String>> {
    Ok(agentq_core::db::within(access::valid_token_hashes(&app.pool, hashes)).await?)
}
