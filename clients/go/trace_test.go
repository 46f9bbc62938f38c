package checkpointq

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

type traceKey struct{}

// traceFromContext is what an OpenTelemetry propagator does: the trace context of ctx.
func traceFromContext(ctx context.Context) map[string]string {
	if tp, ok := ctx.Value(traceKey{}).(string); ok {
		return map[string]string{"traceparent": tp, "tracestate": "cq=test", "b3": "not carried"}
	}
	return nil
}

// recordedSignal is one line of tests/support/signal_recorder.py's log.
type recordedSignal struct {
	Signal      string  `json:"signal"`
	TaskID      string  `json:"task_id"`
	RequestID   string  `json:"request_id"`
	Traceparent *string `json:"traceparent"`
}

func readSignals(t *testing.T, path string) []recordedSignal {
	t.Helper()
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var lines []recordedSignal
	scanner := bufio.NewScanner(bytes.NewReader(data))
	for scanner.Scan() {
		var line recordedSignal
		if err := json.Unmarshal(scanner.Bytes(), &line); err != nil {
			t.Fatalf("signal log line %q: %v", scanner.Text(), err)
		}
		lines = append(lines, line)
	}
	return lines
}

// Given a default (coalescing) worker loading a module that records each task signal with
// task.request.traceparent (-I tests.support.signal_recorder), when Go saves and deletes
// with TraceHeaders set, then each request is received, prerun, succeeded and postrun once,
// and its pool-side signals see the traceparent of the context it was sent with.
func TestTraceparentReachesTheWorkersTaskRequest(t *testing.T) {
	broker, store := privateRedis(t), privateRedis(t)
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(t.TempDir(), "signals.jsonl")
	w, err := startWorkerWith(broker.URL(), store.URL(),
		[]string{"CQ_SIGNAL_LOG=" + log, "PYTHONPATH=" + repo}, "-I", "tests.support.signal_recorder")
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if t.Failed() {
			t.Logf("--- worker log ---\n%s", w.Log())
		}
		w.Stop()
	}()
	brokerConn, storeConn := newRedigo(broker.Addr), newRedigo(store.Addr)
	defer brokerConn.Close()
	defer storeConn.Close()
	client := New[Checkpoint](Config{Broker: brokerConn, Store: storeConn, TraceHeaders: traceFromContext})

	sent := map[string]string{} // task id -> traceparent
	for n := 0; n < 6; n++ {
		tp := fmt.Sprintf("00-%032x-%016x-01", n+1, n+100)
		ctx := context.WithValue(background(t), traceKey{}, tp)
		var h Handle
		if n < 4 {
			h, err = client.SaveAsync(ctx, sampleCheckpoint(sessionID(t, fmt.Sprint(n)), 1, "hello"))
		} else {
			h, err = client.DeleteAsync(ctx, sessionID(t, fmt.Sprint(n-4)))
		}
		if err != nil {
			t.Fatal(err)
		}
		sent[h.TaskID] = tp
	}
	err = pollUntil(30*time.Second, "a postrun signal per request", func() bool {
		done := map[string]bool{}
		for _, line := range readSignals(t, log) {
			if line.Signal == "postrun" {
				done[line.TaskID] = true
			}
		}
		for id := range sent {
			if !done[id] {
				return false
			}
		}
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]map[string]int{} // task id -> signal -> count
	for _, line := range readSignals(t, log) {
		tp, ours := sent[line.TaskID]
		if !ours {
			continue
		}
		if seen[line.TaskID] == nil {
			seen[line.TaskID] = map[string]int{}
		}
		seen[line.TaskID][line.Signal]++
		if line.Signal == "received" { // in the main process, before task.request exists
			continue
		}
		if line.RequestID != line.TaskID || line.Traceparent == nil || *line.Traceparent != tp {
			t.Errorf("%s of %s: task.request id %s, traceparent %v; want %s", line.Signal, line.TaskID,
				line.RequestID, line.Traceparent, tp)
		}
	}
	for id := range sent {
		for _, signal := range []string{"received", "prerun", "success", "postrun"} {
			if seen[id][signal] != 1 {
				t.Errorf("request %s: %d %s signals, want 1 (%v)", id, seen[id][signal], signal, seen[id])
			}
		}
	}
}

func TestAnInvalidTraceparentIsRefusedBeforePublishing(t *testing.T) {
	for _, tp := range []string{
		"not a traceparent",
		"00-00000000000000000000000000000000-0000000000000001-01", // all-zero trace id
		"00-0000000000000000000000000000000A-0000000000000001-01", // upper case
	} {
		fields, err := traceHeaderFields(map[string]string{"traceparent": tp})
		if !errors.Is(err, ErrInvalidInput) {
			t.Errorf("%q: %s, %v; want ErrInvalidInput", tp, fields, err)
		}
	}
	fields, err := traceHeaderFields(map[string]string{
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "x-other": "dropped"})
	if err != nil || string(fields) != `,"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"` {
		t.Errorf("got %s, %v", fields, err)
	}
}
