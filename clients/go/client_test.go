package checkpointq

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// captureRedis is a broker that keeps what is pushed instead of delivering it, so that a
// test can deliver it later, out of order and more than once. It keeps no pending records:
// it serves as a broker for writes only.
type captureRedis struct {
	mu     sync.Mutex
	pushed [][]byte
}

func (c *captureRedis) Eval(_ context.Context, script string, _ []string, args ...interface{}) (interface{}, error) {
	if script != publishScript {
		return nil, errors.New("captureRedis only takes publishes")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pushed = append(c.pushed, append([]byte(nil), args[0].([]byte)...))
	return []interface{}{"capture-epoch", int64(1), int64(0)}, nil
}

func (c *captureRedis) ZScan(context.Context, string, uint64, int64) ([]string, uint64, error) {
	return nil, 0, errors.New("captureRedis is a broker only")
}

func (c *captureRedis) messages() [][]byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([][]byte(nil), c.pushed...)
}

// waitDrained polls until the shared worker has taken and acknowledged every message.
func waitDrained(t *testing.T) {
	t.Helper()
	err := pollUntil(30*time.Second, "the worker to drain the queue", func() bool {
		queued, err1 := redis.Int(env.broker.Do("LLEN", "checkpoints"))
		unacked, err2 := redis.Int(env.broker.Do("HLEN", "unacked"))
		return err1 == nil && err2 == nil && queued == 0 && unacked == 0
	})
	if err != nil {
		t.Fatal(err)
	}
}

func mustWait[C any](t *testing.T, c *Client[C], h Handle, want Outcome) Result {
	t.Helper()
	res, err := c.WaitDurable(background(t), h)
	if err != nil {
		t.Fatalf("WaitDurable(%s seq %d): %v", h.Task, h.Seq, err)
	}
	if res.Outcome != want {
		t.Fatalf("WaitDurable(%s seq %d) = %+v, want %s", h.Task, h.Seq, res, want)
	}
	return res
}

