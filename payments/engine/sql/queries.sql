-- The fence's statements, each a block under its `-- name --` line, written out whole:
-- no statement is made by editing another's text. payments/engine/sql/__init__.py reads
-- them once, at import; payments/engine/fence.py runs them. Parameters are bound
-- (%(name)s). Each statement's comment says its transition.
--
-- A transition on a worker's path is ONE data-modifying statement: the row lock, the
-- compare-and-set, the change and its audit row travel together. Its WHERE clause
-- accepts exactly the from-states the transition table allows (passed as
-- %(from_states)s, from payments.engine.transitions); when it changes nothing, the
-- fence's Python check on a fresh read raises with both states.
-- String parameters are cast (`::text`): a prepared statement types each parameter once,
-- and one used both as a column's value and in a comparison would otherwise get two.
-- An UPDATE joined to its locked row (`FROM old`) also names the row by its id
-- parameter: planned on a table without statistics (new, or emptied), the join alone
-- may become a scan of the whole table, kept by the prepared statement's plan as the
-- table grows (tests/engine/test_plans.py).
-- Every statement names the columns it returns (no `*` of a table): a column a migration
-- adds cannot change a prepared statement's result; tests/engine/test_queries.py checks
-- the lists against the models.

-- db_now --
-- PostgreSQL's clock (the transaction's start inside one): the only clock for leases.
SELECT now()

-- record_event --
-- One audit row, stamped by the database's clock like every statement below, with the
-- provider requests behind it (NULL: none).
INSERT INTO {OperationEvent}
    (operation_id, step, from_state, to_state, actor, reason, requests, created_at)
VALUES (%(operation)s, %(step)s, %(from_state)s, %(to_state)s, %(actor)s, %(reason)s,
        %(requests)s::jsonb, statement_timestamp())

-- create_operation --
-- Create an operation (none -> pending), audited; a key already taken returns nothing.
WITH created AS (
    INSERT INTO {Operation} (
        key, scope, tenant, parent_id, retry_of_id, kind, entity_type, entity_id, params,
        fingerprint, state, attempts, last_error, lease_owner, job_id, dispatched_at,
        created_at, updated_at
    )
    VALUES (
        %(key)s::text, %(scope)s::text, %(tenant)s::text, %(parent)s, %(retry_of)s, %(kind)s::text,
        %(entity_type)s::text, %(entity_id)s::text, %(params)s::jsonb, %(fingerprint)s::text,
        'pending', 0, '', '', %(job_id)s::text,
        CASE WHEN %(job_id)s::text <> '' THEN statement_timestamp() END,
        statement_timestamp(), statement_timestamp()
    )
    ON CONFLICT ON CONSTRAINT {Operation.KEY_CONSTRAINT} DO NOTHING
    RETURNING id, key, scope, tenant, kind, entity_type, entity_id, params, fingerprint,
              state, attempts, last_error, next_attempt_at, lease_owner, lease_expires_at,
              job_id, dispatched_at, result, retry_of_id, parent_id, created_at, updated_at, purged_at
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, created_at)
    SELECT id, '', '', 'pending', %(actor)s::text, 'created', statement_timestamp() FROM created
)
SELECT id, key, scope, tenant, kind, entity_type, entity_id, params, fingerprint,
       state, attempts, last_error, next_attempt_at, lease_owner, lease_expires_at,
       job_id, dispatched_at, result, retry_of_id, parent_id, created_at, updated_at, purged_at
FROM created

-- read_entity --
-- The operation's entity when it is one of a handler's model's rows (entity_type is the
-- model's name, entity_id its key as text), else nothing. The one template: the model is
-- the handler's, unknown here, so its columns, table and key ({columns}, {table}, {pk})
-- are composed in as identifiers by psycopg.sql (fence._read_entity_sql), once per model,
-- and so are the test that entity_id can be the key and its cast to the key's type
-- ({key_test}, {key}: fence.ENTITY_KEYS, one pair per kind of key: integer, UUID, text),
-- so that a text that is no key reads nothing instead of failing the cast.
SELECT {columns} FROM {table}
WHERE {pk} = (
    SELECT CASE WHEN entity_type = %(entity_type)s::text AND {key_test} THEN {key} END
    FROM {Operation} WHERE id = %(id)s
)

