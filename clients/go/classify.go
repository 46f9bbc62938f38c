package checkpointq

import (
	"context"
	"errors"
	"io"
	"strings"
)

// Which failures are worth retrying. Save, Delete and WaitDurable retry until their
// deadline; that only helps when the next attempt can succeed. A Redis that answered with
// an error reply will mostly answer the same again until someone changes its
// configuration or its data, so those replies end the call at once (a *RedisError), except
// for the few codes that mean "not now":
//
//   - LOADING (a restart reading its data), BUSY (a long script), MASTERDOWN, READONLY (a
//     failover under way), CLUSTERDOWN, TRYAGAIN (a multi-key call while its slot moves),
//     NOREPLICAS, and "ERR max number of clients reached".
//   - MOVED and ASK when Config.Cluster is set: the slot map is moving, and the Store
//     adapter follows them (one that surfaces them still has the old map).
//   - OOM. Only a write can meet it: reads, and the read-only scripts the client sends
//     while it waits, are served at maxmemory (Redis 7 refuses a script for OOM only when
//     its shebang does not declare no-writes; outcomeScript, hmgetScript and loadScript
//     have none, clusterPageScript declares no-writes). So OOM reaches the LPUSH of Save
//     and Delete, on a broker whose queue is full: the workers draining it free memory,
//     and PublishTimeout bounds the wait; when it passes, ErrBrokerUnavailable names OOM.
//
// Errors that are not Redis replies (refused or reset connections, timeouts, EOF, an
// adapter's own pool errors) are transport trouble: retried, as before. An error is read
// as a Redis reply when it, or an error it wraps, says "<CODE> <text>" with CODE in capitals,
// as redigo's redis.Error and go-redis's proto.RedisError do (the server's text as is).

// retriedCodes are the error reply codes worth another attempt (MOVED and ASK aside).
var retriedCodes = map[string]bool{
	"LOADING": true, "BUSY": true, "MASTERDOWN": true, "READONLY": true, "CLUSTERDOWN": true,
	"TRYAGAIN": true, "NOREPLICAS": true, "OOM": true,
}

// replyCode returns the code of the Redis error reply err is or wraps ("CROSSSLOT",
// "WRONGTYPE", "ERR"), and that reply's text; "" when err is not a Redis reply.
func replyCode(err error) (code, reply string) {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return "", ""
	}
	for e := err; e != nil; e = errors.Unwrap(e) {
		msg := e.Error()
		word, _, spaced := strings.Cut(msg, " ")
		if spaced && len(word) >= 2 && strings.Trim(word, "ABCDEFGHIJKLMNOPQRSTUVWXYZ") == "" {
			return word, msg
		}
	}
	return "", ""
}

// permanent returns err as a *RedisError when retrying cannot help, nil when it may: see
// the rules above. server is "broker" or "store"; op says what the call was for.
func (c *Client[C]) permanent(server, op string, err error) error {
	code, reply := replyCode(err)
	switch {
	case code == "":
		return nil
	case retriedCodes[code], code == "ERR" && strings.HasPrefix(reply, "ERR max number of clients reached"):
		return nil
	case (code == "MOVED" || code == "ASK") && server == "store" && c.keys.cluster:
		return nil
	}
	return &RedisError{Server: server, Op: op, Code: code, Hint: c.hint(server, code, reply), Err: err}
}

// hint says what to do about a permanent error reply.
func (c *Client[C]) hint(server, code, reply string) string {
	lower := strings.ToLower(reply)
	switch {
	case server == "broker" && (code == "MOVED" || code == "ASK" || code == "CROSSSLOT"):
		return "the broker is a Redis Cluster node: the broker must be a single Redis (CHECKPOINTQ_BROKER_URL)"
	case (code == "MOVED" || code == "ASK" || code == "CROSSSLOT") && !c.keys.cluster:
		return "the store is a Redis Cluster: set Config.Cluster, and give Store an adapter that " +
			"routes each command by its first key and follows MOVED and ASK (README.md, \"A store on Redis Cluster\")"
	case code == "CROSSSLOT":
		return "a call named keys of several slots: a bug in the client's cluster layout, please report it"
	case code == "NOAUTH", code == "WRONGPASS", code == "NOPERM",
		code == "ERR" && (strings.Contains(lower, "password") || strings.Contains(lower, "auth")):
		return "the " + server + " adapter's credentials (user, password) do not match the " + server +
			"'s: use those of the " + server + " URL the workers have, whose user may run what they run"
	case code == "WRONGTYPE":
		return "a key the client uses holds another type: another application writes under Config.Prefix " +
			"or Config.Queue; give checkpointq a prefix and queue of its own"
	case code == "NOSCRIPT":
		return "the adapter must fall back from EVALSHA to EVAL on NOSCRIPT (README.md's adapter does)"
	case code == "ERR" && strings.Contains(lower, "unknown command"):
		return "the server lacks a command the client needs (EVAL, EVALSHA, LPUSH, ZSCAN): an old Redis, " +
			"or a proxy that blocks it (a cluster store needs Redis 7 or later)"
	default:
		return "the " + server + " will answer the same until its cause is fixed"
	}
}

// redirectHint is what to add to ErrStoreUnavailable when err is a MOVED or ASK that a
// cluster client retried: an adapter that keeps passing them on does not follow them.
func redirectHint(err error) string {
	if code, _ := replyCode(err); code == "MOVED" || code == "ASK" {
		return "; the Store adapter must route each command by its first key and follow MOVED and ASK"
	}
	return ""
}
