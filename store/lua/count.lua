#!lua flags=no-writes,allow-cross-slot-keys
-- count.lua: how many sessions many deadline indexes of one node hold, live and due.
--
-- Keys come in ARGV and the script is sent to the node directly, as due.lua (see there).
-- Read-only. (A single Redis has one index: it is counted with two ZCOUNTs.)
--
-- ARGV[1]  now in ms since epoch
-- ARGV[2..] deadline indexes
--
-- Returns {live, due}: ids whose deadline is later than now, and at or before it.
local now = ARGV[1]
local live, due = 0, 0
for i = 2, #ARGV do
  live = live + redis.call('ZCOUNT', ARGV[i], '(' .. now, '+inf')
  due = due + redis.call('ZCOUNT', ARGV[i], '-inf', now)
end
return {live, due}
