//! The registry: what a deployment's own code runs. Job kinds by name and version, each an async
//! function `(JobContext, Input) -> Output` with typed (serde) input and output, the tools its
//! agents may call, and the deployment's own state. One registry is built by the deployment's
//! `main` and handed to every role (`agentq::main(registry)`): the worker runs it, and the
//! producer, the API, the scheduler and the console check inputs against it ([`Catalog`]),
//! beside the kinds of the services an admin registered, which each process adds at run time.
//!
//! A kind's version is a string its author bumps when the kind's step sequence changes (steps
//! added, removed, renamed or reordered), so that an operation recorded by one version is never
//! replayed by another: an operation runs on the version its first claim pinned, and a worker
//! claims only the versions it has. One registry may hold several versions of a kind (the old
//! code kept next to the new until the old operations are gone: `agentq versions` tells when).
//! Versions compare in natural order (`agentq_core::version`); a new operation runs on the
//! newest version a live worker runs.
//!
//! Invariant kept here: an input is checked by decoding it into the kind's own input type, so
//! what an enqueue accepts is exactly what the kind's function can read; a refusal names the
//! field ([`InputError::pointer`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use agentq_core::kinds::{Catalog, InputError, KindInfo, ToolInfo};
use agentq_core::operation::Requires;
use agentq_core::version;

use crate::context::JobContext;
use crate::error::JobError;
use crate::info::decode;
use crate::provided::Provided;
use crate::tool::{self, Tool};

/// A kind's function as the engine calls it: the handle of a run, and the input as JSON.
#[doc(hidden)]
pub type Handler =
    Arc<dyn Fn(JobContext, Value) -> BoxFuture<'static, Result<Value, JobError>> + Send + Sync>;
type Check = Arc<dyn Fn(&Value) -> Result<Requires, InputError> + Send + Sync>;

#[derive(Clone)]
struct Kind {
    /// The handler of each version.
    versions: BTreeMap<String, Handler>,
    /// The input check of the newest version: what producers check an enqueue against.
    check: Check,
    /// The JSON Schema of the newest version's input.
    schema: Value,
    description: String,
    webhook_only: bool,
    for_tests: bool,
}

/// The job kinds a worker can run (and a producer may accept), and the tools its agents may
/// call. agentq's built-in kinds and tools are registered by `agentq_kinds::register_builtin`;
/// a deployment's own next to them, or alone.
///
/// ```
/// use agentq_sdk::{JobContext, JobError, Registry};
///
/// #[derive(serde::Deserialize, schemars::JsonSchema)]
/// struct Greet {
///     name: String,
/// }
///
/// async fn greet(ctx: JobContext, input: Greet) -> Result<String, JobError> {
///     ctx.step("greet", || async move { Ok(format!("hello, {}", input.name)) })
///         .await
/// }
///
/// let mut registry = Registry::new();
/// registry.register("greet", greet).describe("Says hello.");
/// assert!(registry.check_input("greet", &serde_json::json!({ "name": "Ada" })).is_ok());
/// let refused = registry.check_input("greet", &serde_json::json!({ "name": 7 })).unwrap_err();
/// assert!(refused.starts_with("name:"), "{refused}");
/// ```
#[derive(Clone, Default)]
pub struct Registry {
    kinds: BTreeMap<String, Kind>,
    tools: BTreeMap<String, Arc<dyn Tool>>,
    /// The deployment's own state, handed to its kinds and tools by type.
    provided: Provided,
}

/// Further facts about a kind just registered, returned by [`Registry::register`] and
/// [`Registry::register_version`]: chain them, or ignore them.
pub struct KindOptions<'a, I> {
    kind: &'a mut Kind,
    /// The version registered is the kind's newest: its input check is the kind's.
    newest: bool,
    input: PhantomData<fn(I)>,
}

impl<I: DeserializeOwned + 'static> KindOptions<'_, I> {
    /// What the kind does, shown by `agentq kinds`, `GET /v1/kinds` and the console.
    pub fn describe(self, text: &str) -> Self {
        self.kind.description = text.to_string();
        self
    }

    /// Only a verified webhook delivery may create an operation of this kind: its input holds
    /// the webhook source's configuration (a callback URL an admin chose), which a producer
    /// must not be able to supply. Enqueues and spawns of it are refused.
    pub fn webhook_only(self) -> Self {
        self.kind.webhook_only = true;
        self
    }

