-- A wait's event says what the job needs: the step event of a wait for a signal that starts
-- carries the `about` the job journaled with it (`ctx.wait_for_signal_about`; the built-in
-- agent's pending tool call: tool, arguments, the model turn's text). The API's event stream
-- serves it with the keys of AGENTQ_CONSOLE_REDACT replaced, as every other view of it does.
-- Other events still carry no inputs, outputs or payloads.

CREATE OR REPLACE FUNCTION agentq_step_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM agentq_append_event(NEW.op_id, 'step', jsonb_strip_nulls(jsonb_build_object(
        'seq', NEW.seq, 'name', NEW.name, 'kind', NEW.kind, 'status', NEW.status,
        'about', CASE WHEN NEW.kind = 'signal' AND NEW.status = 'started'
                      THEN NEW.output -> 'about' END)), true);
    RETURN NULL;
END $$;
