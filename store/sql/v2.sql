-- checkpointq's PostgreSQL schema, version 2: from version 1 (store/postgres_schema.py applies
-- it once, in one transaction, under an advisory lock; "{schema}" is the configured schema).
--
-- 1. Rows are keyed by session_key = {schema}.session_key(session_id): the id itself when it
--    is at most 256 bytes, else 0xff followed by sha256(id) (33 bytes), with the full id beside
--    it. A btree entry holds at most a third of a page (~2,700 bytes), so a primary key on the
--    id itself refused a 6,000-byte id that a Redis store keeps ("index row size ... exceeds
--    btree version 4 maximum"). Any id the Redis store accepts is now stored here too. Short
--    ids stay their own key, so ids that sort together (ULIDs, UUIDv7, counters) keep their
--    index pages together, as the sweep's and the writes' locality need; no UTF-8 id starts
--    with the byte 0xff, and one that does (bytes from elsewhere) is hashed too, so two ids
--    never share a key. Existing rows get their key in place: the table is rewritten under
--    an ACCESS EXCLUSIVE lock, which holds writers until the upgrade commits
--    (docs/operations.md#postgresql says when to run it).
-- 2. apply_group: a worker's group in one call, with a bounded lock_timeout, so that a row
--    locked by another client (an analytics or erasure transaction) stops the statement
--    after p_lock_timeout_ms instead of holding it, and every other session of the group.
-- 3. apply_each: the same group, each item in a subtransaction of its own: the items that
--    wait on a lock or that the database refuses are reported (code 3, or 4 with the
--    error), and the others apply. The store calls it only once apply_group failed.
CREATE OR REPLACE FUNCTION {schema}.session_key(p_session_id bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
    SELECT CASE
        WHEN octet_length(p_session_id) <= 256
            AND substring(p_session_id FROM 1 FOR 1) <> '\xff'::bytea THEN p_session_id
        ELSE '\xff'::bytea || sha256(p_session_id)
    END
$fn$;

DO $$
DECLARE
    key_column boolean;
    pkey name;
    partition_columns text;
BEGIN
    SELECT EXISTS (
        SELECT 1 FROM pg_attribute
        WHERE attrelid = '{schema}.sessions'::regclass AND attname = 'session_key'
            AND NOT attisdropped
    ) INTO key_column;
    IF NOT key_column THEN
        SELECT string_agg(a.attname, ', ') INTO partition_columns
        FROM pg_partitioned_table p
        JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = ANY (p.partattrs::int2[])
        WHERE p.partrelid = '{schema}.sessions'::regclass;
        IF partition_columns IS NOT NULL THEN
            RAISE EXCEPTION '{schema}.sessions is partitioned by (%): version 2 keys rows by '
                'session_key ({schema}.session_key(session_id)); make a table partitioned by session_key '
                'and copy the rows (docs/scaling.md, "Partitioning by session")',
                partition_columns;
        END IF;
        ALTER TABLE {schema}.sessions ADD COLUMN session_key bytea;
        UPDATE {schema}.sessions SET session_key = {schema}.session_key(session_id);
        ALTER TABLE {schema}.sessions ALTER COLUMN session_key SET NOT NULL;
        SELECT conname INTO pkey FROM pg_constraint
        WHERE conrelid = '{schema}.sessions'::regclass AND contype = 'p';
        IF pkey IS NOT NULL THEN
            EXECUTE format('ALTER TABLE {schema}.sessions DROP CONSTRAINT %I', pkey);
        END IF;
        ALTER TABLE {schema}.sessions ADD PRIMARY KEY (session_key);
    END IF;
END
$$;

-- Same arguments as version 1 (a worker of version 1 still calls it correctly, and finds its
-- row by the key): only the conflict target and the key change.
CREATE OR REPLACE FUNCTION {schema}.apply(
    p_op "char",  -- 's' save, 'd' delete, 'l' lapse
    p_session_id bytea,
    p_seq bigint,
    p_request_id bytea,
    p_value bytea,
    p_version bigint,
    p_last_run_ref text,
    p_metadata jsonb,
    p_ttl_ms bigint,
    p_margin_ms bigint
) RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    floor_seq CONSTANT bigint := 1577836800000000;  -- store/ordering.py SEQ_TIME_FLOOR
    now bigint := {schema}.now_ms();
    op "char" := p_op;
    request_deadline bigint;
    deadline bigint;
    rank int;
    repeats boolean;
    done boolean;
BEGIN
    IF p_seq >= floor_seq THEN
        request_deadline := p_seq / 1000 + p_ttl_ms;
    END IF;
    IF op = 's' AND request_deadline <= now THEN
        op := 'l';
    END IF;
    rank := CASE WHEN op = 'd' THEN 1 ELSE 0 END;
    -- A save or a delete that repeats the request holding the fence applies again
    -- (idempotent); a lapse never does.
    repeats := op <> 'l';
    IF op = 's' THEN
        deadline := coalesce(request_deadline, now + p_ttl_ms);
        INSERT INTO {schema}.sessions AS s (
            session_key, session_id, value, value_deadline_ms, version, last_run_ref, metadata,
            fence_seq, fence_deleted, fence_request_id, fence_lapsed, fence_expires_ms)
        VALUES ({schema}.session_key(p_session_id), p_session_id, p_value, deadline, p_version,
            p_last_run_ref, p_metadata, p_seq, false, p_request_id, false, deadline + p_margin_ms)
        ON CONFLICT (session_key) DO UPDATE SET
            value = excluded.value,
            value_deadline_ms = excluded.value_deadline_ms,
            version = excluded.version,
            last_run_ref = excluded.last_run_ref,
            metadata = excluded.metadata,
            fence_seq = excluded.fence_seq,
            fence_deleted = false,
            fence_request_id = excluded.fence_request_id,
            fence_lapsed = false,
            fence_expires_ms = excluded.fence_expires_ms,
            updated_at = clock_timestamp()
        WHERE s.fence_expires_ms <= now
            OR (p_seq, 0, p_request_id)
                >= (s.fence_seq, CASE WHEN s.fence_deleted THEN 1 ELSE 0 END, s.fence_request_id)
        RETURNING true INTO done;
        RETURN CASE WHEN done THEN 1 ELSE 0 END;
    END IF;
    -- A delete's tombstone, or a lapsed save's fence: kept until every request ordered
    -- before it is past its deadline, plus the margin.
    deadline := greatest(now, coalesce(request_deadline, 0)) + p_margin_ms;
    INSERT INTO {schema}.sessions AS s (
        session_key, session_id, value, value_deadline_ms, version, last_run_ref, metadata,
        fence_seq, fence_deleted, fence_request_id, fence_lapsed, fence_expires_ms)
    VALUES ({schema}.session_key(p_session_id), p_session_id, NULL, NULL, NULL, NULL, NULL,
        p_seq, op = 'd', p_request_id, op = 'l', deadline)
    ON CONFLICT (session_key) DO UPDATE SET
        value = NULL,
        value_deadline_ms = NULL,
        version = NULL,
        last_run_ref = NULL,
        metadata = NULL,
        fence_seq = excluded.fence_seq,
        fence_deleted = excluded.fence_deleted,
        fence_request_id = excluded.fence_request_id,
        fence_lapsed = excluded.fence_lapsed,
        fence_expires_ms = excluded.fence_expires_ms,
        updated_at = clock_timestamp()
    WHERE s.fence_expires_ms <= now
        OR (p_seq, rank, p_request_id)
            > (s.fence_seq, CASE WHEN s.fence_deleted THEN 1 ELSE 0 END, s.fence_request_id)
        OR (repeats AND (p_seq, rank, p_request_id)
            = (s.fence_seq, CASE WHEN s.fence_deleted THEN 1 ELSE 0 END, s.fence_request_id))
    RETURNING true INTO done;
    IF p_op = 's' THEN
        RETURN 2;
    END IF;
    RETURN CASE WHEN done THEN 1 ELSE 0 END;
END
$$;

-- A group in one statement: apply over the arrays, in their order (each call sees the ones
-- before it), waiting at most p_lock_timeout_ms for any one lock (0: the server's setting).
-- set_config(..., true) holds for this statement's transaction only, which is also what a
-- pooler in transaction mode expects.
CREATE FUNCTION {schema}.apply_group(
    p_lock_timeout_ms integer,
    p_ttl_ms bigint,
    p_margin_ms bigint,
    p_ops text[],
    p_session_ids bytea[],
    p_seqs bigint[],
    p_request_ids bytea[],
    p_values bytea[],
    p_versions bigint[],
    p_refs text[],
    p_metadata jsonb[]
) RETURNS SETOF smallint
LANGUAGE plpgsql AS $$
BEGIN
    IF p_lock_timeout_ms > 0 THEN
        PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
    END IF;
    RETURN QUERY
        SELECT {schema}.apply(u.op::"char", u.sid, u.seq, u.rid, u.value, u.version, u.ref,
            u.meta, p_ttl_ms, p_margin_ms)
        FROM unnest(p_ops, p_session_ids, p_seqs, p_request_ids, p_values, p_versions, p_refs,
            p_metadata) WITH ORDINALITY AS u(op, sid, seq, rid, value, version, ref, meta, n)
        ORDER BY u.n;
END
$$;

-- The group again, one subtransaction per item: code 3 for an item that waited on a lock
-- past p_lock_timeout_ms (or was cancelled: statement_timeout), 4 with the SQLSTATE and the
-- message for one the database refused; the later items of a session that met either are
-- not tried (code 3 or 4 as well), so that no request of a session applies before an
-- earlier one. An error outside an item (the connection, the server) fails the statement.
CREATE FUNCTION {schema}.apply_each(
    p_lock_timeout_ms integer,
    p_ttl_ms bigint,
    p_margin_ms bigint,
    p_ops text[],
    p_session_ids bytea[],
    p_seqs bigint[],
    p_request_ids bytea[],
    p_values bytea[],
    p_versions bigint[],
    p_refs text[],
    p_metadata jsonb[]
) RETURNS TABLE (item_code smallint, item_state text, item_message text)
LANGUAGE plpgsql AS $$
DECLARE
    failed_session bytea;
    failed_code smallint;
    failed_state text;
    failed_message text;
BEGIN
    IF p_lock_timeout_ms > 0 THEN
        PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
    END IF;
    FOR i IN 1 .. coalesce(array_length(p_ops, 1), 0) LOOP
        IF failed_session IS NOT NULL AND p_session_ids[i] = failed_session THEN
            item_code := failed_code; item_state := failed_state; item_message := failed_message;
            RETURN NEXT;
            CONTINUE;
        END IF;
        BEGIN
            item_code := {schema}.apply(p_ops[i]::"char", p_session_ids[i], p_seqs[i],
                p_request_ids[i], p_values[i], p_versions[i], p_refs[i], p_metadata[i],
                p_ttl_ms, p_margin_ms);
            item_state := NULL; item_message := NULL;
        EXCEPTION
            WHEN lock_not_available OR query_canceled THEN
                item_code := 3; item_state := SQLSTATE; item_message := SQLERRM;
            WHEN data_exception OR program_limit_exceeded OR integrity_constraint_violation THEN
                item_code := 4; item_state := SQLSTATE; item_message := SQLERRM;
        END;
        IF item_code >= 3 THEN
            failed_session := p_session_ids[i];
            failed_code := item_code; failed_state := item_state; failed_message := item_message;
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
