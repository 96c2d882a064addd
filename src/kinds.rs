//! `agentq kinds [KIND] [--json]`: what this binary's registry runs, over
//! `agentq_app::kinds::list` (the flow of `GET /v1/kinds` and the console's Kinds page).

use agentq_app::kinds::{KindView, Kinds};
use serde_json::Value;

use crate::wiring::{Deployment, cli_app, done, refuse};

/// Prints every kind and tool (or one kind with its whole input schema).
pub async fn run(config: Deployment, kind: Option<String>, json: bool) -> anyhow::Result<()> {
    let (app, caller) = cli_app(&config, &None).await?;
    let listed = agentq_app::kinds::list(&app, &caller).await;
    let Kinds { kinds, tools } = done(app, listed).await?;
    if let Some(name) = kind {
        let Some(k) = kinds.iter().find(|k| k.kind.name == name) else {
            let known: Vec<&str> = kinds.iter().map(|k| k.kind.name.as_str()).collect();
            return Err(refuse(format!(
                "unknown kind {name:?}; this binary runs: {}",
                known.join(", ")
            )));
        };
        if json {
            println!("{}", serde_json::to_string(k)?);
        } else {
            print_kind(k);
            println!(
                "  input schema:\n{}",
                serde_json::to_string_pretty(&k.kind.input_schema)?
            );
        }
        return Ok(());
    }
    if json {
        println!("{}", serde_json::to_string(&Kinds { kinds, tools })?);
        return Ok(());
    }
    for k in &kinds {
        print_kind(k);
    }
    if !tools.is_empty() {
        println!("\ntools an agent may name (`\"tools\": [...]`, `\"approval\": [...]`):");
        for t in &tools {
            let mut traits = vec![t.replay.as_str()];
            if t.requires_approval {
                traits.push("always approved first");
            }
            println!(
                "  {:<16} {:<28} {}",
                t.name,
                traits.join(", "),
                t.description
            );
            println!("  {:<16} args: {}", "", fields(&t.parameters));
        }
    }
    println!("\n`agentq kinds KIND` prints a kind's whole input schema; --json prints everything.");
    Ok(())
}

fn print_kind(k: &KindView) {
    let live = if k.live_versions.is_empty() {
        "no live worker runs it".to_string()
    } else {
        format!("live workers run {}", k.live_versions.join(", "))
    };
    println!(
        "{:<16} versions {} ({live}){}",
        k.kind.name,
        k.kind.versions.join(", "),
        match (k.kind.webhook_only, k.kind.for_tests) {
            (true, _) => "; webhook deliveries only",
            (false, true) => "; for tests, demos and benchmarks",
            (false, false) => "",
        }
    );
    if !k.kind.description.is_empty() {
        println!("  {}", k.kind.description);
    }
    if let Some(service) = &k.kind.service {
        println!("  runs in service {service} (`agentq services list`)");
        if k.service_drift {
            println!(
                "  DRIFT: service {service} serves another manifest than registered (`agentq services list` says how)"
            );
        }
    }
    println!("  input: {}", fields(&k.kind.input_schema));
}

/// A schema's top-level fields as one line: `name (type, required), …`.
fn fields(schema: &Value) -> String {
    let Some(props) = schema.get("properties").and_then(Value::as_object) else {
        return type_of(schema);
    };
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let listed: Vec<String> = props
        .iter()
        .map(|(name, s)| {
            let mut t = type_of(s);
            if required.contains(&name.as_str()) {
                t.push_str(", required");
            }
            format!("{name} ({t})")
        })
        .collect();
    if listed.is_empty() {
        "{}".into()
    } else {
        listed.join(", ")
    }
}

/// A short name for the type a schema describes.
fn type_of(s: &Value) -> String {
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        return r.rsplit('/').next().unwrap_or(r).to_string();
    }
    match s.get("type") {
        Some(Value::String(t)) if t == "array" => match s.get("items") {
            Some(items) => format!("array of {}", type_of(items)),
            None => "array".into(),
        },
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" or "),
        _ if s.get("enum").is_some() || s.get("oneOf").is_some() || s.get("anyOf").is_some() => {
            "one of several".into()
        }
        _ if s.get("properties").is_some() => "object".into(),
        _ => "any JSON".into(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_schema_reads_as_one_line_of_fields() {
        let s = json!({
            "type": "object",
            "properties": {
                "text": { "type": "string" },
                "tags": { "type": "array", "items": { "type": "string" } },
                "step": { "$ref": "#/$defs/Step" },
                "note": { "type": ["string", "null"] },
                "any": true
            },
            "required": ["text"]
        });
        assert_eq!(
            fields(&s),
            "any (any JSON), note (string or null), step (Step), tags (array of string), \
             text (string, required)"
        );
    }
}
