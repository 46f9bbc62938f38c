package checkpointq

import (
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// restart kills the server (kill -9: nothing saved on the way out) and starts it again on
// the same port and directory, so that it loads what its RDB file held: a broker that
// comes back with a prefix of what it accepted, as after a machine crash inside its fsync
// window or a failover to a lagging replica.
func (s *redisServer) restart(t *testing.T) {
	t.Helper()
	args := s.cmd.Args[1:]
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = exec.Command(s.cmd.Path, args...)
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if err := pollUntil(10*time.Second, "redis-server back on "+s.Addr, func() bool {
		_, err := s.Do("PING")
		return err == nil
	}); err != nil {
		t.Fatal(err)
	}
}

// logLines collects a client's log lines (Config.Logf).
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logf(format string, args ...interface{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
}

func (l *logLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

// goneBackInTime is a private broker and store with a client on them; then sessions
// s-0..s-4 at turn 1 and one more, "doomed"; the broker's snapshot (SAVE); turn 2 of every
// session and the doomed one deleted, all accepted; then the broker killed and started
// again from its snapshot.
func goneBackInTime(t *testing.T, cfg Config) (*Client[Checkpoint], *redisServer, *redisServer, []string, *logLines) {
	t.Helper()
	broker, store := privateRedis(t), privateRedis(t)
	brokerConn, storeConn := newRedigo(broker.Addr), newRedigo(store.Addr)
	t.Cleanup(func() { _ = brokerConn.Close(); _ = storeConn.Close() })
	logs := &logLines{}
	cfg.Broker, cfg.Store, cfg.Logf = brokerConn, storeConn, logs.logf
	c := New[Checkpoint](cfg)
	ctx := background(t)
	sessions := []string{"s-0", "s-1", "s-2", "s-3", "s-4"}
	for _, id := range append(sessions, "doomed") {
		if _, err := c.Save(ctx, sampleCheckpoint(id, 1, turns(1)...)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := broker.Do("SAVE"); err != nil {
		t.Fatal(err)
	}
	for _, id := range sessions {
		takeTurn(t, c, id, 1)
	}
	if err := c.Delete(ctx, "doomed"); err != nil {
		t.Fatal(err)
	}
	if cp, _ := mustLoad(t, c, "doomed"); cp != nil {
		t.Fatalf("Load(doomed) = %s before the crash", contents(cp))
	}
	broker.restart(t)
	// The adapter's pooled connections died with the server: new ones, as a client that
	// reconnects (go-redis's retries) would dial.
	old := brokerConn.pool
	brokerConn.pool = newRedigo(broker.Addr).pool
	_ = old.Close()
	return c, broker, store, sessions, logs
}

func TestABrokerGoneBackInTimeGetsBackWhatThisClientPublishedLately(t *testing.T) {
	// Given turn 2 of five sessions and a delete accepted, then lost with the broker's
	// suffix (its snapshot from before them)
	c, broker, store, sessions, logs := goneBackInTime(t, Config{})
	// When the client loads, then it finds the loss, counts it once, publishes its window
	// again (all 12 requests, oldest first), and serves turn 2 and no doomed session
	for _, id := range sessions {
		if cp, _ := mustLoad(t, c, id); contents(cp) != contents(sampleCheckpoint(id, 2, turns(2)...)) {
			t.Fatalf("Load(%s) = %s after the broker went back in time; want turn 2\nlog:\n%s", id, contents(cp), logs)
		}
	}
	if cp, _ := mustLoad(t, c, "doomed"); cp != nil {
		t.Fatalf("Load(doomed) = %s: a delete lost with the broker came undone", contents(cp))
	}
	if c.EpochChanges() != 1 || c.Republished() != 12 {
		t.Fatalf("%d epoch changes, %d republished; want 1 and 12", c.EpochChanges(), c.Republished())
	}
	for _, want := range []string{"the broker went back in time", "republished the 12 this producer published"} {
		if !strings.Contains(logs.String(), want) {
			t.Fatalf("the log lacks %q:\n%s", want, logs)
		}
	}
	// And a worker then applies every turn, and the delete: the store holds turn 2
	for _, id := range sessions {
		takeTurn(t, c, id, 2)
	}
	w, err := startWorker(broker.URL(), store.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Stop)
	readerConn := newRedigo(store.Addr)
	t.Cleanup(func() { _ = readerConn.Close() })
	reader := New[Checkpoint](Config{Broker: readerConn, Store: readerConn})
	err = pollUntil(60*time.Second, "every turn in the store", func() bool {
		if n, err := broker.Do("LLEN", "checkpoints"); err != nil || n.(int64) != 0 {
			return false
		}
		for _, id := range append(sessions, "doomed") {
			want := contents(sampleCheckpoint(id, 3, turns(3)...))
			if id == "doomed" {
				want = contents(nil)
			}
			// The store alone: a broker with nothing pending for it (reader's broker is the
			// store, which holds no pending records).
			if cp, _, err := reader.LoadWithSeq(background(t), id); err != nil || contents(cp) != want {
				return false
			}
		}
		return true
	})
	if err != nil {
		t.Fatalf("%v\nworker log:\n%s", err, w.Log())
	}
	if c.EpochChanges() != 1 {
		t.Fatalf("%d epoch changes, want 1", c.EpochChanges())
	}
}

func TestARecoveryWindowKeepsItsBounds(t *testing.T) {
	// Given windows bounded by count, by bytes, by age, and none
	byCount := newRecentPublishes(time.Hour, 3, 1<<20)
	byBytes := newRecentPublishes(time.Hour, 100, 250)
	byAge := newRecentPublishes(time.Millisecond, 100, 1<<20)
	none := newRecentPublishes(-1, 0, 0)
	for i := 0; i < 5; i++ {
		h := Handle{TaskID: fmt.Sprint(i)}
		for _, r := range []*recentPublishes{byCount, byBytes, byAge, none} {
			r.add(h, make([]byte, 60), make([]byte, 40))
		}
	}
	ids := func(r *recentPublishes) string {
		var out []string
		for _, p := range r.take() {
			out = append(out, p.h.TaskID)
		}
		return strings.Join(out, " ")
	}
	// Then each keeps the newest that fit, oldest first
	if got := ids(byCount); got != "2 3 4" {
		t.Fatalf("by count: %q", got)
	}
	if got := ids(byBytes); got != "3 4" || byBytes.bytes != 200 {
		t.Fatalf("by bytes: %q, %d bytes", got, byBytes.bytes)
	}
	if err := pollUntil(time.Second, "the age bound", func() bool { return len(byAge.take()) == 0 }); err != nil {
		t.Fatal(err)
	}
	if none.len() != 0 {
		t.Fatalf("a window turned off kept %d", none.len())
	}
}

func TestAClientWithoutAWindowDetectsButDoesNotRecover(t *testing.T) {
	// Given the same loss, with the window turned off
	c, _, _, sessions, _ := goneBackInTime(t, Config{RepublishWindow: -1})
	// Then loads find and count it, and serve what the broker kept: turn 1
	for _, id := range sessions {
		if cp, _ := mustLoad(t, c, id); contents(cp) != contents(sampleCheckpoint(id, 1, turns(1)...)) {
			t.Fatalf("Load(%s) = %s; want turn 1 (nothing republished)", id, contents(cp))
		}
	}
	if c.EpochChanges() != 1 || c.Republished() != 0 {
		t.Fatalf("%d epoch changes, %d republished; want 1 and 0", c.EpochChanges(), c.Republished())
	}
}

func TestALossThatUnawarePublishesCoverUpIsFoundByTheMarksToken(t *testing.T) {
	// Given this client's last six publishes (marks 7-12) lost with the broker's suffix
	c, broker, store, sessions, logs := goneBackInTime(t, Config{})
	// And another client, which saw none of them, publishing six times: the pending mark
	// is back at 12, the one this client saw (tests/model/README.md, finding 7)
	brokerConn, storeConn := newRedigo(broker.Addr), newRedigo(store.Addr)
	t.Cleanup(func() { _ = brokerConn.Close(); _ = storeConn.Close() })
	other := New[Checkpoint](Config{Broker: brokerConn, Store: storeConn})
	for n := 0; n < 6; n++ {
		if _, err := other.Save(background(t), sampleCheckpoint(fmt.Sprintf("other-%d", n), 1, turns(1)...)); err != nil {
			t.Fatal(err)
		}
	}
	if mark, err := broker.Do("HGET", c.keys.pendingMark(), "n"); err != nil || string(mark.([]byte)) != "12" {
		t.Fatalf("pending mark %v (%v); want 12", mark, err)
	}
	// When this client loads, then the mark's token shows the loss: counted once, the
	// window published again, turn 2 served
	for _, id := range sessions {
		if cp, _ := mustLoad(t, c, id); contents(cp) != contents(sampleCheckpoint(id, 2, turns(2)...)) {
			t.Fatalf("Load(%s) = %s after the broker went back in time; want turn 2\nlog:\n%s", id, contents(cp), logs)
		}
	}
	if c.EpochChanges() != 1 || c.Republished() != 12 {
		t.Fatalf("%d epoch changes, %d republished; want 1 and 12\nlog:\n%s", c.EpochChanges(), c.Republished(), logs)
	}
	// And the republish turned the epoch: the other client counts the loss once too
	if _, err := other.Load(background(t), "other-0"); err != nil || other.EpochChanges() != 1 {
		t.Fatalf("the other client: %d epoch changes (%v); want 1", other.EpochChanges(), err)
	}
}

func TestAMarkSeenHeldByAnotherPublishIsOneLossReportedWithItsToken(t *testing.T) {
	var e epochs
	e.observeMark("e1", 9, 1, false, "a9", nil)
	seen := e.floor()
	if seen != (seenMark{9, "a9"}) {
		t.Fatalf("floor %+v, want mark 9 with its token", seen)
	}
	// A read answering mark 12, and that mark 9 holds another publish: one loss
	if !e.observeMark("e1", 12, seen.mark, false, "c12", &seen) || e.changes.Load() != 1 {
		t.Fatalf("the forked mark was not counted once (%d)", e.changes.Load())
	}
	// A concurrent read sent before it, answered after: the same loss
	if e.observeMark("e1", 12, seen.mark, false, "", &seen) || e.changes.Load() != 1 {
		t.Fatalf("the same loss counted again (%d)", e.changes.Load())
	}
	// The next publish sends the lost mark and token, for the script to turn the epoch,
	// which is that loss again, not a new one
	if epoch, mark, token := e.seen(); epoch != "e1" || mark != 9 || token != "a9" {
		t.Fatalf("seen() = %q %d %q, want e1 9 a9", epoch, mark, token)
	}
	if e.observeMark("e2", 13, 13, true, "d13", nil) || e.changes.Load() != 1 {
		t.Fatalf("the reported loss counted again (%d)", e.changes.Load())
	}
	if _, mark, token := e.seen(); mark != 13 || token != "d13" {
		t.Fatalf("seen() = %d %q after the report, want 13 d13", mark, token)
	}
}
