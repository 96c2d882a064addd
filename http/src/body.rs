//! Request bodies: size limit, content type, UTF-8, nesting depth, then typed decoding with
//! the path of the field at fault. Nothing is read past the limit.

use axum::body::Body;
use axum::http::{HeaderMap, header};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::problem::{ApiError, ApiResult};

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
/// Deepest JSON nesting accepted.
pub const MAX_DEPTH: usize = 64;

/// The raw bytes of a body of at most [`MAX_BODY_BYTES`].
pub async fn bytes(body: Body) -> ApiResult<axum::body::Bytes> {
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| {
            ApiError::new(
                axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                "payload-too-large",
                format!(
                    "the request body is larger than {MAX_BODY_BYTES} bytes (1 MiB); store large \
                 documents elsewhere and pass a reference"
                ),
            )
        })
}

/// Refuses a body whose declared type is not JSON.
pub fn require_json(headers: &HeaderMap) -> ApiResult<()> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") || essence.ends_with("+json") {
        Ok(())
    } else {
        Err(ApiError::new(
            axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            format!(
                "Content-Type is {:?}; send the body as JSON with Content-Type: application/json",
                if ct.is_empty() { "missing" } else { ct }
            ),
        )
        .field("Content-Type"))
    }
}

/// Parses JSON bytes into a value after checking UTF-8 and nesting depth.
pub fn parse_value(bytes: &[u8]) -> ApiResult<Value> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        ApiError::bad_request(format!(
            "the body is not valid UTF-8 (invalid byte at offset {}); send UTF-8 JSON",
            e.valid_up_to()
        ))
    })?;
    if let Some(at) = too_deep(text.as_bytes()) {
        return Err(ApiError::bad_request(format!(
            "the JSON nests deeper than {MAX_DEPTH} levels (at byte {at}); flatten it"
        )));
    }
    let value: Value = serde_json::from_str(text).map_err(|e| {
        ApiError::bad_request(format!(
            "the body is not valid JSON: {e}; send one JSON object"
        ))
    })?;
    if let Some(at) = agentq_core::operation::nul_at(&value) {
        return Err(ApiError::unprocessable(
            "a string contains the NUL character (\\u0000), which cannot be stored; remove it",
        )
        .field(at));
    }
    Ok(value)
}

/// Decodes a JSON value into `T`, naming the field at fault.
pub fn decode<T: DeserializeOwned>(value: Value) -> ApiResult<T> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let pointer = if path == "." {
            String::new()
        } else {
            format!("/{}", path.replace('.', "/"))
        };
        let what = if pointer.is_empty() {
            "the body".to_string()
        } else {
            format!("field {pointer:?}")
        };
        let err = ApiError::unprocessable(format!("{what}: {inner}"));
        // "missing field `x`" and "unknown field `x`" name their field in the message.
        let named = inner
            .to_string()
            .split('`')
            .nth(1)
            .map(|f| format!("{pointer}/{f}"));
        match (pointer.is_empty(), named) {
            (false, _) => err.field(pointer),
            (true, Some(f)) => err.field(f),
            (true, None) => err,
        }
    })
}

/// Reads a JSON body of type `T`: content type, size, UTF-8, depth, then fields.
pub async fn json<T: DeserializeOwned>(headers: &HeaderMap, body: Body) -> ApiResult<T> {
    require_json(headers)?;
    let bytes = bytes(body).await?;
    decode(parse_value(&bytes)?)
}

/// Like [`json`], for bodies that may be empty (`T::default()`).
pub async fn optional_json<T: DeserializeOwned + Default>(
    headers: &HeaderMap,
    body: Body,
) -> ApiResult<T> {
    let bytes = bytes(body).await?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    require_json(headers)?;
    decode(parse_value(&bytes)?)
}

/// The byte offset where nesting first exceeds [`MAX_DEPTH`], if it does (strings skipped).
fn too_deep(bytes: &[u8]) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (i, &b) in bytes.iter().enumerate() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Some(i);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_ignores_brackets_in_strings() {
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert_eq!(too_deep(ok.as_bytes()), None);
        let deep = "[".repeat(MAX_DEPTH + 1);
        assert_eq!(too_deep(deep.as_bytes()), Some(MAX_DEPTH));
        let quoted = format!("{{\"a\": \"{}\\\"\"}}", "[".repeat(1000));
        assert_eq!(too_deep(quoted.as_bytes()), None);
    }

    #[test]
    fn nul_characters_are_refused_with_their_path() {
        let e = parse_value(br#"{"input": {"text": ["ok", "a\u0000b"]}}"#).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("/input/text/1"));
        assert!(parse_value(br#"{"a\u0000": 1}"#).is_err());
        assert!(parse_value(br#"{"text": "fine \\u0000 escaped"}"#).is_ok());
    }

    #[test]
    fn decode_names_the_field() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct T {
            kind: String,
            n: Option<i16>,
        }
        let e = decode::<T>(serde_json::json!({"kind": "a", "n": "x"})).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("/n"));
        let e = decode::<T>(serde_json::json!({"n": 1})).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("/kind"));
        let e = decode::<T>(serde_json::json!({"kind": "a", "zzz": 1})).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("/zzz"));
    }
}
