//! The `echo` kind: input `{"text": …}`; one model step through the configured model client
//! (the built-in local model echoes the text); output `{"text": …}`.

use agentq_worker::model::ModelRequest;
use agentq_worker::{JobContext, JobError};
use serde::{Deserialize, Serialize};

/// Input of `echo`.
#[derive(Debug, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EchoInput {
    pub text: String,
}

/// Output of `echo`.
#[derive(Debug, Deserialize, Serialize)]
pub struct EchoOutput {
    pub text: String,
}

/// Sends the text to the model and returns its answer.
pub async fn echo(ctx: JobContext, input: EchoInput) -> Result<EchoOutput, JobError> {
    let answer = ctx.model("echo", ModelRequest::user(input.text)).await?;
    Ok(EchoOutput {
        text: answer.content,
    })
}