-- acquire_lease --
-- pending | retrying | running (its lease run out, or this owner's) -> running, audited;
-- with the steps claimed so far. With %(async_commit)s (its own transaction, never a
-- caller's), a lease taken commits without waiting for its WAL to be flushed
-- (`synchronous_commit` off for this transaction only): the claim that fences a call
-- commits synchronously after it, which flushes the lease's WAL too, and a lease lost
-- with the server's unflushed WAL leaves the operation as it was (the sweeper sends it).
-- A lease that carries its run's first claim (insert_claim_with_lease, after it in its
-- transaction) goes without %(async_commit)s: that claim fences a call.
WITH old AS (
    SELECT id, state FROM {Operation} WHERE id = %(id)s FOR UPDATE
), leased AS (
    UPDATE {Operation} AS op
    SET state = 'running', lease_owner = %(owner)s::text,
        lease_expires_at = statement_timestamp() + make_interval(secs => %(seconds)s),
        next_attempt_at = NULL, updated_at = statement_timestamp()
    FROM old
    WHERE op.id = %(id)s AND op.id = old.id
      AND old.state = ANY(%(from_states)s)
      AND NOT (old.state = 'running' AND op.lease_owner <> %(owner)s::text
               AND COALESCE(op.lease_expires_at > statement_timestamp(), false))
    RETURNING op.id, op.key, op.scope, op.tenant, op.kind, op.entity_type, op.entity_id,
              op.params, op.fingerprint, op.state, op.attempts, op.last_error,
              op.next_attempt_at, op.lease_owner, op.lease_expires_at, op.job_id,
              op.dispatched_at, op.result, op.retry_of_id, op.parent_id, op.created_at,
              op.updated_at, op.purged_at, old.state AS from_state, statement_timestamp() AS db_now
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, created_at)
    SELECT id, '', from_state, 'running', %(owner)s::text,
           CASE WHEN from_state = 'running' THEN 'lease expired; taken over' ELSE '' END,
           statement_timestamp()
    FROM leased
)
SELECT id, key, scope, tenant, kind, entity_type, entity_id, params, fingerprint,
       state, attempts, last_error, next_attempt_at, lease_owner, lease_expires_at,
       job_id, dispatched_at, result, retry_of_id, parent_id, created_at, updated_at, purged_at,
       from_state, db_now,
       ARRAY(SELECT step FROM {StepClaim} WHERE operation_id = leased.id) AS claimed_steps,
       set_config('synchronous_commit',
                  CASE WHEN %(async_commit)s THEN 'off'
                       ELSE current_setting('synchronous_commit') END,
                  true) AS commit_mode
FROM leased

-- release_held_lease --
-- running (held by this owner) -> a run's outcome, lease dropped, audited. Each of the
-- columns a release may set besides the state and the lease (last_error,
-- next_attempt_at, attempts, result) is set only when its %(set_...)s flag is true.
WITH old AS (
    SELECT id, state FROM {Operation}
    WHERE id = %(id)s AND state = 'running' AND lease_owner = %(owner)s::text
    FOR UPDATE
), released AS (
    UPDATE {Operation} AS op
    SET state = %(to_state)s::text, lease_owner = '', lease_expires_at = NULL,
        updated_at = statement_timestamp(),
        last_error = CASE WHEN %(set_last_error)s::boolean THEN %(last_error)s::text
                          ELSE op.last_error END,
        next_attempt_at = CASE WHEN %(set_next_attempt_at)s::boolean
                               THEN %(next_attempt_at)s::timestamptz
                               ELSE op.next_attempt_at END,
        attempts = CASE WHEN %(set_attempts)s::boolean THEN %(attempts)s::integer
                        ELSE op.attempts END,
        result = CASE WHEN %(set_result)s::boolean THEN %(result)s::jsonb ELSE op.result END
    FROM old
    WHERE op.id = %(id)s AND op.id = old.id
      AND op.state = 'running' AND op.lease_owner = %(owner)s::text
    RETURNING op.id, op.key, op.scope, op.tenant, op.kind, op.entity_type, op.entity_id,
              op.params, op.fingerprint, op.state, op.attempts, op.last_error,
              op.next_attempt_at, op.lease_owner, op.lease_expires_at, op.job_id,
              op.dispatched_at, op.result, op.retry_of_id, op.parent_id, op.created_at,
              op.updated_at, op.purged_at, old.state AS from_state
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, created_at)
    SELECT id, '', from_state, %(to_state)s::text, %(owner)s::text, %(reason)s::text,
           statement_timestamp()
    FROM released
)
SELECT id, key, scope, tenant, kind, entity_type, entity_id, params, fingerprint,
       state, attempts, last_error, next_attempt_at, lease_owner, lease_expires_at,
       job_id, dispatched_at, result, retry_of_id, parent_id, created_at, updated_at, purged_at,
       from_state
