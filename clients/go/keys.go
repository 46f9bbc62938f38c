package checkpointq

import (
	"strconv"
	"strings"
	"sync"
)

// Keys of the store (store/keys.py): the checkpoint where the Go RedisStore keeps it, and
// checkpointq's bookkeeping under "<prefix>.cq:".
//
// Single Redis (KeySpace):
//
//	<prefix>:<id>                 the checkpoint
//	<prefix>.cq:fence:<id>        its fence hash
//	<prefix>.cq:deadlines         the deadline index
//	<prefix>.cq:refusals:<id>     its refusal records: request id -> JSON {kind, reason, entry}
//
// On the broker (always a single Redis; docs/protocol.md, "Pending records"):
//
//	<prefix>.cq:pending-requests:<id>             one entry per request for <id> that the
//	                                              queue may hold: request id -> "<seq> <op>"
//	<prefix>.cq:pending-value:<n>:<id>:<req>      a pending save's value (n: len(<id>) in bytes)
//	<prefix>.cq:pending:<id>                      the layout before issue 31 (the newest
//	                                              request only), still read by the scripts
//	<prefix>.cq:pending                           the index: id -> latest entry deadline (ms)
//	<prefix>.cq:pending-epoch                     a token that changes when the broker lost its data
//	<prefix>.cq:pending-counts                    id -> requests counted and not settled
//	<prefix>.cq:pending-counted:<id>              the requests that count includes:
//	                                              request id -> "<seq> <op>"
//
// Redis Cluster (ClusterKeySpace): the data key is the same, while a session's fence,
// refusal records and deadline index carry the hash tag of its data key's slot, so that
// one script reads the value and the fence:
//
//	<prefix>.cq:{<tag>}:fence:<id>
//	<prefix>.cq:{<tag>}:refusals:<id>
//	<prefix>.cq:{<tag>}:slot-deadlines    one index per slot, 16384 in all
type keySpace struct {
	prefix  string
	cluster bool
}

// DefaultPrefix is the Go RedisStore's key prefix.
const DefaultPrefix = "agentorca-session"

func (k keySpace) data(sessionID string) string { return k.prefix + ":" + sessionID }
func (k keySpace) internal() string             { return k.prefix + ".cq" }
func (k keySpace) index() string                { return k.internal() + ":deadlines" }

// pendingRequests is the session's pending entries, one per request the queue may hold.
func (k keySpace) pendingRequests(sessionID string) string {
	return k.internal() + ":pending-requests:" + sessionID
}

// pendingValuePrefix names a pending save's value key before its request id: the session
// id comes with its length, so that no (session, request) pair names another's value.
func (k keySpace) pendingValuePrefix(sessionID string) string {
	return k.internal() + ":pending-value:" + strconv.Itoa(len(sessionID)) + ":" + sessionID + ":"
}

// pendingValue is a pending save's value, by session and request.
func (k keySpace) pendingValue(sessionID, requestID string) string {
	return k.pendingValuePrefix(sessionID) + requestID
}

// pending is the session's record in the layout before issue 31 (the newest request only):
// producers of that release may still write it, and the scripts read it as one more entry.
func (k keySpace) pending(sessionID string) string { return k.internal() + ":pending:" + sessionID }
func (k keySpace) pendingIndex() string            { return k.internal() + ":pending" }
func (k keySpace) pendingEpoch() string            { return k.internal() + ":pending-epoch" }
func (k keySpace) pendingMark() string             { return k.internal() + ":pending-mark" }
func (k keySpace) pendingCounts() string           { return k.internal() + ":pending-counts" }

// pendingCounted is the session's counted requests (request id -> "<seq> <op>"): those its
// count includes, each spent once by its own settle (publish.lua).
func (k keySpace) pendingCounted(sessionID string) string {
	return k.internal() + ":pending-counted:" + sessionID
}

func (k keySpace) fence(sessionID string) string { return k.sessionKey("fence", sessionID) }

// refusals is the session's refusal records: request id -> the JSON of its dead letter's
// kind, reason and entry. By session, so that a request id names nothing outside it.
func (k keySpace) refusals(sessionID string) string { return k.sessionKey("refusals", sessionID) }

// sessionKey is the session's bookkeeping key of that kind: on a cluster, in its data
// key's slot (the hash tag first, so that Redis hashes our tag whatever the id holds).
func (k keySpace) sessionKey(kind, sessionID string) string {
	if k.cluster {
		return k.internal() + ":{" + slotTag(keySlot(k.data(sessionID))) + "}:" + kind + ":" + sessionID
	}
	return k.internal() + ":" + kind + ":" + sessionID
}

// slotIndex is the cluster layout's deadline index of the sessions whose data keys hash
// to slot.
func (k keySpace) slotIndex(slot int) string {
	return k.internal() + ":{" + slotTag(slot) + "}:slot-deadlines"
}

// clusterSlots is the number of Redis Cluster hash slots.
const clusterSlots = 16384

// keySlot is Redis Cluster's CLUSTER KEYSLOT: CRC16 of the key, or of its hash tag (the
// text between the first "{" and the first "}" after it, when not empty), mod 16384.
func keySlot(key string) int {
	if open := strings.IndexByte(key, '{'); open >= 0 {
		if end := strings.IndexByte(key[open+1:], '}'); end > 0 {
			key = key[open+1 : open+1+end]
		}
	}
	return int(crc16(key) % clusterSlots)
}

// crc16Table is CRC-16/XMODEM (polynomial 0x1021, initial value 0), Redis Cluster's CRC16.
var crc16Table = func() (t [256]uint16) {
	for i := range t {
		crc := uint16(i) << 8
		for bit := 0; bit < 8; bit++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
		t[i] = crc
	}
	return t
}()

func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc = crc<<8 ^ crc16Table[byte(crc>>8)^s[i]]
	}
	return crc
}

var (
	slotTagsOnce sync.Once
	slotTags     []string
)

// slotTag is the hash-tag text that places a key in slot: the smallest decimal number
// whose CRC16 is that slot (store/keys.py, slot_tags: part of the stored layout). The
// table is computed once, on first use (~110k CRC16s of short strings).
func slotTag(slot int) string {
	slotTagsOnce.Do(func() {
		tags := make([]string, clusterSlots)
		for missing, n := clusterSlots, 0; missing > 0; n++ {
			text := strconv.Itoa(n)
			if s := keySlot(text); tags[s] == "" {
				tags[s] = text
				missing--
			}
		}
		slotTags = tags
	})
	return slotTags[slot]
}
