package checkpointq

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
)

// fieldsOf finds, once per checkpoint type, the struct fields that a save needs to read
// (sessionId, version) and trim (conversationHistory), by their JSON tags. Reading them
// by reflection spares decoding the whole marshalled document again (that cost more than
// the marshalling). A type without them (not a struct) takes the slow path: decode.
type checkpointFields struct {
	ok                        bool
	sessionID, version, histo []int
}

func fieldsOf(t reflect.Type) checkpointFields {
	if t.Kind() != reflect.Struct {
		return checkpointFields{}
	}
	f := checkpointFields{}
	for _, want := range []struct {
		tag  string
		kind reflect.Kind
		dst  *[]int
	}{
		{"sessionId", reflect.String, &f.sessionID},
		{"version", reflect.Int64, &f.version},
		{"conversationHistory", reflect.Slice, &f.histo},
	} {
		field, found := fieldByTag(t, want.tag)
		if !found || field.Type.Kind() != want.kind && !(want.tag == "version" && isInt(field.Type.Kind())) {
			return checkpointFields{}
		}
		*want.dst = field.Index
	}
	f.ok = true
	return f
}

func isInt(k reflect.Kind) bool {
	return k == reflect.Int || k == reflect.Int32 || k == reflect.Int64
}

func fieldByTag(t reflect.Type, name string) (reflect.StructField, bool) {
	for i := 0; i < t.NumField(); i++ {
		field := t.Field(i)
		if tag, _, _ := strings.Cut(field.Tag.Get("json"), ","); tag == name && field.IsExported() {
			return field, true
		}
	}
	return reflect.StructField{}, false
}

// checkpointHead is what a save needs besides the document: the id, version and, when the
// history had to be cut to historyCap, the document re-marshalled with the cut history.
type checkpointHead struct {
	SessionID string
	Version   int64
	Doc       []byte
	// Kept is how many history messages Doc holds.
	Kept int
}

// marshalCheckpoint marshals cp with at most historyCap history messages (the most recent).
func marshalCheckpoint[C any](f checkpointFields, cp *C, historyCap int) (checkpointHead, error) {
	if !f.ok {
		return marshalSlow(cp, historyCap)
	}
	v := reflect.ValueOf(cp).Elem()
	history := v.FieldByIndex(f.histo)
	value := any(cp)
	kept := history.Len()
	if kept > historyCap {
		kept = historyCap
		trimmed := reflect.New(v.Type())
		trimmed.Elem().Set(v) // a shallow copy: the caller's checkpoint is left alone
		trimmed.Elem().FieldByIndex(f.histo).Set(history.Slice(history.Len()-historyCap, history.Len()))
		value = trimmed.Interface()
	}
	doc, err := json.Marshal(value)
	if err != nil {
		return checkpointHead{}, fmt.Errorf("%w: checkpoint does not marshal: %v", ErrInvalidInput, err)
	}
	return checkpointHead{v.FieldByIndex(f.sessionID).String(), v.FieldByIndex(f.version).Int(), doc, kept}, nil
}

// marshalSlow serves checkpoint types that are not structs with the three fields.
func marshalSlow(cp any, historyCap int) (checkpointHead, error) {
	doc, err := json.Marshal(cp)
	if err != nil {
		return checkpointHead{}, fmt.Errorf("%w: checkpoint does not marshal: %v", ErrInvalidInput, err)
	}
	var head struct {
		SessionID string            `json:"sessionId"`
		Version   int64             `json:"version"`
		History   []json.RawMessage `json:"conversationHistory"`
	}
	if err := json.Unmarshal(doc, &head); err != nil {
		return checkpointHead{}, fmt.Errorf("%w: checkpoint: %v", ErrInvalidInput, err)
	}
	kept := len(head.History)
	if n := kept; n > historyCap {
		kept = historyCap
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(doc, &fields); err != nil {
			return checkpointHead{}, fmt.Errorf("%w: checkpoint: %v", ErrInvalidInput, err)
		}
		if fields["conversationHistory"], err = json.Marshal(head.History[n-historyCap:]); err != nil {
			return checkpointHead{}, err
		}
		if doc, err = json.Marshal(fields); err != nil {
			return checkpointHead{}, err
		}
	}
	return checkpointHead{head.SessionID, head.Version, doc, kept}, nil
}