FROM released

-- succeed_message --
-- A message's operation (pending | retrying | failed, ...) -> succeeded, audited; locks it.
WITH old AS (
    SELECT id, state FROM {Operation} WHERE id = %(id)s FOR UPDATE
), succeeded AS (
    UPDATE {Operation} AS op
    SET state = 'succeeded', next_attempt_at = NULL, updated_at = statement_timestamp()
    FROM old
    WHERE op.id = %(id)s AND op.id = old.id AND old.state = ANY(%(from_states)s)
    RETURNING op.id, op.key, op.scope, op.tenant, op.kind, op.entity_type, op.entity_id,
              op.params, op.fingerprint, op.state, op.attempts, op.last_error,
              op.next_attempt_at, op.lease_owner, op.lease_expires_at, op.job_id,
              op.dispatched_at, op.result, op.retry_of_id, op.parent_id, op.created_at,
              op.updated_at, op.purged_at, old.state AS from_state
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, created_at)
    SELECT id, '', from_state, 'succeeded', %(actor)s::text, %(reason)s::text,
           statement_timestamp()
    FROM succeeded
)
SELECT id, key, scope, tenant, kind, entity_type, entity_id, params, fingerprint,
       state, attempts, last_error, next_attempt_at, lease_owner, lease_expires_at,
       job_id, dispatched_at, result, retry_of_id, parent_id, created_at, updated_at, purged_at,
       from_state
FROM succeeded

-- deliver_message --
-- A message's first delivery: its inbox row (as inbox.services.record_message writes it)
-- and its operation -> succeeded, audited and locked, in one statement. A redelivery
-- (the row exists) changes nothing. Always one row: `recorded`, and the operation's
-- columns when it succeeded (NULL when its state may not succeed).
WITH inbox AS (
    INSERT INTO {InboxEntry} (consumer, message_id, handled_at)
    VALUES (%(consumer)s::text, %(message_id)s::text, %(handled_at)s)
    ON CONFLICT (consumer, message_id) DO NOTHING
    RETURNING id
), old AS (
    SELECT id, state FROM {Operation}
    WHERE id = %(id)s AND EXISTS (SELECT 1 FROM inbox)
    FOR UPDATE
), succeeded AS (
    UPDATE {Operation} AS op
    SET state = 'succeeded', next_attempt_at = NULL, updated_at = statement_timestamp()
    FROM old
    WHERE op.id = %(id)s AND op.id = old.id AND old.state = ANY(%(from_states)s)
    RETURNING op.id, op.key, op.scope, op.tenant, op.kind, op.entity_type, op.entity_id,
              op.params, op.fingerprint, op.state, op.attempts, op.last_error,
              op.next_attempt_at, op.lease_owner, op.lease_expires_at, op.job_id,
              op.dispatched_at, op.result, op.retry_of_id, op.parent_id, op.created_at,
              op.updated_at, op.purged_at, old.state AS from_state
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, created_at)
    SELECT id, '', from_state, 'succeeded', %(actor)s::text, %(reason)s::text,
           statement_timestamp()
    FROM succeeded
)
SELECT s.id, s.key, s.scope, s.tenant, s.kind, s.entity_type, s.entity_id, s.params,
       s.fingerprint, s.state, s.attempts, s.last_error, s.next_attempt_at, s.lease_owner,
       s.lease_expires_at, s.job_id, s.dispatched_at, s.result, s.retry_of_id, s.parent_id,
       s.created_at, s.updated_at, s.purged_at, s.from_state,
       EXISTS (SELECT 1 FROM inbox) AS recorded
FROM (SELECT 1) AS one LEFT JOIN succeeded AS s ON true

