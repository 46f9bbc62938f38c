// Package checkpointq is the Go producer of checkpointq: a drop-in for the checkpoint
// package's Store that enqueues saves and deletes for the checkpointq workers instead of
// writing Redis itself, and reads the store the workers write (the Go RedisStore's layout).
//
// Save and Delete publish one fenced Celery protocol 2 message each and return at once; the
// script that pushes it also records the request on the broker (pending.go), so that every
// replica's Load and List see it while the queue holds it. WaitDurable tells when, and how,
// a request took effect. Every request carries a causal seq (see docs/protocol.md, "The
// producer rule"), which the broker checks against its own clock at publish (ErrSeqRefused).
package checkpointq

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Config says where a Client publishes and reads. Zero fields take the defaults named.
type Config struct {
	// Broker receives the requests (CHECKPOINTQ_BROKER_URL's Redis). Required.
	Broker Redis
	// Store is the store Redis (CHECKPOINTQ_STORE_URL); nil: the broker's, and then a Load
	// reads the pending entries and the store in one script call.
	Store Redis
	// Postgres is a PostgreSQL store (a postgresql:// CHECKPOINTQ_STORE_URL): a *sql.DB
	// opened with a PostgreSQL driver the application registered (lib/pq's "postgres", or
	// pgx's "pgx"), on which loads, lists and WaitDurable read the store (postgres.go).
	// Store and Cluster must then be unset: the broker, a plain Redis, keeps the pending
	// records and the workers' refusal records.
	Postgres *sql.DB
	// PostgresSchema is the store's schema (CHECKPOINTQ_PG_SCHEMA); default
	// DefaultPostgresSchema.
	PostgresSchema string
	// Cluster says the store is a Redis Cluster (a redis+cluster:// CHECKPOINTQ_STORE_URL):
	// the client then uses the cluster key layout, and Store must route each command to
	// the node serving its first key's slot, following MOVED (go-redis's ClusterClient
	// does; README.md). A cluster store needs Redis 7 or later.
	Cluster bool
	// Queue is the broker list (CHECKPOINTQ_QUEUE); default "checkpoints".
	Queue string
	// Prefix of every store key (CHECKPOINTQ_KEY_PREFIX); default DefaultPrefix.
	Prefix string
	// PublishTimeout bounds one Save or Delete, retries included; default 5 s.
	PublishTimeout time.Duration
	// ReadTimeout bounds one Load or List when ctx has no earlier deadline; default 5 s.
	ReadTimeout time.Duration
	// WaitTimeout bounds WaitDurable when ctx has no deadline; default 10 s.
	WaitTimeout time.Duration
	// MaxMessageBytes is the largest body published (CHECKPOINTQ_MAX_MESSAGE_BYTES, whose
	// default, 8 MiB, is this default too); larger requests fail with ErrTooLarge.
	MaxMessageBytes int
	// HistoryCap is how many of the most recent messages a save keeps (the Go store: 100;
	// CHECKPOINTQ_HISTORY_CAP).
	HistoryCap int
	// MaxValueBytes is the stored-size budget (CHECKPOINTQ_MAX_VALUE_BYTES, default 1 MiB):
	// a save whose compressed value is larger keeps its most recent messages that fit, and
	// one whose most recent message alone does not fit fails with ErrTooLarge, as the
	// worker would refuse it. Set it to the workers' value.
	MaxValueBytes int
	// SessionTTL is a session's lifetime (CHECKPOINTQ_TTL_SECONDS, default 30 days), and so
	// a request's: one stamped seq is never applied after its deadline, seq + SessionTTL,
	// and its pending entry lives until then.
	SessionTTL time.Duration
	// MaxSeqAhead is the most a seq may be ahead of the workers' clock
	// (CHECKPOINTQ_MAX_SEQ_AHEAD_SECONDS, default 300 s): set it to the workers'. The broker
	// applies it at publish, against its own clock: a request stamped further ahead, or made
	// while this producer's clock runs more than half of it ahead, fails at once with
	// ErrSeqRefused, where a worker would have dead-lettered it later.
	MaxSeqAhead time.Duration
	// TombstoneTTL is the store's margin for clocks that disagree
	// (CHECKPOINTQ_TOMBSTONE_TTL_SECONDS, default 1 day): WaitDurable reports Expired for a
	// request whose deadline is more than this in the past and that no fence names.
	TombstoneTTL time.Duration
	// Now is the clock that stamps requests; default time.Now.
	Now func() time.Time
	// WaitOnWrite makes Save and Delete return only once WaitDurable has (read-your-writes,
	// as with the Go RedisStore, at the cost of the worker's latency); a refused request
	// is then their error. Off by default: they return as soon as the broker has them.
	WaitOnWrite bool
	// TraceHeaders, when set, gives each request the trace context of its ctx (W3C
	// traceparent, tracestate, baggage), so the worker's span continues the caller's trace.
	TraceHeaders TraceHeaders
	// Encryption, when set (ParseKeyring of CHECKPOINTQ_ENCRYPTION_KEYS: the workers'
	// keys), seals every save's value before it reaches the broker and sends it as a
	// staged save (TaskSaveStaged), whose message holds no checkpoint; loads open values
	// sealed under any of its keys. Unset: a load of a sealed value fails with
	// ErrMissingKey naming the key id (docs/security.md).
	Encryption *Keyring
	// BrokerDurability (CHECKPOINTQ_BROKER_DURABILITY): when Save and Delete count as
	// accepted. Local ("" or "local", the default): once the broker's primary has the
	// request. Replicated ("replicated"): once BrokerReplicas replicas acknowledged it
	// (WAIT on the publishing connection, in the same write: Broker must implement
	// ReplicaWaiter); fewer within BrokerReplicationTimeout return ErrReplicationTimeout,
	// the request queued on the primary all the same (docs/reliability.md).
	BrokerDurability string
	// BrokerReplicas (CHECKPOINTQ_BROKER_REPLICAS): replicas each request waits for with
	// Replicated; default 1.
	BrokerReplicas int
	// BrokerReplicationTimeout (CHECKPOINTQ_BROKER_REPLICATION_TIMEOUT_MS): how long a
	// request waits for them; default 1 s. PublishTimeout grows by it.
	BrokerReplicationTimeout time.Duration
	// RepublishWindow, RepublishRequests and RepublishBytes bound the recovery window
	// (the Python producers' CHECKPOINTQ_REPUBLISH_SECONDS, _REQUESTS and _BYTES): the
	// requests this client published in the last RepublishWindow (default 10 s), at most
	// RepublishRequests of them (default 10,000) and RepublishBytes of messages and values
	// (default 64 MiB), the oldest going first, are published again when it finds that the
	// broker lost accepted requests (a crash inside its fsync window, a failover to a
	// lagging replica: docs/reliability.md). A negative RepublishWindow or RepublishRequests
	// keeps none.
	RepublishWindow   time.Duration
	RepublishRequests int
	RepublishBytes    int
	// Logf, when set, receives the client's log lines (a loss of accepted requests found on
	// the broker, the republish that follows); default log.Printf.
	Logf func(format string, args ...interface{})
}

