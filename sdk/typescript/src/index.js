// agentq's TypeScript SDK: kinds served over agentq's step protocol (docs/protocol.md).
export { Context, NoEffect, NonRetryable } from "./context.js";
export { Service, PROTOCOL } from "./service.js";
export { Secret, Refused, verify, signHeaders } from "./signing.js";
export { replayJournal } from "./testing.js";
export { Check, Report, Tester } from "./tester.js";
