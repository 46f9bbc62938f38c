package checkpointq

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// clusterIDs returns session ids whose data keys hash to every node of the cluster, at
// least perNode each (among them one with a hash tag of its own, and a non-ASCII one).
func clusterIDs(t *testing.T, store *redigoCluster, perNode int) []string {
	t.Helper()
	if err := store.loadSlots(background(t)); err != nil {
		t.Fatal(err)
	}
	ids := []string{sessionID(t, "{tagged}"), sessionID(t, "ç-日本")}
	count := map[string]int{}
	for _, id := range ids {
		count[store.slots[keySlot(DefaultPrefix+":"+id)]]++
	}
	for n := 0; len(count) < 3 || minCount(count) < perNode; n++ {
		id := sessionID(t, fmt.Sprint(n))
		ids = append(ids, id)
		count[store.slots[keySlot(DefaultPrefix+":"+id)]]++
	}
	return ids
}

func minCount(m map[string]int) int {
	least := -1
	for _, n := range m {
		if least < 0 || n < least {
			least = n
		}
	}
	return least
}

func TestClusterStoreSaveLoadListDelete(t *testing.T) {
	c, store := newClusterClient[Checkpoint](t, Config{})
	ctx := background(t)
	ids := clusterIDs(t, store, 2)
	handles := map[string]Handle{}
	for i, id := range ids {
		h, err := c.SaveAsync(ctx, sampleCheckpoint(id, int64(i+1), "hello", "wörld"))
		if err != nil {
			t.Fatal(err)
		}
		handles[id] = h
	}
	for i, id := range ids {
		h := handles[id]
		if res := mustWait(t, c, h, Applied); res.FenceSeq != h.Seq || res.Winner != h.TaskID {
			t.Fatalf("%q: fence %+v, want seq %d won by %s", id, res, h.Seq, h.TaskID)
		}
		got, seq, err := c.LoadWithSeq(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if want := sampleCheckpoint(id, int64(i+1), "hello", "wörld"); got == nil || normalise(got) != normalise(want) || seq != h.Seq {
			t.Fatalf("%q: loaded %+v at seq %d, want %+v at %d", id, got, seq, want, h.Seq)
		}
		// Where the worker put it: Go's data key, the fence in the data key's slot.
		k := keySpace{prefix: DefaultPrefix, cluster: true}
		fenceSeq, err := redis.Int64(store.Do(ctx, "HGET", k.fence(id), "seq"))
		if err != nil || fenceSeq != h.Seq {
			t.Fatalf("%q: cluster fence %s seq = %d, %v; want %d", id, k.fence(id), fenceSeq, err, h.Seq)
		}
		if n, err := redis.Int(store.Do(ctx, "EXISTS", k.data(id))); err != nil || n != 1 {
			t.Fatalf("%q: data key %s: %d, %v", id, k.data(id), n, err)
		}
	}

	listed, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if missing := without(ids, listed); len(missing) != 0 {
		t.Fatalf("List() misses %q (listed %d ids)", missing, len(listed))
	}

	deleted, kept := ids[:len(ids)/2], ids[len(ids)/2:]
	for _, id := range deleted {
		h, err := c.DeleteAsync(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if res := mustWait(t, c, h, Applied); !res.Deleted {
			t.Fatalf("%q: delete applied but the fence says %+v", id, res)
		}
		if got, err := c.Load(ctx, id); err != nil || got != nil {
			t.Fatalf("%q: Load after delete = %+v, %v", id, got, err)
		}
		mustWait(t, c, handles[id], Superseded)
	}
	listed, err = c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if missing := without(kept, listed); len(missing) != 0 {
		t.Fatalf("List() misses %q", missing)
	}
	if still := without(deleted, without(deleted, listed)); len(still) != 0 {
		t.Fatalf("List() still shows deleted sessions %q", still)
	}
}

// without returns the items of a not in b.
func without(a, b []string) []string {
	in := map[string]bool{}
	for _, s := range b {
		in[s] = true
	}
	var out []string
	for _, s := range a {
		if !in[s] {
			out = append(out, s)
		}
	}
	return out
}

func TestClusterWaitDurableTellsAppliedSupersededAndRefused(t *testing.T) {
	c, _ := newClusterClient[Checkpoint](t, Config{})
	appliedThenSuperseded(t, c)

	// A refused request: its refusal record is in its session's refusals, in the slot of
	// its fence, and WaitDurable reads both.
	ahead, _ := newClusterClient[Checkpoint](t, misconfiguredAhead)
	mustBeRefused(t, ahead)
}

// countingRedis counts the calls that reach a Redis.
type countingRedis struct {
	Redis
	evals atomic.Int64
}

func (c *countingRedis) Eval(ctx context.Context, script string, keys []string, args ...interface{}) (interface{}, error) {
	c.evals.Add(1)
	return c.Redis.Eval(ctx, script, keys, args...)
}

func TestClusterListWalksEverySlotOneNodeRunPerCall(t *testing.T) {
	// Index entries written straight into the slot indexes of a prefix no worker serves:
	// the first and last slot of every node's range, 2,500 ids in one slot (several pages
	// and a ZSCAN cursor to resume), ids already expired, and one re-indexed without a TTL.
	_, store := newClusterClient[Checkpoint](t, Config{})
	ctx := background(t)
	const prefix = "golist"
	k := keySpace{prefix: prefix, cluster: true}
	if err := store.loadSlots(ctx); err != nil {
		t.Fatal(err)
	}
	live := time.Now().Add(time.Hour).UnixMilli()
	past := time.Now().Add(-time.Minute).UnixMilli()
	var want []string
	add := func(slot int, id string, deadline interface{}, isLive bool) {
		if _, err := store.Do(ctx, "ZADD", k.slotIndex(slot), deadline, id); err != nil {
			t.Fatal(err)
		}
		if isLive {
			want = append(want, id)
		}
	}
	boundaries := 0
	for slot := 0; slot < clusterSlots; slot++ {
		if slot == 0 || slot == clusterSlots-1 || store.slots[slot] != store.slots[slot-1] || store.slots[slot] != store.slots[slot+1] {
			add(slot, fmt.Sprintf("edge-%d", slot), live, true)
			add(slot, fmt.Sprintf("gone-%d", slot), past, false)
			boundaries++
		}
	}
	if boundaries != 6 {
		t.Fatalf("%d range edges in the slot map, want 6 (3 nodes)", boundaries)
	}
	for i := 0; i < 2500; i++ {
		add(7000, fmt.Sprintf("many-%04d", i), live, true)
	}
	add(9000, "no-ttl", "+inf", true)
	t.Cleanup(func() {
		for _, slot := range []int{7000, 9000} {
			_, _ = store.Do(context.Background(), "DEL", k.slotIndex(slot))
		}
		for slot := 0; slot < clusterSlots; slot++ {
			if slot == 0 || slot == clusterSlots-1 || store.slots[slot] != store.slots[slot-1] || store.slots[slot] != store.slots[slot+1] {
				_, _ = store.Do(context.Background(), "DEL", k.slotIndex(slot))
			}
		}
	})
	sort.Strings(want)

	counted := &countingRedis{Redis: store}
	c := New[Checkpoint](Config{Broker: store, Store: counted, Prefix: prefix, Cluster: true})
	got, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("List() = %d ids, want %d; missing %q, extra %q", len(got), len(want),
			without(want, got), without(got, want))
	}
	// 3 nodes of ~5,461 slots: 6 runs of at most 1,024 slots each, plus a few more pages
	// for the slot with 2,500 ids: one call per run of one node's slots, not per slot.
	calls := counted.evals.Load()
	t.Logf("List() of %d ids over 16384 slot indexes: %d script calls", len(got), calls)
	if calls > 3*6+6 {
		t.Fatalf("List() made %d script calls", calls)
	}

	// No sessions at all: one call per run of at most 1,024 of a node's slots, one read of
	// the store's time (List judges deadlines by it, as Load does), and one of the store's
	// identity (a new client compares it with the workers': identity.go).
	empty := &countingRedis{Redis: store}
	ids, err := New[Checkpoint](Config{Broker: store, Store: empty, Prefix: "golist-empty", Cluster: true}).List(ctx)
	runs, start := 0, 0
	for slot := 1; slot <= clusterSlots; slot++ {
		if slot == clusterSlots || slot-start == indexesPerCall || store.slots[slot] != store.slots[start] {
			runs, start = runs+1, slot
		}
	}
	if err != nil || len(ids) != 0 || empty.evals.Load() != int64(runs+2) {
		t.Fatalf("List() of no sessions = %q, %v in %d calls, want none in %d", ids, err, empty.evals.Load(), runs+2)
	}
	t.Logf("List() of no sessions: %d script calls", runs)

	// A stale slot map (every slot on the first node): the adapter follows MOVED.
	for slot := range store.slots {
		store.slots[slot] = store.seeds[0]
	}
	if again, err := c.List(ctx); err != nil || !reflect.DeepEqual(again, want) {
		t.Fatalf("List() with a stale slot map = %d ids, %v", len(again), err)
	}
}

func TestClusterStoreWithoutConfigClusterFailsAtOnce(t *testing.T) {
	// Given a cluster store read without Config.Cluster: through one node, as a plain
	// client would, and through the routing adapter
	d := clusterDeploymentFor(t)
	ctx := background(t)
	broker, node, routed := newRedigo(d.broker.Addr), newRedigo(d.cluster.Addrs()[0]), newRedigoCluster(d.cluster.Addrs())
	t.Cleanup(func() { _ = broker.Close(); _ = node.Close(); _ = routed.Close() })
	for name, store := range map[string]Redis{"one node": node, "routing adapter": routed} {
		c := New[Checkpoint](Config{Broker: broker, Store: store})
		id := sessionID(t, name)
		h, err := c.SaveAsync(ctx, sampleCheckpoint(id, 1))
		if err != nil {
			t.Fatal(err)
		}
		// When it waits, with a deadline a minute away, and loads
		_, waitErr := c.WaitDurable(ctx, h)
		_, loadErr := c.Load(ctx, id)
		// Then both fail with the cluster's error reply, saying to set Config.Cluster (not
		// after the deadline: that would be ErrStoreUnavailable wrapping the deadline)
		for call, err := range map[string]error{"WaitDurable": waitErr, "Load": loadErr} {
			var refused *RedisError
			if !errors.As(err, &refused) || refused.Server != "store" || !strings.Contains(err.Error(), "set Config.Cluster") ||
				errors.Is(err, context.DeadlineExceeded) || errors.Is(err, ErrStoreUnavailable) {
				t.Fatalf("%s through %s: err = %v, want a *RedisError saying to set Config.Cluster", call, name, err)
			}
			t.Logf("%s through %s: %v", call, name, err)
		}
	}
}

func TestClusterAdapterFollowsASKWhileASlotMigrates(t *testing.T) {
	// Given a slot half-way through a migration (its old node MIGRATING, the new one
	// IMPORTING) and a session's fence already on the new node, in a prefix no worker serves
	_, store := newClusterClient[Checkpoint](t, Config{})
	d := clusterDeploymentFor(t)
	ctx := background(t)
	if err := store.loadSlots(ctx); err != nil {
		t.Fatal(err)
	}
	k := keySpace{prefix: "goask", cluster: true}
	id := sessionID(t, "s")
	slot := keySlot(k.fence(id))
	var from, to *redisServer
	for _, n := range d.cluster.nodes {
		if n.Addr == store.slots[slot] {
			from = n
		} else if to == nil {
			to = n
		}
	}
	nodeID := func(n *redisServer) string {
		id, err := redis.String(n.Do("CLUSTER", "MYID"))
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	if _, err := to.Do("CLUSTER", "SETSLOT", slot, "IMPORTING", nodeID(from)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = store.Do(context.Background(), "DEL", k.fence(id)) // on the new node, through ASK
		for _, n := range []*redisServer{from, to} {
			if _, err := n.Do("CLUSTER", "SETSLOT", slot, "STABLE"); err != nil {
				t.Errorf("slot %d on %s: %v", slot, n.Addr, err)
			}
		}
	})
	if _, err := from.Do("CLUSTER", "SETSLOT", slot, "MIGRATING", nodeID(to)); err != nil {
		t.Fatal(err)
	}
	h := Handle{TaskID: "ask-" + id, Task: TaskSave, SessionID: id, Seq: 42}
	if _, err := store.Do(ctx, "HSET", k.fence(id), "seq", h.Seq, "req", h.TaskID, "deleted", 0); err != nil {
		t.Fatal(err)
	}
	if n, err := redis.Int(to.Do("CLUSTER", "COUNTKEYSINSLOT", slot)); err != nil || n != 1 {
		t.Fatalf("keys of slot %d on the importing node: %d, %v; want the fence", slot, n, err)
	}

	// When a client waits for the request that fence names
	c := New[Checkpoint](Config{Broker: store, Store: store, Prefix: "goask", Cluster: true})
	res, err := c.WaitDurable(ctx, h)

	// Then its fence read was answered by the new node (ASK, ASKING), and the slot map
	// still names the old one, which serves the slot until the migration ends
	if err != nil || res.Outcome != Applied || res.FenceSeq != h.Seq {
		t.Fatalf("WaitDurable = %+v, %v; want applied at seq %d", res, err, h.Seq)
	}
	if store.slots[slot] != from.Addr {
		t.Fatalf("slot %d mapped to %s after an ASK, want %s still", slot, store.slots[slot], from.Addr)
	}
}

func TestClusterStoreLoadsAndListsWhatTheQueueHolds(t *testing.T) {
	// Given sessions on every node, half of them stored
	c, store := newClusterClient[Checkpoint](t, Config{})
	held, _ := newClusterClient[Checkpoint](t, Config{Queue: "held-" + t.Name()})
	ctx := background(t)
	ids := clusterIDs(t, store, 2)
	for _, id := range ids[:len(ids)/2] {
		h, err := c.SaveAsync(ctx, sampleCheckpoint(id, 1, "stored"))
		if err != nil {
			t.Fatal(err)
		}
		mustWait(t, c, h, Applied)
	}
	// When every other session is deleted and the rest saved anew, on a queue no worker reads
	var handles []Handle
	want := map[string]*Checkpoint{}
	for i, id := range ids {
		var h Handle
		var err error
		if i%2 == 0 {
			h, err = held.DeleteAsync(ctx, id)
		} else {
			want[id] = sampleCheckpoint(id, int64(100+i), "pending")
			h, err = held.SaveAsync(ctx, want[id])
		}
		if err != nil {
			t.Fatal(err)
		}
		handles = append(handles, h)
	}
	// Then loads and List show the pending requests, before and after the worker applies them
	for _, when := range []string{"queued", "applied"} {
		if when == "applied" {
			d := clusterDeploymentFor(t)
			for {
				moved, err := d.broker.Do("RPOPLPUSH", held.cfg.Queue, "checkpoints")
				if err != nil {
					t.Fatal(err)
				}
				if moved == nil {
					break
				}
			}
			for _, h := range handles {
				mustWait(t, c, h, Applied)
			}
		}
		listed, err := c.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		inList := map[string]bool{}
		for _, id := range listed {
			inList[id] = true
		}
		for _, id := range ids {
			got, err := c.Load(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			if w := want[id]; normalise(got) != normalise(w) || inList[id] != (w != nil) {
				t.Fatalf("%s: %q loaded %+v (listed %v), want %+v", when, id, got, inList[id], w)
			}
		}
	}
}
