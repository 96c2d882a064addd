//! Console sessions: log in with an operator or admin token, get a random session id in an
//! HttpOnly, SameSite=Strict cookie; the token stays on the server. Each session has its own
//! CSRF token, which every form carries.
//!
//! Sessions live in this process's memory (bounded; idle ones expire): a restart, or a request
//! that lands on another `serve` replica, asks for the token again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Form;
use axum::extract::rejection::FormRejection;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};

use agentq_app::access::{Authenticated, authenticate};
use agentq_app::{Caller, Role};
use maud::html;

use super::form::{Fields, FormPost};
use super::html::bare;
use super::{UiError, UiResult, UiState};

/// The session cookie's name.
pub const COOKIE: &str = "agentq_session";
/// The cookie holding the login form's CSRF token (there is no session yet).
const LOGIN_COOKIE: &str = "agentq_login";
/// A session unused this long ends.
const IDLE: Duration = Duration::from_secs(60 * 60);
/// A session ends this long after login, used or not.
const ABSOLUTE: Duration = Duration::from_secs(12 * 60 * 60);
/// Most sessions held at once; the oldest is dropped beyond this.
const MAX_SESSIONS: usize = 10_000;

struct Entry {
    token: String,
    csrf: String,
    created: Instant,
    last_seen: Instant,
    /// A message for the next page shown (the outcome of the last action).
    flash: Option<String>,
}

/// The sessions of this process.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Entry>>,
}

impl Sessions {
    fn open(&self, token: String) -> (String, String) {
        let id = random();
        let csrf = random();
        let now = Instant::now();
        let mut map = self.map.lock().expect("sessions lock");
        map.retain(|_, e| e.last_seen.elapsed() < IDLE && e.created.elapsed() < ABSOLUTE);
        if map.len() >= MAX_SESSIONS
            && let Some(oldest) = map
                .iter()
                .min_by_key(|(_, e)| e.last_seen)
                .map(|(k, _)| k.clone())
        {
            map.remove(&oldest);
        }
        map.insert(
            id.clone(),
            Entry {
                token,
                csrf: csrf.clone(),
                created: now,
                last_seen: now,
                flash: None,
            },
        );
        (id, csrf)
    }

    /// The token and CSRF token of a live session (touching it), and its pending message.
    fn touch(&self, id: &str) -> Option<(String, String, Option<String>)> {
        let mut map = self.map.lock().expect("sessions lock");
        let e = map.get_mut(id)?;
        if e.last_seen.elapsed() >= IDLE || e.created.elapsed() >= ABSOLUTE {
            map.remove(id);
            return None;
        }
        e.last_seen = Instant::now();
        Some((e.token.clone(), e.csrf.clone(), e.flash.take()))
    }

    fn close(&self, id: &str) {
        self.map.lock().expect("sessions lock").remove(id);
    }

    /// Leaves a message for the session's next page.
    pub fn flash(&self, id: &str, message: impl Into<String>) {
        if let Some(e) = self.map.lock().expect("sessions lock").get_mut(id) {
            e.flash = Some(message.into());
        }
    }
}

/// 244 random bits (two v4 UUIDs, from the OS's generator), hex.
fn random() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Compares secrets without an early exit.
pub(super) fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

/// `Secure` when the request came over https (a TLS-terminating proxy says so).
fn secure(headers: &HeaderMap) -> &'static str {
    let https = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("https"));
    if https { "; Secure" } else { "" }
}

fn set_cookie(res: &mut Response, value: String) {
    if let Ok(v) = HeaderValue::from_str(&value) {
        res.headers_mut().append(header::SET_COOKIE, v);
    }
}

/// Resolves a token to its caller through the application layer's one lookup (`None`: unknown
/// or revoked).
async fn caller_of(state: &UiState, token: &str) -> UiResult<Option<Authenticated>> {
    Ok(authenticate(&state.api.app, token).await?)
}

/// A logged-in console user: the caller its token stands for, and the session's CSRF token.
pub struct Session {
    pub id: String,
    pub caller: Caller,
    /// The token's public prefix (`agq_` and 8 characters), shown in the page header.
    pub prefix: String,
    pub csrf: String,
    /// The outcome of the previous action, shown once.
    pub flash: Option<String>,
}