// The broker durability modes (Config.BrokerDurability).
const (
	Local      = "local"
	Replicated = "replicated"
)

// Handle names a request on its way: pass it to WaitDurable.
type Handle struct {
	// TaskID is the message's id (headers.id), the request's identity everywhere.
	TaskID string
	// Task is TaskSave, TaskSaveStaged (with Config.Encryption) or TaskDelete.
	Task string
	// SessionID is the session the request is for.
	SessionID string
	// Seq is the request's causal seq.
	Seq int64
	// Ref is what Save returns: "session://<sessionId>/v<version>" ("" for deletes).
	Ref string
}

// Outcome is how a request ended, once it has.
type Outcome string

const (
	// Applied: the request is what the store holds for its session.
	Applied Outcome = "applied"
	// Superseded: a request for the session ordered after this one won; this one no
	// longer can (it was applied and overwritten, or refused as stale).
	Superseded Outcome = "superseded"
	// Expired: the request reached a worker past its deadline (seq + SessionTTL), or is
	// past it now (by more than TombstoneTTL): never stored, as its session would have
	// expired by then.
	Expired Outcome = "expired"
	// Lost: the request's message was gone while its pending record stayed (a purge of
	// the queue): the sweep settled it as lost and dead-lettered it (kind "lost"); it was
	// never applied.
	Lost Outcome = "lost"
)

// Result is WaitDurable's answer: the outcome and the fence it was read from.
type Result struct {
	Outcome Outcome
	// FenceSeq is the seq of the session's last applied request.
	FenceSeq int64
	// Deleted: that request was a delete.
	Deleted bool
	// Winner is that request's task id ("" from workers that do not record it).
	Winner string
}

// Client implements the checkpoint package's Store for the checkpoint type C (the
// apiserver's agentorcav1alpha1.Checkpoint, or this package's Checkpoint, which has the
// same JSON). Safe for concurrent use.
type Client[C any] struct {
	cfg  Config
	keys keySpace
	// oneRedis: the broker is the store, so a load reads record and store in one call.
	oneRedis bool
	// pg: the store is PostgreSQL (Config.Postgres); nil for a Redis store.
	pg     *pgStore
	epochs epochs
	recent *recentPublishes // the recovery window (recent.go)
	// stores: this client's store against the one the workers write to (identity.go).
	stores  storeCheck
	clock   *seqClock
	fields  checkpointFields
	replyTo string
	origin  string
}

