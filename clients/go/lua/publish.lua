-- Push one message onto the queue and record, for each request it carries, a pending entry
-- in its session's entries (docs/protocol.md, "Pending records"), atomically: a load that
-- reads the entries sees every request the queue holds, and no entry exists for a message
-- that was not pushed. The request's deadline (its seq in ms + the session TTL: a save past
-- it is never applied, store/ordering.py) is how long its entry and its value live.
--
-- KEYS[1]      the queue (a list)
-- KEYS[2]      the pending index: sorted set, session id -> the latest deadline of its
--              entries (ms)
-- KEYS[3]      the pending epoch: a token that changes only when the broker lost its data
--              (all of it, or a suffix of what it accepted: see KEYS[4])
-- KEYS[4]      the pending mark (a hash): 'n', a counter every publish advances, so that a
--              broker that went back in time (a crash, or a failover to a lagging replica,
--              that lost a suffix of accepted writes) shows a mark below one a producer saw;
--              the last such loss found ('losses', 'lost_at' ms, 'lost_seen', 'lost_mark');
--              and a ring of the recent marks' tokens: field 't<mark mod 65536>' holds
--              '<mark>:<token>' (the token: ARGV[3]'s first 16 characters), so that a mark
--              the broker lost and gave again to another publish shows another token
-- KEYS[5]      the pending counts (a hash): session id -> how many requests its publishes
--              counted and settles did not spend, so that a load can tell an entry missing
--              (deleted by hand, evicted) from one settled
-- KEYS[6..]    three per request in the message, in ARGV order: its session's entries
--              (<prefix>.cq:pending-requests:<id>, a hash: request id -> "<seq> <op>"),
--              its value key (<prefix>.cq:pending-value:<n>:<id>:<request id>; unused
--              by a delete), and its session's counted requests
--              (<prefix>.cq:pending-counted:<id>, the same fields as the entries, their
--              values followed by ' <delivery tag>' when the message has one: the requests
--              the count includes, so that a settle spends only its own, once, and the
--              publish of each that owns its records, the latest: a settle of an older
--              delivery, published again since, leaves them to the newer one).
--              A staged save's value is there already (SET by the caller just before this
--              script); a plain save's value is written here.
-- ARGV[1]      the message, as LPUSH stores it; its delivery tag, when it ends with
--              '"delivery_tag":"<tag>"}}' (kombu's envelope, ours), tells this publish
--              apart from another of the same request (a republish carries a fresh tag)
-- ARGV[2]      the session TTL, ms
-- ARGV[3]      a fresh random token, the epoch if the broker has none yet
-- ARGV[4]      the producer's clock when it publishes, microseconds since the epoch
-- ARGV[5]      the most a seq may be ahead of the broker's clock, microseconds
-- ARGV[6]      the epoch this producer last saw ('' none), ARGV[7] the highest mark it
--              saw in that epoch and ARGV[8] that mark's token ('' unknown): a mark now
--              at or below ARGV[7], or the ring's slot of ARGV[7] holding that mark with
--              another token, means the broker lost that suffix, and the epoch turns to
--              ARGV[3], for every client to see (a slot holding another mark, overwritten
--              65536 publishes later or never written, tells nothing: the mark alone judges)
-- ARGV[9..]    five per request: session id, seq, op ("save" | "delete" | "staged"),
--              request id, value (save: the stored value; delete, staged: "")
-- Refused before any write, with a CQREFUSED error naming why (nothing is pushed):
-- a producer clock more than half the limit ahead of the broker's (its requests would
-- make every later request of their sessions wait or be refused), a seq more than the
-- limit ahead, a seq that is not a time or is past its deadline already (a clock behind
-- by more than the TTL), a request id already pending in its session as another request.
-- A staged save whose value is missing is refused with ERR.
-- Returns {epoch, mark, found}: the epoch, this publish's mark (its token: ARGV[3]'s first 16
-- characters), and 1 when this call found
-- the broker had gone back in time (and turned the epoch), else 0.
local ttl, limit = tonumber(ARGV[2]), tonumber(ARGV[5])
local records = (#ARGV - 8) / 5
local time = redis.call('TIME')
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local now_ms = math.floor(now_us / 1000)
local ahead = tonumber(ARGV[4]) - now_us
if ahead > limit / 2 then
  return redis.error_reply(string.format(
    "CQREFUSED clock: this producer's clock is %.1f s ahead of the broker's (at most %.1f s"
      .. ' allowed): fix its time synchronisation (NTP)', ahead / 1e6, limit / 2e6))
end
-- The first request's session's entries before this publish: whether there are any, and
-- until when (-2: none, -1: no expiry), read once, here; the writes below read those of
-- each later request (an earlier one of the message may have written them).
local first_expires
for i = 1, records do
  local a = 9 + (i - 1) * 5
  local seq = tonumber(ARGV[a + 1])
  if not string.match(ARGV[a + 1], '^%d+$') or seq < 1577836800000000 then
    return redis.error_reply('CQREFUSED seq: ' .. ARGV[a + 1] .. ' is not a time in'
      .. ' microseconds (the producer rule, docs/protocol.md)')
  elseif seq - now_us > limit then
    return redis.error_reply(string.format('CQREFUSED seq: %s is %.1f s ahead of the'
      .. " broker's clock (at most %.1f s allowed)", ARGV[a + 1], (seq - now_us) / 1e6, limit / 1e6))
  elseif math.floor(seq / 1000) + ttl <= now_ms then
    return redis.error_reply('CQREFUSED seq: ' .. ARGV[a + 1] .. ' is past its deadline'
      .. " already (more than the session TTL behind the broker's clock)")
  elseif ARGV[a + 2] == 'staged' and redis.call('EXISTS', KEYS[4 + 3 * i]) == 0 then
    return redis.error_reply('ERR staged value ' .. KEYS[4 + 3 * i] .. ' is missing')
  end
  -- A request id is its request's, in its session: one already pending (or counted, its
  -- entry gone) with another seq or op is another request's (a faulty producer reusing
  -- it), which would replace its entry and value. The same again is a retried publish that
  -- landed: harmless.
  -- (A session with no entries, as one whose worker keeps up most often has, holds none.)
  local entries_exist = true
  if i == 1 then
    first_expires = redis.call('PEXPIRETIME', KEYS[6])
    entries_exist = first_expires ~= -2
  end
  local held = entries_exist and redis.call('HGET', KEYS[3 + 3 * i], ARGV[a + 3])
    or redis.call('HGET', KEYS[5 + 3 * i], ARGV[a + 3])
  local op = ARGV[a + 2] == 'staged' and 'save' or ARGV[a + 2]
  if held and string.match(held, '^%S+ %S+') ~= ARGV[a + 1] .. ' ' .. op then
    return redis.error_reply('CQREFUSED request: id ' .. ARGV[a + 3] .. ' is pending for'
      .. ' this session as another request (' .. held .. '): request ids must be unique')
  end
