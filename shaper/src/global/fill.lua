-- shaper: the fill of one global key's limit over its hosts (EVALSHA by an allocator: a
-- daemon whose Redis user may run it, or `shaper global allocate`; never needed by a
-- host, whose user may only write its own report and announce itself).
-- KEYS[1]  shaper:{K}:shares  the last fill: field HOST -> share (bit/s), and ".hosts",
--          ".epoch" (when this state began, ms), ".filled" (its time, ms), ".limit",
--          ".version", ".interval" (what it used). Hosts read it, never write it.
-- KEYS[2]  shaper:{K}:hosts   a set where a host not in the last fill announces itself
--          (SADD: the one write a host makes outside its own report).
-- KEYS[1]..":limits" less ":shares": shaper:{K}:limits, the published limits (read,
--          never written, and not declared: Redis counts a script's declared keys as
--          written, and the allocator's ACL only lets it read this one).
-- Reports  shaper:{K}:r:HOST  a string "DEMAND CURRENT INSTANCE" (bit/s, bit/s, the
--          daemon's instance) that HOST writes with SET PX (three of its intervals): a
--          host's ACL lets it write that key and no other, so a report is its host's.
-- ARGV     limit, floor (bit/s), interval (ms), headroom (ppm of the limit kept free):
--          the allocator's own, used when none are published.
-- Returns  {filled (1: this call filled, 0: a fill less than half an interval old
--          stands), hosts, dropped (announcements and reports that could not be read:
--          counted by the caller), version (of the published limits, 0: none)}.
--
-- The fill (all hosts, O(n log n)) runs at most once per half interval, however many
-- allocators call: more than one may run, for availability, at no cost to the result.
local shares_key, announce_key = KEYS[1], KEYS[2]
if type(shares_key) ~= 'string' or string.sub(shares_key, 1, 8) ~= 'shaper:{'
    or string.sub(shares_key, -8) ~= '}:shares' then
  return redis.error_reply('shaper: KEYS[1] must be shaper:{KEY}:shares')
end
local prefix = string.sub(shares_key, 1, -8)
if announce_key ~= prefix .. ':hosts' then
  return redis.error_reply('shaper: KEYS must be shaper:{KEY}:shares and shaper:{KEY}:hosts of one KEY')
end
local limits_key = prefix .. ':limits'

local most = 9007199254740992 -- 2^53: exact in a Lua number
-- Whole numbers in range or nothing: `tonumber` takes `nan`, `inf` and `-1`, which every
-- comparison after it would get wrong.
local function whole_of(text, lo, hi)
  local v = tonumber(text)
  if v and v == math.floor(v) and v >= lo and v <= hi then return v end
  return nil
end
local function host_id(name)
  return type(name) == 'string' and #name <= 64 and string.match(name, '^[%w][%w%-_.:]*$') ~= nil
end

local limit = whole_of(ARGV[1], 1, most)
local floor = limit and whole_of(ARGV[2], 0, limit)
local interval = whole_of(ARGV[3], 50, 10000)
local headroom = whole_of(ARGV[4], 0, 999999)
if not (limit and floor and interval and headroom) then
  return redis.error_reply('shaper: bad arguments (limit >= 1, floor <= limit, interval 50..10000 ms, headroom < 1000000 ppm)')
end
local own_interval = interval
local version = 0
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
-- A state is forgotten after three silent intervals of the longer of the published
-- interval and the allocator's own (a rolling change).
local heard = math.max(interval, own_interval)

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local function stored(field, lo, hi)
  return whole_of(redis.call('HGET', shares_key, field), lo, hi)
end
local filled = stored('.filled', 0, most)
if filled and filled <= now and now - filled < interval / 2 then
  return {0, stored('.hosts', 0, most) or 0, 0, version}
end
-- A new state (first use, Redis restarted empty, or no fill for three intervals: every
-- allocator gone, Redis paused, a failover): the hosts re-learn it, nobody rising above
-- what it holds for two intervals, since those still to report are not counted yet.
-- The wall clock stepped back (TIME is the wall clock): an epoch "in the future" is
-- taken as two intervals ago, so the fills go on.
local epoch = stored('.epoch', 0, most)
if epoch and epoch > now then epoch = now - 2 * interval end
if not epoch or not filled or (filled < now and now - filled > 3 * heard) then
  epoch = now
end

-- The hosts: those of the last fill and those announced since. An announcement is
-- only a name: its host counts once its own report is there. At most ANNOUNCED_PER_FILL
-- announcements are taken per fill (SPOP), so one fill's work stays bounded however
-- many there are; the rest wait for the next fill, half an interval later. More
-- announcements than any class has hosts is someone flooding the set: it is dropped
-- whole (UNLINK, freed off the main thread) and counted, and the hosts still to be
-- counted announce themselves again at their next report.
local ANNOUNCED_PER_FILL = 4096
local dropped = 0
local candidates, seen = {}, {}
local fields = redis.call('HKEYS', shares_key)
for _, name in ipairs(fields) do
  if string.sub(name, 1, 1) ~= '.' and host_id(name) and not seen[name] then
    seen[name] = true
    candidates[#candidates + 1] = name
  end
end
local announced = redis.call('SCARD', announce_key)
if announced > 65536 then
  dropped = dropped + announced
  redis.call('UNLINK', announce_key)
elseif announced > 0 then
  for _, name in ipairs(redis.call('SPOP', announce_key, ANNOUNCED_PER_FILL)) do
    if not host_id(name) then
      dropped = dropped + 1
    elseif not seen[name] then
      seen[name] = true
      candidates[#candidates + 1] = name
    end
  end
end

local names, wants, holds = {}, {}, {}
for _, name in ipairs(candidates) do
  local report = redis.call('GET', prefix .. ':r:' .. name)
  if report then
    local d, c = string.match(report, '^(%d+) (%d+) ?%w*$')
    d = whole_of(d, 0, most)
    c = whole_of(c, 0, most)
    if d and c then
      names[#names + 1] = name
      wants[#wants + 1] = d
      holds[#holds + 1] = c
    else
      -- Its own host wrote it (no other user may): that host is left out, and said so.
      dropped = dropped + 1
    end
  end
  -- No report: the host was silent for three of its intervals (its report expired), or
  -- an announcement named a host that never reported.
end

-- Max-min fill of the limit less the headroom: every host its floor, then the rest to
-- the smallest demands first, each at most an equal part of what is left; any spare is
-- spread evenly (a host may grow into it).
local n = #names
redis.call('DEL', shares_key)
local meta = {'.hosts', n, '.epoch', epoch, '.filled', now, '.limit', limit,
  '.version', version, '.interval', interval}
if n > 0 then
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
  local learning = now - epoch < 2 * interval
  -- Written in chunks: unpack() takes a few thousand values at most.
  local chunk = {}
  for i = 1, n do
    local share = math.floor(base + gives[i] + rest / n)
    if learning then share = math.min(share, holds[i]) end
    chunk[#chunk + 1] = names[i]
    chunk[#chunk + 1] = share
    if #chunk >= 1000 then
      redis.call('HSET', shares_key, unpack(chunk))
      chunk = {}
    end
  end
  if #chunk > 0 then
    redis.call('HSET', shares_key, unpack(chunk))
  end
end
redis.call('HSET', shares_key, unpack(meta))
redis.call('PEXPIRE', shares_key, 40 * heard)
return {1, n, dropped, version}
