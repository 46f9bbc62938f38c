package checkpointq

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// workersStore waits for the shared deployment's worker to announce its store on the
// broker (with a heartbeat) and returns what it said.
func workersStore(t *testing.T) publishedStore { return announcedStore(t, env.broker) }

// announcedStore waits for a worker to announce its store on broker and returns what it
// said.
func announcedStore(t *testing.T, broker *redisServer) publishedStore {
	t.Helper()
	var said publishedStore
	err := pollUntil(20*time.Second, "the worker's store announcement", func() bool {
		raw, err := redis.Bytes(broker.Do("GET", DefaultPrefix+".cq:workers-store"))
		return err == nil && json.Unmarshal(raw, &said) == nil && said.Identity != ""
	})
	if err != nil {
		t.Fatal(err)
	}
	return said
}

// otherStore is a private Redis whose store identity was made at made (as its first user
// would have made it).
func otherStore(t *testing.T, made time.Time) (*redisServer, string) {
	t.Helper()
	other := privateRedis(t)
	id := fmt.Sprintf("00000000-0000-4000-8000-000000000000@%d", made.UnixMilli())
	if _, err := other.Do("SET", DefaultPrefix+".cq:identity", id); err != nil {
		t.Fatal(err)
	}
	return other, id
}

func TestAClientOnAnotherStoreThanTheWorkersFailsNamingBoth(t *testing.T) {
	// Given a worker that announced its store, and a client reading another store, one
	// that existed before the announcement
	said := workersStore(t)
	other, mine := otherStore(t, time.Now().Add(-time.Minute))
	c := newClient[Checkpoint](t, Config{Store: newRedigo(other.Addr)})
	ctx := background(t)

	// When it loads and lists
	_, loadErr := c.Load(ctx, sessionID(t, "s"))
	_, listErr := c.List(ctx)

	// Then both fail at once with ErrStoreMismatch, naming both identities and the
	// workers' store
	for _, err := range []error{loadErr, listErr} {
		if !errors.Is(err, ErrStoreMismatch) {
			t.Fatalf("want ErrStoreMismatch, got %v", err)
		}
		for _, name := range []string{mine, said.Identity, said.Store} {
			if !strings.Contains(err.Error(), name) {
				t.Fatalf("the error does not name %q: %v", name, err)
			}
		}
	}
}

func TestAClientOnTheWorkersStoreAgreesAndStopsLooking(t *testing.T) {
	// Given a worker that announced its store, and a client on that same store
	workersStore(t)
	c := newClient[Checkpoint](t, Config{})
	ctx := background(t)
	id := sessionID(t, "s")
	h, err := c.SaveAsync(ctx, sampleCheckpoint(id, 1, "hi"))
	if err != nil {
		t.Fatal(err)
	}
	// When it waits for its save and loads it
	mustWait(t, c, h, Applied)
	if cp, err := c.Load(ctx, id); err != nil || cp == nil {
		t.Fatalf("load: %v %v", cp, err)
	}
	// Then the two agree, and no later read compares again
	if !c.stores.agreed || c.stores.due(time.Now().Add(time.Hour)) {
		t.Fatal("the client should agree with the workers")
	}
}

func TestAnIdentityMadeAfterTheAnnouncementProvesNothingYet(t *testing.T) {
	// Given a client on another store whose identity is newer than the workers' last word
	// (a store emptied since, or made just now)
	said := workersStore(t)
	announced := time.Unix(0, int64(said.Time*float64(time.Second)))
	other, _ := otherStore(t, announced.Add(time.Second))
	c := newClient[Checkpoint](t, Config{Store: newRedigo(other.Addr)})

	// When it loads, the load is answered, and it looks again later
	if _, err := c.Load(background(t), sessionID(t, "s")); err != nil {
		t.Fatalf("load: %v", err)
	}
	if c.stores.agreed || c.stores.due(time.Now()) || !c.stores.due(time.Now().Add(identityRecheck)) {
		t.Fatal("the comparison should wait, then come again")
	}
}

func TestStoreCheckJudgesByTheAnnouncementsTime(t *testing.T) {
	made := time.UnixMilli(1_700_000_000_000)
	mine := "a@1700000000000"
	at := func(d time.Duration) *publishedStore {
		return &publishedStore{Identity: "b@1", Store: "redis://w", Worker: "w1", Time: float64(made.Add(d).UnixNano()) / 1e9}
	}
	for _, tc := range []struct {
		name      string
		mine      string
		published *publishedStore
		mismatch  bool
	}{
		{"no announcement", mine, nil, false},
		{"no identity of its own", "", at(time.Hour), false},
		{"the same store", mine, &publishedStore{Identity: mine}, false},
		{"said within the clock margin", mine, at(identityClockMargin - time.Millisecond), false},
		{"said after it", mine, at(identityClockMargin), true},
		{"an identity of another form", "not-dated", at(time.Hour), false},
	} {
		var s storeCheck
		err := s.compare(made, tc.mine, "mine", tc.published, "the broker")
		if got := errors.Is(err, ErrStoreMismatch); got != tc.mismatch {
			t.Errorf("%s: mismatch %v, want %v (%v)", tc.name, got, tc.mismatch, err)
		}
	}
}