// New returns a client for cfg. Like the Go NewRedisStore, it panics when cfg.Broker is
// nil: a programming error, not a runtime condition.
func New[C any](cfg Config) *Client[C] {
	if cfg.Broker == nil {
		panic("checkpointq.New: Config.Broker must not be nil")
	}
	var pg *pgStore
	if cfg.Postgres != nil {
		if cfg.Store != nil || cfg.Cluster {
			panic("checkpointq.New: Config.Postgres is the store: Store and Cluster must be unset")
		}
		if cfg.PostgresSchema == "" {
			cfg.PostgresSchema = DefaultPostgresSchema
		}
		pg = newPGStore(cfg.Postgres, cfg.PostgresSchema)
	}
	oneRedis := pg == nil && !cfg.Cluster && sameRedis(cfg.Broker, cfg.Store)
	if cfg.Store == nil {
		cfg.Store = cfg.Broker
	}
	if cfg.Queue == "" {
		cfg.Queue = "checkpoints"
	}
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	if cfg.PublishTimeout <= 0 {
		cfg.PublishTimeout = 5 * time.Second
	}
	if cfg.ReadTimeout <= 0 {
		cfg.ReadTimeout = 5 * time.Second
	}
	if cfg.WaitTimeout <= 0 {
		cfg.WaitTimeout = 10 * time.Second
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = 8 << 20
	}
	if cfg.HistoryCap <= 0 {
		cfg.HistoryCap = 100
	}
	if cfg.MaxValueBytes <= 0 {
		cfg.MaxValueBytes = 1 << 20
	}
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = 30 * 24 * time.Hour
	}
	if cfg.MaxSeqAhead <= 0 {
		cfg.MaxSeqAhead = 300 * time.Second
	}
	if cfg.TombstoneTTL <= 0 {
		cfg.TombstoneTTL = 24 * time.Hour
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	switch cfg.BrokerDurability {
	case "", Local:
		cfg.BrokerDurability = Local
	case Replicated:
		if _, ok := cfg.Broker.(ReplicaWaiter); !ok {
			panic("checkpointq.New: BrokerDurability Replicated needs a Broker that implements ReplicaWaiter")
		}
		if cfg.BrokerReplicas <= 0 {
			cfg.BrokerReplicas = 1
		}
		if cfg.BrokerReplicationTimeout <= 0 {
			cfg.BrokerReplicationTimeout = time.Second
		}
		cfg.PublishTimeout += cfg.BrokerReplicationTimeout
	default:
		panic(fmt.Sprintf("checkpointq.New: BrokerDurability must be %q or %q, not %q", Local, Replicated, cfg.BrokerDurability))
	}
	replyTo, err := newUUID()
	if err != nil {
		panic(err)
	}
	c := &Client[C]{
		cfg: cfg, keys: keySpace{prefix: cfg.Prefix, cluster: cfg.Cluster}, oneRedis: oneRedis, pg: pg, clock: newSeqClock(cfg.Now),
		recent:  newRecentPublishes(cfg.RepublishWindow, cfg.RepublishRequests, cfg.RepublishBytes),
		fields:  fieldsOf(reflect.TypeOf((*C)(nil)).Elem()),
		replyTo: replyTo, origin: origin(),
	}
	c.epochs.logf = c.logf
	return c
}

// RequestOption adjusts one Save or Delete.
type RequestOption func(*requestOptions)

type requestOptions struct{ after int64 }

// After makes the request sort after seq: pass the seq that LoadWithSeq returned in
// another process (a load in this process is taken into account without it).
func After(seq int64) RequestOption { return func(o *requestOptions) { o.after = seq } }

