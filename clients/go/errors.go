package checkpointq

import (
	"errors"
	"fmt"
)

// The error kinds a caller may tell apart with errors.Is; every error the client returns
// wraps one of them (or the context's error, for WaitDurable's own deadline).
var (
	// ErrInvalidInput: the request was refused before publishing, as the worker would
	// refuse it (bad session id, a checkpoint that does not marshal, too large). Never
	// retried.
	ErrInvalidInput = errors.New("checkpointq: invalid input")
	// ErrTooLarge (an ErrInvalidInput too): the checkpoint does not fit the stored-size
	// budget (MaxValueBytes) even with only its most recent message, or the message is
	// over MaxMessageBytes. The error's text is the reason the worker would record.
	ErrTooLarge = fmt.Errorf("%w (too large)", ErrInvalidInput)
	// ErrSeqRefused (an ErrInvalidInput too): the broker refused the request at publish,
	// checked against its own clock: this producer's clock runs more than half of
	// Config.MaxSeqAhead ahead of the broker's, or the request's seq is more than
	// MaxSeqAhead ahead (an After seq too far ahead), or is past its deadline already.
	// Nothing was queued. Fix the clock (NTP), or the After seq. The error's text ends with
	// the broker's reason. Never retried.
	ErrSeqRefused = fmt.Errorf("%w (seq refused)", ErrInvalidInput)
	// ErrBrokerUnavailable: the broker did not take the request within PublishTimeout
	// (connection failures, timeouts and the error replies worth retrying, classify.go);
	// or a Load or List could not read the pending records from a broker that is not the
	// store, and failed rather than serve the store's answer alone, which may miss writes
	// the queue holds.
	ErrBrokerUnavailable = errors.New("checkpointq: broker unavailable")
	// ErrStoreUnavailable: the store Redis did not answer a read (Load, List), or not
	// within WaitDurable's deadline (connection failures, timeouts, LOADING...).
	ErrStoreUnavailable = errors.New("checkpointq: store unavailable")
	// ErrCorrupt: a stored value is neither zstd JSON nor JSON of a checkpoint, or a fence,
	// pending entry or refusal record does not read as the workers and producers write it
	// (a pending save whose value is gone before its deadline among them).
	ErrCorrupt = errors.New("checkpointq: corrupt stored checkpoint")
	// ErrMissingKey: a stored value is encrypted under a key Config.Encryption lacks (or
	// the client has no keys); the error names the key id. The value is intact: a client
	// given that key reads it.
	ErrMissingKey = errors.New("checkpointq: missing encryption key")
	// ErrRefused: the worker dead-lettered the request (see RefusedError for why).
	ErrRefused = errors.New("checkpointq: request refused by the worker")
	// ErrReplicationTimeout: Config.BrokerDurability is Replicated and the broker's primary
	// took the request (queued, its pending entry written: it may still apply), but fewer
	// than Config.BrokerReplicas replicas acknowledged it within
	// Config.BrokerReplicationTimeout (WAIT), so a failover now could lose it. Retrying is
	// harmless (requests are fenced): save again, or WaitDurable on the Handle returned
	// beside this error. Not retried inside the call.
	ErrReplicationTimeout = errors.New("checkpointq: not acknowledged by enough broker replicas")
	// ErrMisconfigured: the broker or the store answered with an error reply that retrying
	// will not change (a *RedisError says which and what to do), so the call failed at once
	// instead of retrying until its timeout. Almost always configuration: a cluster store
	// without Config.Cluster, missing credentials, a prefix another application writes.
	ErrMisconfigured = errors.New("checkpointq: redis refused the call")
)

// RefusedError is WaitDurable's answer for a request the worker dead-lettered: it never
// became durable. Kind and Reason are the dead letter's; Entry is its id in the
// dead-letter stream (`checkpointq dlq show <Entry>`).
type RefusedError struct {
	Handle Handle
	Kind   string
	Reason string
	Entry  string
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("checkpointq: %s %s for session %q was refused (%s): %s; dead letter %s",
		e.Handle.Task, e.Handle.TaskID, e.Handle.SessionID, e.Kind, e.Reason, e.Entry)
}

// Unwrap makes errors.Is(err, ErrRefused) true.
func (e *RefusedError) Unwrap() error { return ErrRefused }

// RedisError is an error reply from the broker or the store that the client does not
// retry (the rules are in classify.go): Code is the reply's first word (CROSSSLOT,
// NOAUTH, WRONGTYPE, ERR...), Hint says what to do, Err is the adapter's error as
// returned (errors.As reaches the Redis client's own error type through it).
// errors.Is(err, ErrMisconfigured) is true for every RedisError.
type RedisError struct {
	// Server is "broker" or "store".
	Server string
	// Op is what the call was for, e.g. `wait for save <id> for session "s"`.
	Op   string
	Code string
	Hint string
	Err  error
}

func (e *RedisError) Error() string {
	return fmt.Sprintf("checkpointq: the %s refused %s: %v; %s", e.Server, e.Op, e.Err, e.Hint)
}

// Is makes errors.Is(err, ErrMisconfigured) true.
func (e *RedisError) Is(target error) bool { return target == ErrMisconfigured }

// Unwrap returns the adapter's error.
func (e *RedisError) Unwrap() error { return e.Err }
