package checkpointq

import (
	"context"
	_ "embed" // the Lua scripts, loaded once per server by the adapter's EVALSHA
	"fmt"
	"reflect"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
)

// Pending records (docs/protocol.md, "Pending records"): every save and delete is pushed
// by one script that also writes, on the broker, an entry for the request in its session's
// entries (request id -> "<seq> <op>", a save's value beside it, all living until the
// request's deadline); a worker removes exactly that entry once it settles the request.
// Loads and lists take each session's entry ordered last and merge it with the store by
// the order of requests (outcomes.go), so a request the queue still holds (the workers
// stopped, or the store refusing writes) is seen by every replica's next load, and the
// save made from that load keeps it.

// publishScript is tasks/lua/publish.lua, byte for byte (a test compares them): the one
// script every producer of ours pushes with. It checks this producer's clock and the
// request's seq against the broker's clock before it writes anything.
//
//go:embed lua/publish.lua
var publishScript string

// readPendingScript is tasks/lua/read_pending.lua, byte for byte (a test compares them):
// a session's newest entry and the epoch (mode "one"), the same with the store's value and
// fence when the broker is the store (mode "store"), or the newest entry of many sessions
// (mode "heads"). Entries of the layout before issue 31 (keys.pending) take part too.
//
//go:embed lua/read_pending.lua
var readPendingScript string

// hmgetEachScript reads the same fields of many hashes (List's fences).
//
//go:embed lua/hmget_each.lua
var hmgetEachScript string

// Entry ops: publish.lua's, read_pending.lua's "lapsed" for a save past its deadline, and
// its "missing" for a session the pending index holds whose entries are gone.
const (
	opSave    = "save"
	opDelete  = "delete"
	opLapsed  = "lapsed"
	opMissing = "missing"
)

// pendingRecord is a session's newest pending request as read from the broker.
type pendingRecord struct {
	found   bool
	seq     int64
	deleted bool
	lapsed  bool // a save past its deadline: never to be stored, its session reads as expired
	req     string
	value   []byte // a save's stored value, when read
}

// parseHead reads an entry's seq, op and request id; an entry without a seq is none.
func parseHead(seqItem, opItem, reqItem interface{}) (pendingRecord, error) {
	seq, found, err := replyInt(seqItem)
	if err != nil || !found {
		return pendingRecord{}, err
	}
	op, err := replyText(opItem)
	if err != nil {
		return pendingRecord{}, err
	}
	if op != opSave && op != opDelete && op != opLapsed {
		return pendingRecord{}, fmt.Errorf("op %q is not save, delete or lapsed", op)
	}
	req, err := replyText(reqItem)
	if err != nil {
		return pendingRecord{}, err
	}
	return pendingRecord{found: true, seq: seq, deleted: op == opDelete, lapsed: op == opLapsed, req: req}, nil
}

// parseRecord reads {seq, op, req, value} (read_pending.lua's order) of an entry that
// answers a load: a save's value must be there (pending.py's parse_record).
func parseRecord(items []interface{}) (pendingRecord, error) {
	rec, err := parseHead(items[0], items[1], items[2])
	if err != nil || !rec.found || rec.deleted || rec.lapsed {
		return rec, err
	}
	if rec.value, _, err = replyBytes(items[3]); err != nil {
		return pendingRecord{}, err
	}
	if len(rec.value) == 0 {
		return pendingRecord{}, fmt.Errorf("the value of pending save %s (seq %d) is gone before its deadline "+
			"(evicted? run the broker with maxmemory-policy noeviction)", rec.req, rec.seq)
	}
	return rec, nil
}

// key is the order key of the entry's request.
func (r pendingRecord) key() orderKey { return orderKey{r.seq, r.deleted, r.req} }

// wins says whether the entry, rather than the store, is the session's answer: its
// request is ordered after the one that set the fence (or there is no fence).
func (r pendingRecord) wins(f fence) bool {
	return r.found && (!f.found || r.key().after(f.key()))
}

// epochs follows the broker's pending epoch and mark (pending.py's EpochWatch). A token
// other than the last one seen (or none, where one was seen) means the broker lost data,
// all of it or a suffix a producer found missing; a publish's mark below the highest seen
// in the epoch, or that mark held by another publish (publish.lua's ring of tokens: the
// broker lost it, and unaware publishes brought the counter back up), means it went back
// in time (a crash inside its fsync window, a failover to a lagging replica), and this
// client's next publish reports it (the epoch turns, for every client to see). The loads
// that follow read what is left. Counted once per loss.
type epochs struct {
	mu         sync.Mutex
	last       string   // "" before the first one seen; lostEpoch after a loss, until the next
	mark       seenMark // the highest mark seen in the epoch, with its token
	unreported seenMark // a mark seen before the broker lost it, not yet reported
	changes    atomic.Int64
	logf       func(format string, args ...interface{}) // each loss is logged once; nil: not
}

