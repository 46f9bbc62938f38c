-- checkpointq's PostgreSQL schema, version 1 (store/postgres_schema.py applies it once, in
-- one transaction, under an advisory lock; "{schema}" is the configured schema's name).
--
-- One row per session holds both the value and the fence, so that a fenced write is one
-- row lock and one statement. The value is the Go store's Redis value, byte for byte
-- (zstd-compressed JSON): a worker stores a producer's staged value as it came, the Go
-- client decodes it as it decodes Redis values, and the byte budget means the same on
-- every store. version, last_run_ref and metadata are a queryable copy of the value's
-- fields, for SQL (analytics, deletion requests); the value is what loads read.
--
-- Ids are bytea: a session id is any Go string (NUL included, which text cannot hold) and
-- requests are ordered by their ids' bytes (store/ordering.py), which bytea compares.

-- IF NOT EXISTS: an operator may create the table first, partitioned by hash of session_id
-- with the same columns (docs/scaling.md); every statement works on either.
CREATE TABLE IF NOT EXISTS {schema}.sessions (
    session_id bytea PRIMARY KEY,
    -- NULL once the session is deleted, lapsed or expired: the row then keeps the fence
    value bytea,
    value_deadline_ms bigint,
    version bigint,
    last_run_ref text,
    metadata jsonb,
    fence_seq bigint NOT NULL,
    fence_deleted boolean NOT NULL,
    fence_request_id bytea NOT NULL DEFAULT '',
    fence_lapsed boolean NOT NULL DEFAULT false,
    -- when the fence may be forgotten, and the row with it (ms since the epoch)
    fence_expires_ms bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The value is zstd already: EXTERNAL keeps TOAST from trying (and failing) to compress it
-- again with pglz on every write, a fifth of a group's time in the database.
ALTER TABLE {schema}.sessions ALTER COLUMN value SET STORAGE EXTERNAL;

-- The sweep's index: only rows holding a value, by deadline. A sweep with nothing due reads
-- one index page, whatever the number of sessions.
CREATE INDEX IF NOT EXISTS sessions_due ON {schema}.sessions (value_deadline_ms) WHERE value IS NOT NULL;
-- Rows left holding only a fence, by when it may be forgotten.
CREATE INDEX IF NOT EXISTS sessions_fences_due ON {schema}.sessions (fence_expires_ms) WHERE value IS NULL;

-- The database's clock in ms since the epoch: every deadline is judged by it, never by a
-- worker's or a producer's clock (docs/semantics.md, "Clocks").
CREATE FUNCTION {schema}.now_ms() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint
$$;

-- One request, fenced by its order key (seq, rank, request id): a save, a delete or a lapse
-- (a save that arrived past its deadline). Mirrors store/memory.py and store/lua/save.lua.
-- Returns 1 when applied, 0 when a request ordered after it had already won, 2 for a save
-- found past its deadline (settled as a lapse).
CREATE FUNCTION {schema}.apply(
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
            session_id, value, value_deadline_ms, version, last_run_ref, metadata,
            fence_seq, fence_deleted, fence_request_id, fence_lapsed, fence_expires_ms)
        VALUES (p_session_id, p_value, deadline, p_version, p_last_run_ref, p_metadata,
            p_seq, false, p_request_id, false, deadline + p_margin_ms)
        ON CONFLICT (session_id) DO UPDATE SET
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
        session_id, value, value_deadline_ms, version, last_run_ref, metadata,
        fence_seq, fence_deleted, fence_request_id, fence_lapsed, fence_expires_ms)
    VALUES (p_session_id, NULL, NULL, NULL, NULL, NULL,
        p_seq, op = 'd', p_request_id, op = 'l', deadline)
    ON CONFLICT (session_id) DO UPDATE SET
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

-- What write probes write (store/postgres.py, PostgresStore.write_refusal): one row, rewritten.
CREATE TABLE {schema}.write_probe (
    id integer PRIMARY KEY,
    written_at timestamptz NOT NULL
);
