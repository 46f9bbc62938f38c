package checkpointq

import (
	"errors"
	"fmt"
)

// The error kinds a caller may tell apart with errors.Is; every error the client returns
// wraps one of them (or the context's error, for WaitDurable's own deadline).
var (
	// ErrInvalidInput: the request was refused before publishing (bad session id, a
	// checkpoint that does not marshal, a message over MaxMessageBytes). Never retried.
	ErrInvalidInput = errors.New("checkpointq: invalid input")
	// ErrBrokerUnavailable: the broker did not take the request within PublishTimeout.
	ErrBrokerUnavailable = errors.New("checkpointq: broker unavailable")
	// ErrStoreUnavailable: the store Redis did not answer a read.
	ErrStoreUnavailable = errors.New("checkpointq: store unavailable")
	// ErrCorrupt: a stored value is neither zstd JSON nor JSON of a checkpoint.
	ErrCorrupt = errors.New("checkpointq: corrupt stored checkpoint")
	// ErrRefused: the worker dead-lettered the request (see RefusedError for why).
	ErrRefused = errors.New("checkpointq: request refused by the worker")
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
