package checkpointq

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// The Go store's behaviours in the default, fire-and-forget mode: every read right after a
// write, by another replica, sees the write, whether the worker applied it yet or the queue
// still holds it. Each runs with the shared worker consuming (a real race between the read
// and the worker), and with the requests held on a queue no worker reads, so that only the
// pending records can answer, then delivered, after which the store must hold exactly what
// the loads returned; and each of those against a Redis store and a PostgreSQL store.

// pendingMode is where a test's requests go until they are delivered.
type pendingMode struct {
	name  string
	queue string // "checkpoints": the shared worker's; else held until deliver
}

var pendingModes = []pendingMode{{"worker consuming", "checkpoints"}, {"queue held", "held"}}

// storeBackend is a deployment the fire-and-forget tests run against: the shared one,
// whose store is a Redis, or the one whose store is PostgreSQL (postgres_harness_test.go).
type storeBackend struct {
	name      string
	newClient func(t *testing.T, cfg Config) *Client[Checkpoint]
	broker    func(t *testing.T) *redisServer
	// stored reads id's checkpoint from the store itself, as the worker wrote it (nil: none).
	stored func(t *testing.T, c *Client[Checkpoint], id string) *Checkpoint
}

var storeBackends = []storeBackend{
	{
		name: "redis store", newClient: newClient[Checkpoint],
		broker: func(*testing.T) *redisServer { return env.broker },
		stored: func(t *testing.T, _ *Client[Checkpoint], id string) *Checkpoint { return stored(t, env.store, id) },
	},
	{
		name: "postgres store", newClient: newPGClient[Checkpoint],
		broker: func(t *testing.T) *redisServer { return pgDeploymentFor(t).broker },
		stored: storedPG,
	},
}

// forEachStoreAndMode runs test as a subtest for each store and each pending mode.
func forEachStoreAndMode(t *testing.T, test func(t *testing.T, s storeBackend, mode pendingMode)) {
	for _, s := range storeBackends {
		t.Run(s.name, func(t *testing.T) {
			for _, mode := range pendingModes {
				t.Run(mode.name, func(t *testing.T) { test(t, s, mode) })
			}
		})
	}
}

// replicas are two clients of s's deployment publishing to mode's queue: two apiserver
// replicas, each with its own connections.
func replicas(t *testing.T, s storeBackend, mode pendingMode) (a, b *Client[Checkpoint]) {
	queue := mode.queue
	if queue != "checkpoints" {
		queue = "held-" + strings.ReplaceAll(t.Name(), "/", "-")
	}
	return s.newClient(t, Config{Queue: queue}), s.newClient(t, Config{Queue: queue})
}

// deliver moves what c's queue holds to the worker's queue on c's broker, oldest first,
// and waits until the worker settled each of handles (applied or superseded).
func deliver(t *testing.T, c *Client[Checkpoint], handles ...Handle) {
	t.Helper()
	if c.cfg.Queue != "checkpoints" {
		broker, ok := c.cfg.Broker.(*redigoRedis)
		if !ok {
			t.Fatalf("deliver needs a redigo broker, not %T", c.cfg.Broker)
		}
		for {
			moved, err := broker.do(background(t), "RPOPLPUSH", c.cfg.Queue, "checkpoints")
			if err != nil {
				t.Fatal(err)
			}
			if moved == nil {
				break
			}
		}
	}
	for _, h := range handles {
		if _, err := c.WaitDurable(background(t), h); err != nil {
			t.Fatal(err)
		}
	}
}

