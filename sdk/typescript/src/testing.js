// Replaying a recorded journal (the lines of `agentq steps OP --json`) against the code at
// hand without running anything: whether a deploy would replay the operations that wait today.
// It agrees when the code asks for the journal's steps up to its end (or finishes); any error
// answer (a step asked for differently, an input the code cannot parse, the kind throwing)
// diverges, as `agentq replay` decides.
import { randomUUID } from "node:crypto";

export async function replayJournal(service, kind, input, journal, { version = undefined } = {}) {
  const rows = typeof journal === "string"
    ? journal.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l))
    : [...journal];
  rows.sort((a, b) => (a.seq ?? 0) - (b.seq ?? 0));
  const entries = rows.map((e, i) => ({
    seq: i,
    name: e.name,
    kind: e.kind,
    replay: e.replay ?? "safe",
    status: e.status,
    output: e.output ?? null,
    error: e.error ?? null,
  }));
  const versions = service
    .manifest()
    .kinds.filter((k) => k.name === kind)
    .map((k) => k.version)
    .sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
  const session = randomUUID();
  const request = {
    protocol: 1,
    operation: { id: randomUUID(), kind, version: version ?? versions.at(-1) ?? "1", tenant: "replay", attempt: 1 },
    session,
    input,
    journal: { base: 0, entries },
    run: null,
    reconcile: null,
  };
  const answer = await service.invoke(request, { dry: true });
  service.sessions.drop(session);
  return { agrees: answer.type !== "error", answer, steps: entries.length };
}
