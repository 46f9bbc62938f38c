package checkpointq

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
)

// BenchmarkEnqueueVsRedisStoreSave times, turn about on the same private Redis, the
// client's Save (build the protocol 2 message, one LPUSH) and what the Go RedisStore's
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
	// Prose-like text (seeded random words), which zstd shrinks about as much as real
	// conversation: a repeated sentence would flatter the store's SET.
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
	cp := sampleCheckpoint("bench-session", 1, messages...)
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
