package checkpointq

import (
	"bytes"
	"encoding/json"
	"testing"
)

func TestARepublishedMessageCarriesAFreshDeliveryTagAndNothingElseNew(t *testing.T) {
	// Given a message as a publish builds it
	msg, err := buildEnvelope(TaskSave, "req-1", "checkpoints", "reply", "gen1@host", "()", "{}", nil, []byte(`[[],{},{}]`))
	if err != nil {
		t.Fatal(err)
	}
	// When it is readied to publish again
	again, err := withFreshTag(msg)
	if err != nil {
		t.Fatal(err)
	}
	// Then only its delivery tag differs: settle.lua tells the two publishes apart by it
	var before, after map[string]any
	if err := json.Unmarshal(msg, &before); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(again, &after); err != nil {
		t.Fatalf("%v: %s", err, again)
	}
	tagOf := func(m map[string]any) any { return m["properties"].(map[string]any)["delivery_tag"] }
	if tagOf(before) == tagOf(after) || len(again) != len(msg) {
		t.Fatalf("republished tag %v, first %v (%d and %d bytes)", tagOf(after), tagOf(before), len(again), len(msg))
	}
	after["properties"].(map[string]any)["delivery_tag"] = tagOf(before)
	a, _ := json.Marshal(before)
	b, _ := json.Marshal(after)
	if !bytes.Equal(a, b) {
		t.Fatalf("more than the tag changed:\n%s\n%s", msg, again)
	}
	// And a message without a tag at its end goes as it is
	if raw, _ := withFreshTag([]byte(`{"body":"x"}`)); string(raw) != `{"body":"x"}` {
		t.Fatalf("a message without a tag became %s", raw)
	}
}