// seenMark is a mark a client saw and its token ("" unknown): pending.py's Seen.
type seenMark struct {
	mark  int64
	token string
}

// markTokenChars is how much of a publish's ARGV[3] the broker keeps as its mark's token.
const markTokenChars = 16

const lostEpoch = "\x00lost"

func (e *epochs) observe(epoch string) bool { return e.observeMark(epoch, -1, 0, false, "", nil) }

// seen is the epoch, the highest mark and its token to send with a publish (publish.lua's
// ARGV[6..8]): with a loss this client found and did not report yet, the mark and token it
// saw before it, for the script to find the loss again.
func (e *epochs) seen() (string, int64, string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	epoch := e.last
	if epoch == lostEpoch {
		epoch = ""
	}
	m := e.mark
	if e.unreported.mark > 0 {
		m = e.unreported
	}
	return epoch, m.mark, m.token
}

// floor is the highest mark seen in the epoch since the last loss, and its token: a reply
// to a request sent now showing a lower mark, or that mark with another token, is a new
// loss.
func (e *epochs) floor() seenMark {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.mark
}

// observeMark takes a reply's epoch and mark (-1: none). A mark under below shows the
// broker went back in time (below: the floor when the request went out, plus one for a
// publish, which advances it; replies of concurrent requests come back in any order).
// found: that publish found the loss itself and turned the epoch. token: the mark's token
// ("" unknown). forked: the mark and token the request sent, when the reply says the
// broker holds that mark with another token (read_pending.lua): a loss, as a lower mark
// is. It returns whether the reply shows a loss not counted before (then publish the
// recovery window again).
func (e *epochs) observeMark(epoch string, mark, below int64, found bool, token string, forked *seenMark) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case epoch == e.last:
		if mark < 0 {
			return false
		}
		if forked == nil && mark >= below {
			if mark > e.mark.mark || (mark == e.mark.mark && e.mark.token == "") {
				e.mark = seenMark{mark, token}
			}
			return false
		}
		if forked != nil && e.unreported.mark > 0 {
			return false // found already, not reported yet
		}
		// Below a mark this client saw in this epoch, or that mark with another token: the
		// broker went back in time.
		lost, why := e.mark, fmt.Sprintf("below %d seen before", below)
		if forked != nil {
			lost, why = *forked, fmt.Sprintf("and mark %d seen before holds another publish", forked.mark)
		}
		if lost.mark > e.unreported.mark {
			e.unreported = lost
		}
		e.mark = seenMark{mark, token}
		e.changes.Add(1)
		e.log("checkpointq: the broker went back in time: pending mark %d, %s (a crash or failover "+
			"lost a suffix of accepted requests); see docs/reliability.md", mark, why)
		return true
	case e.last == "" || e.last == lostEpoch:
		if epoch != "" {
			e.last, e.mark = epoch, seenMark{max64(mark, 0), token}
		}
		return false
	default:
		// Turned by the report of the loss this client found (its own, or another
		// client's first): counted already.
		counted := e.unreported.mark > 0
		e.last, e.mark, e.unreported = epoch, seenMark{max64(mark, 0), token}, seenMark{}
		what := "changed"
		if epoch == "" {
			e.last, what = lostEpoch, "gone"
		}
		if counted {
			return false
		}
		e.changes.Add(1)
		e.log("checkpointq: the broker lost accepted requests (pending epoch %s): requests "+
			"published before it may never be applied; see docs/reliability.md", what)
		return true
	}
}

func max64(a, b int64) int64 {
	if a > b {
		return a
	}
	return b
}

func (e *epochs) log(format string, args ...interface{}) {
	if e.logf != nil {
		e.logf(format, args...)
	}
}

// EpochChanges counts the times this client found that the broker had lost its pending
// records (a restart without persistence) or a suffix of them (a crash or a failover that
// went back in time): the Python clients' metric
// checkpointq_pending_epoch_changes_total. Loads then fall back to the store, which holds
// every request the workers applied; requests the lost queue held are lost with it.
func (c *Client[C]) EpochChanges() int64 { return c.epochs.changes.Load() }

// keysPerCall bounds the sessions one script call reads (pending.py's _HEADS_PER_CALL).
const keysPerCall = 500

