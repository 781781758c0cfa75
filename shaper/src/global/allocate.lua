-- shaper: one host's share of a global limit (EVALSHA, one call per class, host, interval).
-- KEYS[1]  the class's hosts: field ".epoch" (when this state began, ms), ".filled" (the
--          last fill, ms) and one "h:HOST" per live host: "DEMAND CURRENT AT_MS" (bit/s,
--          bit/s, Redis TIME in ms).
-- KEYS[2]  the last fill's shares: field HOST -> bit/s, ".hosts" -> live hosts. Same hash
--          tag as KEYS[1], so a Redis Cluster keeps both in one slot.
-- KEYS[1]..":limits"  the published limits (same hash tag; read, never written, and not
--          declared: Redis counts a script's declared keys as written, and the hosts' ACL
--          only lets them read this one): "limit", "floor", "interval", "headroom",
--          "version", written by `shaper global publish` with admin rights. When present
--          they replace the caller's: every host fills with the same numbers, whatever
--          its own file says or a caller sends.
-- ARGV     host, demand, current share, limit, floor (bit/s), interval (ms),
--          headroom (parts per million of the limit kept free), the calling daemon's
--          instance (chosen at its start; optional).
-- Returns  {share (bit/s), live hosts, epoch (ms), 0, limit, version, dropped, interval},
--          or {0, 0, epoch, 1, limit, version, 0, interval} when another daemon holds the
--          host id. limit, interval: what the fill used; version: the published limits'
--          (0: none, the caller's); dropped: host fields this call's fill found broken
--          and removed.
--
-- A call records its host's demand and reads its share from the last fill; the fill (all
-- hosts, O(n log n)) runs again only when it is half an interval old. So n hosts cost
-- O(n log n) per interval, not O(n^2).
local hosts_key, shares_key = KEYS[1], KEYS[2]
-- The two keys belong together: a caller cannot fill one class's hosts into another
-- class's shares.
if type(hosts_key) ~= 'string' or string.sub(hosts_key, 1, 8) ~= 'shaper:{'
    or string.sub(hosts_key, -1) ~= '}' or shares_key ~= hosts_key .. ':shares' then
  return redis.error_reply('shaper: KEYS must be shaper:{KEY} and shaper:{KEY}:shares')
end

-- A caller's arguments are checked before anything is written: a host with a bug (or
-- another client with the hosts' ACL) cannot store what would break the fill for all.
local function whole_of(text, lo, hi)
  local v = tonumber(text)
  if v and v == math.floor(v) and v >= lo and v <= hi then return v end
  return nil
end
local function whole(i, lo, hi) return whole_of(ARGV[i], lo, hi) end
local host = ARGV[1]
if type(host) ~= 'string' or #host > 64 or not string.match(host, '^[%w][%w%-_.:]*$') then
  return redis.error_reply('shaper: bad host id (1 to 64 letters, digits, -_.:, first a letter or digit)')
end
local most = 9007199254740992 -- 2^53: exact in a Lua number
local demand = whole(2, 0, most)
local current = whole(3, 0, most)
local limit = whole(4, 1, most)
local floor = limit and whole(5, 0, limit)
local interval = whole(6, 50, 10000)
local headroom = whole(7, 0, 999999)
local instance = ARGV[8] or ''
if #instance > 32 or not string.match(instance, '^%w*$') then
  return redis.error_reply('shaper: bad daemon instance')
end
if not (demand and current and limit and floor and interval and headroom) then
  return redis.error_reply('shaper: bad arguments (demand, share, limit >= 1, floor <= limit, interval 50..10000 ms, headroom < 1000000 ppm)')
end
-- Published limits, checked as the caller's are: a broken entry fails every call (loudly,
-- in every host's log) rather than fill with numbers nobody meant.
local version = 0
local limits_key = hosts_key .. ':limits'
do
  local published = redis.call('HGETALL', limits_key)
  if #published > 0 then
    local p = {}
    for i = 1, #published, 2 do p[published[i]] = published[i + 1] end
    local l = whole_of(p.limit, 1, most)
    local f = l and whole_of(p.floor, 0, l)
    local iv = whole_of(p.interval, 50, 10000)
    local h = whole_of(p.headroom, 0, 999999)
    local v = whole_of(p.version, 1, most)
    if not (l and f and iv and h and v) then
      return redis.error_reply('shaper: bad published limits in ' .. limits_key .. ' (shaper global publish writes them)')
    end
    limit, floor, interval, headroom, version = l, f, iv, h, v
  end
end
-- Hosts are forgotten after three silent intervals of the longer of the published
-- interval and the caller's: a published interval shorter than a host's own (a rolling
-- change) must not drop that host between its reports while it keeps its share.
local heard = math.max(interval, whole(6, 50, 10000))

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
-- A missing epoch is a new state: first use, or a Redis that restarted empty.
-- Stored stamps and counts are read as whole numbers in range or not at all: another
-- client with the hosts' ACL may have written `nan`, `inf`, `-1` or text there, which
-- `tonumber` takes and every comparison after it would get wrong (a `nan` fill stamp
-- stopped every fill for good).
local function stored(key, field, lo, hi)
  return whole_of(redis.call('HGET', key, field), lo, hi)
