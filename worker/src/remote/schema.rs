//! A remote kind's input schema: the JSON Schema its manifest gives, compiled once, and the
//! check of an input against it that names the place of the first misfit.

use std::sync::Arc;

use agentq_core::kinds::InputError;
use serde_json::Value;

/// A remote kind's input schema, compiled once (draft 2020-12).
#[derive(Clone)]
pub struct InputSchema {
    schema: Value,
    validator: Arc<jsonschema::Validator>,
}

impl std::fmt::Debug for InputSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputSchema")
            .field("schema", &self.schema)
            .finish()
    }
}

impl InputSchema {
    /// Compiles `schema` (draft 2020-12), or says why it is not one.
    pub fn compile(schema: &Value) -> Result<Self, String> {
        let validator = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .build(schema)
            .map_err(|e| format!("is not a JSON Schema: {e}"))?;
        Ok(Self {
            schema: schema.clone(),
            validator: Arc::new(validator),
        })
    }

    /// The schema as the service gave it.
    pub fn schema(&self) -> &Value {
        &self.schema
    }

    /// Checks `input`; the first misfit names its place.
    pub fn check(&self, input: &Value) -> Result<(), InputError> {
        match self.validator.iter_errors(input).next() {
            None => Ok(()),
            Some(e) => Err(InputError::at(
                e.instance_path().as_str().to_string(),
                e.to_string(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn an_input_misfit_names_its_place() {
        let s = InputSchema::compile(&json!({"type": "object", "properties": {
            "order": {"type": "string"}}, "required": ["order"]}))
        .unwrap();
        assert!(s.check(&json!({"order": "A"})).is_ok());
        let e = s.check(&json!({"order": 7})).unwrap_err();
        assert_eq!(e.pointer, "/order");
        assert!(s.check(&json!({})).unwrap_err().message.contains("order"));
    }
}
