// Types of agentq's TypeScript SDK (the package is plain ECMAScript modules: no build step, no
// runtime dependency).

export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** Thrown by a kind: the operation fails at once (dead-lettered). Thrown by a step's function:
 * the step fails with `retryable: false`. */
export class NonRetryable extends Error {}
/** Thrown by an unsafe step's function: its effect certainly did not happen. */
export class NoEffect extends Error {}

export interface OperationInfo {
  id: string;
  kind: string;
  version: string;
  tenant: string;
  attempt: number;
  session: string;
}

export interface ModelMessage {
  role: "system" | "user" | "assistant" | "tool";
  content: string;
  tool_calls?: Json[];
  tool_call_id?: string;
}

export interface ModelRequest {
  messages: ModelMessage[];
  model?: string;
  max_tokens?: number;
  temperature?: number;
  tools?: { name: string; description?: string; parameters?: Json }[];
  tool_choice?: "auto" | "required" | "none" | { tool: string };
}

export interface ModelResponse {
  content: string;
  model?: string;
  finish_reason?: string;
  usage?: { prompt_tokens: number; completion_tokens: number };
  tool_calls?: { id: string; name: string; arguments: Json }[];
}

export type Signal = { payload: Json; sentBy: string | null } | { timedOut: true };

/** What a reconcile found: `null` (the effect did not happen) or that it did, with its output. */
export type Reconciled<T> = null | { happened: true; output: T };

export class Context {
  readonly info: OperationInfo;
  readonly opId: string;
  readonly tenant: string;
  readonly attempt: number;
  readonly replaying: boolean;
  step<T>(name: string, fn: () => T | Promise<T>): Promise<T>;
  unsafeStep<T>(
    name: string,
    fn: (key: string) => T | Promise<T>,
    reconcile?: ((key: string) => Reconciled<T> | Promise<Reconciled<T>>) | null,
  ): Promise<T>;
  model(name: string, request: ModelRequest): Promise<ModelResponse>;
  sleep(seconds: number): Promise<void>;
  waitForSignal(name: string, timeoutSeconds: number): Promise<Signal>;
  spawn(kind: string, input?: Json): Promise<string>;
  join(children: Iterable<string>): Promise<Json[]>;
  now(): Promise<Date>;
  uuid(): Promise<string>;
  patched(changeId: string): Promise<boolean>;
}

export interface KindOptions<I> {
  /** Bump it when the kind's step sequence changes (docs/versions.md). Default "1". */
  version?: string;
  description?: string;
  /** The JSON Schema (draft 2020-12) agentq checks every input against. */
  inputSchema?: Json;
  /** Turns the JSON input into what the kind takes; throw when it does not fit. */
  parse?: (input: Json) => I | Promise<I>;
}

export interface HttpAnswer {
  status: number;
  headers: Record<string, string>;
  body: Uint8Array;
}

export class Service {
  constructor(name: string, options?: { secret?: string | Secret | (string | Secret)[]; maxSessions?: number });
  readonly name: string;
  kind<I = Json, O = Json>(name: string, options: KindOptions<I>, fn: (ctx: Context, input: I) => Promise<O>): this;
  manifest(): Json;
  invoke(request: Json, options?: { dry?: boolean }): Promise<Json>;
  handle(method: string, path: string, headers: Record<string, string>, body: Uint8Array): Promise<HttpAnswer>;
  nodeHandler(): (req: import("node:http").IncomingMessage, res: import("node:http").ServerResponse) => void;
  fetch(request: Request): Promise<Response>;
  listen(port?: number, host?: string): Promise<import("node:http").Server>;
}

export const PROTOCOL: 1;

export class Secret {
  static parse(text: string): Secret;
  static generate(): Secret;
  expose(): string;
  sign(id: string, timestamp: number, body: Uint8Array): string;
}

export class Refused extends Error {}
export function verify(secrets: Secret[], id?: string, timestamp?: string, signature?: string, body?: Uint8Array, now?: number): void;
export function signHeaders(secret: Secret, id: string, body: Uint8Array, now?: number): Record<string, string>;

/** Replays a recorded journal (the JSON Lines of `agentq steps OP --json`, or its rows) against
 * the code at hand, running nothing: `agrees` when the code asks for the journal's steps up to
 * its end or finishes; any error answer diverges, as `agentq replay` decides. */
export function replayJournal(
  service: Service,
  kind: string,
  input: Json,
  journal: string | Json[],
  options?: { version?: string },
): Promise<{ agrees: boolean; answer: Json; steps: number }>;

export const Check: {
  readonly NONDETERMINISM: "nondeterminism";
  readonly RAN_AGAIN: "ran again";
  readonly NO_RECONCILE: "no reconcile";
  readonly WRONG_RECONCILE: "wrong reconcile";
  readonly FAILED: "failed";
};

export type End =
  | { status: "succeeded"; output: Json }
  | { status: "failed"; errorClass: string; message: string };

export interface Violation {
  check: string;
  seq: number | null;
  step: string;
  at: string;
  message: string;
}

/** What `Tester.run` found. */
export class Report {
  readonly outcome: End;
  readonly steps: [number, string, string][];
  readonly crashPoints: number;
  readonly violations: Violation[];
  readonly output: Json | undefined;
  /** No problem found, and the first run did not fail. */
  readonly ok: boolean;
  found(check: string): Violation[];
  /** Throws with the report unless `ok`. */
  assertOk(): void;
}

export type ChildEnd =
  | { status: "succeeded"; result?: Json }
  | { status: "dead"; errorClass?: string; errorMessage?: string }
  | { status: "cancelled" };

/** The replay tester: runs a kind to its end in memory, then again from every crash point of
 * that run, each an operation of its own with its own idempotency keys. */
export class Tester {
  constructor(service: Service, kind: string, input?: Json, options?: { version?: string; tenant?: string });
  version(v: string): this;
  model(script: { replies?: (string | Partial<ModelResponse>)[]; fn?: (request: ModelRequest, n: number) => string | Partial<ModelResponse> }): this;
  signal(name: string, payload?: Json, sentBy?: string): this;
  approve(by?: string, reason?: string | null): this;
  reject(by?: string, reason?: string | null): this;
  child(end: ChildEnd): this;
  children(fn: (kind: string, input: Json) => ChildEnd): this;
  run(): Promise<Report>;
}
