//! Standard Webhooks signatures (<https://www.standardwebhooks.com>): secrets in the
//! `whsec_<base64>` form, `v1,<base64 HMAC-SHA256>` signatures over
//! `webhook-id.webhook-timestamp.body`, a ±5 minute timestamp tolerance, and several secrets
//! at once so a rotation never rejects a delivery signed with the previous one.
//!
//! Invariant kept here: a [`Secret`] never prints (its `Debug` is redacted), and signatures are
//! compared in constant time.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// How far a delivery's timestamp may be from now.
pub const TOLERANCE_SECS: i64 = 5 * 60;

/// A signing secret (the decoded key bytes). `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl Secret {
    /// A new random secret (244 random bits from two UUIDv4s).
    pub fn generate() -> Self {
        let mut key = Vec::with_capacity(32);
        key.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
        key.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
        Self(key)
    }

    /// Parses `whsec_<base64>` (the prefix is optional).
    pub fn parse(s: &str) -> Result<Self, String> {
        let b64 = s.strip_prefix("whsec_").unwrap_or(s);
        let key = STANDARD
            .decode(b64)
            .map_err(|_| "a webhook secret is whsec_ followed by base64".to_string())?;
        if key.len() < 16 {
            return Err("a webhook secret must be at least 16 bytes".into());
        }
        Ok(Self(key))
    }

    /// The `whsec_<base64>` form, shown to the user once and stored for verification.
    pub fn expose(&self) -> String {
        format!("whsec_{}", STANDARD.encode(&self.0))
    }

    fn mac(&self, id: &str, timestamp: &str, body: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }

    /// The `v1,<base64>` signature of a delivery.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let tag = self
            .mac(id, &timestamp.to_string(), body)
            .finalize()
            .into_bytes();
        format!("v1,{}", STANDARD.encode(tag))
    }
}

/// Why a delivery was refused (each maps to 401, or 400 for missing headers).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("missing {0} header")]
    MissingHeader(&'static str),
    #[error("webhook-timestamp is not a Unix time in seconds")]
    BadTimestamp,
    #[error("webhook-timestamp is more than 5 minutes from now")]
    StaleTimestamp,
    #[error("no valid v1 signature for this body")]
    BadSignature,
}

/// Verifies a delivery against any of `secrets` (several during a rotation).
pub fn verify(
    secrets: &[Secret],
    id: Option<&str>,
    timestamp: Option<&str>,
    signature: Option<&str>,
    body: &[u8],
    now: DateTime<Utc>,
) -> Result<(), Refused> {
    let id = id
        .filter(|v| !v.is_empty())
        .ok_or(Refused::MissingHeader("webhook-id"))?;
    let ts = timestamp
        .filter(|v| !v.is_empty())
        .ok_or(Refused::MissingHeader("webhook-timestamp"))?;
    let sig = signature
        .filter(|v| !v.is_empty())
        .ok_or(Refused::MissingHeader("webhook-signature"))?;
    let seconds: i64 = ts.trim().parse().map_err(|_| Refused::BadTimestamp)?;
    if (now.timestamp() - seconds).abs() > TOLERANCE_SECS {
        return Err(Refused::StaleTimestamp);
    }
    // The header may list several signatures, space separated, each `version,base64`.
    let candidates: Vec<Vec<u8>> = sig
        .split(' ')
        .filter_map(|s| s.strip_prefix("v1,"))
        .filter_map(|b64| STANDARD.decode(b64).ok())
        .collect();
    for secret in secrets {
        for candidate in &candidates {
            // `verify_slice` compares in constant time.
            if secret
                .mac(id, ts.trim(), body)
                .verify_slice(candidate)
                .is_ok()
            {
                return Ok(());
            }
        }
    }
    Err(Refused::BadSignature)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TS: i64 = 1614265330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SIG: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    fn at(ts: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(ts, 0).unwrap()
    }

    #[test]
    fn the_standard_webhooks_known_answer_vector_signs_and_verifies() {
        let secret = Secret::parse(SECRET).unwrap();
        assert_eq!(secret.sign(ID, TS, BODY), SIG);
        let ok = verify(
            &[secret],
            Some(ID),
            Some("1614265330"),
            Some(SIG),
            BODY,
            at(TS),
        );
        assert_eq!(ok, Ok(()));
    }

    #[test]
    fn tampered_deliveries_are_refused() {
        let s = vec![Secret::parse(SECRET).unwrap()];
        let v = |id, ts, sig, body: &[u8], now| verify(&s, id, ts, sig, body, at(now));
        let mut flipped = BODY.to_vec();
        flipped[3] ^= 1;
        assert_eq!(
            v(Some(ID), Some("1614265330"), Some(SIG), &flipped, TS),
            Err(Refused::BadSignature)
        );
        assert_eq!(
            v(Some("msg_other"), Some("1614265330"), Some(SIG), BODY, TS),
            Err(Refused::BadSignature)
        );
        assert_eq!(
            v(Some(ID), Some("1614265330"), Some(SIG), BODY, TS + 301),
            Err(Refused::StaleTimestamp)
        );
        assert_eq!(
            v(Some(ID), Some("1614265330"), Some(SIG), BODY, TS - 301),
            Err(Refused::StaleTimestamp)
        );
        assert_eq!(
            v(Some(ID), Some("soon"), Some(SIG), BODY, TS),
            Err(Refused::BadTimestamp)
        );
        assert_eq!(
            v(None, Some("1614265330"), Some(SIG), BODY, TS),
            Err(Refused::MissingHeader("webhook-id"))
        );
        assert_eq!(
            v(Some(ID), Some("1614265330"), Some(&SIG[..20]), BODY, TS),
            Err(Refused::BadSignature)
        );
        assert_eq!(
            v(Some(ID), Some("1614265330"), Some("v2,abc"), BODY, TS),
            Err(Refused::BadSignature)
        );
        let wrong = vec![Secret::generate()];
        assert_eq!(
            verify(
                &wrong,
                Some(ID),
                Some("1614265330"),
                Some(SIG),
                BODY,
                at(TS)
            ),
            Err(Refused::BadSignature)
        );
    }

    #[test]
    fn any_listed_signature_and_any_current_secret_will_do() {
        let old = Secret::parse(SECRET).unwrap();
        let new = Secret::generate();
        let header = format!("v1,bm9wZQ== {SIG}");
        let both = vec![new.clone(), old];
        assert_eq!(
            verify(
                &both,
                Some(ID),
                Some("1614265330"),
                Some(&header),
                BODY,
                at(TS)
            ),
            Ok(())
        );
        let sig_new = new.sign(ID, TS, BODY);
        assert_eq!(
            verify(
                &both,
                Some(ID),
                Some("1614265330"),
                Some(&sig_new),
                BODY,
                at(TS)
            ),
            Ok(())
        );
        assert_eq!(format!("{new:?}"), "Secret(***)");
        assert_eq!(Secret::parse(&new.expose()).unwrap(), new);
    }
}