end
-- The push is the script's first write: a broker at maxmemory refuses it (OOM) before
-- anything changed. Redis lets a script that has written go on past maxmemory, so a DEL
-- first would have let every later write through.
redis.call('LPUSH', KEYS[1], ARGV[1])
local epoch = redis.call('GET', KEYS[3])
-- Numbers go to redis.call as text made here with %d: a Lua number would be printed as a
-- float (%.17g) on its way, at about half the cost of a call.
-- The mark and the ring's slot of the mark this producer saw, in one read; the new mark
-- and its token, in one write (the script runs alone: as an HINCRBY would).
local found, seen, forked = 0, tonumber(ARGV[7]) or 0, false
local held = redis.call('HMGET', KEYS[4], 'n', string.format('t%d', seen % 65536))
local mark = (tonumber(held[1]) or 0) + 1
if epoch == ARGV[6] and ARGV[8] ~= '' then
  local at, token = string.match(held[2] or '', '^(%d+):(.+)$')
  forked = at == ARGV[7] and token ~= ARGV[8]
end
local n = string.format('%d', mark)
redis.call('HSET', KEYS[4], 'n', n, string.format('t%d', mark % 65536),
  n .. ':' .. string.sub(ARGV[3], 1, 16))
if not epoch then
  redis.call('SET', KEYS[3], ARGV[3])
  epoch = ARGV[3]
