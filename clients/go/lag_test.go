package checkpointq

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// Issue 22's two scenarios, each with a deployment of its own (the outage must not stop
// the shared worker): two replicas take turns on a session while the workers cannot apply
// anything for lagOutage, and every turn lands once the outage ends. The outage is held
// for its full length on purpose; the checks during it are paced, not synchronised.

const lagOutage = 60 * time.Second

// lagDeployment is a broker, a store (the broker itself when oneRedis; a Redis Cluster
// when cluster is set) and a worker.
type lagDeployment struct {
	broker, store *redisServer
	cluster       *localCluster
	oneRedis      bool
	worker        *worker
}

type storeLayout int

const (
	oneRedis storeLayout = iota
	storeOfItsOwn
	clusterStore
)

func startLagDeployment(t *testing.T, layout storeLayout) *lagDeployment {
	t.Helper()
	d := &lagDeployment{oneRedis: layout == oneRedis}
	var err error
	if d.broker, err = startRedis(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.broker.Stop)
	switch layout {
	case oneRedis:
		d.store = d.broker
	case storeOfItsOwn:
		if d.store, err = startRedis(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(d.store.Stop)
	case clusterStore:
		if d.cluster, err = startCluster(3); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(d.cluster.Stop)
	}
	d.startWorker(t)
	return d
}

func (d *lagDeployment) storeURL() string {
	if d.cluster != nil {
		return d.cluster.URL()
	}
	return d.store.URL()
}

// stored reads id's checkpoint from the store itself (nil: none).
func (d *lagDeployment) stored(t *testing.T, id string) *Checkpoint {
	t.Helper()
	if d.cluster == nil {
		return stored(t, d.store, id)
	}
	c := newRedigoCluster(d.cluster.Addrs())
	defer c.Close()
	value, err := redis.Bytes(c.Do(background(t), "GET", DefaultPrefix+":"+id))
	if errors.Is(err, redis.ErrNil) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return decodeStored(t, value)
}

func (d *lagDeployment) startWorker(t *testing.T) {
	t.Helper()
	w, err := startWorker(d.broker.URL(), d.storeURL())
	if err != nil {
		t.Fatal(err)
	}
	d.worker = w
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("--- worker log ---\n%s", w.Log())
		}
		w.Stop()
	})
}

// replica is an apiserver replica of d, with connections of its own.
func (d *lagDeployment) replica(t *testing.T) *Client[Checkpoint] {
	broker := newRedigo(d.broker.Addr)
	t.Cleanup(func() { _ = broker.Close() })
	cfg := Config{Broker: broker}
	switch {
	case d.cluster != nil:
		store := newRedigoCluster(d.cluster.Addrs())
		t.Cleanup(func() { _ = store.Close() })
		cfg.Store, cfg.Cluster = store, true
	case !d.oneRedis:
		store := newRedigo(d.store.Addr)
		t.Cleanup(func() { _ = store.Close() })
		cfg.Store = store
	}
	return New[Checkpoint](cfg)
}

func turns(n int) []string {
	var out []string
	for i := 1; i <= n; i++ {
		out = append(out, fmt.Sprint("turn ", i))
	}
	return out
}

func contents(cp *Checkpoint) string {
	if cp == nil {
		return "<none>"
	}
	var out []string
	for _, m := range cp.ConversationHistory {
		out = append(out, m.Content)
	}
	return fmt.Sprintf("v%d [%s]", cp.Version, strings.Join(out, ", "))
}

// takeTurn is an apiserver turn: load, append a message, save (fire and forget).
func takeTurn(t *testing.T, c *Client[Checkpoint], id string, wantBefore int) {
	t.Helper()
	cp, _ := mustLoad(t, c, id)
	if want := contents(sampleCheckpoint(id, int64(wantBefore), turns(wantBefore)...)); contents(cp) != want {
		t.Fatalf("before turn %d, Load = %s; want %s", wantBefore+1, contents(cp), want)
	}
	cp.Version++
	cp.ConversationHistory = append(cp.ConversationHistory, ConversationMessage{Role: "user", Content: fmt.Sprint("turn ", wantBefore+1)})
	if _, err := c.Save(background(t), cp); err != nil {
		t.Fatal(err)
	}
}

