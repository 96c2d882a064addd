//! An operation a person or service asks for, debounced or not: the one flow both front ends
//! call (it sits above `operations` and `debounce`, which it chooses between).

use agentq_core::operation::OperationId;
use agentq_core::state::Status;

use crate::operations::EnqueueRequest;
use crate::{App, Caller, Result};

/// What [`operation`] answers.
#[derive(Clone, Debug)]
pub struct Created {
    pub op_id: OperationId,
    /// False when an operation the request names already existed (a repeated key, or a
    /// debounce joined a pending one).
    pub created: bool,
    pub status: Status,
    /// Where the request was debounced: what the pending operation kept.
    pub debounce: Option<crate::debounce::Answer>,
}

/// An operation a person or service asks for (the CLI's `enqueue`, the API's
/// `POST /v1/operations`): debounced on `debounce` where it names one
/// ([`crate::debounce::enqueue`]), else enqueued ([`crate::operations::enqueue`]). The one
/// flow both front ends call, so neither decides on its own which of the two runs.
pub async fn operation(
    app: &App,
    caller: &Caller,
    req: EnqueueRequest,
    debounce: Option<&agentq_core::db::debounce::Spec>,
) -> Result<Created> {
    Ok(match debounce {
        Some(spec) => {
            let d = crate::debounce::enqueue(app, caller, req, spec).await?;
            Created {
                op_id: d.op_id,
                created: d.created,
                status: d.status,
                debounce: Some(d.debounce),
            }
        }
        None => {
            let e = crate::operations::enqueue(app, caller, req).await?;
            Created {
                op_id: e.op_id,
                created: e.created,
                status: e.status,
                debounce: None,
            }
        }
    })
}