func applyOptions(opts []RequestOption) requestOptions {
	var o requestOptions
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// -- writes ------------------------------------------------------------------------------

// Save enqueues a save of cp and returns its ref at once (Store.Save). Use SaveAsync for
// the handle WaitDurable takes.
func (c *Client[C]) Save(ctx context.Context, cp *C) (string, error) {
	h, err := c.SaveAsync(ctx, cp)
	if err == nil && c.cfg.WaitOnWrite {
		_, err = c.WaitDurable(ctx, h)
	}
	return h.Ref, err
}

// SaveAsync enqueues a save of cp, keeping its HistoryCap most recent messages (fewer when
// they do not fit MaxValueBytes, as the store keeps them), and returns the request's handle
// once the broker has it and its pending entry.
func (c *Client[C]) SaveAsync(ctx context.Context, cp *C, opts ...RequestOption) (Handle, error) {
	if cp == nil {
		return Handle{}, fmt.Errorf("%w: nil checkpoint", ErrInvalidInput)
	}
	save, err := c.encodeSave(cp)
	if err != nil {
		return Handle{}, err
	}
	head, doc := save.checkpointHead, save.Doc
	seq, err := c.clock.next(head.SessionID, applyOptions(opts).after)
	if err != nil {
		return Handle{}, err
	}
	h := Handle{
		Task: TaskSave, SessionID: head.SessionID, Seq: seq,
		Ref: fmt.Sprintf("session://%s/v%d", head.SessionID, head.Version),
	}
	if c.cfg.Encryption != nil {
		// The message names the session only; its sealed value goes to the request's value
		// key on the broker, in the same script call (docs/protocol.md, "Staged saves").
		h.Task = TaskSaveStaged
		sid, _ := json.Marshal(head.SessionID)
		args := append(append([]byte{'['}, sid...), ']')
		argsRepr := fmt.Sprintf("[<checkpoint %s v%d, staged %d bytes>]", pyQuote(head.SessionID), head.Version, len(save.Value))
		return c.enqueue(ctx, h, protocolBody(args, seq), argsRepr, save.Value)
	}
	args := make([]byte, 0, len(doc)+2)
	args = append(append(append(args, '['), doc...), ']')
	argsRepr := fmt.Sprintf("[<checkpoint %s v%d, %d bytes>]", pyQuote(head.SessionID), head.Version, len(doc))
	return c.enqueue(ctx, h, protocolBody(args, seq), argsRepr, save.Value)
}

// Delete enqueues a delete of sessionID (Store.Delete); an empty id is a no-op, as in the
// Go store. Use DeleteAsync for the handle WaitDurable takes.
func (c *Client[C]) Delete(ctx context.Context, sessionID string) error {
	if sessionID == "" {
		return nil
	}
	h, err := c.DeleteAsync(ctx, sessionID)
	if err == nil && c.cfg.WaitOnWrite {
		_, err = c.WaitDurable(ctx, h)
	}
	return err
}

// DeleteAsync enqueues a delete of sessionID (its tombstone keeps older saves out) and
// returns the request's handle once the broker has it.
func (c *Client[C]) DeleteAsync(ctx context.Context, sessionID string, opts ...RequestOption) (Handle, error) {
	if err := ValidateSessionID(sessionID); err != nil {
		return Handle{}, err
	}
	seq, err := c.clock.next(sessionID, applyOptions(opts).after)
	if err != nil {
		return Handle{}, err
	}
	args, _ := json.Marshal([]string{sessionID})
	h := Handle{Task: TaskDelete, SessionID: sessionID, Seq: seq}
	return c.enqueue(ctx, h, protocolBody(args, seq), "["+pyQuote(sessionID)+"]", nil)
}

// enqueue publishes one request: value is a save's stored value, nil for a delete.
func (c *Client[C]) enqueue(ctx context.Context, h Handle, body []byte, argsRepr string, value []byte) (Handle, error) {
	if len(body) > c.cfg.MaxMessageBytes {
		return Handle{}, fmt.Errorf("%w: %s for session %q is %d bytes; the limit is %d",
			ErrTooLarge, h.Task, h.SessionID, len(body), c.cfg.MaxMessageBytes)
	}
	taskID, err := newUUID()
	if err != nil {
		return Handle{}, err
	}
	h.TaskID = taskID
	kwargsRepr := "{'seq': " + strconv.FormatInt(h.Seq, 10) + "}"
	var trace []byte
	if c.cfg.TraceHeaders != nil {
		if trace, err = traceHeaderFields(c.cfg.TraceHeaders(ctx)); err != nil {
			return Handle{}, err
		}
	}
	msg, err := buildEnvelope(h.Task, taskID, c.cfg.Queue, c.replyTo, c.origin, argsRepr, kwargsRepr, trace, body)
	if err != nil {
		return Handle{}, err
	}
	token, err := newUUID()
	if err != nil {
		return Handle{}, err
	}
	keys, args := c.publishCall(h, msg, token, value)
	lost, err := c.publish(ctx, h, keys, args)
	if err != nil && !errors.Is(err, ErrReplicationTimeout) {
		return Handle{}, err
	}
	// Kept in the recovery window (one only the primary acknowledged too); when the reply
	// shows the broker lost accepted requests, the window (this request included) is
	// published again.
	c.recent.add(h, msg, value)
	if lost {
		c.recover(ctx)
	}
	if err != nil {
		return h, err // queued on the primary: the handle can be waited on
	}
	return h, nil
}

// publishCall is publishScript's KEYS and ARGV for h (its header says what each is), as
// pending.py's push_call builds them (tests/go/test_publish_calls.py compares the two):
// value is a save's stored value, nil for a delete; token the epoch should the broker
// have none (its first markTokenChars characters: this publish's mark's token). ARGV[4],
// this producer's clock, and ARGV[6..8], the epoch, mark and token it saw, are read again
// at each attempt (publish).
func (c *Client[C]) publishCall(h Handle, msg []byte, token string, value []byte) ([]string, []interface{}) {
	op := opSave
	if h.Task == TaskDelete {
		op, value = opDelete, []byte{}
	}
	keys := []string{c.cfg.Queue, c.keys.pendingIndex(), c.keys.pendingEpoch(), c.keys.pendingMark(),
		c.keys.pendingCounts(), c.keys.pendingRequests(h.SessionID), c.keys.pendingValue(h.SessionID, h.TaskID),
		c.keys.pendingCounted(h.SessionID)}
	seenEpoch, seenMark, seenToken := c.epochs.seen()
	args := []interface{}{msg, c.cfg.SessionTTL.Milliseconds(), token, c.cfg.Now().UnixMicro(),
		c.cfg.MaxSeqAhead.Microseconds(), seenEpoch, seenMark, seenToken, h.SessionID, h.Seq, op, h.TaskID, value}
	return keys, args
}

// publish runs publishScript (the LPUSH and the pending entry, atomically), retrying
// failures with backoff until PublishTimeout, except for an error reply that retrying
// cannot change: the broker's refusal of the seq or of this producer's clock
// (ErrSeqRefused), or a *RedisError, at once. A push that failed after all may still have
// landed, so one request can arrive twice: harmless, since requests are fenced, and its
// entry is keyed by its request id. It returns whether the reply showed that the broker
// lost accepted requests (a loss not counted before: then publish the window again).
func (c *Client[C]) publish(ctx context.Context, h Handle, keys []string, args []interface{}) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.PublishTimeout)
	defer cancel()
	wait := 50 * time.Millisecond
	for attempt := 1; ; attempt++ {
		args[3] = c.cfg.Now().UnixMicro()
		args[5], args[6], args[7] = c.epochs.seen()
		floor := c.epochs.floor()
		reply, acked, err := c.eval(ctx, keys, args)
		if err == nil {
			lost := false
			if items, err := replyList(reply, 3); err == nil {
				epoch, err1 := replyText(items[0])
				mark, _, err2 := replyInt(items[1])
				found, _, err3 := replyInt(items[2])
				if err1 == nil && err2 == nil && err3 == nil {
					token, _ := args[2].(string)
					if len(token) > markTokenChars {
						token = token[:markTokenChars]
					}
					lost = c.epochs.observeMark(epoch, mark, floor.mark+1, found == 1, token, nil)
				}
			}
			if c.cfg.BrokerDurability == Replicated && acked < int64(c.cfg.BrokerReplicas) {
				return lost, fmt.Errorf("%w: %s for session %q (seq %d) was accepted by the broker's primary, but only %d of %d "+
					"replica(s) acknowledged it within %s: it is queued and may still apply, but a failover now could lose it; "+
					"retrying is safe (requests are fenced), or WaitDurable on its handle",
					ErrReplicationTimeout, h.Task, h.SessionID, h.Seq, acked, c.cfg.BrokerReplicas, c.cfg.BrokerReplicationTimeout)
			}
			return lost, nil
		}
		if code, text := replyCode(err); code == seqRefused {
			return false, fmt.Errorf("%w: %s for session %q (seq %d) not published: %s",
				ErrSeqRefused, h.Task, h.SessionID, h.Seq, strings.TrimSpace(strings.TrimPrefix(text, seqRefused)))
		}
		op := fmt.Sprintf("the publish of %s for session %q to queue %q", h.Task, h.SessionID, c.cfg.Queue)
		if refused := c.permanent("broker", op, err); refused != nil {
			return false, refused
		}
		fail := func(cause error) error {
			return fmt.Errorf("%w: %s for session %q not published to queue %q (%d attempt(s) within %s): %v",
				ErrBrokerUnavailable, h.Task, h.SessionID, c.cfg.Queue, attempt, c.cfg.PublishTimeout, cause)
		}
		if ctx.Err() != nil {
			return false, fail(err)
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return false, fail(err)
		}
		if wait *= 2; wait > time.Second {
			wait = time.Second
		}
	}
}