// turnsThroughAnOutage: session at version 5; begin(); A takes turn 6, B (which must see
// it) turn 7; every load through the outage sees turn 7 while the store still holds turn
// 5; end(); then all seven turns land.
func turnsThroughAnOutage(t *testing.T, d *lagDeployment, begin, end func()) {
	a, b := d.replica(t), d.replica(t)
	id := "lag-session"
	h, err := a.SaveAsync(background(t), sampleCheckpoint(id, 5, turns(5)...))
	if err != nil {
		t.Fatal(err)
	}
	mustWait(t, a, h, Applied)

	begin()
	began := time.Now()
	takeTurn(t, a, id, 5)
	takeTurn(t, b, id, 6)
	want := contents(sampleCheckpoint(id, 7, turns(7)...))
	for checks := 0; checks == 0 || time.Since(began) < lagOutage; checks++ {
		for name, c := range map[string]*Client[Checkpoint]{"A": a, "B": b} {
			if cp, _ := mustLoad(t, c, id); contents(cp) != want {
				t.Fatalf("%s after %s of outage: Load = %s; want %s", name, time.Since(began).Round(time.Second), contents(cp), want)
			}
		}
		if s := d.stored(t, id); s == nil || s.Version != 5 {
			t.Fatalf("the store moved during the outage (%s): no outage", contents(s))
		}
		time.Sleep(5 * time.Second) // paces the checks through the outage
	}
	end()

	err = pollUntil(120*time.Second, "turn 7 in the store", func() bool {
		s := d.stored(t, id)
		return s != nil && s.Version == 7
	})
	if err != nil {
		t.Fatalf("%v: the store holds %s", err, contents(d.stored(t, id)))
	}
	if got := contents(d.stored(t, id)); got != want {
		t.Fatalf("the store holds %s; want %s", got, want)
	}
	waitSettled(t, d.broker, id)
	for name, c := range map[string]*Client[Checkpoint]{"A": a, "B": b} {
		if cp, _ := mustLoad(t, c, id); contents(cp) != want || c.EpochChanges() != 0 {
			t.Fatalf("%s after the outage: Load = %s, %d epoch changes", name, contents(cp), c.EpochChanges())
		}
	}
}

func TestEveryTurnLandsThroughAWorkerOutage(t *testing.T) {
	t.Parallel()
	// One Redis as broker and store: a load is one script call.
	d := startLagDeployment(t, oneRedis)
	turnsThroughAnOutage(t, d, d.worker.Stop, func() { d.startWorker(t) })
}

func TestEveryTurnLandsThroughAStoreWriteOutage(t *testing.T) {
	t.Parallel()
	// A store of its own that refuses writes (maxmemory reached, no eviction) and still
	// serves reads, while the worker keeps running.
	d := startLagDeployment(t, storeOfItsOwn)
	config := func(value string) {
		if _, err := d.store.Do("CONFIG", "SET", "maxmemory", value); err != nil {
			t.Fatal(err)
		}
	}
	begin := func() {
		if _, err := d.store.Do("CONFIG", "SET", "maxmemory-policy", "noeviction"); err != nil {
			t.Fatal(err)
		}
		config("1")
		if _, err := d.store.Do("SET", "probe", "x"); err == nil || !strings.HasPrefix(err.Error(), "OOM") {
			t.Fatalf("the store took a write at maxmemory: %v", err)
		}
	}
	turnsThroughAnOutage(t, d, begin, func() { config("0") })
}

func TestEveryTurnLandsThroughAWorkerOutageOnAClusterStore(t *testing.T) {
	t.Parallel()
	// A three-master Redis Cluster store, a single-Redis broker: a load is a call to each.
	d := startLagDeployment(t, clusterStore)
	turnsThroughAnOutage(t, d, d.worker.Stop, func() { d.startWorker(t) })
}
