-- reserve.lua: pop up to N messages and record each as kombu's Redis QoS would, at once.
--
-- kombu's Redis transport takes one message per BRPOP, then records it in its ``unacked``
-- hash and index (``QoS.append``) in a second round trip that sends the whole message back.
-- This does both for many messages in one call, with what kombu would have written, so that
-- kombu's own restore (visibility timeout, ``restore_unacked``) finds them unchanged.
--
-- KEYS[1]  unacked hash: delivery tag -> JSON [message, exchange, routing key]
-- KEYS[2]  unacked index: sorted set of delivery tag -> the worker's time() when reserved
-- KEYS[3]  where an oversize item goes, as it was (a fresh key: one per call at most)
-- KEYS[4]  the index of kept oversize items: sorted set of their keys -> ARGV[3]
-- KEYS[5..] the queue lists, in the order kombu's BRPOP names them (priority, then queue)
-- ARGV[1]  how many messages at most (the room left in the prefetch window)
-- ARGV[2]  how many bytes at most (at least one message is taken, whatever its size)
-- ARGV[3]  the score: the worker's time(), as kombu's QoS.append takes it
-- ARGV[4]  the largest item the worker may read, bytes (0: no limit)
-- ARGV[5]  bytes of an oversize item's head and of its tail returned to the worker
--
-- Returns a flat array of triples: the index of the list it came from (1 = KEYS[5]), the
-- message as it was in the list, and the delivery tag it was recorded under. A message that
-- cannot be recorded here (not a standard JSON envelope with a plain string tag, exchange
-- and routing key) is never held in a batch: it is put back and ends the batch, or, when it
-- comes first, returned alone with "" as its tag; the worker then hands it to kombu's own
-- path, which records or refuses it as after a BRPOP. An item over ARGV[4] never reaches
-- the worker: it moves to KEYS[3] as it is, and ends the batch as the triple (list index,
-- its head and tail joined, "#" followed by its size).
local limit, budget, score = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local largest, sample = tonumber(ARGV[4]), tonumber(ARGV[5])
local out, taken, bytes = {}, 0, 0
-- What ``standard`` said of each text outside strings met in this call.
local judged = {}

-- Whether ``n`` is a JSON number as Python's json module reads it (cjson also takes 0x10,
-- 01, +1, 1., nan, inf).
local function number(n)
  local rest = string.match(n, '^%-?0(.*)$') or string.match(n, '^%-?[1-9]%d*(.*)$')
  if rest and string.sub(rest, 1, 1) == '.' then rest = string.match(rest, '^%.%d+(.*)$') end
  return rest ~= nil and (rest == '' or string.match(rest, '^[eE][%+%-]?%d+$') ~= nil)
end

local CONTROL = {'\0', '\1', '\2', '\3', '\4', '\5', '\6', '\7', '\8', '\9', '\10', '\11',
  '\12', '\13', '\14', '\15', '\16', '\17', '\18', '\19', '\20', '\21', '\22', '\23',
  '\24', '\25', '\26', '\27', '\28', '\29', '\30', '\31'}
local MAX_DEPTH = 128
-- Strings longer than LONG are left out of what cjson decodes (the body is one): each
-- becomes BLANK, a control character no real value holds (items holding one are refused).
local LONG, BLANK = 256, '\1'

-- The literals, and the numbers an envelope mostly holds (one digit), known good at once.
local PLAIN_TOKEN = {
  ['true'] = true, ['false'] = true, ['null'] = true, ['0'] = true, ['1'] = true, ['2'] = true,
  ['3'] = true, ['4'] = true, ['5'] = true, ['6'] = true, ['7'] = true, ['8'] = true, ['9'] = true}

-- Whether the scalars and nesting left between an item's strings are what Python reads.
local function standard(bare)
  -- Deeper than MAX_DEPTH takes more opening brackets than that: they are counted first,
  -- by plain searches (an envelope has a few; a pattern pass costs ~10 ns a byte), and
  -- the brackets walked only past that many.
  local opens = 0
  for _, opening in ipairs({'{', '['}) do
    local at = string.find(bare, opening, 1, true)
    while at and opens <= MAX_DEPTH do
      opens = opens + 1
      at = string.find(bare, opening, at + 1, true)
    end
  end
  if opens > MAX_DEPTH then
    local depth = 0
    for bracket in string.gmatch(bare, '[%[%]{}]') do
      depth = depth + ((bracket == '[' or bracket == '{') and 1 or -1)
      if depth > MAX_DEPTH then return false end
    end
  end
  for token in string.gmatch(bare, '[^%s%[%]{}:,]+') do
    if not PLAIN_TOKEN[token] and not number(token) then
      return false
    end
  end
  return true
end

