// Command publishcall prints the script calls the Go client (clients/go) sends for a save,
// a delete, two loads and a list, so that tests/go/test_publish_calls.py can check them
// against the calls the Python producer builds (tasks/producer/pending.py) from the same
// inputs, byte for byte.
//
// It runs the real client over a recording Redis adapter that answers as an empty broker
// and store would, with the producer's clock fixed by -clock. The checkpoint is the
// Go JSON document read from stdin. The reply, on stdout, is a JSON object: call name ->
// {"sha1": the script text's SHA-1, "keys": [...], "args": [...]}, every key and argument
// base64 of the bytes a Redis client puts on the wire (adapters send integers in decimal).
//
// Calls: "save" and "delete" (publish.lua, the delete after the save, same session);
// "load_store" (a client whose broker is its store: read_pending.lua, mode "store");
// "load_one" and "load_one_store" (broker and store apart: read_pending.lua, mode "one",
// then load.lua on the store); "heads" (a list: read_pending.lua, mode "heads", the index
// naming the session).
//
// Built in GOPATH mode like tests/go/gostore, with checkpointq/clients/go resolved through
// the GOPATH the test sets up (a link to this repository).
package main

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	checkpointq "checkpointq/clients/go"
)

// call is one recorded Eval, as the server would receive it.
type call struct {
	SHA1 string   `json:"sha1"`
	Keys [][]byte `json:"keys"`
	Args [][]byte `json:"args"`
}

// recorder is a checkpointq.Redis that records every Eval and answers as an empty broker
// and store would: no epoch, no entries, no value, no fence; the pending index names
// indexed (with a deadline far ahead), the store's index nothing.
type recorder struct {
	mu      sync.Mutex
	calls   []call
	queue   string
	indexed string
}

func (r *recorder) Eval(_ context.Context, script string, keys []string, args ...interface{}) (interface{}, error) {
	sum := sha1.Sum([]byte(script))
	c := call{SHA1: hex.EncodeToString(sum[:])}
	for _, k := range keys {
		c.Keys = append(c.Keys, []byte(k))
	}
	for _, a := range args {
		wire, err := onTheWire(a)
		if err != nil {
			return nil, err
		}
		c.Args = append(c.Args, wire)
	}
	r.mu.Lock()
	r.calls = append(r.calls, c)
	r.mu.Unlock()
	nils := func(n int) []interface{} { return make([]interface{}, n) }
	switch {
	case len(keys) > 0 && keys[0] == r.queue: // publish.lua
		return []interface{}{"recorded-epoch", int64(1), int64(0)}, nil
	case len(args) == 0 && strings.Contains(script, "return tonumber(t[1])"): // List's time read
		return int64(1_800_000_000_000), nil
	case len(args) == 0: // load.lua: nothing stored, and the server's time
		return append(nils(5), int64(0)), nil
	}
	switch string(c.Args[0]) {
	case "one":
		return nils(8), nil
	case "store":
		return nils(13), nil
	case "heads":
		return nils(3 * len(keys) / 2), nil
	}
	return nil, fmt.Errorf("publishcall: unexpected script call %q %q", keys, c.Args)
}

func (r *recorder) ZScan(_ context.Context, key string, _ uint64, _ int64) ([]string, uint64, error) {
	if r.indexed != "" {
		return []string{r.indexed, "99999999999999"}, 0, nil
	}
	return nil, 0, nil
}

// onTheWire is an argument's bytes as redigo and go-redis send them.
func onTheWire(a interface{}) ([]byte, error) {
	switch v := a.(type) {
	case string:
		return []byte(v), nil
	case []byte:
		return v, nil
	case int:
		return []byte(strconv.Itoa(v)), nil
	case int64:
		return []byte(strconv.FormatInt(v, 10)), nil
	}
	return nil, fmt.Errorf("publishcall: an argument of type %T", a)
}

// last is the recorder's newest call.
func (r *recorder) last() call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[len(r.calls)-1]
}

func main() {
	session := flag.String("session", "", "the session id")
	clock := flag.Int64("clock", 0, "the producer's clock, µs since the epoch")
	queue := flag.String("queue", "checkpoints", "Config.Queue")
	prefix := flag.String("prefix", checkpointq.DefaultPrefix, "Config.Prefix")
	ttl := flag.Int64("ttl-seconds", 30*24*3600, "Config.SessionTTL, s")
	ahead := flag.Int64("max-ahead-seconds", 300, "Config.MaxSeqAhead, s")
	flag.Parse()
	if err := run(*session, *clock, *queue, *prefix, *ttl, *ahead); err != nil {
		fmt.Fprintln(os.Stderr, "publishcall:", err)
		os.Exit(1)
	}
}

func run(session string, clock int64, queue, prefix string, ttl, ahead int64) error {
	doc, err := io.ReadAll(os.Stdin)
	if err != nil {
		return err
	}
	cp, err := checkpointq.DeserializeCheckpoint(doc)
	if err != nil {
		return err
	}
	cp.SessionID = session
	ctx := context.Background()
	now := time.UnixMicro(clock)
	config := func(broker, store checkpointq.Redis) checkpointq.Config {
		return checkpointq.Config{
			Broker: broker, Store: store, Queue: queue, Prefix: prefix,
			SessionTTL:  time.Duration(ttl) * time.Second,
			MaxSeqAhead: time.Duration(ahead) * time.Second,
			Now:         func() time.Time { return now },
		}
	}
	calls := map[string]call{}
	one := &recorder{queue: queue, indexed: session}
	c := checkpointq.New[checkpointq.Checkpoint](config(one, one))
	if _, err := c.SaveAsync(ctx, cp); err != nil {
		return err
	}
	calls["save"] = one.last()
	if _, err := c.DeleteAsync(ctx, session); err != nil {
		return err
	}
	calls["delete"] = one.last()
	// (a read is followed by the store-identity check's own calls: the load's is the first)
	loading := len(one.calls)
	if _, err := c.Load(ctx, session); err != nil {
		return err
	}
	calls["load_store"] = one.calls[loading]
	listed := len(one.calls)
	if _, err := c.List(ctx); err != nil {
		return err
	}
	calls["heads"] = one.calls[listed+1] // the first call of the list after the store's time
	broker, store := &recorder{queue: queue}, &recorder{queue: queue}
	if _, err := checkpointq.New[checkpointq.Checkpoint](config(broker, store)).Load(ctx, session); err != nil {
		return err
	}
	calls["load_one"], calls["load_one_store"] = broker.calls[0], store.calls[0]
	return json.NewEncoder(os.Stdout).Encode(calls)
}
