package checkpointq

import (
	"fmt"
	"sync"
	"time"
)

// MaxSeq is the largest seq the workers accept (2^53-1: exact as a Lua number and a float).
const MaxSeq = 1<<53 - 1

// pruneAt bounds the per-session memory: past this many sessions, those whose floor the
// clock has passed (and which therefore no longer raise a stamp) are forgotten.
const pruneAt = 100_000

// seqClock stamps requests with a hybrid logical clock, per session (tasks/producer/
// clock.py's SeqClock): seq = max(now µs, floor(session) + 1, after + 1), where the floor
// is the highest of the fences a Load or WaitDurable read for the session and of the seqs
// stamped for it. So a save that follows a load sorts after the write it loaded, however
// far this replica's clock lags the one that made that write.
//
// The floor is the session's own: a fence read for one session never raises another's
// stamps (issue 31: one fast clock's fence, adopted process-wide, had a healthy replica
// stamp every session an hour ahead, and every one refused). The broker bounds the fences
// anyway: it refuses the publish of a producer whose clock runs ahead (publish.lua).
type seqClock struct {
	now    func() time.Time
	mu     sync.Mutex
	floors map[string]int64
	// wallClockOnly ignores the fences seen: the old rule, kept for the skew experiment.
	wallClockOnly bool
}

func newSeqClock(now func() time.Time) *seqClock {
	return &seqClock{now: now, floors: make(map[string]int64)}
}

// observe records that sessionID's fence was at seq.
func (c *seqClock) observe(sessionID string, seq int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.wallClockOnly {
		c.raise(sessionID, seq)
	}
}

// raise lifts sessionID's floor to seq (c.mu held).
func (c *seqClock) raise(sessionID string, seq int64) {
	if floor, ok := c.floors[sessionID]; !ok || seq > floor {
		c.floors[sessionID] = seq
	}
	if len(c.floors) > pruneAt {
		now := c.now().UnixMicro()
		for id, floor := range c.floors {
			if floor < now {
				delete(c.floors, id)
			}
		}
	}
}

// next stamps a request for sessionID that must sort after `after` (0: no constraint).
func (c *seqClock) next(sessionID string, after int64) (int64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	seq := c.now().UnixMicro()
	for _, floor := range []int64{c.floors[sessionID], after} {
		if seq <= floor {
			seq = floor + 1
		}
	}
	if seq < 0 || seq > MaxSeq {
		return 0, fmt.Errorf("%w: seq %d is outside [0, 2^53-1]", ErrInvalidInput, seq)
	}
	c.raise(sessionID, seq)
	return seq, nil
}