// waitSettled polls until the workers removed id's pending entries and its index entry
// from broker (once its requests are settled): the broker holds entries only for what is
// queued.
func waitSettled(t *testing.T, broker *redisServer, id string) {
	t.Helper()
	err := pollUntil(30*time.Second, "the pending entries of "+id+" to be settled", func() bool {
		n, err1 := redis.Int(broker.Do("EXISTS", DefaultPrefix+".cq:pending-requests:"+id))
		score, err2 := broker.Do("ZSCORE", DefaultPrefix+".cq:pending", id)
		return err1 == nil && err2 == nil && n == 0 && score == nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func mustSave(t *testing.T, c *Client[Checkpoint], cp *Checkpoint) Handle {
	t.Helper()
	h, err := c.SaveAsync(background(t), cp)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// stored reads id's checkpoint from the store itself, as the worker wrote it (nil: none).
func stored(t *testing.T, server *redisServer, id string) *Checkpoint {
	t.Helper()
	value, err := redis.Bytes(server.Do("GET", DefaultPrefix+":"+id))
	if errors.Is(err, redis.ErrNil) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return decodeStored(t, value)
}

// decodeStored is the checkpoint of a value as a store holds it.
func decodeStored(t *testing.T, value []byte) *Checkpoint {
	t.Helper()
	doc, err := decodeValue(value)
	if err != nil {
		t.Fatal(err)
	}
	cp, err := DeserializeCheckpoint(doc)
	if err != nil {
		t.Fatal(err)
	}
	return cp
}

func mustLoad(t *testing.T, c *Client[Checkpoint], id string) (*Checkpoint, int64) {
	t.Helper()
	cp, seq, err := c.LoadWithSeq(background(t), id)
	if err != nil {
		t.Fatalf("Load(%q): %v", id, err)
	}
	return cp, seq
}

func mustList(t *testing.T, c *Client[Checkpoint]) map[string]bool {
	t.Helper()
	ids, err := c.List(background(t))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, id := range ids {
		listed[id] = true
	}
	return listed
}

func TestAReplicaLoadsTheCheckpointAnotherJustSaved(t *testing.T) {
	forEachStoreAndMode(t, func(t *testing.T, s storeBackend, mode pendingMode) {
		// Given replica A saves a checkpoint, fire and forget
		a, b := replicas(t, s, mode)
		id := sessionID(t, "round-trip")
		cp := sampleCheckpoint(id, 3, "hello <b>&</b>", "日本語 🎉")
		h, err := a.SaveAsync(background(t), cp)
		if err != nil {
			t.Fatal(err)
		}
		// When replica B loads it at once
		got, seq := mustLoad(t, b, id)
		// Then B has it, with a seq its next save sorts after
		if got == nil || normalise(got) != normalise(cp) || seq < h.Seq {
			t.Fatalf("Load = %+v, seq %d; want %+v, seq >= %d", got, seq, cp, h.Seq)
		}
		// And once applied, the store holds exactly that
		deliver(t, a, h)
		if kept := s.stored(t, a, id); kept == nil || normalise(kept) != normalise(cp) {
			t.Fatalf("stored %+v, want %+v", kept, cp)
		}
		waitSettled(t, s.broker(t), id)
		if got, _ := mustLoad(t, b, id); normalise(got) != normalise(cp) {
			t.Fatalf("Load after apply = %+v", got)
		}
	})
}

func TestALoadRightAfterASaveHasTheHundredMostRecentMessages(t *testing.T) {
	forEachStoreAndMode(t, func(t *testing.T, s storeBackend, mode pendingMode) {
		a, b := replicas(t, s, mode)
		id := sessionID(t, "cap")
		var messages []string
		for i := 0; i < 150; i++ {
			messages = append(messages, fmt.Sprint("message ", i))
		}
		h := mustSave(t, a, sampleCheckpoint(id, 1, messages...))
		check := func(when string, got *Checkpoint) {
			t.Helper()
			if got == nil || len(got.ConversationHistory) != 100 || got.ConversationHistory[0].Content != "message 50" ||
				got.ConversationHistory[99].Content != "message 149" {
				t.Fatalf("%s: %+v; want messages 50-149", when, got)
			}
		}
		got, _ := mustLoad(t, b, id)
		check("Load at once", got)
		deliver(t, a, h)
		check("stored", s.stored(t, a, id))
	})
}

func TestADeletedSessionLeavesTheListAtOnce(t *testing.T) {
	forEachStoreAndMode(t, func(t *testing.T, s storeBackend, mode pendingMode) {
		// Given two sessions saved, fire and forget
		a, b := replicas(t, s, mode)
		ctx := background(t)
		gone, kept := sessionID(t, "gone"), sessionID(t, "kept")
		kh := mustSave(t, a, sampleCheckpoint(kept, 1, "hi"))
		mustSave(t, a, sampleCheckpoint(gone, 1, "hi"))
		if listed := mustList(t, b); !listed[gone] || !listed[kept] {
			t.Fatalf("List after the saves lacks %q or %q", gone, kept)
		}
		// When one is deleted
		dh, err := a.DeleteAsync(ctx, gone)
		if err != nil {
			t.Fatal(err)
		}
		// Then the other replica neither lists nor loads it, before and after the apply
		for _, when := range []string{"at once", "applied"} {
			if when == "applied" {
				deliver(t, a, kh, dh)
				if left := s.stored(t, a, gone); left != nil {
					t.Fatalf("store still holds the deleted session: %+v", left)
				}
			}
			if listed := mustList(t, b); listed[gone] || !listed[kept] {
				t.Fatalf("%s: List has %q: %v, has %q: %v", when, gone, listed[gone], kept, listed[kept])
			}
			if got, _ := mustLoad(t, b, gone); got != nil {
				t.Fatalf("%s: Load of the deleted session = %+v", when, got)
			}
		}
	})
}

func TestLoadBumpSaveTwiceKeepsBothBumps(t *testing.T) {
	forEachStoreAndMode(t, func(t *testing.T, s storeBackend, mode pendingMode) {
		// Given a saved session, and two replicas taking turns: load, bump, save
		a, b := replicas(t, s, mode)
		ctx := background(t)
		id := sessionID(t, "bump")
		mustSave(t, a, sampleCheckpoint(id, 1, "turn 1"))
		var last Handle
		for turn, c := range []*Client[Checkpoint]{b, a} {
			cp, seq := mustLoad(t, c, id)
			if cp == nil || cp.Version != int64(turn+1) {
				t.Fatalf("turn %d: Load = %+v, want version %d", turn+2, cp, turn+1)
			}
			cp.Version++
			cp.ConversationHistory = append(cp.ConversationHistory, ConversationMessage{Role: "user", Content: fmt.Sprint("turn ", turn+2)})
			h, err := c.SaveAsync(ctx, cp)
			if err != nil {
				t.Fatal(err)
			}
			if h.Seq <= seq {
				t.Fatalf("turn %d: save seq %d does not sort after the loaded %d", turn+2, h.Seq, seq)
			}
			last = h
		}
		// Then both bumps land, and every turn with them
		deliver(t, a, last)
		for who, got := range map[string]*Checkpoint{"stored": s.stored(t, a, id), "loaded": func() *Checkpoint {
			cp, _ := mustLoad(t, b, id)
			return cp
		}()} {
			if got == nil || got.Version != 3 || len(got.ConversationHistory) != 3 || got.ConversationHistory[2].Content != "turn 3" {
				t.Fatalf("%s: %+v; want version 3 with turns 1-3", who, got)
			}
		}
	})
}

func TestAPendingDeleteHidesAStoredSession(t *testing.T) {
	for _, s := range storeBackends {
		t.Run(s.name, func(t *testing.T) {
			// Given a session the store holds
			a, b := replicas(t, s, pendingMode{queue: "held"})
			ctx := background(t)
			id := sessionID(t, "stored")
			h, err := s.newClient(t, Config{}).SaveAsync(ctx, sampleCheckpoint(id, 4, "hi"))
			if err != nil {
				t.Fatal(err)
			}
			mustWait(t, b, h, Applied)
			// When a replica deletes it and the delete waits in the queue
			del, err := a.DeleteAsync(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			// Then the other replica loads it as missing, at the delete's seq, and does not list it,
			// while the store still holds it
			if s.stored(t, a, id) == nil {
				t.Fatal("the store lost the session before the delete was delivered")
			}
			if got, seq := mustLoad(t, b, id); got != nil || seq != del.Seq {
				t.Fatalf("Load = %+v at seq %d; want nil at the delete's seq %d", got, seq, del.Seq)
			}
			if mustList(t, b)[id] {
				t.Fatal("List shows a session whose delete is pending")
			}
			// And a save stamped after that load revives it, even before the delete is applied
			again := sampleCheckpoint(id, 5, "again")
			ah := mustSave(t, b, again)
			if got, _ := mustLoad(t, a, id); got == nil || got.Version != 5 || !mustList(t, a)[id] {
				t.Fatalf("Load after the new save = %+v", got)
			}
			deliver(t, a, del, ah)
			if kept := s.stored(t, a, id); kept == nil || normalise(kept) != normalise(again) {
				t.Fatalf("stored %+v, want %+v", kept, again)
			}
		})
	}
}

func TestThePendingEntriesAreTheDocumentedLayout(t *testing.T) {
	c := newClient[Checkpoint](t, Config{Queue: "held-" + t.Name()})
	ctx := background(t)
	id := sessionID(t, "rec ç")
	t.Cleanup(func() { _, _ = env.broker.Do("DEL", c.cfg.Queue) })
	// Given a save of the session, on a queue no worker reads
	h, err := c.SaveAsync(ctx, sampleCheckpoint(id, 2, "hi"))
	if err != nil {
		t.Fatal(err)
	}
	// Then its entry is in the session's entries, named by its request id, and its value,
	// the stored value exactly, under the session (with its length in bytes) and request
	entries := DefaultPrefix + ".cq:pending-requests:" + id
	valueKey := fmt.Sprintf("%s.cq:pending-value:%d:%s:%s", DefaultPrefix, len(id), id, h.TaskID)
	fields, err := redis.StringMap(env.broker.Do("HGETALL", entries))
	if err != nil || len(fields) != 1 || fields[h.TaskID] != fmt.Sprint(h.Seq, " save") {
		t.Fatalf("entries %q = %q, %v", entries, fields, err)
	}
	value, err := redis.Bytes(env.broker.Do("GET", valueKey))
	want, _ := SerializeCheckpoint(sampleCheckpoint(id, 2, "hi"))
	if err != nil || !strings.HasPrefix(string(value), string(zstdMagic)) {
		t.Fatalf("value %q: %.20q, %v", valueKey, value, err)
	}
	if doc, err := decodeValue(value); err != nil || string(doc) != string(want) {
		t.Fatalf("value %q holds %s, %v", valueKey, doc, err)
	}
	// And they live until the request's deadline, its seq + the session TTL, which the
	// index holds
	month := (30 * 24 * time.Hour).Milliseconds()
	deadline := func(seq int64) int64 { return seq/1000 + month }
	expiresAt := func(key string) int64 {
		at, err := redis.Int64(env.broker.Do("PEXPIRETIME", key))
		if err != nil {
			t.Fatal(err)
		}
		return at
	}
	score, err := redis.Int64(env.broker.Do("ZSCORE", DefaultPrefix+".cq:pending", id))
	if expiresAt(entries) != deadline(h.Seq) || expiresAt(valueKey) != deadline(h.Seq) || err != nil || score != deadline(h.Seq) {
		t.Fatalf("entries expire at %d, value at %d, index %d (%v); want %d", expiresAt(entries), expiresAt(valueKey),
			score, err, deadline(h.Seq))
	}
	// When the session is deleted, then the delete's entry joins the save's (each is
	// settled by its own request), with no value, and the deadlines move to the delete's
	del, err := c.DeleteAsync(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	fields, err = redis.StringMap(env.broker.Do("HGETALL", entries))
	if err != nil || len(fields) != 2 || fields[del.TaskID] != fmt.Sprint(del.Seq, " delete") || fields[h.TaskID] == "" {
		t.Fatalf("entries after the delete = %q, %v", fields, err)
	}
	if n, err := redis.Int(env.broker.Do("EXISTS", c.keys.pendingValue(id, del.TaskID))); n != 0 || err != nil {
		t.Fatalf("a delete's value key exists: %d, %v", n, err)
	}
	// And the session's counted requests hold both, as the entries do, each with its
	// message's delivery tag (the publish that owns its records), until the same deadline:
	// each request's settle spends the count once (publish.lua, settle.lua)
	queued, err := redis.ByteSlices(env.broker.Do("LRANGE", c.cfg.Queue, 0, -1))
	if err != nil {
		t.Fatal(err)
	}
	owned := map[string]string{}
	for _, raw := range queued {
		var m struct {
			Headers    struct{ ID string } `json:"headers"`
			Properties struct {
				DeliveryTag string `json:"delivery_tag"`
			} `json:"properties"`
		}
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatal(err)
		}
		owned[m.Headers.ID] = fields[m.Headers.ID] + " " + m.Properties.DeliveryTag
	}
	counted := DefaultPrefix + ".cq:pending-counted:" + id
	if held, err := redis.StringMap(env.broker.Do("HGETALL", counted)); err != nil || len(held) != 2 ||
		held[h.TaskID] != owned[h.TaskID] || held[del.TaskID] != owned[del.TaskID] || expiresAt(counted) != deadline(del.Seq) {
		t.Fatalf("counted requests %q = %q (%v), expiring at %d; want the entries with their tags %q", counted, held, err,
			expiresAt(counted), owned)
	}
	if n, err := redis.Int(env.broker.Do("HGET", DefaultPrefix+".cq:pending-counts", id)); n != 2 || err != nil {
		t.Fatalf("count %d, %v; want 2", n, err)
	}
	score, err = redis.Int64(env.broker.Do("ZSCORE", DefaultPrefix+".cq:pending", id))
	if expiresAt(entries) != deadline(del.Seq) || err != nil || score != deadline(del.Seq) {
		t.Fatalf("entries expire at %d, index %d (%v); want the delete's deadline %d", expiresAt(entries), score, err, deadline(del.Seq))
	}
	if n, err := redis.Int(env.broker.Do("LLEN", c.cfg.Queue)); n != 2 || err != nil {
		t.Fatalf("queue holds %d, %v; want the 2 messages", n, err)
	}
}

func TestPendingScriptsAreTheProtocolsOwn(t *testing.T) {
	for name, embedded := range map[string]string{
		"publish.lua":      publishScript,
		"read_pending.lua": readPendingScript,
	} {
		shared, err := os.ReadFile("../../tasks/lua/" + name)
		if err != nil {
			t.Fatal(err)
		}
		if string(shared) != embedded {
			t.Fatalf("lua/%s differs from tasks/lua/%s: copy the file", name, name)
		}
	}
	if _, err := os.Stat("lua/load_pending.lua"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("lua/load_pending.lua is still there (read_pending.lua's mode 'store' replaced it): %v", err)
	}
}

func TestALoadFailsClearlyWhenTheBrokerIsDown(t *testing.T) {
	// Given a session in the store, and a broker that is down
	id := sessionID(t, "s")
	h, err := newClient[Checkpoint](t, Config{}).SaveAsync(background(t), sampleCheckpoint(id, 1, "hi"))
	if err != nil {
		t.Fatal(err)
	}
	reader := newClient[Checkpoint](t, Config{Broker: newRedigo(closedAddr(t))})
	mustWait(t, reader, h, Applied)
	// When a replica loads or lists, then it fails saying why, rather than serve the store alone
	ctx := background(t)
	got, loadErr := reader.Load(ctx, id)
	_, listErr := reader.List(ctx)
	for call, err := range map[string]error{"Load": loadErr, "List": listErr} {
		if !errors.Is(err, ErrBrokerUnavailable) || !strings.Contains(err.Error(), "pending records") {
			t.Fatalf("%s: err = %v, want ErrBrokerUnavailable about the pending records", call, err)
		}
	}
	if got != nil {
		t.Fatalf("Load returned %+v with its error", got)
	}
}

func TestABrokerThatLostItsDataIsCountedAndLoadsReadTheStore(t *testing.T) {
	// Given a private broker and store, a session in the store and a newer save pending,
	// from a client without a recovery window (one with it publishes the save again:
	// recovery_test.go)
	broker, store := privateRedis(t), privateRedis(t)
	c := New[Checkpoint](Config{Broker: newRedigo(broker.Addr), Store: newRedigo(store.Addr), RepublishWindow: -1})
	ctx := background(t)
	old := sampleCheckpoint("s", 1, "applied")
	doc, _ := SerializeCheckpoint(old)
	if _, err := store.Do("SET", DefaultPrefix+":s", encoder.EncodeAll(doc, nil)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Save(ctx, sampleCheckpoint("s", 2, "pending")); err != nil {
		t.Fatal(err)
	}
	if got, _ := mustLoad(t, c, "s"); got.Version != 2 || c.EpochChanges() != 0 {
		t.Fatalf("Load = v%d, %d epoch changes; want v2, 0", got.Version, c.EpochChanges())
	}
	// When the broker loses its data (a restart without persistence)
	if _, err := broker.Do("FLUSHALL"); err != nil {
		t.Fatal(err)
	}
	// Then a load reads the store, and the loss is counted once, through the next publish
	if got, _ := mustLoad(t, c, "s"); got.Version != 1 || c.EpochChanges() != 1 {
		t.Fatalf("Load = v%d, %d epoch changes; want v1, 1", got.Version, c.EpochChanges())
	}
	if _, err := c.Save(ctx, sampleCheckpoint("s", 3, "after")); err != nil {
		t.Fatal(err)
	}
	if got, _ := mustLoad(t, c, "s"); got.Version != 3 || c.EpochChanges() != 1 {
		t.Fatalf("Load = v%d, %d epoch changes; want v3, 1", got.Version, c.EpochChanges())
	}
	// And a broker replaced under a live client is counted too
	if _, err := broker.Do("SET", DefaultPrefix+".cq:pending-epoch", "another"); err != nil {
		t.Fatal(err)
	}
	if _, _ = mustLoad(t, c, "s"); c.EpochChanges() != 2 {
		t.Fatalf("%d epoch changes, want 2", c.EpochChanges())
	}
}

func TestASaveTheWorkerWouldRefuseIsRefusedAtOnce(t *testing.T) {
	held := &captureRedis{}
	c := New[Checkpoint](Config{Broker: held, Store: held})
	ctx := context.Background()
	// Given 1.6 MB that does not compress, in one message
	random := make([]byte, 1200*1024)
	if _, err := rand.Read(random); err != nil {
		t.Fatal(err)
	}
	big := sampleCheckpoint("big", 1, base64.StdEncoding.EncodeToString(random))
	// When it is saved, then the save fails with the worker's reason, and nothing is sent
	_, err := c.Save(ctx, big)
	want := "conversationHistory: session big: even the most recent message alone does not fit the 1048576-byte stored-size budget"
	if !errors.Is(err, ErrTooLarge) || !errors.Is(err, ErrInvalidInput) || !strings.HasSuffix(err.Error(), want) {
		t.Fatalf("err = %v, want ErrTooLarge ending %q", err, want)
	}
	if n := len(held.messages()); n != 0 {
		t.Fatalf("%d message(s) published", n)
	}
	// And a checkpoint with no history over the budget is refused alike
	bloated := sampleCheckpoint("bloated", 1)
	bloated.LastRunRef = base64.StdEncoding.EncodeToString(random)
	if _, err := c.Save(ctx, bloated); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("err = %v, want ErrTooLarge", err)
	}
}

func TestASaveOverTheBudgetKeepsTheMessagesTheStoreKeeps(t *testing.T) {
	forEachStoreAndMode(t, func(t *testing.T, s storeBackend, mode pendingMode) {
		// Given 40 messages of 60 KB of base64 noise, which zstd leaves as it is: 2.4 MB, of
		// which 17.45 messages' worth fit the 1 MiB budget (no size near its edge)
		a, b := replicas(t, s, mode)
		id := sessionID(t, "budget")
		var messages []string
		noise := mrand.New(mrand.NewSource(22)) // the same bytes every run
		for i := 0; i < 40; i++ {
			random := make([]byte, 44*1024)
			noise.Read(random)
			messages = append(messages, fmt.Sprintf("%d %s", i, base64.StdEncoding.EncodeToString(random)))
		}
		// When it is saved and loaded at once
		h := mustSave(t, a, sampleCheckpoint(id, 1, messages...))
		loaded, _ := mustLoad(t, b, id)
		// Then the load has the most recent messages that fit, and the store the same ones
		deliver(t, a, h)
		kept := s.stored(t, a, id)
		if loaded == nil || kept == nil {
			t.Fatalf("loaded %v, stored %v", loaded != nil, kept != nil)
		}
		if normalise(loaded) != normalise(kept) {
			t.Fatalf("loaded %d messages, the store kept %d", len(loaded.ConversationHistory), len(kept.ConversationHistory))
		}
		n := len(kept.ConversationHistory)
		if n != 17 || kept.ConversationHistory[n-1].Content != messages[39] {
			t.Fatalf("kept %d messages ending %.10q, want the most recent 17", n, kept.ConversationHistory[n-1].Content)
		}
	})
}

// pythonTurn is a turn taken by a Python replica (CheckpointClient, in a process of its
// own): load, append "turn <n>", save to queue. It returns what it loaded (contents) and
// whether List showed the session.
const pythonTurn = `
import json, sys
from checkpointq.store import RedisStore
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.producer.client import CheckpointClient

broker, store, queue, session, turn = sys.argv[1:6]
with CheckpointClient(broker, RedisStore.from_url(store), queue=queue) as client:
    loaded = client.load(session)
    wire = checkpoint_to_wire(loaded)
    before = "v%d [%s]" % (wire["version"], ", ".join(m["content"] for m in wire.get("conversationHistory", [])))
    wire["version"] += 1
    wire.setdefault("conversationHistory", []).append({"role": "user", "content": "turn " + turn})
    client.save(wire)
    print(json.dumps({"before": before, "listed": session in client.list()}))
`

func TestGoAndPythonReplicasSeeEachOthersPendingTurns(t *testing.T) {
	bin := os.Getenv("CHECKPOINTQ_BIN")
	if bin == "" {
		t.Fatal("CHECKPOINTQ_BIN is not set: run the Go tests with scripts/test-go")
	}
	python := filepath.Join(filepath.Dir(bin), "python")
	// Given a Go replica and a Python replica, publishing to a queue no worker reads yet
	a, _ := replicas(t, storeBackends[0], pendingMode{queue: "held"})
	id := sessionID(t, "mixed")
	mustSave(t, a, sampleCheckpoint(id, 1, "turn 1"))
	pyTurn := func(turn int) (before string, listed bool) {
		t.Helper()
		out, err := exec.Command(python, "-c", pythonTurn, env.broker.URL(), env.store.URL(), a.cfg.Queue,
			id, fmt.Sprint(turn)).CombinedOutput()
		if err != nil {
			t.Fatalf("python replica: %v\n%s", err, out)
		}
		var reply struct {
			Before string `json:"before"`
			Listed bool   `json:"listed"`
		}
		if err := json.Unmarshal(out, &reply); err != nil {
			t.Fatalf("python replica said %s: %v", out, err)
		}
		return reply.Before, reply.Listed
	}
	// When they take turns, each loading what the other just saved
	if before, listed := pyTurn(2); before != "v1 [turn 1]" || !listed {
		t.Fatalf("the Python replica loaded %s (listed %v); want Go's v1 [turn 1]", before, listed)
	}
	takeTurn(t, a, id, 2) // checks that Go loads Python's turn 2
	if before, _ := pyTurn(4); before != contents(sampleCheckpoint(id, 3, turns(3)...)) {
		t.Fatalf("the Python replica loaded %s; want Go's turn 3", before)
	}
	cp, seq := mustLoad(t, a, id)
	if contents(cp) != contents(sampleCheckpoint(id, 4, turns(4)...)) {
		t.Fatalf("Go loaded %s, want Python's turn 4", contents(cp))
	}
	// Then, delivered, every turn lands
	deliver(t, a)
	if err := pollUntil(30*time.Second, "turn 4 in the store", func() bool {
		s := stored(t, env.store, id)
		return s != nil && s.Version == 4
	}); err != nil {
		t.Fatal(err)
	}
	if got := contents(stored(t, env.store, id)); got != contents(cp) {
		t.Fatalf("stored %s, want %s", got, contents(cp))
	}
	waitSettled(t, env.broker, id)
	if _, after := mustLoad(t, a, id); after != seq {
		t.Fatalf("the fence of the applied turn 4 is %d, the record's seq was %d", after, seq)
	}
}

func TestAFastReplicasFenceRaisesOnlyItsSessionsStamps(t *testing.T) {
	// Given replica A, whose clock runs 2 minutes ahead (within the broker's limit), saving
	// a session, and replica B, whose clock is right
	a := newClient[Checkpoint](t, Config{Now: func() time.Time { return time.Now().Add(2 * time.Minute) }})
	b := newClient[Checkpoint](t, Config{})
	shared, own := sessionID(t, "shared"), sessionID(t, "own")
	ah := mustSave(t, a, sampleCheckpoint(shared, 1, "from A"))
	// When B loads that session, then saves it and another session
	cp, loaded := mustLoad(t, b, shared)
	if cp == nil || loaded != ah.Seq {
		t.Fatalf("B loaded %+v at seq %d; want A's save at %d", cp, loaded, ah.Seq)
	}
	cp.Version++
	next := mustSave(t, b, cp)
	before := time.Now().UnixMicro()
	other := mustSave(t, b, sampleCheckpoint(own, 1, "from B"))
	after := time.Now().UnixMicro()
	// Then only the loaded session's save is stamped after A's; the other keeps B's clock
	if next.Seq <= ah.Seq {
		t.Fatalf("B's save of the loaded session at %d does not sort after A's %d", next.Seq, ah.Seq)
	}
	if other.Seq < before || other.Seq > after {
		t.Fatalf("B's save of another session at %d, want B's wall clock, within [%d, %d] (A's fence is %d)",
			other.Seq, before, after, ah.Seq)
	}
	// And the workers apply all three
	for _, h := range []Handle{next, other} {
		mustWait(t, b, h, Applied)
	}
	mustWait(t, a, ah, Superseded)
}

func TestSettlingASaveLeavesADeleteStampedAlikePending(t *testing.T) {
	// Given a session in the store at seq f, and two replicas whose clocks lag it, so that
	// one's save and the other's delete are both stamped f + 1 (issue 31, hole 2)
	id := sessionID(t, "alike")
	first := mustSave(t, newClient[Checkpoint](t, Config{}), sampleCheckpoint(id, 1, "stored"))
	f := mustWait(t, newClient[Checkpoint](t, Config{}), first, Applied).FenceSeq
	lagging := Config{Queue: "held-" + t.Name(), Now: func() time.Time { return time.UnixMicro(f - 1_000_000) }}
	saver, deleter := newClient[Checkpoint](t, lagging), newClient[Checkpoint](t, lagging)
	saved, err := saver.SaveAsync(background(t), sampleCheckpoint(id, 2, "saved"), After(f))
	if err != nil {
		t.Fatal(err)
	}
	deleted, err := deleter.DeleteAsync(background(t), id, After(f))
	if err != nil {
		t.Fatal(err)
	}
	if saved.Seq != f+1 || deleted.Seq != f+1 {
		t.Fatalf("seqs %d and %d, want both %d", saved.Seq, deleted.Seq, f+1)
	}
	// When the save alone reaches the worker, is applied and settled
	if _, err := env.broker.Do("RPOPLPUSH", saver.cfg.Queue, "checkpoints"); err != nil {
		t.Fatal(err)
	}
	mustWait(t, saver, saved, Applied)
	entries := DefaultPrefix + ".cq:pending-requests:" + id
	if err := pollUntil(30*time.Second, "the save's entry to be settled", func() bool {
		n, err := redis.Int(env.broker.Do("HEXISTS", entries, saved.TaskID))
		return err == nil && n == 0
	}); err != nil {
		t.Fatal(err)
	}
	// Then the delete's entry is still there, and every load and list answers the delete
	reader := newClient[Checkpoint](t, Config{})
	if n, err := redis.Int(env.broker.Do("HEXISTS", entries, deleted.TaskID)); n != 1 || err != nil {
		t.Fatalf("the delete's entry is gone (%d, %v) though its request is queued", n, err)
	}
	if cp, seq := mustLoad(t, reader, id); cp != nil || seq != deleted.Seq || mustList(t, reader)[id] {
		t.Fatalf("Load = %+v at seq %d (listed %v); want the pending delete at %d", cp, seq, mustList(t, reader)[id], deleted.Seq)
	}
	// And once delivered, the delete is applied over the save stamped alike
	deliver(t, deleter)
	mustWait(t, reader, deleted, Applied)
	mustWait(t, reader, saved, Superseded)
	if s := stored(t, env.store, id); s != nil {
		t.Fatalf("the store holds %+v after the delete", s)
	}
}

func TestAPendingSaveReadsAsExpiredPastItsDeadlineAndFailsWithoutItsValue(t *testing.T) {
	// Given a save held on a queue no worker reads, over a session the store holds
	queue := "held-" + t.Name()
	c := newClient[Checkpoint](t, Config{Queue: queue})
	t.Cleanup(func() { _, _ = env.broker.Do("DEL", queue) })
	id := sessionID(t, "s")
	mustWait(t, c, mustSave(t, newClient[Checkpoint](t, Config{}), sampleCheckpoint(id, 1, "stored")), Applied)
	h := mustSave(t, c, sampleCheckpoint(id, 2, "pending"))
	// When it is read by a replica whose session TTL has already passed since its seq
	// (read_pending.lua answers "lapsed": it will never be stored)
	late := newClient[Checkpoint](t, Config{SessionTTL: time.Millisecond})
	time.Sleep(2 * time.Millisecond)
	// Then that replica loads the session as missing, at the save's seq, and lists it not
	if cp, seq := mustLoad(t, late, id); cp != nil || seq != h.Seq || mustList(t, late)[id] {
		t.Fatalf("Load = %+v at seq %d (listed %v); want none at the lapsed save's %d", cp, seq, mustList(t, late)[id], h.Seq)
	}
	// And when the save's value is gone before its deadline (evicted), loads fail, saying so
	if _, err := env.broker.Do("DEL", c.keys.pendingValue(id, h.TaskID)); err != nil {
		t.Fatal(err)
	}
	if cp, err := c.Load(background(t), id); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "gone before its deadline") {
		t.Fatalf("Load = %+v, %v; want ErrCorrupt saying the value is gone", cp, err)
	}
}
