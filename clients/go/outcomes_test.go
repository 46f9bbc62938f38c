package checkpointq

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// skewedTurns runs the apiserver's pattern with two replicas whose clocks are 2 s apart:
// they take turns on one session, each turn load -> bump version -> save -> wait. Every
// save comes strictly after the previous one in real time. It returns how many saves did
// not end as the session's value.
func skewedTurns(t *testing.T, turns int, wallClockOnly bool) (lost int) {
	t.Helper()
	ctx := background(t)
	fast := newClient[Checkpoint](t, Config{})
	slow := newClient[Checkpoint](t, Config{Now: func() time.Time { return time.Now().Add(-2 * time.Second) }})
	fast.clock.wallClockOnly, slow.clock.wallClockOnly = wallClockOnly, wallClockOnly
	id := sessionID(t, "skew")
	for turn := 0; turn < turns; turn++ {
		replica := fast
		if turn%2 == 1 {
			replica = slow
		}
		cp, err := replica.Load(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if cp == nil {
			cp = sampleCheckpoint(id, 0)
		}
		cp.Version++
		h, err := replica.SaveAsync(ctx, cp)
		if err != nil {
			t.Fatal(err)
		}
		res, err := replica.WaitDurable(ctx, h)
		if err != nil {
			t.Fatal(err)
		}
		got, err := replica.Load(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if got.Version != cp.Version {
			lost++
			if res.Outcome != Superseded {
				t.Fatalf("turn %d: save lost but WaitDurable said %s", turn, res.Outcome)
			}
		} else if res.Outcome != Applied {
			t.Fatalf("turn %d: save applied but WaitDurable said %s", turn, res.Outcome)
		}
	}
	return lost
}

func TestSkewedReplicasLoseNoSave(t *testing.T) {
	const turns = 20
	before := skewedTurns(t, turns, true)
	after := skewedTurns(t, turns, false)
	t.Logf("skew experiment (clocks 2 s apart, %d alternating saves): wall-clock seq lost %d, causal seq lost %d",
		turns, before, after)
	if before == 0 {
		t.Fatal("the wall-clock experiment lost nothing: the test no longer reproduces the skew")
	}
	if after != 0 {
		t.Fatalf("causal seq lost %d of %d saves", after, turns)
	}
}

func TestWaitDurableTellsAppliedFromSuperseded(t *testing.T) {
	appliedThenSuperseded(t, newClient[Checkpoint](t, Config{}))
}

// appliedThenSuperseded saves a session twice, then deletes it, checking each request's
// outcome as the next one lands.
func appliedThenSuperseded(t *testing.T, c *Client[Checkpoint]) {
	t.Helper()
	ctx := background(t)
	id := sessionID(t, "s")
	_, newer := savedTwice(t, c, id)
	del, err := c.DeleteAsync(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if res := mustWait(t, c, del, Applied); !res.Deleted {
		t.Fatalf("delete applied but fence says %+v", res)
	}
	mustWait(t, c, newer, Superseded)
}

// savedTwice saves session id twice and checks that the newer save is applied (the fence
// at its seq) and the older superseded.
func savedTwice(t *testing.T, c *Client[Checkpoint], id string) (older, newer Handle) {
	t.Helper()
	ctx := background(t)
	older, err := c.SaveAsync(ctx, sampleCheckpoint(id, 1))
	if err != nil {
		t.Fatal(err)
	}
	if newer, err = c.SaveAsync(ctx, sampleCheckpoint(id, 2)); err != nil {
		t.Fatal(err)
	}
	res := mustWait(t, c, newer, Applied)
	if res.FenceSeq != newer.Seq {
		t.Fatalf("fence at %d, want the newer save's %d", res.FenceSeq, newer.Seq)
	}
	mustWait(t, c, older, Superseded)
	return older, newer
}

func TestWaitDurableIsBoundedWhenNobodyApplies(t *testing.T) {
	// A queue no worker reads: the request is never applied.
	c := newClient[Checkpoint](t, Config{Queue: "nobody-reads-this"})
	ctx := background(t)
	h, err := c.SaveAsync(ctx, sampleCheckpoint(sessionID(t, "x"), 1))
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = c.WaitDurable(short, h)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "not durable yet") {
		t.Fatalf("err = %v, want a deadline error saying the request is not durable yet", err)
	}
	if _, err := env.broker.Do("DEL", "nobody-reads-this"); err != nil {
		t.Fatal(err)
	}
}

func TestBrokerDownFailsWithinThePublishTimeout(t *testing.T) {
	down := newRedigo(closedAddr(t))
	c := New[Checkpoint](Config{Broker: down, PublishTimeout: time.Second})
	_, err := c.Save(background(t), sampleCheckpoint(sessionID(t, "x"), 1))
	if !errors.Is(err, ErrBrokerUnavailable) || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("err = %v, want ErrBrokerUnavailable naming the refused connection", err)
	}
}

func TestSilentBrokerFailsWithinThePublishTimeout(t *testing.T) {
	silent := newRedigo(silentListener(t))
	c := New[Checkpoint](Config{Broker: silent, PublishTimeout: 500 * time.Millisecond})
	err := c.Delete(background(t), sessionID(t, "x"))
	if !errors.Is(err, ErrBrokerUnavailable) || !strings.Contains(err.Error(), "timeout") {
		t.Fatalf("err = %v, want ErrBrokerUnavailable after a timeout", err)
	}
}

func TestSilentStoreFailsReadsWithinTheirTimeout(t *testing.T) {
	silent := newRedigo(silentListener(t))
	c := New[Checkpoint](Config{Broker: silent, Store: silent, ReadTimeout: 300 * time.Millisecond})
	ctx := background(t)
	if _, err := c.Load(ctx, "x"); !errors.Is(err, ErrStoreUnavailable) {
		t.Fatalf("Load: err = %v, want ErrStoreUnavailable", err)
	}
	if _, err := c.List(ctx); !errors.Is(err, ErrStoreUnavailable) {
		t.Fatalf("List: err = %v, want ErrStoreUnavailable", err)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	h := Handle{TaskID: "t", Task: TaskSave, SessionID: "x", Seq: 1}
	if _, err := c.WaitDurable(short, h); !errors.Is(err, ErrStoreUnavailable) {
		t.Fatalf("WaitDurable: err = %v, want ErrStoreUnavailable", err)
	}
}

// aheadClock is a producer clock 10 minutes ahead: the broker allows 2.5 (half the
// workers' 5) and refuses its requests at publish.
func aheadClock() time.Time { return time.Now().Add(10 * time.Minute) }

// misconfiguredAhead is a producer whose clock runs 6.5 minutes ahead and whose
// MaxSeqAhead is set to 20, above the workers' 5: the broker takes what a worker refuses
// (tests/worker/test_outcomes_e2e.py makes its refused request alike).
var misconfiguredAhead = Config{
	Now:         func() time.Time { return time.Now().Add(390 * time.Second) },
	MaxSeqAhead: 20 * time.Minute,
}

// mustBeRefused saves a checkpoint with ahead, whose seq is ahead of the workers' limit
// (misconfiguredAhead), and checks that WaitDurable says why the worker refused it.
func mustBeRefused(t *testing.T, ahead *Client[Checkpoint]) *RefusedError {
	t.Helper()
	ctx := background(t)
	h, err := ahead.SaveAsync(ctx, sampleCheckpoint(sessionID(t, "ahead"), 1))
	if err != nil {
		t.Fatal(err)
	}
	_, err = ahead.WaitDurable(ctx, h)
	var refused *RefusedError
	if !errors.As(err, &refused) || !errors.Is(err, ErrRefused) {
		t.Fatalf("err = %v, want a *RefusedError", err)
	}
	if refused.Kind != "invalid_input" || !strings.Contains(refused.Reason, "ahead") || refused.Entry == "" {
		t.Fatalf("refusal = %+v", refused)
	}
	return refused
}

func TestWaitDurableRaisesWithTheReasonOfARefusedRequest(t *testing.T) {
	refused := mustBeRefused(t, newClient[Checkpoint](t, misconfiguredAhead))
	entries, err := redis.Values(env.store.Do("XRANGE", DefaultPrefix+".cq:dead-letters", refused.Entry, refused.Entry))
	if err != nil || len(entries) != 1 {
		t.Fatalf("dead letter %s: %v, %v", refused.Entry, entries, err)
	}
}

func TestAProducerWhoseClockRunsAheadIsRefusedAtOnce(t *testing.T) {
	// Given a producer whose clock runs 10 minutes ahead (the workers allow 5), publishing
	// to a queue no worker reads
	conn := newRedigo(env.broker.Addr)
	t.Cleanup(func() { _ = conn.Close() })
	broker := &countingRedis{Redis: conn}
	cfg := Config{Broker: broker, Queue: "held-" + t.Name(), Now: aheadClock, PublishTimeout: time.Minute}
	fast, healthy := newClient[Checkpoint](t, cfg), newClient[Checkpoint](t, Config{})
	ctx := background(t)
	id := sessionID(t, "fast")
	// When it saves or deletes
	_, saveErr := fast.SaveAsync(ctx, sampleCheckpoint(id, 1, "hi"))
	_, deleteErr := fast.DeleteAsync(ctx, id)
	// Then the broker refuses each at once (one call each, never retried), naming the clock
	for call, err := range map[string]error{"SaveAsync": saveErr, "DeleteAsync": deleteErr} {
		if !errors.Is(err, ErrSeqRefused) || !errors.Is(err, ErrInvalidInput) || errors.Is(err, ErrBrokerUnavailable) ||
			!strings.Contains(err.Error(), "clock is 600") || !strings.Contains(err.Error(), "ahead of the broker's") {
			t.Fatalf("%s: err = %v, want ErrSeqRefused naming the clock 600 s ahead", call, err)
		}
	}
	if n := broker.evals.Load(); n != 2 {
		t.Fatalf("%d publishes, want 2: a refusal was retried", n)
	}
	// And nothing was queued, nothing is pending: no load sees it, none adopts its seq
	for key, what := range map[string]string{cfg.Queue: "LLEN", DefaultPrefix + ".cq:pending-requests:" + id: "EXISTS"} {
		if n, err := redis.Int(env.broker.Do(what, key)); n != 0 || err != nil {
			t.Fatalf("%s %s = %d, %v; want 0", what, key, n, err)
		}
	}
	if cp, seq := mustLoad(t, healthy, id); cp != nil || seq != 0 || mustList(t, healthy)[id] {
		t.Fatalf("a refused save is seen: Load = %+v at seq %d, listed %v", cp, seq, mustList(t, healthy)[id])
	}
}

func TestLoadScriptIsTheStoresOwn(t *testing.T) {
	shared, err := os.ReadFile("../../store/lua/load.lua")
	if err != nil {
		t.Fatal(err)
	}
	if string(shared) != loadScript {
		t.Fatal("loadScript differs from store/lua/load.lua: copy the file into redis.go")
	}
}

func TestWaitDurableDecidesByTheFenceFirstInTheFullOrder(t *testing.T) {
	now := time.UnixMicro(1_800_000_000_000_000)
	seq := now.UnixMicro()
	save := Handle{TaskID: "m", Task: TaskSave, SessionID: "s", Seq: seq}
	del := Handle{TaskID: "m", Task: TaskDelete, SessionID: "s", Seq: seq}
	old := Handle{TaskID: "m", Task: TaskSave, SessionID: "s", Seq: seq - (31 * 24 * time.Hour).Microseconds()}
	oldDel := Handle{TaskID: "m", Task: TaskDelete, SessionID: "s", Seq: old.Seq}
	refusal := `{"kind":"invalid_input","reason":"bad","entry":"1-0"}`
	fence := func(seq int64, kind, req string) []interface{} {
		return []interface{}{fmt.Sprint(seq), kind, req}
	}
	for _, tc := range []struct {
		name    string
		h       Handle
		fence   []interface{} // seq, deleted, req; nil: none
		refusal interface{}
		want    Outcome // "" with refused false: still pending
		refused bool
	}{
		{"the fence names it", save, fence(seq, "0", "m"), nil, Applied, false},
		{"the fence names it, a lapsed save", save, fence(seq, "2", "m"), nil, Expired, false},
		{"an older worker's fence at its seq", save, fence(seq, "0", ""), nil, Applied, false},
		{"a later seq", save, fence(seq+1, "0", "a"), nil, Superseded, false},
		{"a delete stamped alike", save, fence(seq, "1", "a"), nil, Superseded, false},
		{"a save stamped alike, ordered after by its id", save, fence(seq, "0", "z"), nil, Superseded, false},
		{"a save stamped alike, ordered before by its id", save, fence(seq, "0", "a"), nil, "", false},
		{"a lapsed save stamped alike ranks as a save", del, fence(seq, "2", "z"), nil, "", false},
		{"a save stamped alike, for a delete", del, fence(seq, "0", "z"), nil, "", false},
		{"another delete stamped alike, ordered after", del, fence(seq, "1", "z"), nil, Superseded, false},
		{"its id reused by a request ordered after", save, fence(seq+1, "0", "m"), nil, Superseded, false},
		{"its id reused by a request ordered before", save, fence(seq-1, "0", "m"), nil, "", false},
		{"its id reused by a delete stamped alike", save, fence(seq, "1", "m"), nil, Superseded, false},
		{"a delete, its id reused by a save stamped alike", del, fence(seq, "0", "m"), nil, "", false},
		{"a delete the fence names", del, fence(seq, "1", "m"), nil, Applied, false},
		{"no fence", save, nil, nil, "", false},
		{"no fence, past its deadline and the margin", old, nil, nil, Expired, false},
		{"an older fence, past its deadline and the margin", old, fence(old.Seq-1, "0", "a"), nil, Expired, false},
		{"a delete past its deadline still applies", oldDel, fence(old.Seq-1, "0", "a"), nil, "", false},
		{"a delete past its deadline, no fence", oldDel, nil, nil, "", false},
		{"no fence, a refusal record", save, nil, refusal, "", true},
		{"no fence, a refusal record of its seq", save, nil, fmt.Sprintf(`{"kind":"invalid_input","reason":"bad","entry":"1-0","seq":%d}`, seq), "", true},
		{"no fence, a refusal record of another request under its id", save, nil, fmt.Sprintf(`{"kind":"invalid_input","reason":"bad","entry":"1-0","seq":%d}`, seq+7), "", false},
		{"a fence ordered after, and a refusal record", save, fence(seq+1, "0", "a"), refusal, Superseded, false},
		{"no fence, its record settled as lost (a purge)", save, nil, fmt.Sprintf(`{"kind":"lost","reason":"gone","entry":"1-0","seq":%d}`, seq), Lost, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := New[Checkpoint](Config{Broker: &failingRedis{}, Now: func() time.Time { return now }})
			items := tc.fence
			if items == nil {
				items = []interface{}{nil, nil, nil}
			}
			res, done, err := c.decide(tc.h, append(append([]interface{}{}, items...), tc.refusal))
			var refused *RefusedError
			switch {
			case tc.refused:
				if !done || !errors.As(err, &refused) || refused.Reason != "bad" || refused.Entry != "1-0" {
					t.Fatalf("decide = %+v, %v, %v; want refused", res, done, err)
				}
			case err != nil || done != (tc.want != "") || res.Outcome != tc.want:
				t.Fatalf("decide = %+v, done %v, %v; want %q", res, done, err, tc.want)
			}
		})
	}
}

// Issue 44: a request whose id a later request reuses (a faulty producer, here a raw
// envelope as any language may push) stays superseded: the fence names the id, but not
// the request's stamp.
func TestWaitDurableTellsARequestFromAnotherUnderItsID(t *testing.T) {
	c := newClient[Checkpoint](t, Config{})
	held := &captureRedis{}
	reuser := newClient[Checkpoint](t, Config{Broker: held})
	ctx := background(t)
	id := sessionID(t, "reused")
	older, newer := savedTwice(t, c, id)
	// When a later save goes out under the superseded request's id
	later, err := reuser.SaveAsync(ctx, sampleCheckpoint(id, 3))
	if err != nil {
		t.Fatal(err)
	}
	msg := strings.ReplaceAll(string(held.messages()[0]), later.TaskID, older.TaskID)
	if _, err := env.broker.Do("LPUSH", "checkpoints", msg); err != nil {
		t.Fatal(err)
	}
	reused := later
	reused.TaskID = older.TaskID
	if res := mustWait(t, c, reused, Applied); res.Winner != older.TaskID {
		t.Fatalf("the reused id's save: %+v", res)
	}
	// Then the older request is still superseded, and so is the newer one
	mustWait(t, c, older, Superseded)
	mustWait(t, c, newer, Superseded)
}
