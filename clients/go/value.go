package checkpointq

import (
	"fmt"
	"strconv"
	"unicode"

	"github.com/klauspost/compress/zstd"
)

// The stored value, as the workers will store it (store/base.py, CheckpointStore.encode):
// the Go JSON with the history cut to HistoryCap, compressed with zstd, and when that is
// over MaxValueBytes, the most messages that fit, found by the same binary search. A save
// computes it before publishing, for two reasons: the pending record must serve the value
// the store will hold, and a checkpoint the worker would refuse must be refused here.
//
// The compressor is klauspost's fastest level, the counterpart of the workers' zstd level
// 1. Its frames are a few percent larger (3.7-4.2% on prose, the same on incompressible
// data), which errs on the safe side: the message carries the history as cut here, and the
// worker's smaller frame of it fits too, so the store keeps what the pending record holds.
// Near the budget a Go save may keep a message fewer than the worker would have kept of the
// whole history, and a newest message within those few percent under the budget is
// refused here though a worker would store it.

// encoder is shared: EncodeAll is safe for concurrent use.
var encoder, _ = zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest))

// storedSave is a save ready to publish: the document the message carries (trimmed as the
// store will trim it) and the value the store will hold.
type storedSave struct {
	checkpointHead
	Value []byte
}

// encodeSave marshals cp and fits it to the stored-size budget as the workers do.
func (c *Client[C]) encodeSave(cp *C) (storedSave, error) {
	head, err := marshalCheckpoint(c.fields, cp, c.cfg.HistoryCap)
	if err != nil {
		return storedSave{}, err
	}
	if err := ValidateSessionID(head.SessionID); err != nil {
		return storedSave{}, err
	}
	budget := c.cfg.MaxValueBytes
	value, err := c.sealed(head.SessionID, encoder.EncodeAll(head.Doc, nil))
	if err != nil {
		return storedSave{}, err
	}
	if len(value) <= budget {
		return storedSave{head, value}, nil
	}
	// The most recent messages that fit: O(log n) compressions. keep itself is known not to
	// fit; like the store, at least one message must.
	keep := head.Kept
	low, high := 0, keep-1
	var best storedSave
	for low <= high {
		mid := (low + high) / 2
		h, err := marshalCheckpoint(c.fields, cp, mid)
		if err != nil {
			return storedSave{}, err
		}
		v, err := c.sealed(h.SessionID, encoder.EncodeAll(h.Doc, nil))
		if err != nil {
			return storedSave{}, err
		}
		if len(v) <= budget {
			best, low = storedSave{h, v}, mid+1
		} else {
			high = mid - 1
		}
	}
	if best.Value == nil || high < 1 {
		// The reason the worker would dead-letter it with (store/errors.py, CheckpointTooLarge).
		return storedSave{}, fmt.Errorf("%w: conversationHistory: session %s: even the most recent message "+
			"alone does not fit the %d-byte stored-size budget", ErrTooLarge, displayID(head.SessionID), budget)
	}
	return best, nil
}

// sealed is a compressed value as the store will hold it: sealed under the primary key
// with Config.Encryption (the budget bounds what is stored), else as it is.
func (c *Client[C]) sealed(sessionID string, value []byte) ([]byte, error) {
	if c.cfg.Encryption == nil {
		return value, nil
	}
	return c.cfg.Encryption.seal(sessionID, value)
}

// displayID is the id as the workers print it in a reason (store/model.py display_id):
// unchanged when it is all visible characters, else Go-quoted.
func displayID(id string) string {
	for _, r := range id {
		if r == '\\' || r == ' ' || !unicode.IsPrint(r) {
			return strconv.QuoteToGraphic(id)
		}
	}
	return id
}
