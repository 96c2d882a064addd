//! The one error type of the application layer. Each front end maps it once: the CLI to an
//! exit code (2 for everything but `Internal`), the HTTP API to a problem+json status, the
//! console to a flash message or an error page.

/// Why a flow did not happen. Nothing was changed unless the variant says otherwise.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// A value the caller gave is wrong (HTTP 422): `field` names it as the HTTP API does
    /// (`/input`, `name`, `/reason`), `message` says what to change.
    #[error("{message}")]
    Invalid { field: String, message: String },
    /// A value the caller gave cannot even be read (HTTP 400): a malformed id or name.
    #[error("{message}")]
    Malformed {
        field: &'static str,
        message: String,
    },
    /// Nothing of that id exists in the caller's scope (another tenant's is not found too).
    #[error("{0}")]
    NotFound(String),
    /// The thing exists but is not in a state that allows the act (HTTP 409).
    #[error("{0}")]
    Conflict(String),
    /// A dedupe (idempotency) key already names an operation enqueued with another request
    /// (HTTP 422 `idempotency-key-reused`): nothing was enqueued.
    #[error(
        "dedupe key {key:?} already names operation {op_id} with a different input; use a new \
         key, or send the same input to get that operation back"
    )]
    KeyReused { key: String, op_id: uuid::Uuid },
    /// A cap of the caller's tenant is reached (HTTP 429 with `Retry-After` when waiting helps,
    /// CLI exit 2): nothing was started. The message names the cap and its setting.
    #[error("{message}")]
    Busy {
        message: String,
        retry_after_secs: u64,
    },
    /// The caller's role does not allow the act (HTTP 403).
    #[error("{0}")]
    Forbidden(String),
    /// The database failed; worth retrying.
    #[error(transparent)]
    Db(#[from] agentq_core::db::Error),
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        AppError::Db(e.into())
    }
}

impl AppError {
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        AppError::Invalid {
            field: field.to_string(),
            message: message.into(),
        }
    }

    pub fn malformed(field: &'static str, message: impl Into<String>) -> Self {
        AppError::Malformed {
            field,
            message: message.into(),
        }
    }

    /// True when the database could not be reached or had no connection to spare (a pool
    /// timeout, a closed pool, an I/O or TLS failure): the request was not started and a
    /// retry later may succeed (HTTP 503). Any other database failure is an internal error.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            AppError::Db(agentq_core::db::Error::Sqlx(
                sqlx::Error::PoolTimedOut
                    | sqlx::Error::PoolClosed
                    | sqlx::Error::Io(_)
                    | sqlx::Error::Tls(_),
            ))
        )
    }

    /// True when the caller's request was refused (CLI exit code 2), false for a failure.
    pub fn is_refusal(&self) -> bool {
        !matches!(self, AppError::Db(_))
    }
}

/// Result alias of the application layer.
pub type Result<T, E = AppError> = std::result::Result<T, E>;
