-- tollgate: GCRA for every quota of a policy, in one atomic call, all-or-nothing; several
-- decisions (of concurrent requests) may share one call.
--
-- ARGV[1]            "" to read the time from Redis TIME; otherwise a fixed time in integer
--                    nanoseconds (test hook, settable only through a hidden builder method)
-- ARGV[2]            number of policies in this call, P >= 1; then per policy p, in order:
--   n                number of quotas
--   then per quota i: emission interval (integer ns >= 1), burst (units >= 1)
-- then               number of decisions in this call, D >= 1; then per decision, in order:
--   p                its policy, 1..P (its keys are the next n_p KEYS, in order)
--   cost             cost of the request in units (>= 1)
-- KEYS               the buckets of every quota of every decision, in the order above (on a
--                    Redis Cluster a call holds one decision, whose keys share one {hash tag})
--
-- A bucket stores its theoretical arrival time (TAT) as "<unix seconds> <nanoseconds>", two
-- integers: Lua numbers are doubles, exact only up to 2^53, and nanoseconds since 1970 are
-- past that. All arithmetic below is on times relative to now, in integer nanoseconds, exact
-- while they stay under 2^53 ns (104 days); no float seconds anywhere.
--
-- Reply: three integers per quota, decision after decision:
--   code   0 allowed (units taken), 1 denied, 2 cost larger than burst (never fits),
--          3 would have allowed but another quota denied (nothing taken)
--          4 Redis refused one of the decision's keys (e.g. a key of another type): this
--            decision fails alone, having taken nothing; the others of the call go on
--   tat    the bucket's TAT after the decision, relative to now, ns (0: bucket full)
--   wait   denied only: ns until this request's cost fits

-- Library functions in locals: global lookups cost a table access each in Redis's sandbox.
local tonumber, type, floor, ceil = tonumber, type, math.floor, math.ceil
local format, match = string.format, string.match
local call, pcall_redis = redis.call, redis.pcall
local KEYS, ARGV = KEYS, ARGV

-- Scripts that read TIME and then write must be replicated by effects; Redis 5+ does this by
-- default, Redis 3.2 and 4 need to be asked.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local now_s, now_ns
if ARGV[1] == '' then
  local t = call('TIME')
  now_s = tonumber(t[1])
  now_ns = tonumber(t[2]) * 1000
else
  local fixed = tonumber(ARGV[1])
  now_s = floor(fixed / 1000000000)
  now_ns = fixed - now_s * 1000000000
end

local CLAMP = 9000000000000000000

-- Written flat, without closures and with few tables: every table and closure a call creates
-- is garbage for Redis's Lua collector, which costs more than the arithmetic.

-- The policies' quotas, parsed once per call, flat: policy p has n = q[p] quotas, whose
-- emission intervals and bursts are at[first[p] + 2 * i - 1] and at[first[p] + 2 * i].
local a = 2
local q, first, at = {}, {}, {}
local na = 0
for p = 1, tonumber(ARGV[a]) do
  local n = tonumber(ARGV[a + 1])
  q[p] = n
  first[p] = na
  for j = a + 2, a + 1 + 2 * n do
    na = na + 1
    at[na] = tonumber(ARGV[j])
  end
  a = a + 1 + 2 * n
end

-- The buckets this call has read, by key: TAT relative to now (ns), or false when Redis
-- refused the key. Decisions of one call on the same key (a hot key, a global limit) read it
-- once and see each other's updates, exactly as if they ran one after another; each bucket
-- changed is written once, at the end (dirty[1..nd]). The script is atomic, so deferring the
-- writes is invisible to every other client.
local tats, dirty = {}, {}
local nd = 0
-- Per quota of the decision being made (reused): code, TAT and wait, 3 slots per quota.
local cur = {}
local reply = {}
local nr = 0

-- Numbers by their argument string: decisions repeat the same policy indices and costs, and
-- Lua strings are interned, so a lookup is much cheaper than parsing (strtod) again.
local nums = {}

a = a + 1
local k = 0
for _ = 1, tonumber(ARGV[a]) do
  local ps, cs = ARGV[a + 1], ARGV[a + 2]
  local p, cost = nums[ps], nums[cs]
  if p == nil then
    p = tonumber(ps)
    nums[ps] = p
  end
  if cost == nil then
    cost = tonumber(cs)
    nums[cs] = cost
  end
  a = a + 2
  local n, f = q[p], first[p]
  local denied, refused = false, false
  for i = 1, n do
    local key = KEYS[k + i]
    local rel = tats[key]
    if rel == nil then
      -- pcall: a refused key fails its decisions, not the whole call.
      local stored = pcall_redis('GET', key)
      if type(stored) == 'table' and stored.err then
        rel = false
      else
        rel = 0
        if stored then
          local sec, ns = match(stored, '^(%d+) (%d+)$')
          if sec then
            rel = (tonumber(sec) - now_s) * 1000000000 + (tonumber(ns) - now_ns)
          end
          if rel < 0 then
            rel = 0
          end
        end
      end
      tats[key] = rel
    end
    if rel == false then
      refused = true
      break
    end
    local t, burst = at[f + 2 * i - 1], at[f + 2 * i]
    local c, w = 0, 0
    if cost > burst then
      c = 2
      denied = true
    else
      -- The request fits when now >= TAT + (cost - 1) * T - tau, with tau = T * (burst - 1).
      w = rel + t * (cost - burst)
      if w > 0 then
        c = 1
        denied = true
      else
        w = 0
      end
    end
    cur[3 * i - 2], cur[3 * i - 1], cur[3 * i] = c, rel, w
  end

  if refused then
    for _ = 1, n do
      reply[nr + 1], reply[nr + 2], reply[nr + 3] = 4, 0, 0
      nr = nr + 3
    end
  else
    for i = 1, n do
      local c, tat, w = cur[3 * i - 2], cur[3 * i - 1], cur[3 * i]
      if denied then
        if c == 0 then
          c = 3
        end
      else
        local key = KEYS[k + i]
        tat = tat + cost * at[f + 2 * i - 1]
        -- First change of this bucket in this call: remember to write it.
        if not dirty[key] then
          dirty[key] = true
          nd = nd + 1
          dirty[nd] = key
        end
        tats[key] = tat
      end
      if tat > CLAMP then
        tat = CLAMP
      end
      if w > CLAMP then
        w = CLAMP
      end
      reply[nr + 1], reply[nr + 2], reply[nr + 3] = c, tat, w
      nr = nr + 3
    end
  end
  k = k + n
end

-- Write each changed bucket once; it expires when it is full again (a missing key is a full
-- bucket).
for i = 1, nd do
  local key = dirty[i]
  local rel = tats[key]
  local total = now_ns + rel
  local carry = floor(total / 1000000000)
  call('SET', key, format('%d %d', now_s + carry, total - carry * 1000000000),
    'PX', format('%d', ceil(rel / 1000000)))
end
return reply
