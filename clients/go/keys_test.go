package checkpointq

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"testing"
)

// clusterVectors is testdata/cluster_keys.json, which tests/go/test_go_cluster_vectors.py
// keeps equal to what the Python store computes (redis.crc.key_slot, store/keys.py).
type clusterVectors struct {
	Slots []struct {
		Key  string `json:"key"`
		Slot int    `json:"slot"`
	} `json:"slots"`
	Tags       map[string]string `json:"tags"`
	TagsSHA256 string            `json:"tags_sha256"`
	Sessions   []struct {
		Prefix, Session, Data, Fence, Index, Refusals string
	} `json:"sessions"`
}

func TestClusterKeysMatchPython(t *testing.T) {
	raw, err := os.ReadFile("testdata/cluster_keys.json")
	if err != nil {
		t.Fatal(err)
	}
	var v clusterVectors
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatal(err)
	}
	if len(v.Slots) == 0 || len(v.Tags) == 0 || len(v.Sessions) == 0 {
		t.Fatalf("empty vectors: %+v", v)
	}
	for _, c := range v.Slots {
		if got := keySlot(c.Key); got != c.Slot {
			t.Errorf("keySlot(%q) = %d, Python says %d", c.Key, got, c.Slot)
		}
	}
	for slot, tag := range v.Tags {
		n, _ := strconv.Atoi(slot)
		if got := slotTag(n); got != tag {
			t.Errorf("slotTag(%d) = %q, Python says %q", n, got, tag)
		}
	}
	all := make([]string, clusterSlots)
	for slot := range all {
		all[slot] = slotTag(slot)
	}
	sum := sha256.Sum256([]byte(strings.Join(all, "\n")))
	if got := hex.EncodeToString(sum[:]); got != v.TagsSHA256 {
		t.Errorf("the tag table's sha256 is %s, Python's is %s", got, v.TagsSHA256)
	}
	for _, s := range v.Sessions {
		k := keySpace{prefix: s.Prefix, cluster: true}
		got := [4]string{k.data(s.Session), k.fence(s.Session), k.slotIndex(keySlot(k.data(s.Session))), k.refusals(s.Session)}
		want := [4]string{s.Data, s.Fence, s.Index, s.Refusals}
		if got != want {
			t.Errorf("keys of %q under %q: got %q, Python's %q", s.Session, s.Prefix, got, want)
		}
		for name, key := range map[string]string{"fence": k.fence(s.Session), "refusals": k.refusals(s.Session)} {
			if keySlot(key) != keySlot(k.data(s.Session)) {
				t.Errorf("the %s of %q is not in its data key's slot", name, s.Session)
			}
		}
	}
}

func TestSingleRedisKeysAreUnchanged(t *testing.T) {
	k := keySpace{prefix: DefaultPrefix}
	got := [4]string{k.data("s1"), k.fence("s1"), k.index(), k.refusals("s1")}
	want := [4]string{"agentorca-session:s1", "agentorca-session.cq:fence:s1",
		"agentorca-session.cq:deadlines", "agentorca-session.cq:refusals:s1"}
	if got != want {
		t.Fatalf("single-Redis keys %q, want %q", got, want)
	}
}
