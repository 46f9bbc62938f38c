package checkpointq

import (
	"fmt"
	"sync"
	"time"
)

// MaxSeq is the largest seq the workers accept (2^53-1: exact as a Lua number and a float).
const MaxSeq = 1<<53 - 1

// pruneAt bounds the per-session memory: past this many sessions, those whose last seen
// seq the clock has passed (and which therefore no longer raise a stamp) are forgotten.
const pruneAt = 100_000

// seqClock stamps requests with a hybrid logical clock: seq = max(now µs, the last seq
// this process stamped + 1, the last seq seen for the session + 1). "Seen" is every fence
// that a Load or WaitDurable read, so a save that follows a load always sorts after the
// write it loaded, however far this replica's clock lags the one that made that write.
type seqClock struct {
	now  func() time.Time
	mu   sync.Mutex
	last int64
	seen map[string]int64
	// wallClockOnly ignores the fences seen: the old rule, kept for the skew experiment.
	wallClockOnly bool
}

func newSeqClock(now func() time.Time) *seqClock {
	return &seqClock{now: now, seen: make(map[string]int64)}
}

// observe records that sessionID's fence was at seq.
func (c *seqClock) observe(sessionID string, seq int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if seq > c.seen[sessionID] {
		c.seen[sessionID] = seq
	}
	if len(c.seen) > pruneAt {
		now := c.now().UnixMicro()
		for id, s := range c.seen {
			if s < now {
				delete(c.seen, id)
			}
		}
	}
}

// next stamps a request for sessionID that must sort after `after` (0: no constraint).
func (c *seqClock) next(sessionID string, after int64) (int64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	seq := c.now().UnixMicro()
	seen := c.seen[sessionID]
	if c.wallClockOnly {
		seen = 0
	}
	for _, floor := range []int64{c.last, seen, after} {
		if seq <= floor {
			seq = floor + 1
		}
	}
	if seq < 0 || seq > MaxSeq {
		return 0, fmt.Errorf("%w: seq %d is outside [0, 2^53-1]", ErrInvalidInput, seq)
	}
	c.last = seq
	// c.last now covers this session: its entry can go.
	delete(c.seen, sessionID)
	return seq, nil
}