elseif epoch == ARGV[6] and (mark <= seen or forked) then
  -- This producer saw a higher mark in this epoch, or its mark with another token: the
  -- broker lost what came after (and gave the marks again, to publishes unaware of it).
  redis.call('SET', KEYS[3], ARGV[3])
  epoch, found = ARGV[3], 1
  redis.call('HINCRBY', KEYS[4], 'losses', 1)
  -- (lost_mark: the mark the broker went back to; -1 when the token found it: unknown)
  redis.call('HSET', KEYS[4], 'lost_at', now_ms, 'lost_seen', ARGV[7], 'lost_mark',
    mark <= seen and mark - 1 or -1)
end
-- The message's delivery tag ('' none): the last bytes of our envelope, found in O(1).
local tag, at = '', string.find(ARGV[1], '"delivery_tag":"', -96, true)
if at and string.sub(ARGV[1], -3) == '"}}' then
  tag = string.sub(ARGV[1], at + 16, -4)
end
for i = 1, records do
  local a = 9 + (i - 1) * 5
  local entries, value_key, counted = KEYS[3 + 3 * i], KEYS[4 + 3 * i], KEYS[5 + 3 * i]
  local op, deadline = ARGV[a + 2], math.floor(tonumber(ARGV[a + 1]) / 1000) + ttl
  local due_at = string.format('%d', deadline)
  if op == 'staged' then
    -- The message needs its value for as long as it may be applied.
    op = 'save'
    redis.call('PEXPIREAT', value_key, due_at)
  elseif op == 'save' then
    redis.call('SET', value_key, ARGV[a + 4], 'PXAT', due_at)
  end
  -- The session's entries: whether there are any, and until when (-2: none, -1: no expiry).
  local expires, fresh = first_expires, false
  if i > 1 then
    expires = redis.call('PEXPIRETIME', entries)
  end
  if expires == -2 then
    local due = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[a]))
    if not due or due <= now_ms then
      redis.call('HDEL', KEYS[5], ARGV[a]) -- a count left by entries that expired
      redis.call('DEL', counted)
      fresh = true -- both keys gone: the HSETs below create them, without an expiry
    end
  end
  -- Counted once: a request counted already (its entry lost, now published again) is not
  -- counted twice. Its counted field names this publish's delivery tag: the latest publish
  -- of a request owns its records (tests/model/README.md, finding 5).
  local stamp = ARGV[a + 1] .. ' ' .. op
  local owner = tag == '' and stamp or stamp .. ' ' .. tag
  if redis.call('HSET', entries, ARGV[a + 3], stamp) == 1 then
    if redis.call('HSET', counted, ARGV[a + 3], owner) == 1 then
      redis.call('HINCRBY', KEYS[5], ARGV[a], '1')
    end
  elseif redis.call('HEXISTS', counted, ARGV[a + 3]) == 1 then
    redis.call('HSET', counted, ARGV[a + 3], owner)
  end
  -- Both keys live until the latest deadline of their requests. The entries' expiry was read
  -- above; the counted requests' only moves later (GT), and GT leaves a key without one
  -- (created here) as it is, which NX sets: the likelier first, the other only when it did
  -- nothing. With no entries before, the counted requests are most often new as well (the
  -- last settle took both).
  if expires < deadline then
    redis.call('PEXPIREAT', entries, due_at)
  end
  if fresh then
    redis.call('PEXPIREAT', counted, due_at)
  else
    local first, second = 'GT', 'NX'
    if expires == -2 then
      first, second = 'NX', 'GT'
    end
    if redis.call('PEXPIREAT', counted, due_at, first) == 0 then
      redis.call('PEXPIREAT', counted, due_at, second)
    end
  end
  redis.call('ZADD', KEYS[2], 'GT', due_at, ARGV[a])
end
return {epoch, mark, found}