// eval runs publishScript; with Replicated, WAIT goes behind it on the same connection
// (ReplicaWaiter) and acked is its reply.
func (c *Client[C]) eval(ctx context.Context, keys []string, args []interface{}) (interface{}, int64, error) {
	if c.cfg.BrokerDurability != Replicated {
		reply, err := c.cfg.Broker.Eval(ctx, publishScript, keys, args...)
		return reply, 0, err
	}
	return c.cfg.Broker.(ReplicaWaiter).EvalWait(ctx, c.cfg.BrokerReplicas, c.cfg.BrokerReplicationTimeout,
		publishScript, keys, args...)
}

// seqRefused starts publish.lua's refusals (the rest of the error says why).
const seqRefused = "CQREFUSED"

// -- reads -------------------------------------------------------------------------------

// Load reads sessionID's checkpoint (Store.Load): the newest accepted write, whether the
// workers applied it or the queue still holds it; nil, nil when absent, expired or deleted
// (a pending delete included), and for an empty id.
func (c *Client[C]) Load(ctx context.Context, sessionID string) (*C, error) {
	cp, _, err := c.LoadWithSeq(ctx, sessionID)
	return cp, err
}

// LoadWithSeq is Load that also returns the seq of the request it read (0 when none): the
// session's fence, or its newest pending entry's seq when that entry is ordered after the
// fence. A later Save or Delete from this client sorts after it by itself; a process that
// saves what another loaded passes it as After(seq).
//
// The pending entries are read before the store (docs/protocol.md, "Pending records": an
// entry is removed only once its request was applied, so one found missing is in the
// store), in one script call when the broker is the store, else in one call to each. A
// broker that does not answer fails the load (ErrBrokerUnavailable): the store alone may
// miss writes the queue holds.
func (c *Client[C]) LoadWithSeq(ctx context.Context, sessionID string) (*C, int64, error) {
	if sessionID == "" {
		return nil, 0, nil
	}
	if err := ValidateSessionID(sessionID); err != nil {
		return nil, 0, err
	}
	ctx, cancel := c.readContext(ctx)
	defer cancel()
	read, err := c.readSession(ctx, sessionID, true)
	if err != nil {
		return nil, 0, err
	}
	if err := c.checkStore(ctx); err != nil {
		return nil, 0, err
	}
	var seq int64
	value, found := read.value, read.found
	if rec := read.record; rec.wins(read.fence) {
		// (A delete, or a save past its deadline, loads as missing.)
		seq, value, found = rec.seq, rec.value, !rec.deleted && !rec.lapsed
	} else if read.fence.found {
		seq = read.fence.seq
	}
	if seq != 0 {
		c.clock.observe(sessionID, seq)
	}
	if !found {
		return nil, seq, nil
	}
	value, err = c.cfg.Encryption.unseal(sessionID, value)
	if err != nil {
		return nil, seq, err
	}
	doc, err := decodeValue(value)
	if err != nil {
		return nil, seq, fmt.Errorf("%w: %q: %v", ErrCorrupt, sessionID, err)
	}
	cp := new(C)
	if err := json.Unmarshal(doc, cp); err != nil {
		return nil, seq, fmt.Errorf("%w: %q: %v", ErrCorrupt, sessionID, err)
	}
	return cp, seq, nil
}

