// The context a kind's code calls (ctx.step, ctx.model, …) and the replay behind it
// (docs/protocol.md). Each invoke runs the kind's function from the top against the journal
// agentq sent. A call whose position holds a `completed` entry of the same name and kind
// returns the recorded output; the first call at a position that is not completed halts the
// run: it records what that call asks for (the answer) and returns a promise that never
// settles, so the kind's code stops there without an exception its own try/catch could take.

/** Thrown by a kind: the operation fails at once (dead-lettered, class `non_retryable`).
 * Thrown by a step's function: the step's error says `retryable: false`. */
export class NonRetryable extends Error {}

/** Thrown by an unsafe step's function: its effect certainly did not happen, so the step may
 * run again. Any other failure leaves its outcome unknown, and the next run reconciles it. */
export class NoEffect extends Error {}

const NEVER = new Promise(() => {});

/** `TypeName: message` (no stack). */
export function errorText(e) {
  if (!(e instanceof Error)) return String(e);
  const name = e.name !== "Error" ? e.name : e.constructor?.name || "Error";
  return e.message ? `${name}: ${e.message}` : name;
}

/** A value as its JSON (undefined becomes null); throws a TypeError for what JSON cannot hold. */
export function jsonable(value) {
  if (value === undefined) return null;
  const text = JSON.stringify(value);
  if (text === undefined) throw new TypeError("not representable as JSON");
  return JSON.parse(text);
}

function seconds(value, what) {
  if (typeof value !== "number" || Number.isNaN(value)) {
    throw new TypeError(`${what} must be a number of seconds`);
  }
  if (value < 0) throw new RangeError(`${what} must not be negative`);
  return Math.ceil(value);
}

function stepError(seq, name, message, { retryable = true, noEffect = false } = {}) {
  return { type: "step", seq, name, error: { message, retryable, no_effect: noEffect } };
}

export class Context {
  #journal;
  #run;
  #reconcile;
  #seq = 0;
  #inStep = false;
  #halted;

  /** @internal */
  constructor(info, journal, { run = null, reconcile = null, dry = false } = {}) {
    this.info = info;
    this.#journal = journal;
    this.#run = run;
    this.#reconcile = reconcile;
    this.dry = dry;
    /** The answer the run stopped with, once it stopped. @internal */
    this.answer = null;
    this.halted = new Promise((resolve) => {
      this.#halted = resolve;
    });
  }

  get opId() {
    return this.info.id;
  }

  get tenant() {
    return this.info.tenant;
  }

  get attempt() {
    return this.info.attempt;
  }

  /** Whether the next call's position is journaled as completed already. */
  get replaying() {
    const e = this.#journal[this.#seq];
    return e !== undefined && e.status === "completed";
  }