    /// The kind is for tests, demos and benchmarks, not production tenants' work: `agentq
    /// kinds` and `GET /v1/kinds` say so, and `agentq tenants kinds T --production` allows a
    /// tenant every kind but these.
    pub fn for_tests(self) -> Self {
        self.kind.for_tests = true;
        self
    }

    /// For an input that needs more than its shape: `requires` says what (the stores it
    /// names, the tools it names), and producers refuse an enqueue that does not have it
    /// before anything is written. Applies when the version registered is the newest.
    pub fn requires(self, requires: fn(&I) -> Requires) -> Self {
        if self.newest {
            self.kind.check = Arc::new(move |v: &Value| decode::<I>(v).map(|i| requires(&i)));
        }
        self
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `name` at version [`version::DEFAULT`] (`"1"`). The input is decoded into `I`
    /// (a misfit fails the operation as non-retryable, and producers refuse it up front,
    /// naming the field); `I`'s JSON Schema is what `agentq kinds` shows.
    ///
    /// # Panics
    /// When `name` is not 1–64 letters, digits, `_`, `-` or `.`, or this version of it is
    /// already registered: a programming error, found when the binary starts.
    pub fn register<I, O, F, Fut>(&mut self, name: &str, f: F) -> KindOptions<'_, I>
    where
        I: DeserializeOwned + JsonSchema + Send + 'static,
        O: Serialize + Send + 'static,
        F: Fn(JobContext, I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, JobError>> + Send + 'static,
    {
        self.register_version(name, version::DEFAULT, f)
    }

    /// Registers `version` of `name`: bump it whenever the kind's step sequence changes (for a
    /// change that only some operations may see, see [`JobContext::patched`]). Operations
    /// started on an older version keep running on it wherever a worker registered it; keep
    /// the old function registered next to the new one until `agentq versions` shows none
    /// left. The input check and schema of the kind are the newest version's.
    ///
    /// # Panics
    /// When `name` or `version` is not 1–64 letters, digits, `.`, `_` and `-`, or the version
    /// is already registered for `name`: a programming error, found when the binary starts.
    pub fn register_version<I, O, F, Fut>(
        &mut self,
        name: &str,
        version: &str,
        f: F,
    ) -> KindOptions<'_, I>
    where
        I: DeserializeOwned + JsonSchema + Send + 'static,
        O: Serialize + Send + 'static,
        F: Fn(JobContext, I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, JobError>> + Send + 'static,
    {
        if let Err(e) = check_kind_name(name) {
            panic!("{e}");
        }
        if let Err(e) = version::check(version) {
            panic!("kind {name:?}: {e}");
        }
        let f = Arc::new(f);
        let kind = name.to_string();
        let run: Handler = Arc::new(move |ctx: JobContext, input| {
            let f = f.clone();
            let kind = kind.clone();
            Box::pin(async move {
                let input: I = decode(&input).map_err(|e| {
                    JobError::NonRetryable(format!("input does not fit kind {kind:?}: {e}"))
                })?;
                let out = f(ctx, input).await?;
                serde_json::to_value(out)
                    .map_err(|e| JobError::NonRetryable(format!("output is not JSON: {e}")))
            })
        });
        let check: Check = Arc::new(|v: &Value| decode::<I>(v).map(|_| Requires::default()));
        let schema = input_schema::<I>();
        let entry = self.kinds.entry(name.to_string()).or_insert_with(|| Kind {
            versions: BTreeMap::new(),
            check: check.clone(),
            schema: schema.clone(),
            description: String::new(),
            webhook_only: false,
            for_tests: false,
        });
        assert!(
            !entry.versions.contains_key(version),
            "kind {name:?}: version {version:?} is registered twice"
        );
        let newest = version::newest(entry.versions.keys().map(String::as_str))
            .is_none_or(|n| version::compare(version, n).is_gt());
        if newest {
            entry.check = check;
            entry.schema = schema;
        }
        entry.versions.insert(version.to_string(), run);
        KindOptions {
            kind: entry,
            newest,
            input: PhantomData,
        }
    }

    /// Registers a tool for every kind of this deployment: the `agent` kind may name it in its
    /// `tools` and `approval` lists (an enqueue naming a tool nobody registered is refused),
    /// and any kind finds it with [`JobContext::registered_tool`]. The built-in tools
    /// (`kv_put`, `kv_get`, `ledger`, `http_get`) are registered the same way.
    ///
    /// # Panics
    /// When the tool's name is not 1–64 letters, digits, `_` or `-`, or is taken: a
    /// programming error, found when the binary starts.
    pub fn register_tool(&mut self, tool: impl Tool + 'static) -> &mut Self {
        let name = tool.name().to_string();
        if let Err(e) = tool::check_name(&name) {
            panic!("{e}");
        }
        assert!(
            !self.tools.contains_key(&name),
            "tool {name:?} is registered twice"
        );
        self.tools.insert(name, Arc::new(tool));
        self
    }

    /// Gives the deployment's kinds and tools a value of its own (its database pool, an HTTP
    /// client, its configuration), which a run reads with
    /// [`JobContext::state`] and a tool call with
    /// [`ToolContext::state`](crate::ToolContext::state), by its type. One value per type:
    /// wrap two of one type in types of your own.
    ///
    /// # Panics
    /// If a value of the same type was provided already.
    pub fn provide<T: Send + Sync + 'static>(&mut self, value: T) -> &mut Self {
        assert!(
            self.provided.insert(value),
            "a {} was provided twice",
            std::any::type_name::<T>()
        );
        self
    }

    /// What [`Registry::provide`] was given.
    #[doc(hidden)]
    pub fn provided(&self) -> Provided {
        self.provided.clone()
    }

    /// The registered tool `name`.
    pub fn tool(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.tools.get(name).cloned()
    }

    /// The registered tools, by name.
    pub fn tool_names(&self) -> Vec<String> {
        self.tools.keys().cloned().collect()
    }

    /// The registered tools, by name (what a run looks tools up in).
    #[doc(hidden)]
    pub fn tool_map(&self) -> BTreeMap<String, Arc<dyn Tool>> {
        self.tools.clone()
    }

    /// The registered kind names.
    pub fn kind_names(&self) -> Vec<String> {
        self.kinds.keys().cloned().collect()
    }

    /// Whether `kind` is registered here.
    pub fn has_kind(&self, kind: &str) -> bool {
        self.kinds.contains_key(kind)
    }

    /// Checks that `input` fits `kind` without running anything; the error says where and why.
    pub fn check_input(&self, kind: &str, input: &Value) -> Result<(), String> {
        Catalog::requires(self, kind, input)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Every `(kind, version)` registered.
    pub fn versions(&self) -> Vec<(String, String)> {
        self.kinds
            .iter()
            .flat_map(|(k, kind)| kind.versions.keys().map(|v| (k.clone(), v.clone())))
            .collect()
    }

    /// The newest version of `kind` registered here.
    pub fn newest(&self, kind: &str) -> Option<String> {
        let k = self.kinds.get(kind)?;
        version::newest(k.versions.keys().map(String::as_str)).map(str::to_string)
    }

    /// The function of `version` of `kind`.
    #[doc(hidden)]
    pub fn handler(&self, kind: &str, version: &str) -> Option<Handler> {
        self.kinds.get(kind)?.versions.get(version).cloned()
    }
}

impl Catalog for Registry {
    fn kinds(&self) -> Vec<KindInfo> {
        self.kinds
            .iter()
            .map(|(name, k)| {
                let mut versions: Vec<String> = k.versions.keys().cloned().collect();
                versions.sort_by(|a, b| version::compare(a, b));
                KindInfo {
                    name: name.clone(),
                    versions,
                    webhook_only: k.webhook_only,
                    for_tests: k.for_tests,
                    description: k.description.clone(),
                    input_schema: k.schema.clone(),
                    service: None,
                }
            })
            .collect()
    }

    fn has_kind(&self, kind: &str) -> bool {
        self.kinds.contains_key(kind)
    }

    fn tools(&self) -> Vec<ToolInfo> {
        self.tools
            .values()
            .map(|t| ToolInfo {
                name: t.name().to_string(),
                description: t.description().to_string(),
                parameters: t.parameters(),
                replay: t.replay(),
                requires_approval: t.requires_approval(),
            })
            .collect()
    }

    fn requires(&self, kind: &str, input: &Value) -> Result<Requires, InputError> {
        let Some(k) = self.kinds.get(kind) else {
            return Err(InputError::whole(format!(
                "unknown kind {kind:?}; this deployment runs: {}",
                self.kind_names().join(", ")
            )));
        };
        let mut requires = (k.check)(input)?;
        requires.webhook_only |= k.webhook_only;
        if let Some(unknown) = requires
            .tools
            .iter()
            .find(|t| !self.tools.contains_key(&t.name))
        {
            return Err(InputError::at(
                unknown.pointer.clone(),
                format!(
                    "unknown tool {:?}; this deployment's tools: {} (`agentq kinds` lists them)",
                    unknown.name,
                    self.tool_names().join(", ")
                ),
            ));
        }
        Ok(requires)
    }
}

/// Whether `name` may name a kind: 1–64 letters, digits, `_`, `-` or `.` (it appears in
/// metric labels, URLs and schema names).
fn check_kind_name(name: &str) -> Result<(), String> {
    agentq_core::services::check_name("kind", name)
}

/// The JSON Schema (draft 2020-12) of a kind's input type.
fn input_schema<I: JsonSchema>() -> Value {
    schemars::generate::SchemaSettings::draft2020_12()
        .into_generator()
        .into_root_schema_for::<I>()
        .to_value()
}

#[cfg(test)]
mod tests {
    use agentq_core::operation::ToolRef;
    use serde_json::json;

    use super::*;

    #[derive(serde::Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Input {
        items: Vec<Item>,
        #[serde(default)]
        tools: Vec<String>,
    }

    #[derive(serde::Deserialize, JsonSchema)]
    #[allow(dead_code)]
    struct Item {
        qty: u32,
    }

    async fn run(_ctx: JobContext, _input: Input) -> Result<(), JobError> {
        Ok(())
    }

    fn registry() -> Registry {
        let mut r = Registry::new();
        r.register("order", run)
            .describe("Orders things.")
            .requires(|i| Requires {
                tools: i
                    .tools
                    .iter()
                    .enumerate()
                    .map(|(n, t)| ToolRef {
                        pointer: format!("/tools/{n}"),
                        name: t.clone(),
                    })
                    .collect(),
                ..Requires::default()
            });
        r
    }

    #[test]
    fn a_misfit_input_names_the_field() {
        let r = registry();
        let e = Catalog::requires(
            &r,
            "order",
            &json!({ "items": [{ "qty": 1 }, { "qty": "x" }] }),
        )
        .unwrap_err();
        assert_eq!(e.pointer, "/items/1/qty", "{e}");
        let e = Catalog::requires(&r, "order", &json!({ "items": [], "bogus": 1 })).unwrap_err();
        assert!(e.message.contains("unknown field \"bogus\""), "{e}");
    }

    #[test]
    fn an_input_naming_an_unregistered_tool_is_refused_there() {
        let r = registry();
        let e = Catalog::requires(&r, "order", &json!({ "items": [], "tools": ["refund"] }))
            .unwrap_err();
        assert_eq!(e.pointer, "/tools/0");
        assert!(e.message.contains("unknown tool \"refund\""), "{e}");
    }

    #[test]
    fn the_catalog_shows_versions_in_natural_order_and_the_input_schema() {
        let mut r = registry();
        r.register_version("order", "10", run);
        r.register_version("order", "2", run).webhook_only();
        let kinds = Catalog::kinds(&r);
        assert_eq!(kinds[0].versions, ["1", "2", "10"]);
        assert!(kinds[0].webhook_only);
        assert_eq!(kinds[0].description, "Orders things.");
        assert_eq!(kinds[0].input_schema["type"], "object");
        assert!(kinds[0].input_schema["properties"]["items"].is_object());
    }

    #[test]
    #[should_panic(expected = "registered twice")]
    fn a_tool_name_is_registered_once() {
        struct T;
        #[async_trait::async_trait]
        impl Tool for T {
            fn name(&self) -> &str {
                "t"
            }
            fn replay(&self) -> tool::Replay {
                tool::Replay::Safe
            }
            async fn call(
                &self,
                _cx: &tool::ToolContext<'_>,
                _args: &Value,
            ) -> Result<Value, JobError> {
                Ok(Value::Null)
            }
        }
        let mut r = Registry::new();
        r.register_tool(T);
        r.register_tool(T);
    }
}
