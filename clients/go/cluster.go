package checkpointq

import (
	"context"
	"fmt"
)

// hmgetScript reads one hash's fields: what WaitDurable reads on a cluster, one key per
// call (through Eval, so that the Redis interface stays three methods).
//
// KEYS[1] the hash; ARGV the fields. Returns their values, nil where absent.
const hmgetScript = `return redis.call('HMGET', KEYS[1], unpack(ARGV))`

// clusterPageScript is store/lua/page.lua for a caller that does not know the cluster's
// slot map: the Python store sends page.lua to the node serving every index it names,
// while this client only routes a call by its first key (Config.Cluster). So KEYS[1],
// the first index to read, routes the call, and the script reads the indexes after it
// only while the node serves them: a cluster node refuses a key of a slot it does not
// serve, and the script stops there. One call thus reads a run of one node's slots.
//
// KEYS[1]  the deadline index to start at (routes the call to its node)
// ARGV[1]  now in ms since epoch: only ids whose deadline is later are live
// ARGV[2]  page size: stop after the index that brings the page to this many ids
// ARGV[3]  ZSCAN cursor to resume KEYS[1] at ("0": from its start)
// ARGV[4..] the indexes of the slots after KEYS[1]'s, in slot order
//
// Returns {n, cursor, id...}: the first n indexes (KEYS[1] first) were read to their end;
// when cursor is not "0", index n + 1 has more, from that ZSCAN cursor. Either n > 0 or
// cursor is not "0", so every call makes progress. Read-only.
const clusterPageScript = `#!lua flags=no-writes,allow-cross-slot-keys
local now, want, cursor = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local out, found = {0, '0'}, 0
local index, pos = KEYS[1], 4
while index do
  local reply
  if pos == 4 then
    reply = redis.call('ZSCAN', index, cursor, 'COUNT', want)
  else
    reply = redis.pcall('ZSCAN', index, cursor, 'COUNT', want)
    if reply.err then
      return out -- another node's slot (or an error the next call, routed there, raises)
    end
  end
  local entries = reply[2]
  for j = 1, #entries, 2 do
    local score = tonumber(entries[j + 1]) or math.huge -- '+inf': re-indexed without a TTL
    if score > now then
      out[#out + 1] = entries[j]
      found = found + 1
    end
  end
  if reply[1] ~= '0' then
    out[2] = reply[1]
    return out
  end
  out[1] = out[1] + 1
  cursor = '0'
  if found >= want then
    return out
  end
  index, pos = ARGV[pos], pos + 1
end
return out`

// indexesPerCall bounds the indexes one clusterPageScript call names (store/redis.py's
// INDEXES_PER_CALL): about a millisecond of a node's time when they are empty.
const indexesPerCall = 1024

// listCluster adds to seen the live ids of every slot's deadline index, in slot order: a
// run of one node's slots per call, so a walk over an empty 3-node cluster takes about
// 16384 / indexesPerCall + 3 round trips.
func (c *Client[C]) listCluster(ctx context.Context, now int64, seen map[string]struct{}) error {
	const pageSize = 1000
	slot, cursor := 0, "0"
	for slot < clusterSlots {
		last := slot + indexesPerCall
		if last > clusterSlots {
			last = clusterSlots
		}
		args := make([]interface{}, 0, 3+last-slot-1)
		args = append(args, now, pageSize, cursor)
		for s := slot + 1; s < last; s++ {
			args = append(args, c.keys.slotIndex(s))
		}
		reply, err := c.cfg.Store.Eval(ctx, clusterPageScript, []string{c.keys.slotIndex(slot)}, args...)
		if err != nil {
			return err
		}
		items, ok := reply.([]interface{})
		if !ok || len(items) < 2 {
			return fmt.Errorf("unexpected reply %T to the page script", reply)
		}
		done, _, err := replyInt(items[0])
		if err != nil {
			return err
		}
		if cursor, err = replyText(items[1]); err != nil {
			return err
		}
		if done == 0 && cursor == "0" {
			return fmt.Errorf("the page script made no progress at slot %d", slot)
		}
		for _, item := range items[2:] {
			id, err := replyText(item)
			if err != nil {
				return err
			}
			seen[id] = struct{}{}
		}
		slot += int(done)
	}
	return nil
}
