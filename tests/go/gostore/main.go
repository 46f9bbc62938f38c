// Command gostore does what the Go checkpoint package's RedisStore does, on a real Redis,
// so that pytest can check checkpointq against it (tests/go/test_go_store.py).
//
// It carries its own copy of the package's struct definitions and JSON tags (from the
// package's API documentation; field names, order and omitempty as store/model.py and
// store/serde.py mirror them) and uses nothing but encoding/json, klauspost's zstd and a
// plain Redis client, as the Go store does:
//
//	Save   = SET <prefix>:<sessionId> zstd(json.Marshal(cp)) EX 30 d
//	Load   = GET, zstd-decode (or plain JSON), json.Unmarshal
//	Delete = DEL <prefix>:<sessionId>
//	List   = SCAN <prefix>:* until the cursor returns to 0
//
// One request per run, as JSON on stdin; one JSON reply on stdout:
//
//	{"op":"save","checkpoint":{...}}      -> {"ok":true}
//	{"op":"load","id":"..."}              -> {"ok":true,"checkpoint":{...} | null}
//	{"op":"delete","id":"..."}            -> {"ok":true}
//	{"op":"list"}                         -> {"ok":true,"ids":[...]}
//
// A failure (Go's Load refusing a document, say) is {"ok":false,"error":"..."}, exit 0.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/gomodule/redigo/redis"
	"github.com/klauspost/compress/zstd"
)

// Checkpoint is agentorcav1alpha1.Checkpoint: field names, order and tags as in the package.
type Checkpoint struct {
	SessionID           string                `json:"sessionId"`
	Version             int64                 `json:"version"`
	ConversationHistory []ConversationMessage `json:"conversationHistory,omitempty"`
	Metadata            CheckpointMetadata    `json:"metadata"`
	LastRunRef          string                `json:"lastRunRef,omitempty"`
}

// ConversationMessage is one message of the recent history.
type ConversationMessage struct {
	Role         string `json:"role"`
	Content      string `json:"content"`
	TraceEntries string `json:"traceEntries,omitempty"`
}

// CheckpointMetadata: totalCostUSD is a string (the apiserver formats spend with %.6f).
type CheckpointMetadata struct {
	TotalMessages   int64  `json:"totalMessages,omitempty"`
	TotalTokens     int64  `json:"totalTokens,omitempty"`
	TotalCostUSD    string `json:"totalCostUSD,omitempty"`
	StartTime       *Time  `json:"startTime,omitempty"`
	LastMessageTime *Time  `json:"lastMessageTime,omitempty"`
}

// Time marshals as metav1.Time: RFC 3339, UTC, whole seconds; null when zero.
type Time struct{ time.Time }

func (t Time) MarshalJSON() ([]byte, error) {
	if t.IsZero() {
		return []byte("null"), nil
	}
	return json.Marshal(t.UTC().Format(time.RFC3339))
}

func (t *Time) UnmarshalJSON(data []byte) error {
	if bytes.Equal(data, []byte("null")) {
		t.Time = time.Time{}
		return nil
	}
	var text string
	if err := json.Unmarshal(data, &text); err != nil {
		return err
	}
	parsed, err := time.Parse(time.RFC3339, text)
	if err != nil {
		return err
	}
	t.Time = parsed.Local()
	return nil
}

const ttlSeconds = 30 * 24 * 60 * 60

var zstdMagic = []byte{0x28, 0xb5, 0x2f, 0xfd}

type request struct {
	Op         string          `json:"op"`
	ID         string          `json:"id"`
	Checkpoint json.RawMessage `json:"checkpoint"`
}

type reply struct {
	OK         bool        `json:"ok"`
	Error      string      `json:"error,omitempty"`
	Checkpoint *Checkpoint `json:"checkpoint,omitempty"`
	Found      bool        `json:"found"`
	IDs        []string    `json:"ids,omitempty"`
}

func main() {
	addr := flag.String("addr", "127.0.0.1:6379", "Redis host:port")
	prefix := flag.String("prefix", "agentorca-session", "key prefix")
	flag.Parse()
	var req request
	if err := json.NewDecoder(os.Stdin).Decode(&req); err != nil {
		fail(fmt.Errorf("bad request: %w", err))
	}
	conn, err := redis.Dial("tcp", *addr)
	if err != nil {
		fail(err)
	}
	defer conn.Close()
	out, err := run(conn, *prefix, req)
	if err != nil {
		out = reply{Error: err.Error()}
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail(err)
	}
}

func run(conn redis.Conn, prefix string, req request) (reply, error) {
	switch req.Op {
	case "save":
		var cp Checkpoint
		if err := json.Unmarshal(req.Checkpoint, &cp); err != nil {
			return reply{}, err
		}
		if cp.SessionID == "" {
			return reply{}, errors.New("sessionId is required")
		}
		doc, err := json.Marshal(&cp)
		if err != nil {
			return reply{}, err
		}
		enc, err := zstd.NewWriter(nil)
		if err != nil {
			return reply{}, err
		}
		value := enc.EncodeAll(doc, nil)
		if _, err := conn.Do("SET", prefix+":"+cp.SessionID, value, "EX", ttlSeconds); err != nil {
			return reply{}, err
		}
		return reply{OK: true}, nil
	case "load":
		stored, err := redis.Bytes(conn.Do("GET", prefix+":"+req.ID))
		if errors.Is(err, redis.ErrNil) {
			return reply{OK: true}, nil
		}
		if err != nil {
			return reply{}, err
		}
		if bytes.HasPrefix(stored, zstdMagic) {
			dec, err := zstd.NewReader(nil)
			if err != nil {
				return reply{}, err
			}
			defer dec.Close()
			if stored, err = dec.DecodeAll(stored, nil); err != nil {
				return reply{}, err
			}
		}
		var cp Checkpoint
		if err := json.Unmarshal(stored, &cp); err != nil {
			return reply{}, err
		}
		return reply{OK: true, Checkpoint: &cp, Found: true}, nil
	case "delete":
		if req.ID == "" {
			return reply{OK: true}, nil
		}
		_, err := conn.Do("DEL", prefix+":"+req.ID)
		return reply{OK: err == nil}, err
	case "list":
		ids := []string{}
		cursor := 0
		for {
			values, err := redis.Values(conn.Do("SCAN", cursor, "MATCH", prefix+":*", "COUNT", 100))
			if err != nil {
				return reply{}, err
			}
			if cursor, err = redis.Int(values[0], nil); err != nil {
				return reply{}, err
			}
			keys, err := redis.Strings(values[1], nil)
			if err != nil {
				return reply{}, err
			}
			for _, key := range keys {
				ids = append(ids, key[len(prefix)+1:])
			}
			if cursor == 0 {
				return reply{OK: true, IDs: ids}, nil
			}
		}
	}
	return reply{}, fmt.Errorf("unknown op %q", req.Op)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "gostore:", err)
	os.Exit(2)
}
