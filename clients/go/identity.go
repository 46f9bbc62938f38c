package checkpointq

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
)

// One deployment, one truth (checkpointq/tasks/store_identity.py is the contract): each
// store has an identity made once in the store itself by its first user ("<uuid>@<ms since
// the epoch it was made>"), and every worker announces the identity of the store it writes
// to on the broker with its heartbeats. After a read, a client reads its own store's
// identity, then the announcement: the same, they agree (and it stops looking); another,
// announced after this identity was made, and the read fails with ErrStoreMismatch naming
// both stores, instead of answering from a store no worker writes. An announcement older
// than the identity proves nothing yet (a store emptied since, or an identity made just
// now): the client looks again after identityRecheck, as while no worker announced.

// ErrStoreMismatch: this client reads another store than the one the broker's workers
// write to (the error names both), so its loads would miss what they apply.
var ErrStoreMismatch = errors.New("checkpointq: the workers write to another store")

const (
	// identityRecheck: how long a client waits before it compares again, until it agrees
	// with the workers (a worker's heartbeat, CHECKPOINTQ_HEARTBEAT_SECONDS' default).
	identityRecheck = 5 * time.Second
	// identityClockMargin: how much later than an identity's making an announcement must
	// be to count (the disagreement allowed between the worker's and the maker's clocks).
	identityClockMargin = 2 * time.Second
)

// identityScript reads a store's identity, making it first when there is none (only then a
// write, as the Python stores do).
const identityScript = `local found = redis.call('GET', KEYS[1])
if not found then
  redis.call('SET', KEYS[1], ARGV[1], 'NX')
  found = redis.call('GET', KEYS[1])
end
return found`

// getScript reads one key (the Redis interface has no GET of its own).
const getScript = `return redis.call('GET', KEYS[1])`

// publishedStore is what a worker said of its store on the broker, with a heartbeat.
type publishedStore struct {
	Identity string  `json:"identity"`
	Store    string  `json:"store"`  // its URL, redacted
	Worker   string  `json:"worker"` // the worker's name
	Time     float64 `json:"time"`   // when it read the identity, seconds since the epoch
}

// storeCheck is a client's comparison of its store with the workers', without I/O.
type storeCheck struct {
	mu        sync.Mutex
	agreed    bool
	checkedAt time.Time // zero: due now
}

func (s *storeCheck) due(now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.agreed && (s.checkedAt.IsZero() || now.Sub(s.checkedAt) >= identityRecheck)
}

// compare judges mine ("" for a store with none) against the workers' announcement (nil:
// none yet), read after it; an error names both stores.
func (s *storeCheck) compare(now time.Time, mine, myStore string, published *publishedStore, broker string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.checkedAt = now
	if mine == "" || published == nil {
		return nil
	}
	if mine == published.Identity {
		s.agreed = true
		return nil
	}
	created, ok := identityCreated(mine)
	said := time.Unix(0, int64(published.Time*float64(time.Second)))
	if !ok || said.Before(created.Add(identityClockMargin)) {
		return nil // said before this identity existed: proves nothing yet
	}
	s.checkedAt = time.Time{} // every read fails, until the configuration changes
	return fmt.Errorf("%w: this client reads the store %s (identity %s), but the workers on %s "+
		"write to %s (identity %s, said by %s): its loads would miss what they apply. Point it "+
		"at their store (CHECKPOINTQ_STORE_URL, as `checkpointq up` prints it)",
		ErrStoreMismatch, myStore, mine, broker, published.Store, published.Identity, published.Worker)
}

// identityCreated is when identity was made ("<uuid>@<ms>"); ok is false for another form.
func identityCreated(identity string) (time.Time, bool) {
	at := strings.LastIndexByte(identity, '@')
	if at < 0 {
		return time.Time{}, false
	}
	ms, err := strconv.ParseInt(identity[at+1:], 10, 64)
	if err != nil || ms < 0 {
		return time.Time{}, false
	}
	return time.UnixMilli(ms), true
}

// checkStore compares this client's store with the workers' after a read, until they
// agree: ErrStoreMismatch when they are two stores. A store or broker that cannot be read
// now leaves the question for later (the read itself succeeded).
func (c *Client[C]) checkStore(ctx context.Context) error {
	now := c.cfg.Now()
	if !c.stores.due(now) {
		return nil
	}
	mine, myStore, err := c.storeIdentity(ctx) // first: an announcement made after it counts
	if err != nil {
		c.stores.compare(now, "", "", nil, "")
		return nil
	}
	reply, err := c.cfg.Broker.Eval(ctx, getScript, []string{c.keys.internal() + ":workers-store"})
	if err != nil {
		c.stores.compare(now, "", "", nil, "")
		return nil
	}
	raw, found, err := replyBytes(reply)
	var published *publishedStore
	if err == nil && found {
		var p publishedStore
		if json.Unmarshal(raw, &p) == nil && p.Identity != "" {
			published = &p // (another form: not ours to judge)
		}
	}
	return c.stores.compare(now, mine, myStore, published, "the broker")
}

// storeIdentity is this client's store's identity ("" for none readable) and how to name
// the store in an error.
func (c *Client[C]) storeIdentity(ctx context.Context) (string, string, error) {
	if c.pg != nil {
		// Made by the store's first user that may create tables (a worker): read only.
		var id string
		schema := c.cfg.PostgresSchema
		err := c.pg.db.QueryRowContext(ctx, "SELECT id FROM "+schema+".store_identity").Scan(&id)
		if errors.Is(err, sql.ErrNoRows) {
			return "", "", nil
		}
		return id, "PostgreSQL (Config.Postgres, schema " + schema + ")", err
	}
	made, err := newUUID()
	if err != nil {
		return "", "", err
	}
	made += "@" + strconv.FormatInt(c.cfg.Now().UnixMilli(), 10)
	reply, err := c.cfg.Store.Eval(ctx, identityScript, []string{c.keys.internal() + ":identity"}, made)
	if err != nil {
		return "", "", err
	}
	id, err := replyText(reply)
	store := "Redis (Config.Store, prefix " + c.cfg.Prefix + ")"
	if c.oneRedis {
		store = "Redis (the broker's: Config.Store unset, prefix " + c.cfg.Prefix + ")"
	}
	return id, store, err
}
