-- shaper: one host's share of a global limit (EVALSHA, one call per class, host, interval).
-- KEYS[1]  the class's hash: field ".epoch" (when this state began) and one "h:HOST" per
--          live host: "DEMAND CURRENT AT_MS" (bit/s, bit/s, Redis TIME in ms).
-- ARGV     host, demand, current share, limit, floor (bit/s), interval (ms),
--          headroom (parts per million of the limit kept free).
-- Returns  {share (bit/s), live hosts, epoch (ms)}.
local key = KEYS[1]
local host = ARGV[1]
local demand = tonumber(ARGV[2])
local current = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local floor = tonumber(ARGV[5])
local interval = tonumber(ARGV[6])
local headroom = tonumber(ARGV[7])

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
-- A missing epoch is a new state: first use, or a Redis that restarted empty.
local epoch = tonumber(redis.call('HGET', key, '.epoch'))
if not epoch then
  epoch = now
  redis.call('HSET', key, '.epoch', epoch)
end
redis.call('HSET', key, 'h:' .. host, ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. now)

-- Live hosts; those silent for three intervals are forgotten.
local fields = redis.call('HGETALL', key)
local names, wants = {}, {}
for i = 1, #fields, 2 do
  local field = fields[i]
  if string.sub(field, 1, 2) == 'h:' then
    local d, c, at = string.match(fields[i + 1], '(%S+) (%S+) (%S+)')
    if now - tonumber(at) > 3 * interval then
      redis.call('HDEL', key, field)
    else
      names[#names + 1] = string.sub(field, 3)
      wants[#wants + 1] = tonumber(d)
    end
  end
end
redis.call('PEXPIRE', key, 40 * interval)

-- Max-min fill of the limit less the headroom: every host its floor, then the rest to the
-- smallest demands first, each at most an equal part of what is left; any spare is spread
-- evenly (a host may grow into it).
local n = #names
local budget = limit - limit * headroom / 1000000
local base = math.min(floor, budget / n)
local rest = budget - base * n
local order = {}
for i = 1, n do order[i] = i end
table.sort(order, function(a, b) return wants[a] < wants[b] end)
local mine = base
for k, i in ipairs(order) do
  local give = math.min(math.max(wants[i] - base, 0), rest / (n - k + 1))
  rest = rest - give
  if names[i] == host then mine = base + give end
end
mine = mine + rest / n

-- While the hosts re-learn a new state (two intervals), nobody rises above what it holds:
-- those that are still to report are not counted yet.
if now - epoch < 2 * interval then
  mine = math.min(mine, current)
end
return {math.floor(mine), n, epoch}