  #halt(answer) {
    if (this.answer === null) {
      this.answer = answer;
      this.#halted(answer);
    }
    return NEVER;
  }

  #passPatchMarkers() {
    for (;;) {
      const e = this.#journal[this.#seq];
      if (e === undefined || e.kind !== "patch" || e.status !== "completed") return;
      this.#seq += 1;
    }
  }

  /** The next position: [seq, the completed entry to replay or null, or a halt]. */
  /** Whether a context call may be made now: false once the run stopped (the call then halts
   * too); throws inside a step's function. */
  #callable(call, name) {
    if (this.answer !== null) return false;
    if (this.#inStep) {
      throw new Error(
        `ctx.${call}(${JSON.stringify(name)}) was called inside a step's function: a step's function must not call the context`,
      );
    }
    return true;
  }

  #next(name, kind, call) {
    if (!this.#callable(call, name)) return [0, null, NEVER];
    this.#passPatchMarkers();
    const seq = this.#seq;
    this.#seq += 1;
    const entry = this.#journal[seq];
    if (entry !== undefined) {
      if (entry.name !== name || entry.kind !== kind) {
        return [
          seq,
          null,
          this.#halt({
            type: "error",
            class: "nondeterminism",
            message: `step ${seq}: the journal recorded ${entry.name} (${entry.kind}), the code asked for ${name} (${kind})`,
          }),
        ];
      }
      if (entry.status === "completed") return [seq, entry, null];
    }
    return [seq, null, null];
  }

  async #runFn(fn, ...args) {
    this.#inStep = true;
    try {
      return await fn(...args);
    } finally {
      this.#inStep = false;
    }
  }

  #outputOr(seq, name, raw) {
    try {
      return [jsonable(raw), null];
    } catch (e) {
      return [null, this.#halt(stepError(seq, name, `the output of step ${name} is not JSON: ${errorText(e)}`, { retryable: false }))];
    }
  }

  /** A safe step: `fn()` runs here, once per completed journal entry; a replay returns its
   * recorded output. Safe means running it again after a crash is harmless. */
  async step(name, fn) {
    const [seq, entry, halt] = this.#next(name, "custom", "step");
    if (halt) return halt;
    if (entry) return entry.output;
    if (this.dry) return this.#halt({ type: "step", seq, name });
    let raw;
    try {
      raw = await this.#runFn(fn);
    } catch (e) {
      if (e instanceof NonRetryable) return this.#halt(stepError(seq, name, e.message || "NonRetryable", { retryable: false }));
      if (e instanceof NoEffect) return this.#halt(stepError(seq, name, errorText(e), { noEffect: true }));
      return this.#halt(stepError(seq, name, errorText(e)));
    }
    const [output, bad] = this.#outputOr(seq, name, raw);
    if (bad) return bad;
    return this.#halt({ type: "step", seq, name, output });
  }

  /** An unsafe step: an effect that must never happen twice. `fn(key)` runs at most once per
   * journal entry, `key` the step's idempotency key (stable across crashes: pass it to the
   * outside system). After a crash that lost its outcome, agentq asks `reconcile(key)`, which
   * returns `null` (it did not happen: the step runs) or `{ happened: true, output }`. Without
   * a reconcile such a step stops the operation as `unknown_side_effect` for a human. Throw
   * NoEffect from `fn` when the effect certainly did not happen. */
  async unsafeStep(name, fn, reconcile = null) {
    const [seq, entry, halt] = this.#next(name, "custom", "unsafeStep");
    if (halt) return halt;
    if (entry) return entry.output;
    if (this.dry) return this.#halt({ type: "unsafe", seq, name, reconcile: reconcile !== null });
    const run = this.#run && this.#run.seq === seq ? this.#run : null;
    const rec = this.#reconcile && this.#reconcile.seq === seq ? this.#reconcile : null;
    if (run) {
      const key = String(run.key);
      let raw;
      try {
        raw = await this.#runFn(fn, key);
      } catch (e) {
        if (e instanceof NoEffect) return this.#halt(stepError(seq, name, errorText(e), { noEffect: true }));
        if (e instanceof NonRetryable) return this.#halt(stepError(seq, name, e.message || "NonRetryable", { retryable: false }));
        return this.#halt(stepError(seq, name, errorText(e)));
      }
      const [output, bad] = this.#outputOr(seq, name, raw);
      if (bad) return bad;
      return this.#halt({ type: "step", seq, name, output });
    }
    if (rec) {
      if (reconcile === null) return this.#halt({ type: "reconciled", seq, unsupported: true });
      let found;
      try {
        found = await this.#runFn(reconcile, String(rec.key));
      } catch (e) {
        return this.#halt({ type: "error", class: "retryable", message: `the reconcile of step ${name} failed: ${errorText(e)}` });
      }
      if (found === null || found === undefined || found.happened === false) {
        return this.#halt({ type: "reconciled", seq, happened: false });
      }
      const [output, bad] = this.#outputOr(seq, name, found.output);
      if (bad) return bad;
      return this.#halt({ type: "reconciled", seq, happened: true, output });
    }
    return this.#halt({ type: "unsafe", seq, name, reconcile: reconcile !== null });
  }

  /** A model call through agentq's gate (breaker, limits, budgets, usage): `request` is
   * `{ messages, model?, max_tokens?, temperature?, tools?, tool_choice? }`. Returns the
   * response (`content`, `model`, `finish_reason`, `usage`, `tool_calls`?). */
  async model(name, request) {
    if (!request || !Array.isArray(request.messages)) {
      throw new TypeError("ctx.model needs a request with a list of messages");
    }
    const [seq, entry, halt] = this.#next(name, "model", "model");
    if (halt) return halt;
    if (entry) return entry.output;
    return this.#halt({ type: "model", seq, name, request: jsonable(request) });
  }

  /** A durable sleep (whole seconds, rounded up): the operation parks `sleeping`. */
  async sleep(secs) {
    const s = seconds(secs, "ctx.sleep's duration");
    const [seq, entry, halt] = this.#next("sleep", "sleep", "sleep");
    if (halt) return halt;
    if (entry) return undefined;
    return this.#halt({ type: "sleep", seq, seconds: s });
  }

  /** Waits (parked `waiting`, holding no worker) for the signal `name` (`agentq approve` sends
   * `approval`) or until `timeoutSecs` pass: `{ payload, sentBy }` or `{ timedOut: true }`. */
  async waitForSignal(name, timeoutSecs) {
    const s = seconds(timeoutSecs, "ctx.waitForSignal's timeout");
    const [seq, entry, halt] = this.#next(`signal:${name}`, "signal", "waitForSignal");
    if (halt) return halt;
    if (entry) {
      const out = entry.output || {};
      return out.timed_out ? { timedOut: true } : { payload: out.payload ?? null, sentBy: out.sent_by ?? null };
    }
    return this.#halt({ type: "signal", seq, name, timeout_seconds: s });
  }

  /** Starts a child operation of `kind` (checked as an enqueue is); returns its id. */
  async spawn(kind, input = null) {
    const [seq, entry, halt] = this.#next(`spawn:${kind}`, "spawn", "spawn");
    if (halt) return halt;
    if (entry) return String(entry.output);
    return this.#halt({ type: "spawn", seq, kind, input: jsonable(input) });
  }

  /** Parks until every named child finished; their outcomes in the order asked. */
  async join(children) {
    const ids = [...new Set([...children].map(String))];
    const [seq, entry, halt] = this.#next("join", "join", "join");
    if (halt) return halt;
    if (entry) return entry.output || [];
    return this.#halt({ type: "join", seq, children: ids });
  }

  /** The worker's clock, journaled. */
  async now() {
    const [seq, entry, halt] = this.#next("now", "now", "now");
    if (halt) return halt;
    if (entry) return new Date(entry.output);
    return this.#halt({ type: "now", seq });
  }

  /** A random UUID, journaled. */
  async uuid() {
    const [seq, entry, halt] = this.#next("uuid", "now", "uuid");
    if (halt) return halt;
    if (entry) return String(entry.output);
    return this.#halt({ type: "uuid", seq });
  }

  /** Whether this execution takes the new path of a change made without a new version: true
   * on a first execution of this point (agentq journals a `patch` marker) and on replays of
   * journals recorded with it; false when replaying a journal recorded before the change. */
  async patched(changeId) {
    if (!this.#callable("patched", changeId)) return NEVER;
    let seq = this.#seq;
    for (;;) {
      const e = this.#journal[seq];
      if (e === undefined || e.status === "failed") break;
      if (e.kind === "patch" && e.name === changeId) {
        this.#seq = seq + 1;
        return true;
      }
      if (e.kind === "patch") {
        seq += 1;
        continue;
      }
      return false;
    }
    this.#seq = seq + 1;
    return this.#halt({ type: "patch", seq, name: changeId });
  }
}
