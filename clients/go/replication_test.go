package checkpointq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// Config.BrokerDurability Replicated against a real primary and its replica (replicaof),
// the replica frozen by SIGSTOP: a save returns once the replica has it, and one the
// replica cannot acknowledge returns ErrReplicationTimeout with its handle.
// frozenTimeout is how long a save waits for the broker's replica in these tests.
const frozenTimeout = 2 * time.Second

func TestReplicatedSavesWaitForTheBrokerReplica(t *testing.T) {
	primary := privateRedis(t)
	if _, err := primary.Do("CONFIG", "SET", "repl-diskless-sync-delay", "0"); err != nil {
		t.Fatal(err)
	}
	host, port, _ := strings.Cut(primary.Addr, ":")
	replica, err := startRedis("--replicaof", host, port)
	if err != nil {
		t.Fatal(err)
	}
	defer replica.Stop()
	err = pollUntil(30*time.Second, "the replica in sync", func() bool {
		info, err := redis.String(replica.Do("INFO", "replication"))
		return err == nil && strings.Contains(info, "master_link_status:up")
	})
	if err != nil {
		t.Fatal(err)
	}
	// The replica says "up" once it loaded the snapshot; the primary counts it online (and
	// asks it for acknowledgements) only after its first one.
	err = pollUntil(30*time.Second, "the primary sees its replica online", func() bool {
		info, err := redis.String(primary.Do("INFO", "replication"))
		return err == nil && strings.Contains(info, "state=online")
	})
	if err != nil {
		t.Fatal(err)
	}
	broker := newRedigo(primary.Addr)
	defer broker.Close()
	// The live save waits for the replica's acknowledgement as long as the frozen one waits
	// in vain: 2 s leaves a loaded machine room to schedule it (300 ms once did not).
	c := New[Checkpoint](Config{Broker: broker, BrokerDurability: Replicated,
		BrokerReplicationTimeout: frozenTimeout})
	ctx := context.Background()

	// Given a live replica: the save returns and the replica holds its pending entry
	h, err := c.SaveAsync(ctx, &Checkpoint{SessionID: "replicated", Version: 1})
	if err != nil {
		t.Fatal(err)
	}
	requests := c.keys.pendingRequests("replicated")
	held, err := redis.Strings(replica.Do("HKEYS", requests))
	if err != nil || len(held) != 1 || held[0] != h.TaskID {
		t.Fatalf("the replica holds %v (%v), want [%s]", held, err, h.TaskID)
	}

	// When the replica is frozen, a save returns ErrReplicationTimeout and its handle
	if err := replica.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = replica.cmd.Process.Signal(syscall.SIGCONT) }()
	started := time.Now()
	frozen, err := c.SaveAsync(ctx, &Checkpoint{SessionID: "frozen", Version: 1})
	waited := time.Since(started)
	_ = replica.cmd.Process.Signal(syscall.SIGCONT)
	if !errors.Is(err, ErrReplicationTimeout) {
		t.Fatalf("err = %v, want ErrReplicationTimeout", err)
	}
	if !strings.Contains(err.Error(), "only 0 of 1 replica(s) acknowledged it within 2s") {
		t.Fatalf("the error does not say what happened: %v", err)
	}
	if waited < frozenTimeout || frozen.SessionID != "frozen" || frozen.TaskID == "" {
		t.Fatalf("waited %s, handle %+v", waited, frozen)
	}
	// And the primary has it, once: loads serve it, and nothing was pushed twice
	if n, err := redis.Int(primary.Do("LLEN", "checkpoints")); err != nil || n != 2 {
		t.Fatalf("the primary's queue holds %d (%v), want 2", n, err)
	}
	if got, err := c.Load(ctx, "frozen"); err != nil || got == nil || got.Version != 1 {
		t.Fatalf("load = %+v, %v", got, err)
	}
}

// A broker adapter without EvalWait cannot give Replicated: New says so.
func TestReplicatedNeedsAReplicaWaiter(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "ReplicaWaiter") {
			t.Fatalf("recovered %v", r)
		}
	}()
	New[Checkpoint](Config{Broker: evalOnly{}, BrokerDurability: Replicated})
}

type evalOnly struct{}

func (evalOnly) Eval(context.Context, string, []string, ...interface{}) (interface{}, error) {
	return nil, nil
}

func (evalOnly) ZScan(context.Context, string, uint64, int64) ([]string, uint64, error) {
	return nil, 0, nil
}
