package checkpointq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// replyError is a Redis error reply as the Redis clients return it: the server's text as
// is (redigo's redis.Error, go-redis's proto.RedisError).
type replyError string

func (e replyError) Error() string { return string(e) }

// failingRedis answers every call with err, counting the calls.
type failingRedis struct {
	err   error
	calls atomic.Int64
}

func (f *failingRedis) Eval(context.Context, string, []string, ...interface{}) (interface{}, error) {
	f.calls.Add(1)
	return nil, f.err
}

func (f *failingRedis) ZScan(context.Context, string, uint64, int64) ([]string, uint64, error) {
	f.calls.Add(1)
	return nil, 0, f.err
}

func TestErrorRepliesAreRetriedOnlyWhenTheNextAttemptMaySucceed(t *testing.T) {
	connRefused := fmt.Errorf("dial tcp 127.0.0.1:1: connect: %w", syscall.ECONNREFUSED)
	cases := []struct {
		err     error
		server  string
		cluster bool
		retried bool
		hint    string // in the error's text when not retried
	}{
		{connRefused, "store", false, true, ""},
		{fmt.Errorf("read tcp 127.0.0.1:1: %w", syscall.ECONNRESET), "store", false, true, ""},
		{errors.New("read tcp 127.0.0.1:1->127.0.0.1:2: i/o timeout"), "store", false, true, ""},
		{context.DeadlineExceeded, "store", false, true, ""},
		{errors.New("EOF"), "broker", false, true, ""},
		{errors.New("redigo: connection pool exhausted"), "store", false, true, ""},
		{replyError("LOADING Redis is loading the dataset in memory"), "store", false, true, ""},
		{replyError("TRYAGAIN Multiple keys request during rehashing of slot"), "store", true, true, ""},
		{replyError("CLUSTERDOWN The cluster is down"), "store", true, true, ""},
		{replyError("BUSY Redis is busy running a script."), "store", false, true, ""},
		{replyError("READONLY You can't write against a read only replica."), "broker", false, true, ""},
		{replyError("MASTERDOWN Link with MASTER is down"), "store", false, true, ""},
		{replyError("OOM command not allowed when used memory > 'maxmemory'."), "broker", false, true, ""},
		{replyError("ERR max number of clients reached"), "broker", false, true, ""},
		{replyError("MOVED 3999 127.0.0.1:7001"), "store", true, true, ""},
		{replyError("ASK 3999 127.0.0.1:7001"), "store", true, true, ""},

		{replyError("CROSSSLOT Keys in request don't hash to the same slot"), "store", false, false, "set Config.Cluster"},
		{replyError("MOVED 3999 127.0.0.1:7001"), "store", false, false, "set Config.Cluster"},
		{replyError("ASK 3999 127.0.0.1:7001"), "store", false, false, "set Config.Cluster"},
		{replyError("MOVED 3999 127.0.0.1:7001"), "broker", false, false, "must be a single Redis"},
		{replyError("CROSSSLOT Keys in request don't hash to the same slot"), "store", true, false, "please report it"},
		{replyError("NOAUTH Authentication required."), "store", false, false, "credentials"},
		{replyError("WRONGPASS invalid username-password pair or user is disabled."), "broker", false, false, "credentials"},
		{replyError("NOPERM this user has no permissions to run the 'evalsha' command"), "store", false, false, "credentials"},
		{replyError("WRONGTYPE Operation against a key holding the wrong kind of value"), "broker", false, false, "prefix and queue of its own"},
		{replyError("ERR unknown command 'EVALSHA', with args beginning with: "), "store", false, false, "lacks a command"},
		{replyError("NOSCRIPT No matching script. Please use EVAL."), "store", false, false, "fall back from EVALSHA"},
		{replyError("ERR user_script:1: Script attempted to access nonexistent global variable 'x'"), "store", false, false, "answer the same"},
		// An adapter that wraps the reply with %w: still read as the reply.
		{fmt.Errorf("evalsha: %w", replyError("NOAUTH Authentication required.")), "store", false, false, "credentials"},
	}
	for _, tc := range cases {
		c := New[Checkpoint](Config{Broker: &failingRedis{}, Cluster: tc.cluster})
		err := c.permanent(tc.server, "the test call", tc.err)
		name := fmt.Sprintf("%s from the %s (cluster %v)", tc.err, tc.server, tc.cluster)
		if tc.retried {
			if err != nil {
				t.Errorf("%s: not retried (%v), want retried", name, err)
			}
			continue
		}
		var refused *RedisError
		if !errors.As(err, &refused) || !errors.Is(err, ErrMisconfigured) || !errors.Is(err, tc.err) {
			t.Errorf("%s: %v, want a *RedisError wrapping it", name, err)
			continue
		}
		if !strings.Contains(err.Error(), tc.hint) || !strings.Contains(err.Error(), tc.err.Error()) {
			t.Errorf("%s: %q does not say %q", name, err, tc.hint)
		}
	}
}

func TestWaitDurableReportsAnErrorReplyAtOnce(t *testing.T) {
	// Given a store that answers CROSSSLOT, as a cluster does to a client without
	// Config.Cluster, and a wait with a deadline far away
	store := &failingRedis{err: replyError("CROSSSLOT Keys in request don't hash to the same slot")}
	c := New[Checkpoint](Config{Broker: store})
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	// When it waits
	_, err := c.WaitDurable(ctx, Handle{TaskID: "t", Task: TaskSave, SessionID: "s", Seq: 1})
	// Then the first failed read ends it, saying what to do
	var refused *RedisError
	if !errors.As(err, &refused) || refused.Code != "CROSSSLOT" || refused.Server != "store" ||
		!strings.Contains(err.Error(), "set Config.Cluster") || errors.Is(err, ErrStoreUnavailable) {
		t.Fatalf("err = %v, want a *RedisError for CROSSSLOT saying to set Config.Cluster", err)
	}
	if n := store.calls.Load(); n != 1 {
		t.Fatalf("%d reads, want 1: the error reply was retried", n)
	}
}