// pendingSessions reads the live pending entries: the index (ids whose latest entry
// deadline is after now, ms), then each session's newest entry (read_pending.lua, mode
// "heads"), keysPerCall sessions per call; a session with none left is not returned.
func (c *Client[C]) pendingSessions(ctx context.Context, now int64) (map[string]pendingRecord, error) {
	var ids []string
	var cursor uint64
	for {
		pairs, next, err := c.cfg.Broker.ZScan(ctx, c.keys.pendingIndex(), cursor, 1000)
		if err != nil {
			return nil, err
		}
		for i := 0; i+1 < len(pairs); i += 2 {
			if deadline, err := strconv.ParseFloat(pairs[i+1], 64); err == nil && deadline > float64(now) {
				ids = append(ids, pairs[i])
			}
		}
		if cursor = next; cursor == 0 {
			break
		}
	}
	ttl := c.cfg.SessionTTL.Milliseconds()
	records := make(map[string]pendingRecord, len(ids))
	for start := 0; start < len(ids); start += keysPerCall {
		chunk := ids[start:min(start+keysPerCall, len(ids))]
		keys := make([]string, 0, 2*len(chunk))
		for _, id := range chunk {
			keys = append(keys, c.keys.pendingRequests(id), c.keys.pending(id))
		}
		reply, err := c.cfg.Broker.Eval(ctx, readPendingScript, keys, "heads", ttl)
		if err != nil {
			return nil, err
		}
		items, err := replyList(reply, 3*len(chunk))
		if err != nil {
			return nil, err
		}
		for i, id := range chunk {
			rec, err := parseHead(items[3*i], items[3*i+1], items[3*i+2])
			if err != nil {
				return nil, fmt.Errorf("%w: the pending entries of %q: %v", ErrCorrupt, id, err)
			}
			if rec.found {
				records[id] = rec
			}
		}
	}
	return records, nil
}

// mergePending applies to seen (the store's live ids, listed before the fences are read)
// each session's newest entry that is ordered after its fence: a save lists the session,
// a delete or a lapsed save hides it. Where a worker applied the request since the
// listing, the fence says the session's state instead: listed iff its last request was a
// save whose deadline (ms) is after now (the database's time on a PostgreSQL store).
func (c *Client[C]) mergePending(ctx context.Context, now int64, pending map[string]pendingRecord, seen map[string]struct{}) error {
	if len(pending) == 0 {
		return nil
	}
	ids := make([]string, 0, len(pending))
	for id := range pending {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	merge := func(id string, f fence, live bool) error {
		rec := pending[id]
		listed := live
		if rec.wins(f) {
			listed = !rec.deleted && !rec.lapsed
		}
		if listed {
			seen[id] = struct{}{}
		} else {
			delete(seen, id)
		}
		return nil
	}
	if c.pg != nil {
		return c.pg.eachFence(ctx, ids, merge)
	}
	batches := [][]string{ids}
	if c.keys.cluster {
		// A script reads one slot's keys: the fences of the sessions of one data-key slot.
		bySlot := make(map[int][]string)
		for _, id := range ids {
			slot := keySlot(c.keys.data(id))
			bySlot[slot] = append(bySlot[slot], id)
		}
		batches = batches[:0]
		for _, group := range bySlot {
			batches = append(batches, group)
		}
	}
	for _, batch := range batches {
		err := c.hmgetEach(ctx, c.cfg.Store, batch, c.keys.fence, []interface{}{"seq", "deleted", "req", "deadline"},
			func(id string, values []interface{}) error {
				f, err := parseFence(values)
				if err != nil {
					return fmt.Errorf("%w: fence of %q: %v", ErrCorrupt, id, err)
				}
				return merge(id, f, f.live(now))
			})
		if err != nil {
			return err
		}
	}
	return nil
}

// hmgetEach reads fields of the hash key(id) for every id on r, keysPerCall per call,
// handing each id's values to each.
func (c *Client[C]) hmgetEach(ctx context.Context, r Redis, ids []string, key func(string) string,
	fields []interface{}, each func(id string, values []interface{}) error) error {
	for start := 0; start < len(ids); start += keysPerCall {
		chunk := ids[start:min(start+keysPerCall, len(ids))]
		keys := make([]string, len(chunk))
		for i, id := range chunk {
			keys[i] = key(id)
		}
		reply, err := r.Eval(ctx, hmgetEachScript, keys, fields...)
		if err != nil {
			return err
		}
		items, err := replyList(reply, len(chunk)*len(fields))
		if err != nil {
			return err
		}
		for i, id := range chunk {
			if err := each(id, items[i*len(fields):(i+1)*len(fields)]); err != nil {
				return err
			}
		}
	}
	return nil
}

// sameRedis says whether broker and store are one client (store nil: the broker's). Only
// comparable adapters are compared: == panics on others.
func sameRedis(broker, store Redis) bool {
	if store == nil {
		return true
	}
	tb, ts := reflect.TypeOf(broker), reflect.TypeOf(store)
	return tb == ts && tb.Comparable() && broker == store
}

func min(a, b int) int {
	if a < b {
		return a
	}
	return b
}
