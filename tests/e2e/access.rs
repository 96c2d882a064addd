//! API tokens and webhook sources through the CLI: tokens are shown once and stored hashed;
//! webhook secrets verify Standard Webhooks signatures, and a rotation keeps the old secret
//! valid for its grace period only.

use agentq_core::db;
use agentq_core::webhook::{self, Secret};
use chrono::Utc;
use serde_json::Value;

use crate::harness::TestApp;

fn lines(out: &std::process::Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test]
async fn tokens_are_shown_once_stored_hashed_and_revocable() {
    let app = TestApp::start().await;
    let created = app.agentq_json(&[
        "tokens", "create", "--tenant", "acme", "--role", "producer", "--as", "ivy", "--json",
    ]);
    let token = created["token"].as_str().unwrap().to_string();
    assert!(
        token.starts_with("agq_") && token.len() >= 4 + 32,
        "{token}"
    );
    assert_eq!(
        (created["tenant"].as_str(), created["role"].as_str()),
        (Some("acme"), Some("producer"))
    );

    // Only the hash is stored: the token appears nowhere in the table.
    let stored: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM api_tokens WHERE api_tokens::text LIKE '%' || $1 || '%'",
    )
    .bind(&token[4..])
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(stored, 0);
    assert_eq!(
        db::access::authenticate(&app.pool, &token).await.unwrap(),
        Some(("acme".into(), "producer".into()))
    );
    assert_eq!(
        db::access::authenticate(&app.pool, "agq_forged")
            .await
            .unwrap(),
        None
    );

    let listed = lines(&app.agentq(&["tokens", "list", "--tenant", "acme", "--json"]));
    assert_eq!(listed.len(), 1);
    assert!(listed[0].get("token").is_none());
    assert!(token.starts_with(listed[0]["prefix"].as_str().unwrap()));

    let id = created["id"].as_str().unwrap();
    assert!(app.agentq(&["tokens", "revoke", id]).status.success());
    assert_eq!(
        db::access::authenticate(&app.pool, &token).await.unwrap(),
        None,
        "revoked"
    );
    assert_eq!(
        app.agentq(&["tokens", "revoke", id]).status.code(),
        Some(2),
        "already revoked"
    );

    for bad in [
        ["--tenant", "acme", "--role", "root"],
        ["--tenant", "", "--role", "admin"],
    ] {
        let mut args = vec!["tokens", "create"];
        args.extend_from_slice(&bad);
        assert_eq!(app.agentq(&args).status.code(), Some(2), "{bad:?}");
    }
    let actions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operator_actions WHERE action LIKE 'token_%'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(actions, 2, "create and revoke are audited");
    app.cleanup().await;
}

#[tokio::test]
async fn webhook_secrets_verify_deliveries_and_rotate_with_a_grace_period() {
    let app = TestApp::start().await;
    let added = app.agentq_json(&[
        "webhooks", "add", "--tenant", "acme", "--source", "crm", "--kind", "echo", "--json",
    ]);
    let old = Secret::parse(added["secret"].as_str().unwrap()).unwrap();
    let body = br#"{"text":"from the crm"}"#;
    let now = Utc::now();
    let verify = |secrets: &[String], signer: &Secret| {
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::parse(s).unwrap()).collect();
        let sig = signer.sign("msg_1", now.timestamp(), body);
        webhook::verify(
            &secrets,
            Some("msg_1"),
            Some(&now.timestamp().to_string()),
            Some(&sig),
            body,
            now,
        )
    };
    let (kind, secrets) = db::access::active_secrets(&app.pool, "acme", "crm")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kind, "echo");
    assert_eq!(verify(&secrets, &old), Ok(()));

    // A rotation with a grace period: old and new both verify.
    let rotated = app.agentq_json(&[
        "webhooks", "rotate", "--tenant", "acme", "--source", "crm", "--grace", "1h", "--json",
    ]);
    let new = Secret::parse(rotated["secret"].as_str().unwrap()).unwrap();
    let (_, secrets) = db::access::active_secrets(&app.pool, "acme", "crm")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(secrets.len(), 2);
    assert_eq!(verify(&secrets, &old), Ok(()));
    assert_eq!(verify(&secrets, &new), Ok(()));

    // Once the grace is over, only the newest verifies.
    let rotated = app.agentq_json(&[
        "webhooks", "rotate", "--tenant", "acme", "--source", "crm", "--grace", "0s", "--json",
    ]);
    let newest = Secret::parse(rotated["secret"].as_str().unwrap()).unwrap();
    let (_, secrets) = db::access::active_secrets(&app.pool, "acme", "crm")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(secrets.len(), 1);
    assert_eq!(verify(&secrets, &newest), Ok(()));
    assert_eq!(verify(&secrets, &old), Err(webhook::Refused::BadSignature));

    // Clear refusals; the listing never shows a secret.
    let dup = app.agentq(&[
        "webhooks", "add", "--tenant", "acme", "--source", "crm", "--kind", "echo",
    ]);
    assert_eq!(dup.status.code(), Some(2));
    let unknown = app.agentq(&[
        "webhooks", "add", "--tenant", "acme", "--source", "x", "--kind", "nope",
    ]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("unknown kind"));
    let missing = app.agentq(&["webhooks", "rotate", "--tenant", "acme", "--source", "none"]);
    assert_eq!(missing.status.code(), Some(2));
    let listed = app.agentq(&["webhooks", "list", "--json"]);
    assert!(!String::from_utf8_lossy(&listed.stdout).contains("whsec_"));
    assert_eq!(lines(&listed)[0]["active_secrets"], 1);
    app.cleanup().await;
}