func TestWaitDurableRetriesATransientErrorUntilItsDeadline(t *testing.T) {
	store := &failingRedis{err: replyError("LOADING Redis is loading the dataset in memory")}
	c := New[Checkpoint](Config{Broker: store})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := c.WaitDurable(ctx, Handle{TaskID: "t", Task: TaskSave, SessionID: "s", Seq: 1})
	if !errors.Is(err, ErrStoreUnavailable) || errors.Is(err, ErrMisconfigured) || !strings.Contains(err.Error(), "LOADING") {
		t.Fatalf("err = %v, want ErrStoreUnavailable naming LOADING", err)
	}
	if n := store.calls.Load(); n < 2 {
		t.Fatalf("%d reads, want retries", n)
	}
}

func TestARedirectionClusterClientKeepsGettingSaysTheAdapterMustFollowIt(t *testing.T) {
	store := &failingRedis{err: replyError("MOVED 3999 127.0.0.1:7001")}
	noRecords := &replyingRedis{reply: []interface{}{nil, nil, nil, nil, nil, nil, nil, nil}} // a broker with no pending record
	c := New[Checkpoint](Config{Broker: noRecords, Store: store, Cluster: true})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, waitErr := c.WaitDurable(ctx, Handle{TaskID: "t", Task: TaskSave, SessionID: "s", Seq: 1})
	_, loadErr := c.Load(context.Background(), "s")
	for call, err := range map[string]error{"WaitDurable": waitErr, "Load": loadErr} {
		if !errors.Is(err, ErrStoreUnavailable) || !strings.Contains(err.Error(), "follow MOVED and ASK") {
			t.Fatalf("%s: err = %v, want ErrStoreUnavailable saying the adapter must follow MOVED", call, err)
		}
	}
}

func TestPublishReportsAnErrorReplyAtOnce(t *testing.T) {
	broker := &failingRedis{err: replyError("WRONGTYPE Operation against a key holding the wrong kind of value")}
	c := New[Checkpoint](Config{Broker: broker, PublishTimeout: time.Hour})
	_, err := c.SaveAsync(context.Background(), sampleCheckpoint("s", 1))
	var refused *RedisError
	if !errors.As(err, &refused) || refused.Server != "broker" || errors.Is(err, ErrBrokerUnavailable) ||
		!strings.Contains(err.Error(), `queue "checkpoints"`) {
		t.Fatalf("err = %v, want a *RedisError from the broker naming the queue", err)
	}
	if n := broker.calls.Load(); n != 1 {
		t.Fatalf("%d pushes, want 1", n)
	}
}

func TestReadsTellAnErrorReplyFromAnUnavailableStore(t *testing.T) {
	store := &failingRedis{err: replyError("NOAUTH Authentication required.")}
	c := New[Checkpoint](Config{Broker: store})
	ctx := context.Background()
	if _, err := c.Load(ctx, "s"); !errors.Is(err, ErrMisconfigured) || !strings.Contains(err.Error(), "credentials") {
		t.Fatalf("Load: err = %v, want ErrMisconfigured asking for credentials", err)
	}
	if _, err := c.List(ctx); !errors.Is(err, ErrMisconfigured) {
		t.Fatalf("List: err = %v, want ErrMisconfigured", err)
	}
	store.err = errors.New("dial tcp 127.0.0.1:1: connect: connection refused")
	if _, err := c.Load(ctx, "s"); !errors.Is(err, ErrStoreUnavailable) {
		t.Fatalf("Load: err = %v, want ErrStoreUnavailable", err)
	}
}

// replyingRedis answers every Eval with reply, counting the calls.
type replyingRedis struct {
	failingRedis
	reply interface{}
}

func (r *replyingRedis) Eval(_ context.Context, script string, _ []string, _ ...interface{}) (interface{}, error) {
	if script == identityScript || script == getScript {
		return nil, nil // the store-identity check's reads (identity.go), not the caller's
	}
	r.calls.Add(1)
	return r.reply, nil
}

func TestWaitDurableEndsAtTheFirstReadThatSettlesIt(t *testing.T) {
	h := Handle{TaskID: "t", Task: TaskSave, SessionID: "s", Seq: 1}
	for _, tc := range []struct {
		name  string
		reply []interface{} // outcomeScript's: seq, deleted, req, refusal
		want  error
	}{
		{"a refusal record", []interface{}{nil, nil, nil, `{"kind":"invalid_input","reason":"seq ahead","entry":"1-0"}`}, ErrRefused},
		{"a fence it cannot read", []interface{}{"not a number", nil, nil, nil}, ErrCorrupt},
		{"a refusal record it cannot read", []interface{}{nil, nil, nil, "kind=invalid_input"}, ErrCorrupt},
	} {
		// Given a store whose first answer settles the wait, and a deadline far away
		store := &replyingRedis{reply: tc.reply}
		c := New[Checkpoint](Config{Broker: store})
		ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
		// When it waits
		_, err := c.WaitDurable(ctx, h)
		cancel()
		// Then that answer is the result
		if !errors.Is(err, tc.want) || store.calls.Load() != 1 {
			t.Fatalf("%s: err = %v after %d reads, want %v after 1", tc.name, err, store.calls.Load(), tc.want)
		}
	}
}
