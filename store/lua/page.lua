#!lua flags=no-writes,allow-cross-slot-keys
-- page.lua: one page of live session ids from consecutive slot indexes of one cluster node.
-- clients/go/cluster.go carries a variant of this script for a caller that routes by
-- key and knows no slot map: keep the two in step.
--
-- Keys come in ARGV and the script is sent to the node directly, as due.lua (see there):
-- every index named must be in a slot that node serves. Read-only.
--
-- ARGV[1]  now in ms since epoch: only ids whose deadline is later are live; '' for this
--          node's time (the store's clock, as load.lua's)
-- ARGV[2]  page size: stop after the index that brings the page to this many ids
-- ARGV[3]  ZSCAN cursor to resume the first index at ("0": from its start)
-- ARGV[4..] deadline indexes, in slot order
--
-- Returns {n, cursor, id...}: the first n indexes were read to their end; when cursor is not
-- "0", index n + 1 has more, from that ZSCAN cursor. Within an index, ZSCAN's guarantee
-- holds: an id present from the first page to the last is returned at least once.
local now, want, cursor = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local out, found = {0, '0'}, 0
for i = 4, #ARGV do
  local reply = redis.call('ZSCAN', ARGV[i], cursor, 'COUNT', want)
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
end
return out