impl FromRequestParts<Arc<UiState>> for Session {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<UiState>,
    ) -> Result<Self, Self::Rejection> {
        let to_login = || Redirect::to("/ui/login").into_response();
        let id = cookie(&parts.headers, COOKIE).ok_or_else(to_login)?;
        let (token, csrf, flash) = state.sessions.touch(&id).ok_or_else(to_login)?;
        let found = caller_of(state, &token)
            .await
            .map_err(IntoResponse::into_response)?;
        let Some(Authenticated { caller, prefix, .. }) =
            found.filter(|a| a.caller.require(Role::Operator).is_ok())
        else {
            state.sessions.close(&id);
            return Err(to_login());
        };
        Ok(Session {
            id,
            caller,
            prefix,
            csrf,
            flash,
        })
    }
}

/// `GET /ui/login`: the token form (its CSRF token also set as a short-lived cookie).
pub async fn login_page(headers: HeaderMap) -> Response {
    login_form(&headers, StatusCode::OK, None)
}

fn login_form(headers: &HeaderMap, status: StatusCode, error: Option<&str>) -> Response {
    let csrf = random();
    let body = html! {
        section class="login" {
            h1 { "agentq console" }
            @if let Some(e) = error {
                p class="flash error" { (e) }
            }
            form method="post" action="/ui/login" {
                input type="hidden" name="csrf" value=(csrf);
                label {
                    "Operator or admin token" br;
                    input type="password" name="token" autocomplete="off" required
                        placeholder="agq_…" size="50";
                }
                p { button type="submit" { "Sign in" } }
            }
            p class="muted" {
                "Create one with " code { "agentq tokens create --tenant T --role operator" }
                ". The token stays on the server; your browser keeps only a session cookie."
            }
        }
    };
    let mut res = (status, bare("Sign in", body)).into_response();
    set_cookie(
        &mut res,
        format!(
            "{LOGIN_COOKIE}={csrf}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=900{}",
            secure(headers)
        ),
    );
    res
}

/// `POST /ui/login`: exchanges an operator or admin token for a session.
pub async fn login(
    State(state): State<Arc<UiState>>,
    headers: HeaderMap,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult<Response> {
    let Ok(Form(fields)) = form else {
        return Ok(login_form(
            &headers,
            StatusCode::BAD_REQUEST,
            Some("the sign-in form was not sent as a form; use this page"),
        ));
    };
    let expected = cookie(&headers, LOGIN_COOKIE).unwrap_or_default();
    let given = fields.get("csrf").map(String::as_str).unwrap_or("");
    if expected.is_empty() || !same(given, &expected) {
        return Err(UiError::new(
            StatusCode::FORBIDDEN,
            "the sign-in form's CSRF token is missing or stale; reload /ui/login and try again",
        ));
    }
    let token = fields.get("token").map(|t| t.trim()).unwrap_or("");
    if !token.starts_with("agq_")
        || token.len() > 256
        || !token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        return Ok(login_form(
            &headers,
            StatusCode::UNAUTHORIZED,
            Some("that is not an agentq token (agq_…)"),
        ));
    }
    let Some(Authenticated { caller, .. }) = caller_of(&state, token).await? else {
        return Ok(login_form(
            &headers,
            StatusCode::UNAUTHORIZED,
            Some("the token is unknown or revoked; ask an admin for a new one"),
        ));
    };
    if caller.require(Role::Operator).is_err() {
        return Ok(login_form(
            &headers,
            StatusCode::FORBIDDEN,
            Some(
                "this is a producer token: the console needs an operator or admin token \
                 (agentq tokens create --role operator)",
            ),
        ));
    }
    let (id, _) = state.sessions.open(token.to_string());
    tracing::info!(actor = %caller.actor, tenant = %caller.tenant, "console: signed in");
    let mut res = Redirect::to("/ui").into_response();
    *res.status_mut() = StatusCode::SEE_OTHER;
    set_cookie(
        &mut res,
        format!(
            "{COOKIE}={id}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={}{}",
            ABSOLUTE.as_secs(),
            secure(&headers)
        ),
    );
    set_cookie(
        &mut res,
        format!("{LOGIN_COOKIE}=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0"),
    );
    Ok(res)
}

/// `POST /ui/logout`: ends the session.
pub async fn logout(State(state): State<Arc<UiState>>, post: FormPost) -> UiResult<Response> {
    state.sessions.close(&post.session.id);
    let mut res = Redirect::to("/ui/login").into_response();
    *res.status_mut() = StatusCode::SEE_OTHER;
    set_cookie(
        &mut res,
        format!("{COOKIE}=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0"),
    );
    Ok(res)
}