-- The envelope, decoded by cjson with its long strings left empty, or nil when kombu's path
-- must judge the item. What cjson accepts and kombu's loads refuses must never reach the
-- unacked hash, where kombu's restore would fail on it at every pass: raw control
-- characters, numbers such as 0x10, 01, +1, 1., nan or inf, deep nesting, and objects that
-- kombu's object hook turns into types ("__type__", however spelled). Items with escapes
-- (in the headers; kombu's envelopes carry the body in base64) are decoded whole. Plain
-- (memchr) searches and one walk from quote to quote keep this cheap for large items: Lua's
-- pattern classes cost ~10 ns per byte, a large string made in Lua ~40 us.
local function typed(value)
  if type(value) ~= 'table' then return false end
  for key, inner in pairs(value) do
    if key == '__type__' or typed(inner) then return true end
  end
  return false
end

local function envelope_of(item)
  if string.find(item, '__type__', 1, true) then return nil end
  for _, byte in ipairs(CONTROL) do
    if string.find(item, byte, 1, true) then return nil end
  end
  local text = item
  local escaped = string.find(item, '\\', 1, true)
  if escaped then text = string.gsub(item, '\\.', '') end
  -- Without escapes, each string runs from one quote to the next. The skeleton is the text
  -- with each long string left empty: most items have none, and are the skeleton as they
  -- are (each piece cut and kept costs about as much as a short item's decoding).
  local outside, long, at = {}, {}, 1
  while true do
    local open = string.find(text, '"', at, true)
    outside[#outside + 1] = string.sub(text, at, (open or 0) - 1)
    if not open then break end
    local close = string.find(text, '"', open + 1, true)
    if not close then return nil end
    if close - open > LONG then
      long[#long + 1] = open
      long[#long + 1] = close
    end
    at = close + 1
  end
  -- Items of one producer share their text outside strings (their shape): judged once a call.
  local bare = table.concat(outside, ' ')
  local verdict = judged[bare]
  if verdict == nil then
    verdict = standard(bare)
    judged[bare] = verdict
  end
  if not verdict then return nil end
  local skeleton = text
  if #long > 0 and not escaped then
    local pieces, from = {}, 1
    for i = 1, #long, 2 do
      pieces[#pieces + 1] = string.sub(text, from, long[i]) .. BLANK
      from = long[i + 1]
    end
    pieces[#pieces + 1] = string.sub(text, from)
    skeleton = table.concat(pieces)
  end
  local ok, envelope = pcall(cjson.decode, escaped and item or skeleton)
  if not ok or type(envelope) ~= 'table' then return nil end
  -- (unescaped, "__type__" would have been found above)
  if escaped and typed(envelope) then return nil end
  return envelope
end

-- The tag, exchange and routing key of an envelope, or nil when kombu's path must judge it.
local function fields(item)
  local envelope = envelope_of(item)
  if not envelope then return nil end
  local properties = envelope['properties']
  if type(properties) ~= 'table' then return nil end
  local tag, info = properties['delivery_tag'], properties['delivery_info']
  -- Tags of plain characters only (kombu's are UUIDs): then the bytes Redis stores here are
  -- the ones redis-py would send for the tag kombu decodes.
  if type(tag) ~= 'string' or tag == '' or string.find(tag, '[^%w%-_.:]') then return nil end
  if type(info) ~= 'table' then return nil end
  local exchange, routing_key = info['exchange'], info['routing_key']
  if type(exchange) ~= 'string' or type(routing_key) ~= 'string' then return nil end
  if exchange == BLANK or routing_key == BLANK then return nil end
  return tag, exchange, routing_key
end

-- The item moves with one copy (SET) besides the one redis.call makes to hand it to Lua;
-- collecting at once gives that one back before the next script rather than at Lua's pace.
local function set_aside(k, item)
  local size = #item
  local head = size > 2 * sample
    and string.sub(item, 1, sample) .. string.sub(item, -sample) or item
  redis.call('SET', KEYS[3], item)
  redis.call('ZADD', KEYS[4], score, KEYS[3])
  out[#out + 1] = k - 4
  out[#out + 1] = head
  out[#out + 1] = '#' .. size
  return size
end

for k = 5, #KEYS do
  while taken < limit and bytes < budget do
    local item = redis.call('RPOP', KEYS[k])
    if not item then break end
    if largest > 0 and #item > largest then
      set_aside(k, item)
      item = nil
      collectgarbage('collect')
      return out
    end
    taken, bytes = taken + 1, bytes + #item
    local tag, exchange, routing_key = fields(item)
    if not tag then
      if taken > 1 then
        -- Back where it was, for the next read: it must not wait in a batch unrecorded.
        redis.call('RPUSH', KEYS[k], item)
        return out
      end
      return {k - 4, item, ''}
    end
    redis.call('ZADD', KEYS[2], score, tag)
    redis.call('HSET', KEYS[1], tag,
      '[' .. item .. ',' .. cjson.encode(exchange) .. ',' .. cjson.encode(routing_key) .. ']')
    out[#out + 1] = k - 4
    out[#out + 1] = item
    out[#out + 1] = tag
  end
end
return out
