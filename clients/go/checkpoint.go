package checkpointq

import (
	"bytes"
	"encoding/json"
	"fmt"
	"time"
	"unicode/utf8"
)

// Checkpoint is a session's persisted state, field for field (JSON tags, order and
// omitempty) the Go checkpoint package's agentorcav1alpha1.Checkpoint, which is what
// store/model.py and store/serde.py mirror on the Python side.
type Checkpoint struct {
	SessionID           string                `json:"sessionId"`
	Version             int64                 `json:"version"`
	ConversationHistory []ConversationMessage `json:"conversationHistory,omitempty"`
	Metadata            CheckpointMetadata    `json:"metadata"`
	LastRunRef          string                `json:"lastRunRef,omitempty"`
}

// ConversationMessage is one message of the recent conversation history.
type ConversationMessage struct {
	Role         string `json:"role"`
	Content      string `json:"content"`
	TraceEntries string `json:"traceEntries,omitempty"`
}

// CheckpointMetadata holds usage counters and timestamps; every field is omitted when empty.
type CheckpointMetadata struct {
	TotalMessages   int64  `json:"totalMessages,omitempty"`
	TotalTokens     int64  `json:"totalTokens,omitempty"`
	TotalCostUSD    string `json:"totalCostUSD,omitempty"`
	StartTime       *Time  `json:"startTime,omitempty"`
	LastMessageTime *Time  `json:"lastMessageTime,omitempty"`
}

// Time marshals as metav1.Time does: RFC 3339 in UTC at second precision, null when zero.
type Time struct {
	time.Time
}

// NewTime wraps t for a CheckpointMetadata field.
func NewTime(t time.Time) *Time { return &Time{t} }

// MarshalJSON writes "2006-01-02T15:04:05Z" (UTC, whole seconds) or null for the zero time.
func (t Time) MarshalJSON() ([]byte, error) {
	if t.IsZero() {
		return []byte("null"), nil
	}
	return json.Marshal(t.UTC().Format(time.RFC3339))
}

// UnmarshalJSON reads RFC 3339 (any offset, any fraction) or null.
func (t *Time) UnmarshalJSON(data []byte) error {
	if bytes.Equal(data, []byte("null")) {
		t.Time = time.Time{}
		return nil
	}
	var text string
	if err := json.Unmarshal(data, &text); err != nil {
		return err
	}
	parsed, err := time.Parse(time.RFC3339Nano, text)
	if err != nil {
		return err
	}
	t.Time = parsed.Local()
	return nil
}

// SerializeCheckpoint encodes a checkpoint to JSON, as the Go package's function does.
func SerializeCheckpoint(cp *Checkpoint) ([]byte, error) { return json.Marshal(cp) }

// DeserializeCheckpoint decodes a checkpoint from JSON, as the Go package's function does.
func DeserializeCheckpoint(data []byte) (*Checkpoint, error) {
	var cp Checkpoint
	if err := json.Unmarshal(data, &cp); err != nil {
		return nil, err
	}
	return &cp, nil
}

// ValidateSessionID applies the workers' rule (store/model.py validate_session_id) before
// anything is published: any non-empty string, as the Go checkpoint package accepts, that is
// valid UTF-8 (a JSON message cannot carry other bytes: encoding/json would replace them, and
// the session would be stored under another id).
func ValidateSessionID(id string) error {
	if id == "" {
		return fmt.Errorf("%w: sessionId must not be empty", ErrInvalidInput)
	}
	if !utf8.ValidString(id) {
		return fmt.Errorf("%w: sessionId is not valid UTF-8", ErrInvalidInput)
	}
	return nil
}
