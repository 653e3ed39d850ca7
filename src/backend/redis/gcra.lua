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

-- Scripts that read TIME and then write must be replicated by effects; Redis 5+ does this by
-- default, Redis 3.2 and 4 need to be asked.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local now_s, now_ns
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now_s = tonumber(t[1])
  now_ns = tonumber(t[2]) * 1000
else
  local fixed = tonumber(ARGV[1])
  now_s = math.floor(fixed / 1000000000)
  now_ns = fixed - now_s * 1000000000
end

local CLAMP = 9000000000000000000
local reply = {}

-- One decision: quotas KEYS[k0 + 1 .. k0 + n], parameters from ARGV[a0 + 1 ..].
local function decide(k0, a0, n, cost)
  local code, tat, wait, period = {}, {}, {}, {}
  local denied = false
  for i = 1, n do
    local t = tonumber(ARGV[a0 + 2 * i - 1])
    local burst = tonumber(ARGV[a0 + 2 * i])
    local tau = t * (burst - 1)
    period[i] = t
    local rel = 0
    -- pcall: a refused key fails this decision, not the whole call.
    local stored = redis.pcall('GET', KEYS[k0 + i])
    if type(stored) == 'table' and stored.err then
      for j = 1, n do
        reply[#reply + 1] = 4
        reply[#reply + 1] = 0
        reply[#reply + 1] = 0
      end
      return
    end
    if stored then
      local s, ns = string.match(stored, '^(%d+) (%d+)$')
      if s then
        rel = (tonumber(s) - now_s) * 1000000000 + (tonumber(ns) - now_ns)
      end
      if rel < 0 then
        rel = 0
      end
    end
    tat[i] = rel
    wait[i] = 0
    if cost > burst then
      code[i] = 2
      denied = true
    else
      -- The request fits when now >= TAT + (cost - 1) * T - tau.
      local w = rel + t * (cost - 1) - tau
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
      local next_tat = tat[i] + cost * period[i]
      tat[i] = next_tat
      local total = now_ns + next_tat
      local carry = math.floor(total / 1000000000)
      -- Expire the key when the bucket is full again: a missing key is a full bucket.
      redis.call('SET', KEYS[k0 + i],
        string.format('%d %d', now_s + carry, total - carry * 1000000000),
        'PX', string.format('%d', math.ceil(next_tat / 1000000)))
    end
  end

  for i = 1, n do
    reply[#reply + 1] = code[i]
    reply[#reply + 1] = math.min(tat[i], CLAMP)
    reply[#reply + 1] = math.min(wait[i], CLAMP)
  end
end

local k, a = 0, 2
for _ = 1, tonumber(ARGV[2]) do
  local n = tonumber(ARGV[a + 1])
  local cost = tonumber(ARGV[a + 2])
  decide(k, a + 2, n, cost)
  k = k + n
  a = a + 2 + 2 * n
end
return reply