-- insert_claim --
-- Claim a step (none -> claimed, or done for a local step), audited; a step already
-- claimed returns nothing.
WITH inserted AS (
    INSERT INTO {StepClaim} (
        operation_id, step, state, idempotency_key, provider_reference, request, result,
        error, attempts, claimed_by, claimed_at, last_request_at, lease_expires_at, settled_at,
        updated_at, system
    )
    VALUES (
        %(operation)s, %(step)s::text, %(state)s::text, %(idempotency_key)s::text, '',
        %(request)s::jsonb,
        %(result)s::jsonb, '', 1, %(owner)s::text, statement_timestamp(),
        -- the claimant sends its first request as this commits
        CASE WHEN %(idempotency_key)s::text <> '' THEN statement_timestamp() END,
        statement_timestamp() + make_interval(secs => %(lease_seconds)s),
        CASE WHEN %(state)s::text = 'done' THEN statement_timestamp() END, statement_timestamp(),
        %(system)s::text
    )
    ON CONFLICT ON CONSTRAINT {StepClaim.UNIQUE_CONSTRAINT} DO NOTHING
    RETURNING id, operation_id, step, state, idempotency_key, provider_reference, request,
              result, error, provider_view, seen_reference, attempts, claimed_by, claimed_at,
              last_request_at, lease_expires_at, settled_at, updated_at, requests_sent, system
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, created_at)
    SELECT operation_id, step, '', state, claimed_by, %(reason)s::text, statement_timestamp()
    FROM inserted
)
SELECT id, operation_id, step, state, idempotency_key, provider_reference, request,
       result, error, provider_view, seen_reference, attempts, claimed_by, claimed_at,
       last_request_at, lease_expires_at, settled_at, updated_at, requests_sent, system
FROM inserted

-- insert_claim_or_fail --
-- insert_claim for a claim sent ahead of its answer (fence.queue_local_claim_in_tx): no
-- ON CONFLICT, so a step already claimed fails the statement (a unique violation of
-- {StepClaim.UNIQUE_CONSTRAINT}) and nothing queued behind it in its pipeline
-- runs, its transaction's COMMIT included.
WITH inserted AS (
    INSERT INTO {StepClaim} (
        operation_id, step, state, idempotency_key, provider_reference, request, result,
        error, attempts, claimed_by, claimed_at, last_request_at, lease_expires_at, settled_at,
        updated_at, system
    )
    VALUES (
        %(operation)s, %(step)s::text, %(state)s::text, %(idempotency_key)s::text, '',
        %(request)s::jsonb,
        %(result)s::jsonb, '', 1, %(owner)s::text, statement_timestamp(),
        CASE WHEN %(idempotency_key)s::text <> '' THEN statement_timestamp() END,
        statement_timestamp() + make_interval(secs => %(lease_seconds)s),
        CASE WHEN %(state)s::text = 'done' THEN statement_timestamp() END, statement_timestamp(),
        %(system)s::text
    )
    RETURNING id, operation_id, step, state, idempotency_key, provider_reference, request,
              result, error, provider_view, seen_reference, attempts, claimed_by, claimed_at,
              last_request_at, lease_expires_at, settled_at, updated_at, requests_sent, system
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, created_at)
    SELECT operation_id, step, '', state, claimed_by, %(reason)s::text, statement_timestamp()
    FROM inserted
)
SELECT id, operation_id, step, state, idempotency_key, provider_reference, request,
       result, error, provider_view, seen_reference, attempts, claimed_by, claimed_at,
       last_request_at, lease_expires_at, settled_at, updated_at, requests_sent, system
FROM inserted