// sessionRead is what a load read: the session's newest pending entry (its value only when
// it answers), and the store's fence and value (found is false for none).
type sessionRead struct {
	record pendingRecord
	fence  fence
	value  []byte
	found  bool
}

// readSession reads sessionID's newest pending entry (broker), then its value and fence
// (store): read_pending.lua's mode "store" in one call when the broker is the store, else
// its mode "one" on the broker, then loadScript on the store (one statement on a
// PostgreSQL store), never the other order.
//
// A read that finds the broker lost accepted requests publishes the recovery window again,
// then (again) reads once more, to serve what was republished.
func (c *Client[C]) readSession(ctx context.Context, sessionID string, again bool) (sessionRead, error) {
	op := fmt.Sprintf("the load of session %q", sessionID)
	entries := []string{c.keys.pendingRequests(sessionID), c.keys.pendingEpoch(), c.keys.pending(sessionID),
		c.keys.pendingMark(), c.keys.pendingIndex(), c.keys.pendingCounts()}
	storeKeys := []string{c.keys.data(sessionID), c.keys.fence(sessionID)}
	floor := c.epochs.floor()
	args := []interface{}{"one", c.keys.pendingValuePrefix(sessionID), c.cfg.SessionTTL.Milliseconds(), sessionID,
		floor.mark, floor.token}
	var items, stored []interface{}
	lapseAt := int64(-1) // the store read's time (ms), when it was a call of its own
	var mark, forked, markToken interface{}
	if c.oneRedis {
		args[0] = "store"
		reply, err := c.cfg.Store.Eval(ctx, readPendingScript, append(entries, storeKeys...), args...)
		if err != nil {
			return sessionRead{}, c.readError(op, err)
		}
		if items, err = replyList(reply, 13); err != nil {
			return sessionRead{}, fmt.Errorf("%w: load %q: %v", ErrStoreUnavailable, sessionID, err)
		}
		// {value, seq, deleted, req, deadline}, as loadScript answers
		items, stored, mark, forked, markToken = items[:5], items[5:10], items[10], items[11], items[12]
	} else {
		reply, err := c.cfg.Broker.Eval(ctx, readPendingScript, entries, args...)
		if err != nil {
			return sessionRead{}, c.brokerReadError(op, err)
		}
		if items, err = replyList(reply, 8); err != nil {
			return sessionRead{}, fmt.Errorf("%w: load %q: %v", ErrBrokerUnavailable, sessionID, err)
		}
		mark, forked, markToken = items[5], items[6], items[7]
		if c.pg != nil {
			if stored, err = c.pg.loadSession(ctx, sessionID); err != nil {
				return sessionRead{}, c.readError(op, err)
			}
		} else if reply, err = c.cfg.Store.Eval(ctx, loadScript, storeKeys); err != nil {
			return sessionRead{}, c.readError(op, err)
		} else if stored, err = replyList(reply, 6); err != nil {
			return sessionRead{}, fmt.Errorf("%w: load %q: %v", ErrStoreUnavailable, sessionID, err)
		}
		// A save alive at the broker read may be past its deadline by the store read, and a
		// fence ordered after it may have expired in between: judge it by the store's time.
		if storeNow, found, err := replyInt(stored[5]); err == nil && found {
			lapseAt = storeNow
		}
	}
	epoch, err := replyText(items[4])
	if err != nil {
		return sessionRead{}, fmt.Errorf("%w: the pending epoch: %v", ErrCorrupt, err)
	}
	seen, found, err := replyInt(mark)
	if err != nil {
		return sessionRead{}, fmt.Errorf("%w: the pending mark: %v", ErrCorrupt, err)
	} else if !found {
		seen = -1
	}
	var sent *seenMark
	if f, _, _ := replyInt(forked); f == 1 {
		sent = &floor
	}
	token, _ := replyText(markToken)
	if c.epochs.observeMark(epoch, seen, floor.mark, false, token, sent) && c.recover(ctx) > 0 && again {
		return c.readSession(ctx, sessionID, false) // with what was republished
	}
	if op, _ := replyText(items[1]); op == opMissing {
		return sessionRead{}, fmt.Errorf("%w: load %q: the pending record of a request still queued for "+
			"the session is missing on the broker (deleted by hand, or evicted), so the store alone "+
			"could serve an older turn; loads refuse until a worker applies the queued request, or "+
			"its deadline passes", ErrBrokerUnavailable, sessionID)
	}
	var read sessionRead
	if read.fence, err = parseFence(stored[1:]); err != nil {
		return sessionRead{}, fmt.Errorf("%w: fence of %q: %v", ErrCorrupt, sessionID, err)
	}
	if read.value, read.found, err = replyBytes(stored[0]); err != nil {
		return sessionRead{}, fmt.Errorf("%w: load %q: %v", ErrStoreUnavailable, sessionID, err)
	}
	// The scripts send the value of whichever answers, the entry's or the store's.
	if read.record, err = parseHead(items[0], items[1], items[2]); err == nil && read.record.wins(read.fence) {
		if !read.record.deleted && !read.record.lapsed && lapseAt >= 0 && c.deadlinePassed(read.record.seq, lapseAt) {
			read.record.lapsed = true
		} else {
			read.record, err = parseRecord(items[:4])
		}
	}
	if err != nil {
		return sessionRead{}, fmt.Errorf("%w: the pending entries of %q: %v", ErrCorrupt, sessionID, err)
	}
	return read, nil
}

