package checkpointq

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
	"github.com/klauspost/compress/zstd"
)

// BenchmarkEnqueueVsRedisStoreSave times, turn about on the same private Redis, the
// client's Save (the protocol 2 message and its pending entry, one script call) and what the Go RedisStore's
// Save does (marshal, zstd, SET ... EX), on a ~20 KB checkpoint. It reports each p50 and
// their ratio; it asserts nothing about time. Run it with
//
//	scripts/test-go -run '^$' -bench EnqueueVsRedisStoreSave -benchtime 2000x
func BenchmarkEnqueueVsRedisStoreSave(b *testing.B) {
	ctx := context.Background()
	const queue = "bench-nobody-reads-this"
	broker := newRedigo(env.broker.Addr)
	defer broker.Close()
	c := New[Checkpoint](Config{Broker: broker, Queue: queue})
	encoder := encoderFor(b)
	cp := benchCheckpoint("bench-session")
	doc, _ := SerializeCheckpoint(cp)
	b.Logf("checkpoint: %d bytes of JSON, %d zstd", len(doc), len(encoderFor(b).EncodeAll(doc, nil)))

	redisStoreSave := func() error {
		data, err := json.Marshal(cp)
		if err != nil {
			return err
		}
		_, err = broker.do(ctx, "SET", DefaultPrefix+":bench-session", encoder.EncodeAll(data, nil), "EX", 30*24*3600)
		return err
	}
	enqueue, save := make([]time.Duration, 0, b.N), make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		if _, err := c.Save(ctx, cp); err != nil {
			b.Fatal(err)
		}
		enqueue = append(enqueue, time.Since(start))
		start = time.Now()
		if err := redisStoreSave(); err != nil {
			b.Fatal(err)
		}
		save = append(save, time.Since(start))
		if i%500 == 499 {
			b.StopTimer()
			if _, err := broker.do(ctx, "DEL", queue); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
		}
	}
	b.StopTimer()
	if _, err := broker.do(ctx, "DEL", queue, DefaultPrefix+":bench-session"); err != nil {
		b.Fatal(err)
	}
	p50e, p50s := median(enqueue), median(save)
	b.ReportMetric(float64(p50e.Microseconds()), "enqueue-p50-µs")
	b.ReportMetric(float64(p50s.Microseconds()), "redisstore-save-p50-µs")
	b.ReportMetric(float64(p50e)/float64(p50s), "enqueue/save")
}

// benchCheckpoint is a ~22.7 KB checkpoint of prose-like text (seeded random words), which
// zstd shrinks about as much as real conversation (to ~6 KB): a repeated sentence would
// flatter the store's SET.
func benchCheckpoint(id string) *Checkpoint {
	words := strings.Fields("the agent said that a tool call returned results for search query " +
		"user asked about weather code review deploy failed retry with backoff token budget " +
		"summary of the plan next step is to read file and write tests error timeout ok")
	rnd := rand.New(rand.NewSource(1))
	var messages []string
	for i := 0; i < 60; i++ {
		var text []string
		for len(strings.Join(text, " ")) < 330 {
			text = append(text, words[rnd.Intn(len(words))])
		}
		messages = append(messages, fmt.Sprintf("message %d: %s", i, strings.Join(text, " ")))
	}
	return sampleCheckpoint(id, 1, messages...)
}

// encoderFor is a zstd encoder at klauspost's default level (SpeedDefault).
func encoderFor(tb testing.TB) *zstd.Encoder {
	encoder, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedDefault))
	if err != nil {
		tb.Fatal(err)
	}
	return encoder
}

func median(d []time.Duration) time.Duration {
	sorted := append([]time.Duration(nil), d...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i] < sorted[j] })
	return sorted[len(sorted)/2]
}

