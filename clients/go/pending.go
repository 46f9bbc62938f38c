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
// by one script that also records, on the broker, the newest accepted request per session;
// loads and lists merge them with the store by seq, so a request the queue still holds (the
// workers stopped, or the store refusing writes) is seen by every replica's next load, and
// the save made from that load keeps it.

// publishScript is tasks/lua/publish.lua, byte for byte (a test compares them): the one
// script every producer of ours pushes with.
//
//go:embed lua/publish.lua
var publishScript string

// loadPendingScript reads the record, the epoch, the value and the fence in one call, when
// the broker is the store; readPendingScript reads the record and the epoch on a broker that
// is not the store. Both are tasks/lua's, byte for byte (a test compares them), and both
// read a staged save's value from the key its record names.
//
//go:embed lua/load_pending.lua
var loadPendingScript string

//go:embed lua/read_pending.lua
var readPendingScript string

// hmgetEachScript reads the same fields of many hashes (List's records and fences).
//
//go:embed lua/hmget_each.lua
var hmgetEachScript string

// Record ops, as the script stores them.
const (
	opSave   = "save"
	opDelete = "delete"
)

// pendingRecord is a session's pending record as read from the broker.
type pendingRecord struct {
	found   bool
	seq     int64
	deleted bool
	req     string
	value   []byte // a save's stored value
}

// parseRecordHead reads a record's seq and op; a record without a seq is none.
func parseRecordHead(seqItem, opItem interface{}) (pendingRecord, error) {
	seq, found, err := replyInt(seqItem)
	if err != nil || !found {
		return pendingRecord{}, err
	}
	op, err := replyText(opItem)
	if err != nil {
		return pendingRecord{}, err
	}
	if op != opSave && op != opDelete {
		return pendingRecord{}, fmt.Errorf("op %q is neither save nor delete", op)
	}
	return pendingRecord{found: true, seq: seq, deleted: op == opDelete}, nil
}

// parseRecord reads {seq, op, req, value} (HMGET order); a record without a seq is none.
func parseRecord(items []interface{}) (pendingRecord, error) {
	rec, err := parseRecordHead(items[0], items[1])
	if err != nil || !rec.found {
		return pendingRecord{}, err
	}
	req, err := replyText(items[2])
	if err != nil {
		return pendingRecord{}, err
	}
	value, _, err := replyBytes(items[3])
	if err != nil {
		return pendingRecord{}, err
	}
	if !rec.deleted && len(value) == 0 {
		return pendingRecord{}, fmt.Errorf("a pending save without a value")
	}
	rec.req, rec.value = req, value
	return rec, nil
}

// wins says whether the record, rather than the store, is the session's answer: its
// request is newer than the last one applied (or none was).
func (r pendingRecord) wins(fenceSeq int64, hasFence bool) bool {
	return r.found && (!hasFence || r.seq > fenceSeq)
}

// epochs follows the broker's pending epoch. A token other than the last one seen (or
// none, where one was seen) means the broker lost its data, records and queue alike: the
// loads that follow read the store alone, which is all there is. Counted once per loss.
type epochs struct {
	mu      sync.Mutex
	last    string // "" before the first one seen; lostEpoch after a loss, until the next
	changes atomic.Int64
}

const lostEpoch = "\x00lost"

func (e *epochs) observe(epoch string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case epoch == e.last:
	case e.last == "" || e.last == lostEpoch:
		if epoch != "" {
			e.last = epoch
		}
	case epoch == "":
		e.changes.Add(1)
		e.last = lostEpoch
	default:
		e.changes.Add(1)
		e.last = epoch
	}
}

// EpochChanges counts the times this client found that the broker had lost its pending
// records (a restart without persistence): the Python clients' metric
// checkpointq_pending_epoch_changes_total. Loads then fall back to the store, which holds
// every request the workers applied; requests the lost queue held are lost with it.
func (c *Client[C]) EpochChanges() int64 { return c.epochs.changes.Load() }

// keysPerCall bounds the hashes one hmgetEachScript call reads.
const keysPerCall = 500

// pendingSessions reads the live pending records: the index (ids whose record deadline is
// after now, ms), then each record's seq and op.
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
	records := make(map[string]pendingRecord, len(ids))
	err := c.hmgetEach(ctx, c.cfg.Broker, ids, c.keys.pending, []interface{}{"seq", "op"},
		func(id string, values []interface{}) error {
			rec, err := parseRecordHead(values[0], values[1])
			if err != nil {
				return fmt.Errorf("the pending record of %q: %v", id, err)
			}
			if rec.found {
				records[id] = rec
			}
			return nil
		})
	return records, err
}

// mergePending applies to seen (the store's live ids, listed before the fences are read)
// each pending record newer than its session's fence: a save lists the session, a delete
// hides it. Where a worker applied the request since the listing, the fence says the
// session's state instead: listed iff its last request was a save whose deadline (ms) is
// after now.
func (c *Client[C]) mergePending(ctx context.Context, now int64, pending map[string]pendingRecord, seen map[string]struct{}) error {
	if len(pending) == 0 {
		return nil
	}
	ids := make([]string, 0, len(pending))
	for id := range pending {
		ids = append(ids, id)
	}
	sort.Strings(ids)
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
		err := c.hmgetEach(ctx, c.cfg.Store, batch, c.keys.fence, []interface{}{"seq", "deleted", "deadline"},
			func(id string, values []interface{}) error {
				seq, hasFence, err := replyInt(values[0])
				if err != nil {
					return fmt.Errorf("%w: fence of %q: %v", ErrCorrupt, id, err)
				}
				listed := !pending[id].deleted
				if !pending[id].wins(seq, hasFence) {
					deleted, _ := replyText(values[1])
					deadline, _ := replyText(values[2])
					due, err := strconv.ParseFloat(deadline, 64)
					listed = deleted != "1" && err == nil && due > float64(now)
				}
				if listed {
					seen[id] = struct{}{}
				} else {
					delete(seen, id)
				}
				return nil
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
		end := start + keysPerCall
		if end > len(ids) {
			end = len(ids)
		}
		chunk := ids[start:end]
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