// List returns every live session id, sorted (Store.List), with the pending entries
// merged in: a session whose newest accepted request is a save is listed, one whose newest
// is a delete (or a save past its deadline) is not, whether the workers applied them yet
// or not. It reads checkpointq's
// deadline index rather than SCANning the keyspace, so its cost follows the sessions (on
// a cluster, every slot's index: see listCluster), plus the pending entries, which the
// requests the queue holds bound.
func (c *Client[C]) List(ctx context.Context) ([]string, error) {
	ctx, cancel := c.readContext(ctx)
	defer cancel()
	const op = "the listing of sessions"
	// The store's clock, as loads judge deadlines (load.lua's time): a replica whose own
	// clock runs ahead would otherwise list none of the sessions its loads return.
	now, err := c.storeNow(ctx)
	if err != nil {
		return nil, c.readError(op, err)
	}
	pending, err := c.pendingSessions(ctx, now) // first, as for a load
	if errors.Is(err, ErrCorrupt) {
		return nil, err
	} else if err != nil {
		if c.oneRedis {
			return nil, c.readError(op, err)
		}
		return nil, c.brokerReadError(op, err)
	}
	seen := make(map[string]struct{})
	list := c.listIndex
	if c.keys.cluster {
		list = c.listCluster
	} else if c.pg != nil {
		list = func(ctx context.Context, _ int64, seen map[string]struct{}) error { return c.pg.listLive(ctx, seen) }
	}
	if err := list(ctx, now, seen); err != nil {
		return nil, c.readError(op, err)
	}
	if err := c.mergePending(ctx, now, pending, seen); errors.Is(err, ErrCorrupt) {
		return nil, err
	} else if err != nil {
		return nil, c.readError(op, err)
	}
	ids := make([]string, 0, len(seen))
	for id := range seen {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	if err := c.checkStore(ctx); err != nil {
		return nil, err
	}
	return ids, nil
}

// timeScript is the server's time in ms, as load.lua reads it.
const timeScript = `local t = redis.call('TIME')
return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)`

// storeNow is the store's time in ms: the Redis server's (on a cluster, the node serving
// the first slot index's), or the PostgreSQL server's.
func (c *Client[C]) storeNow(ctx context.Context) (int64, error) {
	if c.pg != nil {
		var now int64
		err := c.pg.db.QueryRowContext(ctx,
			"SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint").Scan(&now)
		return now, err
	}
	key := c.keys.index()
	if c.keys.cluster {
		key = c.keys.slotIndex(0)
	}
	reply, err := c.cfg.Store.Eval(ctx, timeScript, []string{key})
	if err != nil {
		return 0, err
	}
	now, ok := reply.(int64)
	if !ok {
		return 0, fmt.Errorf("unexpected reply %T to the time script", reply)
	}
	return now, nil
}

// listIndex adds to seen the ids of the single-Redis deadline index whose deadline is
// after now (ms).
func (c *Client[C]) listIndex(ctx context.Context, now int64, seen map[string]struct{}) error {
	var cursor uint64
	for {
		pairs, next, err := c.cfg.Store.ZScan(ctx, c.keys.index(), cursor, 1000)
		if err != nil {
			return err
		}
		for i := 0; i+1 < len(pairs); i += 2 {
			deadline, err := strconv.ParseFloat(pairs[i+1], 64)
			if err == nil && deadline > float64(now) {
				seen[pairs[i]] = struct{}{}
			}
		}
		if cursor = next; cursor == 0 {
			return nil
		}
	}
}

// brokerReadError wraps a failed read of the pending records: a *RedisError when retrying
// cannot help, else ErrBrokerUnavailable.
func (c *Client[C]) brokerReadError(op string, err error) error {
	if refused := c.permanent("broker", op, err); refused != nil {
		return refused
	}
	return fmt.Errorf("%w: %s could not read the pending records on the broker (without them "+
		"the store's answer may miss writes the queue holds): %v", ErrBrokerUnavailable, op, err)
}

// readError wraps a failed read: a *RedisError when retrying cannot help, else
// ErrStoreUnavailable.
func (c *Client[C]) readError(op string, err error) error {
	if refused := c.permanent("store", op, err); refused != nil {
		return refused
	}
	return fmt.Errorf("%w: %s: %v%s", ErrStoreUnavailable, op, err, redirectHint(err))
}

func (c *Client[C]) readContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, c.cfg.ReadTimeout)
}

