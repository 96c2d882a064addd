//! Token → caller: the one lookup of a bearer token (by its SHA-256: only the hash is stored)
//! into the [`Caller`] it stands for. The console's sessions re-check theirs with it on every
//! request, so a revoked token ends its sessions.

use agentq_core::db::access;

use crate::{App, Caller, Result, Role};

/// How many characters of a token are its public prefix (`agq_` and 8 more): the name its
/// actions are audited under (`token:agq_1234abcd`) and what a console shows.
pub const PREFIX_CHARS: usize = 12;

/// The public prefix of `token` (see [`PREFIX_CHARS`]).
pub fn prefix(token: &str) -> String {
    token.chars().take(PREFIX_CHARS).collect()
}

/// The caller `token` stands for: its tenant, its role, audited as `token:<prefix>`. `None`
/// when the token is unknown or revoked (or has a role this build does not know, which the
/// table's check forbids).
pub async fn authenticate(app: &App, token: &str) -> Result<Option<Caller>> {
    let hash = access::token_hash(token);
    let Some((tenant, role)) = access::authenticate_hash(&app.pool, &hash).await? else {
        return Ok(None);
    };
    Ok(Role::parse(&role).map(|role| Caller {
        tenant,
        role,
        actor: format!("token:{}", prefix(token)),
    }))
}
