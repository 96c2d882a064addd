//! `agentq why OP`: the one gate that holds an operation now, or what it is doing, with its
//! evidence (`agentq_app::why`, the answer the API and the console show too).

use crate::wiring::{Deployment, cli_app, cli_error, done};

/// Prints the answer: the headline, then one indented line per piece of evidence; or the one
/// JSON object of `GET /v1/operations/{id}/why`.
pub async fn run(config: Deployment, op: &str, json: bool) -> anyhow::Result<()> {
    let op = agentq_app::operations::parse_id(op).map_err(cli_error)?;
    let (app, caller) = cli_app(&config, &None).await?;
    let answer = agentq_app::why::why(&app, &caller, op).await;
    let why = done(app, answer).await?;
    if json {
        println!("{}", serde_json::to_string(&why)?);
        return Ok(());
    }
    println!("{}", why.headline);
    for line in &why.evidence {
        println!("  {line}");
    }
    Ok(())
}