// saveAndLoad saves cp, waits until it is applied, and loads it back.
func saveAndLoad[C any](t *testing.T, c *Client[C], cp *C) *C {
	t.Helper()
	ctx := background(t)
	h, err := c.SaveAsync(ctx, cp)
	if err != nil {
		t.Fatal(err)
	}
	mustWait(t, c, h, Applied)
	got, err := c.Load(ctx, h.SessionID)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func sampleCheckpoint(id string, version int64, messages ...string) *Checkpoint {
	cp := &Checkpoint{
		SessionID: id,
		Version:   version,
		Metadata: CheckpointMetadata{
			TotalMessages: int64(len(messages)),
			TotalTokens:   1234,
			TotalCostUSD:  "0.012300",
			StartTime:     NewTime(time.Date(2026, 12, 3, 7, 0, 0, 0, time.UTC)),
		},
		LastRunRef: "run-" + fmt.Sprint(version),
	}
	for i, m := range messages {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		cp.ConversationHistory = append(cp.ConversationHistory, ConversationMessage{Role: role, Content: m})
	}
	return cp
}

func TestSavedCheckpointIsStoredByteForByteAsGoWritesIt(t *testing.T) {
	c := newClient[Checkpoint](t, Config{})
	ctx := background(t)
	id := sessionID(t, "ünïcödé-🚀-{tag}:*?[x]")
	cp := sampleCheckpoint(id, 3, "hello <b>&</b>", "line\u2028separator, 日本語, emoji 🎉", `quotes " and \ backslash`)
	cp.ConversationHistory[0].TraceEntries = `[{"tool":"search"}]`

	h, err := c.SaveAsync(ctx, cp)
	if err != nil {
		t.Fatal(err)
	}
	if h.Ref != "session://"+id+"/v3" {
		t.Fatalf("ref %q", h.Ref)
	}
	mustWait(t, c, h, Applied)

	stored, err := redis.Bytes(env.store.Do("GET", DefaultPrefix+":"+id))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(stored), string(zstdMagic)) {
		t.Fatalf("stored value is not a zstd frame: %q", stored[:8])
	}
	doc, err := decodeValue(stored)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := SerializeCheckpoint(cp)
	if string(doc) != string(want) {
		t.Fatalf("stored JSON differs from Go's:\n got %s\nwant %s", doc, want)
	}
	got, err := c.Load(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(normalise(got), normalise(cp)) {
		t.Fatalf("Load = %+v, want %+v", got, cp)
	}
}

// normalise compares times as instants (Load gives them in the local zone, as metav1 does).
func normalise(cp *Checkpoint) string {
	data, _ := json.Marshal(cp)
	return string(data)
}

func TestLargeCheckpointRoundTrips(t *testing.T) {
	c := newClient[Checkpoint](t, Config{})
	id := sessionID(t, "200k")
	random := make([]byte, 150*1024)
	rand.New(rand.NewSource(1)).Read(random)
	cp := sampleCheckpoint(id, 1, base64.StdEncoding.EncodeToString(random)) // ~200 KB
	doc, _ := SerializeCheckpoint(cp)
	if len(doc) < 200*1024 {
		t.Fatalf("checkpoint is only %d bytes", len(doc))
	}
	if got := saveAndLoad(t, c, cp); normalise(got) != normalise(cp) {
		t.Fatal("200 KB checkpoint changed on its way through the worker")
	}
}

func TestSaveKeepsTheHundredMostRecentMessages(t *testing.T) {
	c := newClient[Checkpoint](t, Config{})
	id := sessionID(t, "history")
	var messages []string
	for i := 0; i < 150; i++ {
		messages = append(messages, fmt.Sprintf("message %d", i))
	}
	got := saveAndLoad(t, c, sampleCheckpoint(id, 1, messages...))
	if n := len(got.ConversationHistory); n != 100 {
		t.Fatalf("%d messages kept, want 100", n)
	}
	if first := got.ConversationHistory[0].Content; first != "message 50" {
		t.Fatalf("oldest kept message is %q, want \"message 50\"", first)
	}
}

func TestOrderingHoldsUnderDuplicatesAndReordering(t *testing.T) {
	// Given five saves and then a delete, captured instead of delivered
	held := &captureRedis{}
	producer := newClient[Checkpoint](t, Config{Broker: held})
	reader := newClient[Checkpoint](t, Config{})
	ctx := background(t)
	id := sessionID(t, "dup")
	var saves []Handle
	for v := int64(1); v <= 5; v++ {
		h, err := producer.SaveAsync(ctx, sampleCheckpoint(id, v, fmt.Sprint("v", v)))
		if err != nil {
			t.Fatal(err)
		}
		saves = append(saves, h)
	}
	messages := held.messages()

	// When each is delivered twice, newest first, then shuffled
	deliver := func(batch [][]byte) {
		for _, m := range batch {
			if _, err := env.broker.Do("LPUSH", "checkpoints", m); err != nil {
				t.Fatal(err)
			}
		}
	}
	var shuffled [][]byte
	for i := len(messages) - 1; i >= 0; i-- {
		shuffled = append(shuffled, messages[i])
	}
	rnd := rand.New(rand.NewSource(7))
	rest := append([][]byte(nil), messages...)
	rnd.Shuffle(len(rest), func(i, j int) { rest[i], rest[j] = rest[j], rest[i] })
	deliver(append(shuffled, rest...))
	waitDrained(t)

	// Then the newest save won, and every older one knows it was superseded
	mustWait(t, reader, saves[4], Applied)
	for _, h := range saves[:4] {
		mustWait(t, reader, h, Superseded)
	}
	got, err := reader.Load(ctx, id)
	if err != nil || got == nil || got.Version != 5 {
		t.Fatalf("Load = %+v, %v; want version 5", got, err)
	}

	// When the session is deleted and all the saves arrive once more
	del, err := producer.DeleteAsync(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	deliver(held.messages()[5:])
	deliver(messages)
	waitDrained(t)

	// Then it stays deleted: the tombstone refuses every older save
	mustWait(t, reader, del, Applied)
	for _, h := range saves {
		mustWait(t, reader, h, Superseded)
	}
	if got, err := reader.Load(ctx, id); err != nil || got != nil {
		t.Fatalf("Load after delete = %+v, %v; want nil", got, err)
	}
	ids, err := reader.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, listed := range ids {
		if listed == id {
			t.Fatal("deleted session still listed")
		}
	}
}

func TestListShowsLiveSessions(t *testing.T) {
	c := newClient[Checkpoint](t, Config{})
	ctx := background(t)
	var want []string
	for _, suffix := range []string{"a", "b", "ç"} {
		id := sessionID(t, suffix)
		h, err := c.SaveAsync(ctx, sampleCheckpoint(id, 1))
		if err != nil {
			t.Fatal(err)
		}
		mustWait(t, c, h, Applied)
		want = append(want, id)
	}
	ids, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, id := range ids {
		listed[id] = true
	}
	for _, id := range want {
		if !listed[id] {
			t.Fatalf("%q not in List() = %v", id, ids)
		}
	}
}

func TestLoadOfUnknownSessionIsNilWithoutError(t *testing.T) {
	c := newClient[Checkpoint](t, Config{})
	for _, id := range []string{"", sessionID(t, "never-saved")} {
		got, err := c.Load(background(t), id)
		if got != nil || err != nil {
			t.Fatalf("Load(%q) = %+v, %v; want nil, nil", id, got, err)
		}
	}
}

func TestInvalidRequestsAreRefusedBeforePublishing(t *testing.T) {
	held := &captureRedis{}
	c := newClient[Checkpoint](t, Config{Broker: held, MaxMessageBytes: 4096})
	ctx := background(t)
	cases := map[string]func() error{
		"empty id":      func() error { _, err := c.Save(ctx, sampleCheckpoint("", 1)); return err },
		"invalid UTF-8": func() error { return c.Delete(ctx, "bad\xffid") },
		"too large": func() error {
			_, err := c.Save(ctx, sampleCheckpoint("big", 1, strings.Repeat("x", 5000)))
			return err
		},
	}
	for name, call := range cases {
		if err := call(); !errors.Is(err, ErrInvalidInput) {
			t.Errorf("%s: err = %v, want ErrInvalidInput", name, err)
		}
	}
	if n := len(held.messages()); n != 0 {
		t.Fatalf("%d invalid request(s) published", n)
	}
}

func TestMessageIsTheDocumentedProtocol2Envelope(t *testing.T) {
	held := &captureRedis{}
	c := New[Checkpoint](Config{Broker: held, Store: held})
	h, err := c.SaveAsync(context.Background(), sampleCheckpoint("sess-42", 3, "hello"))
	if err != nil {
		t.Fatal(err)
	}
	var msg struct {
		Body            string                 `json:"body"`
		ContentType     string                 `json:"content-type"`
		ContentEncoding string                 `json:"content-encoding"`
		Headers         map[string]interface{} `json:"headers"`
		Properties      struct {
			BodyEncoding string            `json:"body_encoding"`
			DeliveryTag  string            `json:"delivery_tag"`
			DeliveryInfo map[string]string `json:"delivery_info"`
		} `json:"properties"`
	}
	if err := json.Unmarshal(held.messages()[0], &msg); err != nil {
		t.Fatal(err)
	}
	uuid := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	if msg.ContentType != "application/json" || msg.ContentEncoding != "utf-8" ||
		msg.Headers["task"] != TaskSave || msg.Headers["id"] != h.TaskID || !uuid.MatchString(h.TaskID) ||
		msg.Properties.BodyEncoding != "base64" || !uuid.MatchString(msg.Properties.DeliveryTag) ||
		msg.Properties.DeliveryInfo["routing_key"] != "checkpoints" || msg.Properties.DeliveryInfo["exchange"] != "" {
		t.Fatalf("envelope does not follow docs/protocol.md: %+v", msg)
	}
	raw, err := base64.StdEncoding.DecodeString(msg.Body)
	if err != nil {
		t.Fatal(err)
	}
	var body [3]json.RawMessage
	if err := json.Unmarshal(raw, &body); err != nil {
		t.Fatal(err)
	}
	want, _ := SerializeCheckpoint(sampleCheckpoint("sess-42", 3, "hello"))
	if string(body[0]) != "["+string(want)+"]" || string(body[1]) != fmt.Sprintf(`{"seq":%d}`, h.Seq) {
		t.Fatalf("body = %s", raw)
	}
}

func TestSeqIsCausalAndMonotonicPerSession(t *testing.T) {
	now := time.UnixMicro(1_800_000_000_000_000)
	clock := newSeqClock(func() time.Time { return now })
	first, _ := clock.next("a", 0)
	if first != now.UnixMicro() {
		t.Fatalf("first seq %d, want the clock's %d", first, now.UnixMicro())
	}
	if second, _ := clock.next("a", 0); second != first+1 {
		t.Fatalf("same-microsecond seq of the same session %d, want %d", second, first+1)
	}
	// Another session's stamps are its own: no process-wide floor.
	if other, _ := clock.next("b", 0); other != now.UnixMicro() {
		t.Fatalf("another session's seq %d, want the clock's %d", other, now.UnixMicro())
	}
	// A fence seen 2 s ahead (another replica's clock) lifts this session's next stamp,
	// and no other session's.
	ahead := now.UnixMicro() + 2_000_000
	clock.observe("a", ahead)
	if seq, _ := clock.next("a", 0); seq != ahead+1 {
		t.Fatalf("seq after a fence at %d is %d, want %d", ahead, seq, ahead+1)
	}
	if seq, _ := clock.next("b", 0); seq != now.UnixMicro()+1 {
		t.Fatalf("session b's seq after a's fence is %d, want b's own floor + 1, %d", seq, now.UnixMicro()+1)
	}
	if seq, _ := clock.next("c", ahead+10); seq != ahead+11 {
		t.Fatalf("After(%d) gave %d", ahead+10, seq)
	}
	if _, err := clock.next("d", MaxSeq); !errors.Is(err, ErrInvalidInput) {
		t.Fatalf("seq past 2^53-1: err = %v", err)
	}
}

func TestTheClockForgetsFloorsItsTimeHasPassedBeyondTheLimit(t *testing.T) {
	now := time.UnixMicro(1_800_000_000_000_000)
	clock := newSeqClock(func() time.Time { return now })
	// Given a floor ahead of the clock, and pruneAt sessions stamped now
	clock.observe("ahead", now.UnixMicro()+5_000_000)
	for i := 0; i < pruneAt; i++ {
		if _, err := clock.next(fmt.Sprint("s", i), 0); err != nil {
			t.Fatal(err)
		}
	}
	// When the clock moves on and one more session goes past the limit
	now = now.Add(time.Second)
	clock.observe("one-more", now.UnixMicro())
	// Then the floors the clock passed are forgotten, and those still ahead kept
	if n := len(clock.floors); n != 2 || clock.floors["ahead"] == 0 || clock.floors["one-more"] == 0 {
		t.Fatalf("%d floors kept after the prune (ahead: %d), want 2", n, clock.floors["ahead"])
	}
}

// apiCheckpoint stands for the apiserver's own type (agentorcav1alpha1.Checkpoint): other
// Go names, the same JSON.
type apiCheckpoint struct {
	SessionID string                 `json:"sessionId"`
	Version   int64                  `json:"version"`
	History   []ConversationMessage  `json:"conversationHistory,omitempty"`
	Metadata  map[string]interface{} `json:"metadata"`
}

func TestTheApiserversOwnCheckpointTypeWorks(t *testing.T) {
	c := newClient[apiCheckpoint](t, Config{})
	ctx := background(t)
	id := sessionID(t, "api")
	cp := &apiCheckpoint{SessionID: id, Version: 7, Metadata: map[string]interface{}{"totalTokens": 5.0}}
	for i := 0; i < 120; i++ {
		cp.History = append(cp.History, ConversationMessage{Role: "user", Content: fmt.Sprint(i)})
	}
	h, err := c.SaveAsync(ctx, cp)
	if err != nil {
		t.Fatal(err)
	}
	if len(cp.History) != 120 {
		t.Fatal("SaveAsync trimmed the caller's checkpoint")
	}
	mustWait(t, c, h, Applied)
	got, err := c.Load(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if got.Version != 7 || len(got.History) != 100 || got.History[0].Content != "20" || got.Metadata["totalTokens"] != 5.0 {
		t.Fatalf("Load = %+v", got)
	}
}

func TestACheckpointTypeWithoutTheFieldsIsTrimmedByItsJSON(t *testing.T) {
	held := &captureRedis{}
	c := New[map[string]interface{}](Config{Broker: held, HistoryCap: 2})
	cp := map[string]interface{}{
		"sessionId": "m", "version": 2, "metadata": map[string]interface{}{},
		"conversationHistory": []map[string]string{{"role": "user", "content": "1"}, {"role": "user", "content": "2"}, {"role": "user", "content": "3"}},
	}
	h, err := c.SaveAsync(context.Background(), &cp)
	if err != nil || h.SessionID != "m" || h.Ref != "session://m/v2" {
		t.Fatalf("SaveAsync = %+v, %v", h, err)
	}
	var msg struct {
		Body string `json:"body"`
	}
	_ = json.Unmarshal(held.messages()[0], &msg)
	raw, _ := base64.StdEncoding.DecodeString(msg.Body)
	if !strings.Contains(string(raw), `"conversationHistory":[{"content":"2","role":"user"},{"content":"3","role":"user"}]`) {
		t.Fatalf("history not cut to the 2 most recent: %s", raw)
	}
}

func TestWaitOnWriteGivesReadYourWrites(t *testing.T) {
	c := newClient[Checkpoint](t, Config{WaitOnWrite: true})
	ctx := background(t)
	id := sessionID(t, "sync")
	for v := int64(1); v <= 3; v++ {
		if _, err := c.Save(ctx, sampleCheckpoint(id, v)); err != nil {
			t.Fatal(err)
		}
		if got, err := c.Load(ctx, id); err != nil || got == nil || got.Version != v {
			t.Fatalf("Load right after Save(v%d) = %+v, %v", v, got, err)
		}
	}
	if err := c.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	if got, err := c.Load(ctx, id); err != nil || got != nil {
		t.Fatalf("Load right after Delete = %+v, %v", got, err)
	}
}

func TestLoadReadsWhatAGoRedisStoreWrote(t *testing.T) {
	// Given values written by Go RedisStores directly: zstd JSON, and plain JSON (older ones)
	c := newClient[Checkpoint](t, Config{})
	for name, encode := range map[string]func([]byte) []byte{
		"zstd":  func(doc []byte) []byte { return encoderFor(t).EncodeAll(doc, nil) },
		"plain": func(doc []byte) []byte { return doc },
	} {
		id := sessionID(t, name)
		cp := sampleCheckpoint(id, 4, "written by Go")
		doc, _ := SerializeCheckpoint(cp)
		if _, err := env.store.Do("SET", DefaultPrefix+":"+id, encode(doc), "EX", 60); err != nil {
			t.Fatal(err)
		}
		// Then Load reads it back (with no fence: nothing went through checkpointq)
		got, seq, err := c.LoadWithSeq(background(t), id)
		if err != nil || seq != 0 || normalise(got) != normalise(cp) {
			t.Fatalf("%s: LoadWithSeq = %+v, %d, %v", name, got, seq, err)
		}
	}
}
