package checkpointq

import (
	"context"
	"errors"
	"log"
	"sync"
	"sync/atomic"
	"time"
)

// The recovery window (issue 44; pending.py's RecentPublishes): a broker can come back
// with a prefix of what it accepted (a machine crash inside its fsync window, a failover to
// a lagging replica). The client detects it (epochs) and publishes again what it published
// lately: harmless for the requests that were not lost, since each is the same request
// again (same id and stamp: its entry is kept, and a worker settles the duplicate as
// applied or superseded).

// The recovery window's defaults, the Python producers' (CHECKPOINTQ_REPUBLISH_SECONDS,
// _REQUESTS, _BYTES): the publishes of the last 10 s, at most 10,000 of them and 64 MiB of
// messages and values. 10 s covers Redis's everysec fsync (1 s, up to 2 s more when an
// fsync is slow) and a replica's usual lag; a loss further back is detected and counted
// all the same.
const (
	DefaultRepublishWindow   = 10 * time.Second
	DefaultRepublishRequests = 10_000
	DefaultRepublishBytes    = 64 << 20
)

// published is one request as it was published: enough to publish it again.
type published struct {
	at    time.Time // monotonic: the window's age is not the stamping clock's
	h     Handle
	msg   []byte
	value []byte
	size  int
}

// recentPublishes keeps the requests published lately, oldest first, bounded by age, count
// and bytes (the oldest go first). Keeping one costs an append of what the publish built
// anyway. Safe for concurrent use.
type recentPublishes struct {
	window   time.Duration
	requests int
	maxBytes int

	mu    sync.Mutex
	kept  []published // kept[head:] are in the window
	head  int
	bytes int // of messages and values kept now

	recovering  sync.Mutex // held while the window is published again
	republished atomic.Int64
}

func newRecentPublishes(window time.Duration, requests, maxBytes int) *recentPublishes {
	if window == 0 {
		window = DefaultRepublishWindow
	}
	if requests == 0 {
		requests = DefaultRepublishRequests
	}
	if maxBytes == 0 {
		maxBytes = DefaultRepublishBytes
	}
	return &recentPublishes{window: window, requests: requests, maxBytes: maxBytes}
}

func (r *recentPublishes) add(h Handle, msg, value []byte) {
	if r.requests <= 0 || r.window <= 0 {
		return
	}
	now := time.Now()
	size := len(msg) + len(value)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.kept = append(r.kept, published{at: now, h: h, msg: msg, value: value, size: size})
	r.bytes += size
	r.trim(now)
}

func (r *recentPublishes) trim(now time.Time) {
	oldest := now.Add(-r.window)
	for r.head < len(r.kept) {
		first := &r.kept[r.head]
		if len(r.kept)-r.head <= r.requests && r.bytes <= r.maxBytes && !first.at.Before(oldest) {
			break
		}
		r.bytes -= first.size
		*first = published{} // let the message and value go
		r.head++
	}
	if r.head == len(r.kept) {
		r.kept, r.head = r.kept[:0], 0
	} else if r.head > 1024 && r.head > len(r.kept)/2 {
		r.kept, r.head = append(r.kept[:0:0], r.kept[r.head:]...), 0
	}
}

// take returns the publishes still in the window, oldest first (they stay kept).
func (r *recentPublishes) take() []published {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.trim(time.Now())
	return append([]published(nil), r.kept[r.head:]...)
}

func (r *recentPublishes) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.kept) - r.head
}

// recover publishes again, oldest first, what this client published within its window,
// after a reply showed the broker lost accepted requests: those it still holds land after
// all. It returns how many went out. A request the broker now refuses (ErrSeqRefused: past
// its deadline by now, it could never apply) is skipped; any other failure stops it
// (logged: the loss is counted already). One goroutine recovers at a time: another that
// finds a loss meanwhile returns 0 at once (pending.py's recover).
func (c *Client[C]) recover(ctx context.Context) int {
	if !c.recent.recovering.TryLock() {
		return 0
	}
	defer c.recent.recovering.Unlock()
	sent := 0
	for _, kept := range c.recent.take() {
		token, err := newUUID()
		var msg []byte
		if err == nil {
			msg, err = withFreshTag(kept.msg)
		}
		if err == nil {
			keys, args := c.publishCall(kept.h, msg, token, kept.value)
			_, err = c.publish(ctx, kept.h, keys, args)
		}
		if errors.Is(err, ErrReplicationTimeout) {
			err = nil // on the primary again: sent, as the Python producers count it
		}
		if errors.Is(err, ErrSeqRefused) {
			continue
		} else if err != nil {
			c.logf("checkpointq: republished %d requests, then: %v", sent, err)
			break
		}
		sent++
	}
	c.recent.republished.Add(int64(sent))
	window := c.recent.window
	if window < 0 {
		window = 0
	}
	c.logf("checkpointq: the broker lost accepted requests: republished the %d this producer "+
		"published in the last %s", sent, window)
	return sent
}

// Republished counts the requests this client published again, in all, after it found
// that the broker had lost accepted requests (its recovery window: Config.RepublishWindow).
func (c *Client[C]) Republished() int64 { return c.recent.republished.Load() }

func (c *Client[C]) logf(format string, args ...interface{}) {
	if c.cfg.Logf != nil {
		c.cfg.Logf(format, args...)
	} else {
		log.Printf(format, args...)
	}
}
