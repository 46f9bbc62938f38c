package checkpointq

import (
	"context"
	"database/sql"
	"encoding/hex"
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// A store in PostgreSQL (a postgresql:// CHECKPOINTQ_STORE_URL; store/postgres.py and its
// schema, store/sql/v1.sql and v2.sql): one row per session in {schema}.sessions, keyed by
// session_key = {schema}.session_key(session_id) (the id, or a digest of a long one), holds
// the value, the Go store's bytes as a Redis store holds them, and the session's fence. The client reads
// it through database/sql with whichever PostgreSQL driver the application registered
// (lib/pq, pgx's stdlib), one statement per read, and judges every deadline by the
// database's clock ({schema}.now_ms()), as the workers do. The pending records stay on the
// broker and merge with these reads exactly as with a Redis store of its own: the broker
// is read first (docs/protocol.md, "Pending records").

// DefaultPostgresSchema is CHECKPOINTQ_PG_SCHEMA's default.
const DefaultPostgresSchema = "checkpointq"

// schemaName is store/postgres_schema.py's rule: the name is spliced into statements.
var schemaName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// pgStore is the statements for one schema.
type pgStore struct {
	db *sql.DB
	// load: the database's time, and one session's value and fence (a row even for none).
	load string
	// fences: the database's time, and the fence of each session of a hex text array that
	// has a row, with whether its value is live.
	fences string
	// live: the ids of the sessions whose value is live.
	live string
}

func newPGStore(db *sql.DB, schema string) *pgStore {
	if !schemaName.MatchString(schema) {
		panic(fmt.Sprintf("checkpointq.New: Config.PostgresSchema %q must be a lower-case SQL identifier "+
			"(letters, digits and _, at most 63, not starting with a digit)", schema))
	}
	s := schema
	return &pgStore{
		db: db,
		load: "SELECT " + s + ".now_ms(), t.value, t.value_deadline_ms, t.fence_seq, t.fence_deleted, " +
			"t.fence_request_id, t.fence_lapsed, t.fence_expires_ms FROM (SELECT 1) AS one " +
			"LEFT JOIN " + s + ".sessions AS t ON t.session_key = " + s + ".session_key(decode($1, 'hex'))",
		fences: "WITH now AS (SELECT " + s + ".now_ms() AS ms) SELECT now.ms, t.session_id, t.fence_seq, " +
			"t.fence_deleted, t.fence_request_id, t.fence_lapsed, t.fence_expires_ms, " +
			"t.value IS NOT NULL AND t.value_deadline_ms > now.ms FROM now, " + s + ".sessions AS t " +
			"WHERE t.session_key = ANY(ARRAY(SELECT " + s + ".session_key(decode(h, 'hex')) FROM unnest($1::text[]) AS h))",
		live: "SELECT session_id FROM " + s + ".sessions WHERE value IS NOT NULL " +
			"AND value_deadline_ms > (SELECT " + s + ".now_ms())",
	}
}

// pgFence is a row's fence columns as PostgresStore._fence_of reads them: none once
// fence_expires_ms is not after the database's time.
func pgFence(now int64, seq sql.NullInt64, deleted, lapsed sql.NullBool, req []byte, expires sql.NullInt64) fence {
	if !seq.Valid || !expires.Valid || expires.Int64 <= now {
		return fence{}
	}
	f := fence{found: true, seq: seq.Int64, kind: fenceSave, req: string(req)}
	switch {
	case deleted.Valid && deleted.Bool:
		f.kind = fenceDelete
	case lapsed.Valid && lapsed.Bool:
		f.kind = fenceLapsed
	}
	return f
}

// fenceItems is f as HMGET seq, deleted, req, deadline answers (nil where absent), with
// deadline set while the value is live, as the fence hash of a Redis store has it.
func fenceItems(f fence, deadline int64, live bool) []interface{} {
	if !f.found {
		return []interface{}{nil, nil, nil, nil}
	}
	items := []interface{}{f.seq, f.kind, f.req, nil}
	if live {
		items[3] = strconv.FormatInt(deadline, 10)
	}
	return items
}

// loadSession reads sessionID's value and fence in one statement, and answers as
// loadScript does: {value, seq, deleted, req, deadline, now}, nil where absent, the value
// only while live (PostgresStore.load_at).
func (p *pgStore) loadSession(ctx context.Context, sessionID string) ([]interface{}, error) {
	var (
		now                    int64
		value, req             []byte
		deadline, seq, expires sql.NullInt64
		deleted, lapsed        sql.NullBool
	)
	err := p.db.QueryRowContext(ctx, p.load, hex.EncodeToString([]byte(sessionID))).
		Scan(&now, &value, &deadline, &seq, &deleted, &req, &lapsed, &expires)
	if err != nil {
		return nil, err
	}
	f := pgFence(now, seq, deleted, lapsed, req, expires)
	live := value != nil && deadline.Valid && deadline.Int64 > now
	items := append([]interface{}{nil}, fenceItems(f, deadline.Int64, live && f.kind == fenceSave)...)
	if live {
		items[0] = value
	}
	return append(items, now), nil
}

// eachFence hands each of ids' fences (found false for none), with whether its session's
// value is live at the database's time, keysPerCall ids per statement.
func (p *pgStore) eachFence(ctx context.Context, ids []string, each func(id string, f fence, live bool) error) error {
	for start := 0; start < len(ids); start += keysPerCall {
		chunk := ids[start:min(start+keysPerCall, len(ids))]
		got, err := p.fenceChunk(ctx, chunk)
		if err != nil {
			return err
		}
		for _, id := range chunk {
			row := got[id]
			if err := each(id, row.fence, row.live); err != nil {
				return err
			}
		}
	}
	return nil
}

type pgFenceRow struct {
	fence fence
	live  bool
}

func (p *pgStore) fenceChunk(ctx context.Context, ids []string) (map[string]pgFenceRow, error) {
	hexes := make([]string, len(ids))
	for i, id := range ids {
		hexes[i] = hex.EncodeToString([]byte(id))
	}
	// A text array literal: hex digits need no quoting, and every driver sends a string.
	rows, err := p.db.QueryContext(ctx, p.fences, "{"+strings.Join(hexes, ",")+"}")
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	got := make(map[string]pgFenceRow, len(ids))
	for rows.Next() {
		var (
			now             int64
			sid, req        []byte
			seq, expires    sql.NullInt64
			deleted, lapsed sql.NullBool
			live            sql.NullBool
		)
		if err := rows.Scan(&now, &sid, &seq, &deleted, &req, &lapsed, &expires, &live); err != nil {
			return nil, err
		}
		f := pgFence(now, seq, deleted, lapsed, req, expires)
		got[string(sid)] = pgFenceRow{fence: f, live: live.Valid && live.Bool && f.kind == fenceSave}
	}
	return got, rows.Err()
}

// listLive adds to seen the ids of every session whose value is live (one statement, the
// database's time: PostgresStore.list_page's condition).
func (p *pgStore) listLive(ctx context.Context, seen map[string]struct{}) error {
	rows, err := p.db.QueryContext(ctx, p.live)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var sid []byte
		if err := rows.Scan(&sid); err != nil {
			return err
		}
		seen[string(sid)] = struct{}{}
	}
	return rows.Err()
}

// readOutcomePG reads h's session's fence from the database and h's refusal record from
// the broker, where the workers keep them beside a PostgreSQL store, as outcomeScript's
// reply: {seq, deleted, req, refusal}. The fence first, as decide reads them.
func (c *Client[C]) readOutcomePG(ctx context.Context, h Handle) ([]interface{}, error) {
	var items []interface{}
	err := c.pg.eachFence(ctx, []string{h.SessionID}, func(_ string, f fence, _ bool) error {
		items = fenceItems(f, 0, false)[:3]
		return nil
	})
	if err != nil {
		return nil, err
	}
	reply, err := c.cfg.Broker.Eval(ctx, hmgetScript, []string{c.keys.refusals(h.SessionID)}, h.TaskID)
	if err != nil {
		return nil, err
	}
	refusal, err := replyList(reply, 1)
	if err != nil {
		return nil, err
	}
	return append(items, refusal[0]), nil
}
