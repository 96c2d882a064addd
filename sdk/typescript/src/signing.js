// Standard Webhooks signatures, as agentq signs them: a secret is `whsec_` + base64 of at least
// 16 bytes; a signature is `v1,` + base64 of HMAC-SHA256 over `{id}.{timestamp}.{body}`; a
// timestamp more than 5 minutes from now is refused; a header may list several signatures,
// space separated; signatures are compared in constant time. A Secret never prints its key.
import { createHmac, randomBytes, timingSafeEqual } from "node:crypto";

export const TOLERANCE_SECS = 5 * 60;

/** Why a signed request was refused. */
export class Refused extends Error {}

export class Secret {
  #key;

  constructor(key) {
    if (!(key instanceof Uint8Array) || key.length < 16) {
      throw new Error("a webhook secret must be at least 16 bytes");
    }
    this.#key = Buffer.from(key);
  }

  /** Parses `whsec_<base64>` (the prefix is optional). */
  static parse(text) {
    let b64 = String(text).trim();
    if (b64.startsWith("whsec_")) b64 = b64.slice("whsec_".length);
    if (!/^[A-Za-z0-9+/]+={0,2}$/.test(b64)) {
      throw new Error("a webhook secret is whsec_ followed by base64");
    }
    return new Secret(Buffer.from(b64, "base64"));
  }

  static generate() {
    return new Secret(randomBytes(32));
  }

  /** The `whsec_<base64>` form. */
  expose() {
    return "whsec_" + this.#key.toString("base64");
  }

  mac(id, timestamp, body) {
    return createHmac("sha256", this.#key)
      .update(`${id}.${timestamp}.`)
      .update(body)
      .digest();
  }

  sign(id, timestamp, body) {
    return "v1," + this.mac(id, String(Math.trunc(timestamp)), body).toString("base64");
  }

  toString() {
    return "Secret(***)";
  }

  toJSON() {
    return "Secret(***)";
  }

  [Symbol.for("nodejs.util.inspect.custom")]() {
    return "Secret(***)";
  }
}

/** Secrets from a `whsec_…` string (several, space separated: a rotation), a Secret, or a list. */
export function parseSecrets(value) {
  if (value === undefined || value === null) return [];
  if (value instanceof Secret) return [value];
  if (typeof value === "string") return value.split(/\s+/).filter(Boolean).map((p) => Secret.parse(p));
  return [...value].flatMap((v) => parseSecrets(v));
}

/** Throws Refused unless one of `signature`'s v1 signatures is one of `secrets`' over the body. */
export function verify(secrets, id, timestamp, signature, body, now = Date.now() / 1000) {
  if (!id) throw new Refused("missing webhook-id header");
  if (!timestamp) throw new Refused("missing webhook-timestamp header");
  if (!signature) throw new Refused("missing webhook-signature header");
  const ts = String(timestamp).trim();
  if (!/^-?\d+$/.test(ts)) throw new Refused("webhook-timestamp is not a Unix time in seconds");
  if (Math.abs(Math.trunc(now) - Number(ts)) > TOLERANCE_SECS) {
    throw new Refused("webhook-timestamp is more than 5 minutes from now");
  }
  const candidates = signature
    .split(" ")
    .filter((p) => p.startsWith("v1,"))
    .map((p) => Buffer.from(p.slice(3), "base64"));
  for (const secret of secrets) {
    const expected = secret.mac(id, ts, body);
    for (const c of candidates) {
      if (c.length === expected.length && timingSafeEqual(c, expected)) return;
    }
  }
  throw new Refused("no valid v1 signature for this body");
}

/** The three Standard Webhooks headers for `body` signed as message `id`. */
export function signHeaders(secret, id, body, now = Date.now() / 1000) {
  const ts = Math.trunc(now);
  return {
    "webhook-id": id,
    "webhook-timestamp": String(ts),
    "webhook-signature": secret.sign(id, ts, body),
  };
}