// -- read-your-writes --------------------------------------------------------------------

// WaitDurable blocks until h's own outcome is known: Applied, Superseded or Expired, read
// from the session's fence first. A request the worker dead-lettered returns a
// *RefusedError (errors.Is(err, ErrRefused)) with the reason and the dead letter's id,
// read from the session's refusal records. Without a deadline on ctx it waits at most WaitTimeout;
// when the deadline passes first, the error wraps ctx's error and says how far the
// session's fence got, or wraps ErrStoreUnavailable when the store's reads kept failing.
// Failed reads are retried until the deadline only when the next one may succeed
// (classify.go): an error reply that would come again (CROSSSLOT from a cluster store
// without Config.Cluster, NOAUTH, WRONGTYPE...) returns at once as a *RedisError
// (errors.Is(err, ErrMisconfigured)) that says what to do.
func (c *Client[C]) WaitDurable(ctx context.Context, h Handle) (Result, error) {
	if h.TaskID == "" || h.SessionID == "" {
		return Result{}, fmt.Errorf("%w: WaitDurable needs a handle from SaveAsync or DeleteAsync", ErrInvalidInput)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.cfg.WaitTimeout)
		defer cancel()
	}
	delay := 5 * time.Millisecond
	var fenceSeq int64
	var storeErr error // the last read's failure (nil once a read succeeded since)
	succeeded := false
	for {
		items, err := c.readOutcome(ctx, h)
		if err == nil {
			if err := c.checkStore(ctx); err != nil {
				return Result{}, err
			}
			res, done, err := c.decide(h, items)
			if done {
				return res, err // applied, superseded, expired, or refused (a *RefusedError)
			}
			if err != nil {
				return res, fmt.Errorf("%w: the outcome of %s %s for session %q: %v",
					ErrCorrupt, h.Task, h.TaskID, h.SessionID, err)
			}
			fenceSeq, storeErr, succeeded = res.FenceSeq, nil, true
		} else if refused := c.permanent("store", fmt.Sprintf("the wait for %s %s for session %q",
			h.Task, h.TaskID, h.SessionID), err); refused != nil {
			// An error reply that the next poll would get too (CROSSSLOT from a cluster
			// store without Config.Cluster, NOAUTH, WRONGTYPE...): say so now.
			return Result{}, refused
		} else if ctx.Err() == nil || !succeeded {
			// A failure before the deadline, or no read ever answering: the store is the
			// problem (a read cut short by the deadline after good ones is not).
			storeErr = err
		}
		if ctx.Err() != nil {
			if storeErr != nil {
				return Result{}, fmt.Errorf("%w: waiting for %s %s for session %q: %v (%v)%s",
					ErrStoreUnavailable, h.Task, h.TaskID, h.SessionID, storeErr, ctx.Err(), redirectHint(storeErr))
			}
			return Result{}, fmt.Errorf("checkpointq: %s %s for session %q (seq %d) not durable yet, fence at seq %d: %w",
				h.Task, h.TaskID, h.SessionID, h.Seq, fenceSeq, ctx.Err())
		}
		select {
		case <-time.After(delay):
		case <-ctx.Done():
		}
		if delay *= 2; delay > 250*time.Millisecond {
			delay = 250 * time.Millisecond
		}
	}
}

// -- helpers -----------------------------------------------------------------------------

// pyQuote renders s as Python's repr would, roughly: for argsrepr (logs only).
func pyQuote(s string) string {
	if len(s) > 40 {
		s = s[:37] + "..."
	}
	return "'" + s + "'"
}