-- insert_claim_with_lease --
-- insert_claim for the step a handler opens with (`opens_with`), sent last in the lease's
-- round trip and implicit transaction (fence.acquire_lease's `first_claim`), which then
-- commits synchronously: its request and key were built before the lease from the job's
-- hint of the operation (payments.engine.dispatch.operation_hint). Inserted only if this
-- owner now holds the operation's lease and the row holds the very values the request was
-- built from (params compared as text: 1 and 1.0 differ); otherwise, or if the step is
-- claimed already, nothing: the run then claims the step as any other.
WITH inserted AS (
    INSERT INTO {StepClaim} (
        operation_id, step, state, idempotency_key, provider_reference, request, result,
        error, attempts, claimed_by, claimed_at, last_request_at, lease_expires_at, settled_at,
        updated_at, system
    )
    SELECT op.id, %(step)s::text, 'claimed', %(idempotency_key)s::text, '',
           %(request)s::jsonb, NULL, '', 1, %(owner)s::text, statement_timestamp(),
           -- the claimant sends its first request as this commits
           CASE WHEN %(idempotency_key)s::text <> '' THEN statement_timestamp() END,
           statement_timestamp() + make_interval(secs => %(lease_seconds)s),
           NULL, statement_timestamp(), %(system)s::text
    FROM {Operation} AS op
    WHERE op.id = %(operation)s AND op.state = 'running'
      AND op.lease_owner = %(owner)s::text AND op.lease_expires_at > statement_timestamp()
      AND op.key = %(key)s::text AND op.scope = %(scope)s::text
      AND op.tenant = %(tenant)s::text AND op.kind = %(kind)s::text
      AND op.entity_type = %(entity_type)s::text AND op.entity_id = %(entity_id)s::text
      AND op.params::text = %(params)s::jsonb::text
      AND op.retry_of_id IS NOT DISTINCT FROM %(retry_of_id)s::bigint
    ON CONFLICT ON CONSTRAINT {StepClaim.UNIQUE_CONSTRAINT} DO NOTHING
    RETURNING id, operation_id, step, state, idempotency_key, provider_reference, request,
              result, error, provider_view, seen_reference, attempts, claimed_by, claimed_at,
              last_request_at, lease_expires_at, settled_at, updated_at, requests_sent, system
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, created_at)
    SELECT operation_id, step, '', state, claimed_by, 'claimed', statement_timestamp()
    FROM inserted
)
SELECT id, operation_id, step, state, idempotency_key, provider_reference, request,
       result, error, provider_view, seen_reference, attempts, claimed_by, claimed_at,
       last_request_at, lease_expires_at, settled_at, updated_at, requests_sent, system
FROM inserted

-- withdraw_claim --
-- The claim made with the lease, when the run did not get to its step: claimed, held by
-- this owner under a live lease, no reference, no request counted -> gone, audited
-- ('claimed' -> 'withdrawn'), as if never claimed. Anything else: nothing. That nothing
-- was sent under it is the caller's to know (Run.external takes the claim off the run
-- before it calls); the columns tested here only refuse a claim that moved on.
WITH withdrawn AS (
    DELETE FROM {StepClaim}
    WHERE id = %(id)s AND state = 'claimed' AND claimed_by = %(owner)s::text
      AND lease_expires_at > statement_timestamp() AND provider_reference = ''
      AND requests_sent = 0
    RETURNING id, operation_id, step, state, idempotency_key, provider_reference, request,
              result, error, provider_view, seen_reference, attempts, claimed_by, claimed_at,
              last_request_at, lease_expires_at, settled_at, updated_at, requests_sent, system
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, created_at)
    SELECT operation_id, step, 'claimed', 'withdrawn', %(owner)s::text, %(reason)s::text,
           statement_timestamp()
    FROM withdrawn
)
SELECT id, operation_id, step, state, idempotency_key, provider_reference, request,
       result, error, provider_view, seen_reference, attempts, claimed_by, claimed_at,
       last_request_at, lease_expires_at, settled_at, updated_at, requests_sent, system
FROM withdrawn

