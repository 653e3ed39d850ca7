-- tollgate: GCRA for every quota of a policy, in one atomic call, all-or-nothing; several
-- decisions (of concurrent requests) may share one call.
--
-- ARGV[1]            "" to read the time from Redis TIME; otherwise a fixed time in integer
--                    nanoseconds (test hook, settable only through a hidden builder method)
-- ARGV[2]            number of decisions in this call, D >= 1
-- then, per decision d, in order:
--   n                number of quotas (its keys are the next n KEYS, in order)
--   cost             cost of the request in units (>= 1)
--   then per quota i: emission interval (integer ns >= 1), burst (units >= 1)
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
local tonumber, floor, ceil, format, match = tonumber, math.floor, math.ceil, string.format,
  string.match
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
local reply = {}
local nr = 0

-- Numbers by their argument string: decisions of one policy repeat the same parameters, and
-- Lua strings are interned, so a lookup is cheaper than parsing again.
local numbers = {}
local function number(s)
  local v = numbers[s]
  if v == nil then
    v = tonumber(s)
    numbers[s] = v
  end
  return v
end

-- The buckets this call has read, by key: TAT relative to now (ns), or false when Redis
-- refused the key. Decisions of one call on the same key (a hot key, a global limit) read it
-- once and see each other's updates, exactly as if they ran one after another; each bucket
-- changed is written once, at the end. The script is atomic, so deferring the writes is
-- invisible to every other client.
local tats = {}
local dirty_keys = {}
local ndirty = 0

local function load(key)
  local rel = tats[key]
  if rel ~= nil then
    return rel
  end
  -- pcall: a refused key fails its decisions, not the whole call.
  local stored = pcall_redis('GET', key)
  if type(stored) == 'table' and stored.err then
    rel = false
  else
    rel = 0
    if stored then
      local s, ns = match(stored, '^(%d+) (%d+)$')
      if s then
        rel = (tonumber(s) - now_s) * 1000000000 + (tonumber(ns) - now_ns)
      end
      if rel < 0 then
        rel = 0
      end
    end
  end
  tats[key] = rel
  return rel
end

-- Per-quota scratch of the decision being made, reused by every decision of the call.
local code, tat, wait, period = {}, {}, {}, {}

-- One decision: quotas KEYS[k0 + 1 .. k0 + n], parameters from ARGV[a0 + 1 ..].
local function decide(k0, a0, n, cost)
  local denied = false
  for i = 1, n do
    local t = number(ARGV[a0 + 2 * i - 1])
    local burst = number(ARGV[a0 + 2 * i])
    period[i] = t
    local rel = load(KEYS[k0 + i])
    if rel == false then
      for _ = 1, n do
        reply[nr + 1], reply[nr + 2], reply[nr + 3] = 4, 0, 0
        nr = nr + 3
      end
      return
    end
    tat[i] = rel
    wait[i] = 0
    if cost > burst then
      code[i] = 2
      denied = true
    else
      -- The request fits when now >= TAT + (cost - 1) * T - tau, with tau = T * (burst - 1).
      local w = rel + t * (cost - burst)
      if w > 0 then
        code[i] = 1
        wait[i] = w
        denied = true
      else
        code[i] = 0
      end
    end
  end

  for i = 1, n do
    if denied then
      if code[i] == 0 then
        code[i] = 3
      end
    else
      local key = KEYS[k0 + i]
      local next_tat = tat[i] + cost * period[i]
      tat[i] = next_tat
      -- First change of this bucket in this call: remember to write it.
      if not dirty_keys[key] then
        dirty_keys[key] = true
        ndirty = ndirty + 1
        dirty_keys[ndirty] = key
      end
      tats[key] = next_tat
    end
  end

  for i = 1, n do
    local r, w = tat[i], wait[i]
    if r > CLAMP then
      r = CLAMP
    end
    if w > CLAMP then
      w = CLAMP
    end
    reply[nr + 1], reply[nr + 2], reply[nr + 3] = code[i], r, w
    nr = nr + 3
  end
end

local k, a = 0, 2
for _ = 1, tonumber(ARGV[2]) do
  local n = number(ARGV[a + 1])
  local cost = number(ARGV[a + 2])
  decide(k, a + 2, n, cost)
  k = k + n
  a = a + 2 + 2 * n
end

-- Write each changed bucket once; it expires when it is full again (a missing key is a full
-- bucket).
for i = 1, ndirty do
  local key = dirty_keys[i]
  local rel = tats[key]
  local total = now_ns + rel
  local carry = floor(total / 1000000000)
  call('SET', key, format('%d %d', now_s + carry, total - carry * 1000000000),
    'PX', format('%d', ceil(rel / 1000000)))
end
return reply
