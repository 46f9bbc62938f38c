package checkpointq

import (
	"testing"
	"time"
)

// Issue 44: List judges deadlines by the store's clock, as Load does, so a replica whose
// own clock runs ahead (here past the sessions' whole lifetime) lists what it loads.
func TestListUsesTheStoresClockAsLoadDoes(t *testing.T) {
	writer := newClient[Checkpoint](t, Config{})
	ahead := newClient[Checkpoint](t, Config{Now: func() time.Time { return time.Now().Add(31 * 24 * time.Hour) }})
	ctx := background(t)
	var ids []string
	for n := 0; n < 10; n++ {
		id := sessionID(t, string(rune('a'+n)))
		h, err := writer.SaveAsync(ctx, sampleCheckpoint(id, 1))
		if err != nil {
			t.Fatal(err)
		}
		mustWait(t, writer, h, Applied)
		ids = append(ids, id)
	}
	listed, err := ahead.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	seen := make(map[string]bool, len(listed))
	for _, id := range listed {
		seen[id] = true
	}
	for _, id := range ids {
		cp, err := ahead.Load(ctx, id)
		if err != nil || cp == nil {
			t.Fatalf("Load(%q) = %v, %v; want the saved checkpoint", id, cp, err)
		}
		if !seen[id] {
			t.Fatalf("List misses %q, which Load returns (listed %d)", id, len(listed))
		}
	}
}
