package checkpointq

import (
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// The client on a PostgreSQL store (postgres.go), against a real worker writing to a
// private server (postgres_harness_test.go). The fire-and-forget tests of pending_test.go
// run against this deployment too.

func TestAPostgresStoreServesSavesLoadsListsDeletesAndWaits(t *testing.T) {
	// Given a replica whose saves wait on a queue no worker reads, and another replica
	ctx := background(t)
	queue := "held-" + t.Name()
	a, b := newPGClient[Checkpoint](t, Config{Queue: queue}), newPGClient[Checkpoint](t, Config{Queue: queue})
	id := sessionID(t, "ç \x00 nul")
	cp := sampleCheckpoint(id, 2, "hello", "world")
	save, err := a.SaveAsync(ctx, cp)
	if err != nil {
		t.Fatal(err)
	}
	// When the other loads and lists before the worker has it
	if got, seq := mustLoad(t, b, id); got == nil || normalise(got) != normalise(cp) || seq != save.Seq {
		t.Fatalf("Load before the apply = %+v at seq %d; want %+v at %d", got, seq, cp, save.Seq)
	}
	if !mustList(t, b)[id] {
		t.Fatal("List before the apply lacks the session")
	}
	if storedPG(t, b, id) != nil {
		t.Fatal("the database holds the session before the worker had the save")
	}
	// Then once delivered, WaitDurable says applied, and the row holds exactly that
	deliver(t, a)
	res, err := b.WaitDurable(ctx, save)
	if err != nil || res.Outcome != Applied || res.FenceSeq != save.Seq || res.Winner != save.TaskID || res.Deleted {
		t.Fatalf("WaitDurable(save) = %+v, %v", res, err)
	}
	if kept := storedPG(t, b, id); kept == nil || normalise(kept) != normalise(cp) {
		t.Fatalf("stored %+v, want %+v", kept, cp)
	}
	waitSettled(t, pgDeploymentFor(t).broker, id)
	if got, seq := mustLoad(t, b, id); got == nil || normalise(got) != normalise(cp) || seq != save.Seq {
		t.Fatalf("Load from the database = %+v at seq %d", got, seq)
	}
	if !mustList(t, b)[id] {
		t.Fatal("List from the database lacks the session")
	}
	// When it is deleted: gone at once, and once applied
	del, err := b.DeleteAsync(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	for _, when := range []string{"pending", "applied"} {
		if when == "applied" {
			deliver(t, b)
			res, err := a.WaitDurable(ctx, del)
			if err != nil || res.Outcome != Applied || !res.Deleted || res.FenceSeq != del.Seq {
				t.Fatalf("WaitDurable(delete) = %+v, %v", res, err)
			}
			if res, err := a.WaitDurable(ctx, save); err != nil || res.Outcome != Superseded {
				t.Fatalf("WaitDurable(save) after the delete = %+v, %v", res, err)
			}
			waitSettled(t, pgDeploymentFor(t).broker, id)
		}
		if got, seq := mustLoad(t, a, id); got != nil || seq != del.Seq {
			t.Fatalf("%s: Load of the deleted session = %+v at seq %d", when, got, seq)
		}
		if mustList(t, a)[id] {
			t.Fatalf("%s: List has the deleted session", when)
		}
	}
}

func TestAPostgresStoreListsOnlyLiveRows(t *testing.T) {
	// Given rows the worker would leave: a live value, one past its deadline, a tombstone
	c := newPGClient[Checkpoint](t, Config{})
	db, schema := c.cfg.Postgres, c.cfg.PostgresSchema
	live, expired, deleted := sessionID(t, "live"), sessionID(t, "expired"), sessionID(t, "deleted")
	save, err := c.encodeSave(sampleCheckpoint(live, 1, "hi"))
	if err != nil {
		t.Fatal(err)
	}
	value := save.Value
	now := time.Now().UnixMilli()
	insert := "INSERT INTO " + schema + ".sessions (session_key, session_id, value, value_deadline_ms, " +
		"fence_seq, fence_deleted, fence_request_id, fence_expires_ms) VALUES (" + schema + ".session_key($1), $1, $2, $3, $4, $5, 'r', $6)"
	for _, row := range []struct {
		id       string
		value    []byte
		deadline sql.NullInt64
		deleted  bool
	}{
		{live, value, sql.NullInt64{Int64: now + 60_000, Valid: true}, false},
		{expired, value, sql.NullInt64{Int64: now - 60_000, Valid: true}, false},
		{deleted, nil, sql.NullInt64{}, true},
	} {
		if _, err := db.Exec(insert, []byte(row.id), row.value, row.deadline, now*1000, row.deleted, now+600_000); err != nil {
			t.Fatal(err)
		}
	}
	// When they are listed and loaded, Then only the live one is there
	listed := mustList(t, c)
	if !listed[live] || listed[expired] || listed[deleted] {
		t.Fatalf("List: live %v, expired %v, deleted %v", listed[live], listed[expired], listed[deleted])
	}
	for _, id := range []string{expired, deleted} {
		if got, seq := mustLoad(t, c, id); got != nil || seq != now*1000 {
			t.Fatalf("Load(%q) = %+v at seq %d; want nil at the fence's seq", id, got, seq)
		}
	}
}

func TestAPostgresStoreKeepsASessionIDLongerThanAnIndexEntry(t *testing.T) {
	// Given a session id of 6,000 bytes, which a Redis store keeps (a btree entry holds
	// about 2,700: the database keys a long id by its sha256)
	ctx := background(t)
	c := newPGClient[Checkpoint](t, Config{})
	id := sessionID(t, strings.Repeat("long", 1500))
	cp := sampleCheckpoint(id, 3, "hello")
	save, err := c.SaveAsync(ctx, cp)
	if err != nil {
		t.Fatal(err)
	}
	// When the worker applies it, Then it is durable, stored, loaded and listed
	deliver(t, c)
	if res, err := c.WaitDurable(ctx, save); err != nil || res.Outcome != Applied {
		t.Fatalf("WaitDurable = %+v, %v", res, err)
	}
	if kept := storedPG(t, c, id); kept == nil || normalise(kept) != normalise(cp) {
		t.Fatalf("stored %+v, want %+v", kept, cp)
	}
	waitSettled(t, pgDeploymentFor(t).broker, id)
	if got, seq := mustLoad(t, c, id); got == nil || normalise(got) != normalise(cp) || seq != save.Seq {
		t.Fatalf("Load = %+v at seq %d", got, seq)
	}
	if !mustList(t, c)[id] {
		t.Fatal("List lacks the session")
	}
}

func TestWaitDurableReadsARefusalFromTheBrokerBesideAPostgresStore(t *testing.T) {
	// The workers keep refusal records on the broker when the store is a database.
	mustBeRefused(t, newPGClient[Checkpoint](t, misconfiguredAhead))
}

func TestAPostgresStoreThatIsDownFailsReadsAsUnavailable(t *testing.T) {
	db, err := sql.Open("postgres", fmt.Sprintf("postgresql://postgres@%s/postgres?sslmode=disable&connect_timeout=1", closedAddr(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	d := pgDeploymentFor(t)
	broker := newRedigo(d.broker.Addr)
	t.Cleanup(func() { _ = broker.Close() })
	c := New[Checkpoint](Config{Broker: broker, Postgres: db, PostgresSchema: d.schema, ReadTimeout: 2 * time.Second})
	ctx := background(t)
	if _, err := c.Load(ctx, "x"); !errors.Is(err, ErrStoreUnavailable) {
		t.Fatalf("Load: err = %v, want ErrStoreUnavailable", err)
	}
	if _, err := c.List(ctx); !errors.Is(err, ErrStoreUnavailable) {
		t.Fatalf("List: err = %v, want ErrStoreUnavailable", err)
	}
}

func TestNewRefusesAPostgresStoreBesideARedisOneOrABadSchema(t *testing.T) {
	db, err := sql.Open("postgres", "postgresql://127.0.0.1:1/none?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	for name, cfg := range map[string]Config{
		"a Store too":     {Broker: &failingRedis{}, Store: &failingRedis{}, Postgres: db},
		"Cluster too":     {Broker: &failingRedis{}, Cluster: true, Postgres: db},
		"a quoted schema": {Broker: &failingRedis{}, Postgres: db, PostgresSchema: `x"; DROP TABLE y; --`},
	} {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "Postgres") {
					t.Fatalf("New did not panic about Postgres: %v", r)
				}
			}()
			New[Checkpoint](cfg)
		})
	}
}

func TestAPostgresClientAgreesWithItsWorkersStore(t *testing.T) {
	// Given the PostgreSQL deployment's worker, once it announced its store on the broker
	said := announcedStore(t, pgDeploymentFor(t).broker)
	// When a client on the same database loads
	c := newPGClient[Checkpoint](t, Config{})
	if _, err := c.Load(background(t), sessionID(t, "s")); err != nil {
		t.Fatal(err)
	}
	// Then it read the identity the worker announced, and agrees
	if !c.stores.agreed {
		t.Fatalf("the client does not agree with the workers' store %+v", said)
	}
}
