package checkpointq

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
)

// The order of requests and how a request ended (store/ordering.py, tasks/producer/
// outcomes.py). Every save and delete of a session is ordered by its key (seq, rank,
// request id): the seq first, then a delete over a save, then the request id byte by byte.
// The store, the pending records and every producer agree on it, whatever the arrival
// order. A seq from seqTimeFloor on is a time, and its request has a deadline: seq (in ms)
// + the session TTL, after which it is never applied.

// seqTimeFloor is 2020-01-01T00:00:00Z in microseconds: a seq from here on is a time.
const seqTimeFloor = 1_577_836_800_000_000

// orderKey is a request's place in its session's order.
type orderKey struct {
	seq     int64
	deleted bool // the delete rank, above a save's at equal seq
	req     string
}

// after says whether k is ordered after o (Go compares strings byte by byte, as the Lua
// scripts do with string.byte).
func (k orderKey) after(o orderKey) bool {
	if k.seq != o.seq {
		return k.seq > o.seq
	}
	if k.deleted != o.deleted {
		return k.deleted
	}
	return k.req > o.req
}

// Fence kinds: the fence hash's "deleted" field.
const (
	fenceSave   = "0"
	fenceDelete = "1"
	fenceLapsed = "2" // a save that arrived past its deadline: fenced, never stored
)

// fence is a session's fence as read from the store: the request that set it.
type fence struct {
	found    bool
	seq      int64
	kind     string // fenceSave, fenceDelete or fenceLapsed
	req      string // "" from workers that do not record it
	deadline string // ms since the epoch while the session's value is live
}

// parseFence reads HMGET seq, deleted, req[, deadline]; a fence without a seq is none.
func parseFence(items []interface{}) (fence, error) {
	seq, found, err := replyInt(items[0])
	if err != nil || !found {
		return fence{}, err
	}
	f := fence{found: true, seq: seq}
	if f.kind, err = replyText(items[1]); err != nil {
		return fence{}, err
	}
	if f.req, err = replyText(items[2]); err != nil {
		return fence{}, err
	}
	if len(items) > 3 {
		if f.deadline, err = replyText(items[3]); err != nil {
			return fence{}, err
		}
	}
	return f, nil
}

// key is the order key of the request that set the fence: a lapsed save ranks as a save.
func (f fence) key() orderKey { return orderKey{f.seq, f.kind == fenceDelete, f.req} }

// live says whether the fence's last request is a save whose value is live at now (ms).
func (f fence) live(now int64) bool {
	due, err := strconv.ParseFloat(f.deadline, 64)
	return f.found && f.kind == fenceSave && err == nil && due > float64(now)
}

// key is h's request's order key.
func (h Handle) key() orderKey { return orderKey{h.Seq, h.Task == TaskDelete, h.TaskID} }

// outcomeScript reads what WaitDurable needs from a single Redis in one round trip (the
// Python client pipelines the same two reads).
//
// KEYS[1] the session's fence hash; KEYS[2] its refusal records; ARGV[1] the request id.
// Returns {seq, deleted, req, refusal}, nil where absent.
const outcomeScript = `local f = redis.call('HMGET', KEYS[1], 'seq', 'deleted', 'req')
return {f[1], f[2], f[3], redis.call('HGET', KEYS[2], ARGV[1])}`

// readOutcome reads h's session's fence and h's refusal record, as outcomeScript's reply:
// in one script call on a single Redis. On a cluster both keys are in the session's slot,
// but they are read by two calls, one key each, as the Python client's pipeline does:
// while the slot migrates, a call naming both keys is refused (TRYAGAIN) as long as one of
// them is on each node, or missing from the node importing it. On a PostgreSQL store, see
// readOutcomePG.
func (c *Client[C]) readOutcome(ctx context.Context, h Handle) ([]interface{}, error) {
	if c.pg != nil {
		return c.readOutcomePG(ctx, h)
	}
	fenceKey, refusals := c.keys.fence(h.SessionID), c.keys.refusals(h.SessionID)
	if !c.keys.cluster {
		reply, err := c.cfg.Store.Eval(ctx, outcomeScript, []string{fenceKey, refusals}, h.TaskID)
		if err != nil {
			return nil, err
		}
		return replyList(reply, 4)
	}
	fenceReply, err := c.cfg.Store.Eval(ctx, hmgetScript, []string{fenceKey}, "seq", "deleted", "req")
	if err != nil {
		return nil, err
	}
	refusal, err := c.cfg.Store.Eval(ctx, hmgetScript, []string{refusals}, h.TaskID)
	if err != nil {
		return nil, err
	}
	f, err := replyList(fenceReply, 3)
	if err != nil {
		return nil, err
	}
	r, err := replyList(refusal, 1)
	if err != nil {
		return nil, err
	}
	return append(f, r[0]), nil
}