end
local epoch = stored(hosts_key, '.epoch', 0, most)
-- TIME is the wall clock: stepped back (NTP, a VM restored), an epoch or fill "in the
-- future" would hold the hosts in re-learning and stop the fills until the clock caught
-- up. Past stamps are taken as now instead.
if epoch and epoch > now then
  epoch = now - 2 * interval
  redis.call('HSET', hosts_key, '.epoch', epoch)
end
if not epoch then
  epoch = now
  redis.call('DEL', shares_key)
  redis.call('HSET', hosts_key, '.epoch', epoch)
end
-- No call for three intervals (Redis paused, a failover to a replica): every host is
-- stale, and the first to call back would find itself alone and take the whole limit
-- before the others report. That is a new state too: the hosts re-learn it.
local last = stored(hosts_key, '.filled', 0, most)
if last and now - last > 3 * heard and epoch < now - 2 * interval then
  epoch = now
  redis.call('HSET', hosts_key, '.epoch', epoch)
end
-- One daemon per host id: the field names the daemon that holds it, and another
-- daemon's call while that one reports (its stamp within 3 intervals) is refused, so
-- two hosts cloned with one id do not merge into one host that both enforce.
local held = redis.call('HGET', hosts_key, 'h:' .. host)
if held and instance ~= '' then
  local at, owner = string.match(held, '^%d+ %d+ (%d+) ?(%w*)$')
  if at and owner ~= '' and owner ~= instance and math.abs(now - tonumber(at)) <= 3 * heard then
    return {0, 0, epoch, 1, limit, version, 0, interval}
  end
end
redis.call('HSET', hosts_key, 'h:' .. host, string.format('%d %d %d %s', demand, current, now, instance))
redis.call('PEXPIRE', hosts_key, 40 * heard)

-- A host the last fill does not know yet keeps what it holds until the next fill (a
-- thousand hosts joining at once must not fill a thousand times).
local mine = stored(shares_key, host, 0, limit) or current
local filled = stored(hosts_key, '.filled', 0, most) or 0
local dropped = 0
if now - filled >= interval / 2 or filled > now then
  -- Live hosts; those silent for three intervals are forgotten.
  local fields = redis.call('HGETALL', hosts_key)
  local names, wants = {}, {}
  for i = 1, #fields, 2 do
    local field = fields[i]
    if string.sub(field, 1, 2) == 'h:' then
      local d, c, at = string.match(fields[i + 1], '^(%d+) (%d+) (%d+) ?%w*$')
      local name = string.sub(field, 3)
      -- A field that does not parse (no host of this script wrote it: its value, or a
      -- name no host id has, such as `h:.hosts`) is dropped, as a host silent for three
      -- intervals is (or stamped that far ahead: the clock stepped back; a live host is
      -- back at its next report).
      if not at or #name > 64 or not string.match(name, '^[%w][%w%-_.:]*$') then
        dropped = dropped + 1
        redis.call('HDEL', hosts_key, field)
      elseif math.abs(now - tonumber(at)) > 3 * heard then
        redis.call('HDEL', hosts_key, field)
      else
        names[#names + 1] = name
        wants[#wants + 1] = tonumber(d)
      end
    end
  end
  -- Max-min fill of the limit less the headroom: every host its floor, then the rest to
  -- the smallest demands first, each at most an equal part of what is left; any spare is
  -- spread evenly (a host may grow into it).
  local n = #names
  local budget = limit - limit * headroom / 1000000
  local base = math.min(floor, budget / n)
  local rest = budget - base * n
  local order = {}
  for i = 1, n do order[i] = i end
  table.sort(order, function(a, b) return wants[a] < wants[b] end)
  local gives = {}
  for k, i in ipairs(order) do
    local give = math.min(math.max(wants[i] - base, 0), rest / (n - k + 1))
    rest = rest - give
    gives[i] = give
  end
  redis.call('DEL', shares_key)
  -- Written in chunks: unpack() takes a few thousand values at most.
  local chunk = {'.hosts', n}
  for i = 1, n do
    local share = math.floor(base + gives[i] + rest / n)
    chunk[#chunk + 1] = names[i]
    chunk[#chunk + 1] = share
    if names[i] == host then mine = share end
    if #chunk >= 1000 then
      redis.call('HSET', shares_key, unpack(chunk))
      chunk = {}
    end
  end
  if #chunk > 0 then
    redis.call('HSET', shares_key, unpack(chunk))
  end
  redis.call('PEXPIRE', shares_key, 40 * heard)
  redis.call('HSET', hosts_key, '.filled', now)
end
local n = stored(shares_key, '.hosts', 1, most) or 1

-- While the hosts re-learn a new state (two intervals), nobody rises above what it holds:
-- those that are still to report are not counted yet.
if now - epoch < 2 * interval then
  mine = math.min(mine, current)
end
return {math.floor(mine), n, epoch, 0, limit, version, dropped, interval}
