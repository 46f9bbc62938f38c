package checkpointq

import (
	"context"
	"fmt"
	"strconv"
	"time"
)

// Redis is the few commands the client needs, so that the package pins no Redis client:
// wrap the one the application already has (README.md has the go-redis/v9 adapter; the
// tests have one for redigo). Implementations must honour ctx's deadline and
// cancellation, and must be safe for concurrent use. (An LPush method that adapters
// written for earlier versions have is no longer called: Save and Delete push with a
// script.)
type Redis interface {
	// Eval runs a Lua script: EVALSHA, then EVAL (which loads it) on NOSCRIPT, so that a
	// script is sent once per server, and again after SCRIPT FLUSH or a restart. Replies as the client
	// decodes them: bulk strings as string or []byte, integers as int64, arrays as
	// []interface{}, nil bulk replies as nil.
	Eval(ctx context.Context, script string, keys []string, args ...interface{}) (interface{}, error)
	// ZScan is one ZSCAN step: member and score strings alternating, and the next cursor.
	ZScan(ctx context.Context, key string, cursor uint64, count int64) ([]string, uint64, error)
}

// ReplicaWaiter is what Config.BrokerDurability Replicated needs of the broker's adapter
// besides Redis: Eval's script (EVALSHA, then EVAL on NOSCRIPT, as Eval) followed by
// WAIT replicas timeout-ms on the same connection, pipelined in one write, so that the WAIT
// covers the script's writes and costs no extra round trip. It returns the script's reply
// (or its error) and WAIT's: how many replicas acknowledged. The read must wait at least
// timeout beyond the script's answer (README.md has go-redis's; the tests' redigo adapter
// has one).
type ReplicaWaiter interface {
	EvalWait(ctx context.Context, replicas int, timeout time.Duration, script string, keys []string,
		args ...interface{}) (reply interface{}, acked int64, err error)
}

// loadScript is store/lua/load.lua, byte for byte (a test compares them): a checkpoint and
// its session's fence in one round trip, and the server's time then. Returns {value, seq,
// deleted, req, deadline, now}, nil where absent.
const loadScript = `-- load.lua: read a session's checkpoint and its fence in one round trip.
--
-- KEYS[1]  data key
-- KEYS[2]  fence hash (see save.lua)
--
-- Returns {value, seq, deleted, req, deadline, now}, each nil (false) where absent; now is the
-- server's time (ms) at the read. Read together, the fence is never older than the value,
-- so a request stamped after the fence's seq sorts after the write that was loaded (the
-- producer rule, docs/protocol.md). A producer merging a pending entry read from a broker
-- of its own judges whether that entry's save is past its deadline by this time, the store
-- read's, never by its own clock: between its two reads a newer fence may have expired.
local fence = redis.call('HMGET', KEYS[2], 'seq', 'deleted', 'req', 'deadline')
local time = redis.call('TIME')
return {redis.call('GET', KEYS[1]), fence[1], fence[2], fence[3], fence[4],
  tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)}
`

// replyList reads an array reply of n elements.
func replyList(reply interface{}, n int) ([]interface{}, error) {
	items, ok := reply.([]interface{})
	if !ok || len(items) != n {
		return nil, fmt.Errorf("unexpected reply %T (want an array of %d)", reply, n)
	}
	return items, nil
}

// replyBytes reads a bulk string reply; ok is false for nil.
func replyBytes(v interface{}) (b []byte, ok bool, err error) {
	switch x := v.(type) {
	case nil:
		return nil, false, nil
	case []byte:
		return x, true, nil
	case string:
		return []byte(x), true, nil
	default:
		return nil, false, fmt.Errorf("unexpected reply element %T", v)
	}
}

// replyText reads a bulk string reply as text ("" for nil).
func replyText(v interface{}) (string, error) {
	b, _, err := replyBytes(v)
	return string(b), err
}

// replyInt reads an integer held in a bulk string (a hash field); ok is false for nil.
func replyInt(v interface{}) (n int64, ok bool, err error) {
	if i, isInt := v.(int64); isInt {
		return i, true, nil
	}
	b, ok, err := replyBytes(v)
	if err != nil || !ok {
		return 0, ok, err
	}
	n, err = strconv.ParseInt(string(b), 10, 64)
	return n, err == nil, err
}