// decide reads readOutcome's items, the fence first (outcomes.decide): done is true once
// h's outcome is known (err is then nil or a *RefusedError); an err without done is a
// reply it cannot read. The fence is the session's own, so it decides before a refusal
// record: h is applied when the fence names it by its whole stamp, id, seq and kind (expired when that fence is a lapsed
// save's), superseded when the fence holds a request ordered after it, expired when its
// deadline is certainly past; only then does its refusal record say it was refused.
func (c *Client[C]) decide(h Handle, items []interface{}) (res Result, done bool, err error) {
	f, err := parseFence(items[:3])
	if err != nil {
		return Result{}, false, err
	}
	if f.found {
		c.clock.observe(h.SessionID, f.seq)
		res = Result{FenceSeq: f.seq, Deleted: f.kind == fenceDelete, Winner: f.req}
	}
	switch {
	case !f.found:
		if c.lapsed(h) {
			res.Outcome = Expired
		}
	case (f.req == h.TaskID || f.req == "") && f.seq == h.Seq && (f.kind == fenceDelete) == (h.Task == TaskDelete):
		// The fence is h's only when its whole stamp is: a request id alone may be another
		// request's (a faulty producer reusing it, issue 44). (Workers that do not record
		// the winner: the fence at this request's own stamp.)
		res.Outcome = Applied
		if f.kind == fenceLapsed {
			res.Outcome = Expired
		}
	case f.key().after(h.key()):
		res.Outcome = Superseded
	case c.lapsed(h):
		res.Outcome = Expired
	}
	if res.Outcome != "" {
		return res, true, nil
	}
	raw, present, err := replyBytes(items[3])
	if err != nil || !present {
		return res, false, err
	}
	var refusal struct {
		Kind, Reason, Entry string
		Seq                 *int64
	}
	if err := json.Unmarshal(raw, &refusal); err != nil {
		return res, false, fmt.Errorf("refusal record %q: %v", raw, err)
	}
	if refusal.Seq != nil && *refusal.Seq != h.Seq {
		// Another request of the session under the same id (a faulty producer reusing it):
		// not this one's refusal.
		return res, false, nil
	}
	if refusal.Kind == string(Lost) {
		res.Outcome = Lost // settled as lost by the sweep (tasks/orphans.py): never applied
		return res, true, nil
	}
	return res, true, &RefusedError{Handle: h, Kind: refusal.Kind, Reason: refusal.Reason, Entry: refusal.Entry}
}

// lapsed says whether h is a save certainly past its deadline: it can no longer apply. A
// delete applies at any age (outcomes.decide).
func (c *Client[C]) lapsed(h Handle) bool {
	return h.Task != TaskDelete && c.pastDeadline(h.Seq)
}

// pastDeadline says whether a request stamped seq is certainly past its deadline (seq +
// SessionTTL) by this producer's clock, less TombstoneTTL for clocks that disagree: it
// can no longer apply, whatever the fence says. A counter seq has no deadline.
func (c *Client[C]) pastDeadline(seq int64) bool {
	return c.deadlinePassed(seq, c.cfg.Now().UnixMilli()-c.cfg.TombstoneTTL.Milliseconds())
}

// deadlinePassed says whether a request stamped seq is past its deadline (seq + SessionTTL)
// at nowMs. A counter seq has no deadline.
func (c *Client[C]) deadlinePassed(seq, nowMs int64) bool {
	return seq >= seqTimeFloor && seq/1000+c.cfg.SessionTTL.Milliseconds() <= nowMs
}