// BenchmarkRecordsVsRedisStore times, turn about on one private Redis (broker and store,
// the README's layout), the client's Save (trim, zstd, the protocol 2 message and the
// pending record in one script call) against the Go RedisStore's Save (marshal, zstd,
// SET ... EX), and the client's Load against the Go RedisStore's (GET, zstd, unmarshal):
// with a pending record that wins (the value comes from the record), with none (the
// store's value), and the same two with the store given as a second connection (no
// shared script: a call to the broker, then one to the store). It reports each p50 and
// the ratios to the Go store's; it asserts nothing about time. Run it with
//
//	scripts/test-go -run '^$' -bench RecordsVsRedisStore -benchtime 2000x
func BenchmarkRecordsVsRedisStore(b *testing.B) {
	ctx := context.Background()
	server, err := startRedis()
	if err != nil {
		b.Fatal(err)
	}
	defer server.Stop()
	r, second := newRedigo(server.Addr), newRedigo(server.Addr)
	defer r.Close()
	defer second.Close()
	const queue = "bench-nobody-reads-this"
	one := New[Checkpoint](Config{Broker: r, Queue: queue})
	two := New[Checkpoint](Config{Broker: r, Store: second, Queue: queue})
	if !one.oneRedis || two.oneRedis {
		b.Fatal("the two clients do not read as intended")
	}
	encoder := encoderFor(b)
	cp := benchCheckpoint("bench-pending")
	direct := benchCheckpoint("bench-stored")
	data, _ := json.Marshal(direct)
	if _, err := r.do(ctx, "SET", DefaultPrefix+":bench-stored", encoder.EncodeAll(data, nil)); err != nil {
		b.Fatal(err)
	}
	redisStoreSave := func() error {
		data, err := json.Marshal(cp)
		if err != nil {
			return err
		}
		_, err = r.do(ctx, "SET", DefaultPrefix+":bench-direct", encoder.EncodeAll(data, nil), "EX", 30*24*3600)
		return err
	}
	redisStoreLoad := func() error {
		value, err := r.do(ctx, "GET", DefaultPrefix+":bench-direct")
		if err != nil {
			return err
		}
		doc, err := decodeValue(value.([]byte))
		if err != nil {
			return err
		}
		var got Checkpoint
		return json.Unmarshal(doc, &got)
	}
	load := func(c *Client[Checkpoint], id string) error {
		got, err := c.Load(ctx, id)
		if err == nil && (got == nil || len(got.ConversationHistory) != 60) {
			err = fmt.Errorf("Load(%q) = %+v", id, got)
		}
		return err
	}
	var save, storeSave, loadRecord, loadStore, loadRecord2, loadStore2, storeLoad []time.Duration
	timed := func(into *[]time.Duration, call func() error) {
		start := time.Now()
		if err := call(); err != nil {
			b.Fatal(err)
		}
		*into = append(*into, time.Since(start))
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var h Handle
		timed(&save, func() (err error) { h, err = one.SaveAsync(ctx, cp); return err })
		timed(&storeSave, redisStoreSave)
		timed(&loadRecord, func() error { return load(one, "bench-pending") })
		timed(&loadStore, func() error { return load(one, "bench-stored") })
		timed(&loadRecord2, func() error { return load(two, "bench-pending") })
		timed(&loadStore2, func() error { return load(two, "bench-stored") })
		timed(&storeLoad, redisStoreLoad)
		// Settle the request as a worker would (one entry per queued request: a session
		// rarely has more than one or two), so that every load reads one entry.
		b.StopTimer()
		if _, err := r.do(ctx, "DEL", queue, one.keys.pendingRequests(h.SessionID),
			one.keys.pendingValue(h.SessionID, h.TaskID)); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.StopTimer()
	p50 := func(name string, d []time.Duration, base time.Duration) {
		b.ReportMetric(float64(median(d).Microseconds()), name+"-p50-µs")
		if base > 0 {
			b.ReportMetric(float64(median(d))/float64(base), name+"/redisstore")
		}
	}
	p50("redisstore-save", storeSave, 0)
	p50("redisstore-load", storeLoad, 0)
	p50("save", save, median(storeSave))
	p50("load-record", loadRecord, median(storeLoad))
	p50("load-store", loadStore, median(storeLoad))
	p50("load-record-2calls", loadRecord2, median(storeLoad))
	p50("load-store-2calls", loadStore2, median(storeLoad))
}

// BenchmarkBrokerMemoryPerPendingSession saves the ~22.7 KB checkpoint for 1,000 sessions
// onto a queue nobody reads, on a fresh private Redis, and reports the broker's memory per
// pending session: in all (the message and the pending entry: INFO used_memory), and the
// entry alone (MEMORY USAGE of the entries hashes, the values and the index). Entries are
// bounded by the requests the queue holds: one per request, removed once settled. Run it with
//
//	scripts/test-go -run '^$' -bench BrokerMemoryPerPendingSession -benchtime 1x
func BenchmarkBrokerMemoryPerPendingSession(b *testing.B) {
	ctx := context.Background()
	server, err := startRedis()
	if err != nil {
		b.Fatal(err)
	}
	defer server.Stop()
	r := newRedigo(server.Addr)
	defer r.Close()
	c := New[Checkpoint](Config{Broker: r, Queue: "bench-nobody-reads-this"})
	const sessions = 1000
	usedMemory := func() int64 {
		info, err := redis.String(server.Do("INFO", "memory"))
		if err != nil {
			b.Fatal(err)
		}
		for _, line := range strings.Split(info, "\r\n") {
			if strings.HasPrefix(line, "used_memory:") {
				n, _ := strconv.ParseInt(strings.TrimPrefix(line, "used_memory:"), 10, 64)
				return n
			}
		}
		b.Fatal("no used_memory in INFO")
		return 0
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		if _, err := server.Do("FLUSHALL"); err != nil {
			b.Fatal(err)
		}
		before := usedMemory()
		b.StartTimer()
		handles := make([]Handle, sessions)
		for s := range handles {
			if handles[s], err = c.SaveAsync(ctx, benchCheckpoint(fmt.Sprint("pending-", s))); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		total := usedMemory() - before
		var records int64
		for _, h := range handles {
			for _, key := range []string{c.keys.pendingRequests(h.SessionID), c.keys.pendingValue(h.SessionID, h.TaskID)} {
				n, err := redis.Int64(server.Do("MEMORY", "USAGE", key))
				if err != nil {
					b.Fatal(err)
				}
				records += n
			}
		}
		index, err := redis.Int64(server.Do("MEMORY", "USAGE", c.keys.pendingIndex()))
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(total)/sessions, "broker-bytes/pending-session")
		b.ReportMetric(float64(records+index)/sessions, "record-bytes/pending-session")
		b.StartTimer()
	}
}

// BenchmarkRecoveryWindowCost times the client's Save (a plain ~20 KB checkpoint) with the
// recovery window on (the defaults: 10 s, 10,000 requests, 64 MiB) and off
// (RepublishWindow -1), turn about on one private Redis: b.N rounds, each 2,000 saves of
// one client, then 2,000 of the other (which goes first alternates). It reports the
// median of the rounds' p50s for each, their ratio, and logs each round's; it asserts
// nothing about time. Run it with
//
//	scripts/test-go -run '^$' -bench RecoveryWindowCost -benchtime 9x
func BenchmarkRecoveryWindowCost(b *testing.B) {
	ctx := context.Background()
	server, err := startRedis()
	if err != nil {
		b.Fatal(err)
	}
	defer server.Stop()
	broker := newRedigo(server.Addr)
	defer broker.Close()
	const queue, saves = "bench-nobody-reads-this", 2000
	clients := map[string]*Client[Checkpoint]{
		"on":  New[Checkpoint](Config{Broker: broker, Queue: queue}),
		"off": New[Checkpoint](Config{Broker: broker, Queue: queue, RepublishWindow: -1}),
	}
	cp := benchCheckpoint("bench-session")
	// Between turns, everything but the epoch and the mark goes: a FLUSHALL would be a loss
	// the clients detect (and the window's would be republished).
	keep := map[string]bool{clients["on"].keys.pendingEpoch(): true, clients["on"].keys.pendingMark(): true}
	reset := func(b *testing.B) {
		keys, err := redis.Strings(server.Do("KEYS", "*"))
		if err != nil {
			b.Fatal(err)
		}
		for _, key := range keys {
			if !keep[key] {
				if _, err := server.Do("DEL", key); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	p50s := map[string][]time.Duration{}
	b.ResetTimer()
	for round := 0; round < b.N; round++ {
		order := []string{"on", "off"}
		if round%2 == 1 {
			order = []string{"off", "on"}
		}
		for _, way := range order {
			took := make([]time.Duration, 0, saves)
			for i := 0; i < saves; i++ {
				start := time.Now()
				if _, err := clients[way].Save(ctx, cp); err != nil {
					b.Fatal(err)
				}
				took = append(took, time.Since(start))
			}
			p50s[way] = append(p50s[way], median(took))
			b.StopTimer()
			reset(b)
			b.StartTimer()
		}
	}
	b.StopTimer()
	spread := func(d []time.Duration) string {
		sorted := append([]time.Duration(nil), d...)
		sort.Slice(sorted, func(i, j int) bool { return sorted[i] < sorted[j] })
		return fmt.Sprintf("%.1f (%.1f-%.1f) µs", float64(median(d))/1e3, float64(sorted[0])/1e3, float64(sorted[len(sorted)-1])/1e3)
	}
	b.Logf("window on: %s; off: %s; kept at the end: %d requests, %d bytes; republished %d", spread(p50s["on"]),
		spread(p50s["off"]), clients["on"].recent.len(), clients["on"].recent.bytes, clients["on"].Republished())
	b.ReportMetric(float64(median(p50s["on"]))/1e3, "on-p50-µs")
	b.ReportMetric(float64(median(p50s["off"]))/1e3, "off-p50-µs")
	b.ReportMetric(float64(median(p50s["on"]))/float64(median(p50s["off"])), "on/off")
}