-- settle_claim --
-- claimed | uncertain (held by this actor) -> done | failed | uncertain, audited with the
-- provider requests that told the outcome (%(requests)s, NULL: none).
WITH old AS (
    SELECT id, state FROM {StepClaim} WHERE id = %(id)s FOR UPDATE
), settled AS (
    UPDATE {StepClaim} AS claim
    SET state = %(to_state)s::text,
        provider_reference = CASE WHEN %(reference)s <> '' THEN %(reference)s
                                  ELSE claim.provider_reference END,
        result = CASE WHEN %(set_result)s THEN %(result)s::jsonb ELSE claim.result END,
        error = %(error)s,
        lease_expires_at = NULL,
        settled_at = CASE WHEN %(to_state)s::text <> 'uncertain' THEN statement_timestamp()
                          ELSE claim.settled_at END,
        updated_at = statement_timestamp()
    FROM old
    WHERE claim.id = %(id)s AND claim.id = old.id AND old.state = ANY(%(from_states)s)
      AND claim.claimed_by = %(actor)s::text
    RETURNING claim.id, claim.operation_id, claim.step, claim.state, claim.idempotency_key,
              claim.provider_reference, claim.request, claim.result, claim.error,
              claim.provider_view, claim.seen_reference, claim.attempts, claim.claimed_by,
              claim.claimed_at, claim.last_request_at, claim.lease_expires_at,
              claim.settled_at, claim.updated_at, claim.requests_sent, claim.system,
              old.state AS from_state
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, requests, created_at)
    SELECT operation_id, step, from_state, %(to_state)s::text, %(actor)s::text,
           %(reason)s::text, %(requests)s::jsonb, statement_timestamp()
    FROM settled
)
SELECT id, operation_id, step, state, idempotency_key, provider_reference, request,
       result, error, provider_view, seen_reference, attempts, claimed_by, claimed_at,
       last_request_at, lease_expires_at, settled_at, updated_at, requests_sent, system,
       from_state
FROM settled

-- settle_claim_or_refuse --
-- settle_claim for an outcome sent ahead of its answer (fence.queue_outcome_in_tx): when
-- it settles nothing (the claim is not the actor's, or not in a state it may leave), the
-- statement fails (payments_fence_refuse, migration payments 0009, SQLSTATE PF001), so
-- that nothing queued behind it in its pipeline runs, its transaction's COMMIT included.
WITH old AS (
    SELECT id, state FROM {StepClaim} WHERE id = %(id)s FOR UPDATE
), settled AS (
    UPDATE {StepClaim} AS claim
    SET state = %(to_state)s::text,
        provider_reference = CASE WHEN %(reference)s <> '' THEN %(reference)s
                                  ELSE claim.provider_reference END,
        result = CASE WHEN %(set_result)s THEN %(result)s::jsonb ELSE claim.result END,
        error = %(error)s,
        lease_expires_at = NULL,
        settled_at = CASE WHEN %(to_state)s::text <> 'uncertain' THEN statement_timestamp()
                          ELSE claim.settled_at END,
        updated_at = statement_timestamp()
    FROM old
    WHERE claim.id = %(id)s AND claim.id = old.id AND old.state = ANY(%(from_states)s)
      AND claim.claimed_by = %(actor)s::text
    RETURNING claim.id, claim.operation_id, claim.step, claim.state, claim.idempotency_key,
              claim.provider_reference, claim.request, claim.result, claim.error,
              claim.provider_view, claim.seen_reference, claim.attempts, claim.claimed_by,
              claim.claimed_at, claim.last_request_at, claim.lease_expires_at,
              claim.settled_at, claim.updated_at, claim.requests_sent, claim.system,
              old.state AS from_state
), audit AS (
    INSERT INTO {OperationEvent}
        (operation_id, step, from_state, to_state, actor, reason, requests, created_at)
    SELECT operation_id, step, from_state, %(to_state)s::text, %(actor)s::text,
           %(reason)s::text, %(requests)s::jsonb, statement_timestamp()
    FROM settled
)
SELECT settled.id, settled.operation_id, settled.step, settled.state,
       settled.idempotency_key, settled.provider_reference, settled.request, settled.result,
       settled.error, settled.provider_view, settled.seen_reference, settled.attempts,
       settled.claimed_by, settled.claimed_at, settled.last_request_at,
       settled.lease_expires_at, settled.settled_at, settled.updated_at,
       settled.requests_sent, settled.system, settled.from_state
FROM (SELECT 1) AS one LEFT JOIN settled ON true
WHERE CASE WHEN settled.id IS NOT NULL THEN true
           ELSE payments_fence_refuse(%(refusal)s) END

-- note_request_sent --
-- A request goes out again under a claim's key (a replay, a confirm after a lost answer):
-- recorded before it is sent, by the database's clock, by the claim's owner only.
UPDATE {StepClaim}
SET last_request_at = statement_timestamp(), requests_sent = requests_sent + 1
WHERE id = %(id)s AND claimed_by = %(actor)s::text AND state IN ('claimed', 'uncertain')
RETURNING last_request_at
