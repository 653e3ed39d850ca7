-- tollgate: every quota of a policy (GCRA, fixed window or sliding window, mixed freely) in one
-- atomic call, all-or-nothing; several decisions (of concurrent requests) may share one call.
--
-- Numbers in ARGV are lowercase hexadecimal (parsed by strtoul: decimal would go through strtod,
-- several times dearer), except ARGV[1].
-- ARGV[1]            "" to read the time from Redis TIME; "=<ns>" a time read outside the
--                    script (a server that refuses TIME in scripts: Redis's read apart, or the
--                    instances'), integer nanoseconds since the epoch, decimal; "<ns>" the
--                    same for the test hook (settable only through a hidden builder method)
-- ARGV[2]            number of policies in this call, P >= 1; then per policy p, in order:
--   n                number of quotas
--   then per quota i, four numbers "kind a b c" (the kind plus 8 times the policy's
--   OnChange strategy: 0 keep, 1 reset, 2 proportional, 3 additive):
--     0 emission burst 0      GCRA: emission interval (integer ns >= 1), burst (units >= 1)
--     1 window limit 0        fixed window: length (integer us >= 1), limit (>= 1)
--     2 slice limit slices    sliding window of `slices` (>= 1) sub-windows of `slice` us
--     3 lease slots 0         requests in flight: `slots` (>= 1), each a lease of `lease` ms
--     5 boundary limit+id<<32 lengths
--                             a calendar's fixed window (src/quota/calendar.rs): the boundary
--                             nearest the instance's time (s since the epoch), the lengths (s)
--                             of the windows before and after it (before * 2^26 + after); the
--                             window is the one of the two holding now (Redis's time), its
--                             index its end (s); the calendar's id rides above the limit's
--                             32 bits, kept as the values' length (a changed calendar is a
--                             change of values)
--     4 block 1 mask          a penalty, last if any: once a quota refuses (code 1), the key
--                             is refused for `block` us (requests meanwhile do not extend it);
--                             `mask` 0 for any quota, else only quota i's refusal (bit i - 1,
--                             i = 1..n) starts it
-- then               number of runs R >= 1; then per run, in order, "count p cost arg op":
--                    `count` decisions in a row of policy p (1..P) costing `cost` units (>= 1)
--                    each, as `op` says:
--                    0  decide; `arg` > 0 makes them reservations: a GCRA quota passes when
--                       the cost fits within `arg` ns, and is charged as of the time the
--                       decision goes on (the longest wait over its GCRA quotas); a
--                       concurrent quota is checked, no slot taken
--                    1  peek: what the decisions would get, nothing written
--                    2  decide, and hold a slot of each concurrent quota under the lease id
--                       `arg` (its hexadecimal text is the lease's member)
--                    3  refund `cost` units taken `arg` us ago: a GCRA bucket never past full,
--                       a window only into the (sub-)window that counted them
--                    4  debit `cost` more units, past empty into debt
--                    5  release the slot held under the lease id `arg` (none if it expired)
--                    (ops 3 to 5 are settlements: always allowed, concurrent quotas untouched
--                    by 3 and 4, rate quotas by 5); the decisions are those of the runs one
--                    after another, D in all, and the keys of each are the next n_p KEYS, in
--                    order
-- KEYS               one per quota of every decision, in the order above (on a Redis Cluster a
--                    call holds one decision, whose keys share one {hash tag}); during a
--                    rolling upgrade from format 1, then as many again: the key format 1
--                    gives each, in the same order (see `lk`), and the last argument is "L"
--                    (after the runs)
--
-- Time is integer: nanoseconds for GCRA, microseconds since the Unix epoch for windows (exact
-- in Lua's doubles: both stay below 2^53). No float seconds anywhere.
--
-- Storage, format 2: one string key per quota, named by the quota's identity and algorithm,
-- not its values (`2.g0`, `2.f-hourly`), binary (Redis's struct library, little-endian: no
-- number is parsed or formatted as text). Every rate quota's value is its state (below) then
-- "<dI4I4B": the values it was counted under (the quota's first three numbers above: length,
-- limit, sub-windows or 0) and the format, 2. A value counted under other values than the
-- quota's now is converted as the strategy says (see `carry`: the units it used now, a GCRA
-- debt as a count of emission intervals, a sliding window's estimate, moved into the current
-- (sub-)window) before the decision. A key so converted keeps the values it was converted
-- from ("<dI4I4", 16 bytes between its state and its values, as long as the key lives): a
-- call under those values converts it back as keep does, whatever the strategy (see `recs`).
-- A release before this record reads a value with one as nothing stored. A block's value
-- ends with the format alone.
--   GCRA     the theoretical arrival time (TAT), struct "<I4I4": unix seconds, nanoseconds
--            (nanoseconds since 1970 are past 2^53); arithmetic is on times relative to now,
--            in integer ns, exact while they stay under 2^53 ns (104 days). Expires when the
--            bucket is full.
--   fixed    "<dI4": the window index floor(now_us / window), the count; expires at the
--            window's end. A calendar's: the window's end in seconds, the count.
--   sliding  "<d" then slices + 1 times "I4": the newest sub-window's index, then the counts
--            c_oldest ... c_newest; expires when every count has slid out of the window.
--   block    "<dB": the Unix time (us) the block ends, the format; expires then.
--   concurrent  a sorted set: one member per lease (its id), scored by its expiry (ms since the
--            Unix epoch); expired leases are removed when the key is read; the key expires
--            with its newest lease.
--   A value of another length (written by someone else) counts as nothing stored.
-- Expiries are absolute (SET ... PXAT, computed from TIME) on Redis 7+: a relative PX is
-- rewritten by Redis into PXAT for replication, which costs an object per write; before
-- Redis 7 (no redis.REDIS_VERSION_NUM) and with the test hook's fixed time, relative (PX; a
-- minute longer with the test hook).
-- The window arithmetic is that of src/backend/window.rs, in the same floating-point
-- operations in the same order, so that both give the same numbers to the bit:
--   estimate   E = c_oldest * (S - r) / S + (sum of the other counts), r = now_us % S
--   passes     E + cost <= limit
--   remaining  floor(limit - E), at least 0
--   reset      0 when remaining = limit, else wait_us(remaining + 1)
--   retry      wait_us(cost) (see wait_us below)
--
-- Reply: 2 to 4 integers per quota (by algorithm), decision after decision; the codes:
--   0 allowed (units taken), 1 denied, 2 cost larger than the burst or limit (never fits; the
--   state is reported as it is), 3 would have allowed but another quota denied (nothing taken,
--   state as it is), 4 Redis refused one of the decision's keys (e.g. a key of another type):
--   this decision fails alone, having taken nothing; the others of the call go on.
--   GCRA     code, TAT after the decision relative to now (ns, 0: full); a denial's wait
--            (until the cost fits) is TAT + T * (cost - burst), computed by the caller
--   fixed    code, count after the decision, us until the window's end
--   sliding  code, remaining, reset (us), retry (denied: us until the cost fits)
--   concurrent  code, slots held after the decision
--   block    1 and the us left when the key is blocked (before the decision, or from it),
--            else 0, 0
--   (code 4: the code then zeros, as many integers as the algorithm's)

-- Library functions in locals: global lookups cost a table access each in Redis's sandbox.
local tonumber, type, floor, ceil, fmod, ipairs = tonumber, type, math.floor, math.ceil, math.fmod, ipairs
local format, rep = string.format, string.rep
local spack, sunpack, tunpack = struct.pack, struct.unpack, unpack
local call, pcall_redis = redis.call, redis.pcall
local KEYS, ARGV = KEYS, ARGV

-- Scripts that read TIME and then write must be replicated by effects; Redis 5+ does this by
-- default, Redis 3.2 and 4 need to be asked.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

-- Expiries: 'PXAT' and ms since the epoch from TIME, or 'PX' and ms from now; an expiry in
-- `delta` us from now is at base_ms + ceil((base_us + delta) / 1000) ms (see the end).
local now_s, now_ns, now_us
local px, base_ms, base_us = 'PX', 0, 0
if ARGV[1] == '' then
  local t = call('TIME')
  now_s = tonumber(t[1])
  local us = tonumber(t[2])
  now_ns = us * 1000
  now_us = now_s * 1000000 + us
  if redis.REDIS_VERSION_NUM then
    px, base_us = 'PXAT', us % 1000
    base_ms = now_s * 1000 + (us - base_us) / 1000
  end
else
  -- Split as a string: nanoseconds since 1970 are past 2^53. `=<ns>`: a time read outside
  -- the script (on a server that refuses TIME in scripts); `<ns>`: the test hook's.
  local fixed = ARGV[1]
  local given = string.sub(fixed, 1, 1) == '='
  if given then
    fixed = string.sub(fixed, 2)
  end
  local len = #fixed
  if len > 9 then
    now_s = tonumber(string.sub(fixed, 1, len - 9))
    now_ns = tonumber(string.sub(fixed, len - 8))
  else
    now_s = 0
    now_ns = tonumber(fixed)
  end
  now_us = now_s * 1000000 + floor(now_ns / 1000)
  -- The test hook's time stands still while Redis's runs on: keys live a minute of Redis's
  -- time longer, so that one does not expire between two steps of a test that are a
  -- millisecond apart in its time but more in Redis's. Every value says its own time (a
  -- window's index, a TAT, a block's end, a lease's expiry), so a key kept longer reads the
  -- same as a missing one once its time is past. A time read outside the script runs on:
  -- keys live a second longer, for the skew between the instances' clocks and Redis's.
  if given then
    base_ms = 1000
  else
    base_ms = 60000
  end
end

local now_ms = floor(now_us / 1000)
local CLAMP = 9000000000000000000
-- The largest count of a window: 2^32 - 1 on every store (counts are packed in 32 bits here
-- and in the local backend); a debit past it saturates.
local MAXC = 4294967295

-- Microseconds from now until a request of `cost` (at most `limit`) fits in a sliding window
-- whose counts are c[1..m] (oldest first, summing to `total`), `r` us into the current
-- sub-window of `s` us, if nothing else is counted meanwhile: window.rs's `wait_us`, step by
-- step. Segment j is the j-th sub-window from the current one; in it the oldest count still
-- in the window, c[j], slides out linearly, and at its end it leaves.
local function wait_us(c, m, s, r, limit, cost, total)
  local rest = total
  for j = 1, m do
    local old = c[j]
    rest = rest - old
    if rest + cost <= limit then
      local from = 0
      if j == 1 then
        from = r
      end
      if old == 0 then
        return (j - 1) * s + from - r
      end
      -- Fits at position p when old * (s - p) / s + rest + cost <= limit.
      local need = limit - cost - rest
      local p = s - need * s / old
      if p <= from then
        p = from
      else
        p = ceil(p)
      end
      -- Floating-point rounding can leave the first candidate a microsecond late (long
      -- sub-windows) or short: step back while the one before fits, then on while it does not.
      for _ = 1, 4 do
        if p > from and old * (s - (p - 1)) / s + rest + cost <= limit then
          p = p - 1
        else
          break
        end
      end
      for _ = 1, 4 do
        if p >= s or old * (s - p) / s + rest + cost <= limit then
          break
        end
        p = p + 1
      end
      if p < s then
        return (j - 1) * s + p - r
      end
    end
  end
  -- Every count has slid out.
  return m * s - r
end

-- Written flat, without closures and with few tables: every table and closure a call creates
-- is garbage for Redis's Lua collector, which costs more than the arithmetic.

-- The policies' quotas, parsed once per call, flat, in one table (every table a call makes is
-- an allocation and garbage): policy p has n = pq[2p - 1] quotas, numbered g = pq[2p] + 1 ..
-- pq[2p] + n over the call; quota g's numbers are at[8g - 7] (kind), at[8g - 6], at[8g - 5]
-- (burst or limit), at[8g - 4]; for windows, where now is in the quota's window or
-- sub-window, computed here once: at[8g - 3] = now_us mod its length (exact: fmod),
-- at[8g - 2] = the window's or sub-window's index; for sliding windows, at[8g - 1] = the
-- struct format of the stored value. (Sized for the usual one policy of one quota.)
local a = 2
local pq, at = {0, 0}, {0, 0, 0, 0, 0, 0, 0, 0}
-- The stored format this script writes (format 1 named a quota's values in its key and stored
-- none). Each rate quota's value ends with the values it was counted under and the format
-- ("<dI4I4B"), so that a quota whose values changed converts its state; a block's with the
-- format.
local FORMAT = 2
local ng = 0
for p = 1, tonumber(ARGV[a], 16) do
  local n = tonumber(ARGV[a + 1], 16)
  pq[2 * p - 1], pq[2 * p] = n, ng
  for j = a + 2, a + 1 + 4 * n, 4 do
    ng = ng + 1
    local g = 8 * ng
    local kind, len = tonumber(ARGV[j], 16), tonumber(ARGV[j + 1], 16)
    local c = tonumber(ARGV[j + 3], 16)
    local limit = tonumber(ARGV[j + 2], 16)
    -- The kind's number carries the policy's OnChange strategy times 8.
    local strategy = floor(kind / 8)
    kind = kind - 8 * strategy
    at[g - 7], at[g - 6], at[g - 5], at[g - 4], at[g] = kind, len, limit, c, strategy
    if kind == 1 or kind == 2 then
      local r = fmod(now_us, len)
      at[g - 3], at[g - 2] = r, (now_us - r) / len
      if kind == 2 then
        at[g - 1] = '<d' .. rep('I4', c + 1)
      end
    elseif kind == 5 then
      -- A calendar: the window of the two around the boundary that holds now, at[g - 1] its
      -- length (us), at[g - 2] its end (s), at[g - 3] now's time into it; its values are the
      -- calendar's id and the limit. (A time more than a window from the instance's, whose
      -- clocks differ by more than half a window, counts in the nearer of the two.)
      local id = floor(limit / 4294967296)
      local before = floor(c / 67108864)
      local b = len * 1000000
      local start, wlen = b, (c - before * 67108864) * 1000000
      if now_us < b then
        start, wlen = b - before * 1000000, before * 1000000
      end
      local r = now_us - start
      if r < 0 then
        r = 0
      elseif r >= wlen then
        r = wlen - 1
      end
      at[g - 6], at[g - 5], at[g - 4] = id, limit - id * 4294967296, 0
      at[g - 3], at[g - 2], at[g - 1] = r, (start + wlen) / 1000000, wlen
    end
  end
  a = a + 1 + 4 * n
end

-- During a rolling upgrade from format 1 (KEYS holds, after every decision's keys, the key
-- format 1 gives each, in the same order): lk[key] is format 1's key of a decision's key.
-- Its value, when there is one, is the state (format 1's values are format 2's without their
-- end, counted under the quota's values now, which named the key), and every write of the
-- key is made to it too, so that both releases keep one limit.
local lk

-- A key converted by a change of its quota's values keeps the values it came from, written
-- between its state and its own values ("<dI4I4": length, limit, sub-windows; 16 bytes): recs[key]
-- is that record, {length, limit, sub-windows}, for each key read that has one (nil: none in
-- this call). `decode` keeps the record of the value it read for `key` (none given: a value
-- of format 1, which has none).
local recs

-- Reads a quota's key (once per call): GCRA, the TAT relative to now (ns, 0 when full);
-- fixed, the count of the current window; sliding, a table c[1..m] of the m = slices + 1
-- counts moved on to the current sub-window, c[m + 1] the sum of all but the oldest, c[m + 2]
-- the newest sub-window's index. False when Redis refused the key. Values of another length
-- (written by someone else) count as nothing stored. `decode` reads a value (a string, or
-- false: nothing stored) as `load` returns it; `load` gets it (and, upgrading, format 1's).
local function decode(stored, g, kind, key)
  if kind == 4 then
    if stored and #stored == 9 then
      local left = sunpack('<d', stored) - now_us
      if left > 0 then
        return left
      end
    end
    return 0
  end
  -- A rate quota's value: its state, then (a key a change converted) the values it was
  -- converted from, then the values it was counted under and the format.
  local olen, olim, osl, ver
  if stored and #stored > 17 then
    olen, olim, osl, ver = sunpack('<dI4I4B', stored, #stored - 16)
  end
  if ver == FORMAT then
    -- The state's length: GCRA 8 bytes, fixed 12, sliding 8 + 4 * (sub-windows + 1).
    local slen = 8
    if kind == 1 or kind == 5 then
      slen = 12
    elseif kind == 2 then
      slen = 12 + 4 * osl
    end
    local flen, flim, fsl
    if #stored == slen + 33 then
      flen, flim, fsl = sunpack('<dI4I4', stored, slen + 1)
      -- From here on the value reads as one without the record.
      stored = string.sub(stored, 1, slen) .. string.sub(stored, slen + 17)
    elseif #stored ~= slen + 17 then
      stored = false
    end
    local len, lim, sl = at[8 * g - 6], at[8 * g - 5], at[8 * g - 4]
    if stored and (olen ~= len or olim ~= lim or osl ~= sl) then
      -- A key keeps the values a change converted it from: a call under them (an instance
      -- of the fleet the change has not reached, or a change back) converts it back as keep
      -- does, so that two versions serving one key in turn forgive its units once, not at
      -- every call.
      if key then
        recs = recs or {}
        recs[key] = {olen, olim, osl}
      end
      local strategy = at[8 * g]
      if flen == len and flim == lim and fsl == sl then
        strategy = 0
      end
      -- Counted under other values: the units it used now, under those values (GCRA: its
      -- debt in emission intervals; fixed: the count of the window of now; sliding: the
      -- estimate of now), converted to this quota's limit as its strategy says (0 keep, 1
      -- reset, 2 proportional, 3 additive: OnChange::carry in src/quota/change.rs, in the
      -- same floating-point operations), are its state under these, counted now. (Inline:
      -- a helper function would be a closure made on every call.)
      local units = 0
      if kind == 0 then
        local sec, ns = sunpack('<I4I4', stored)
        local rel = (sec - now_s) * 1000000000 + (ns - now_ns)
        if rel > 0 then
          units = rel / olen
        end
      elseif kind == 1 then
        local w, n = sunpack('<dI4', stored)
        local r = fmod(now_us, olen)
        if w == (now_us - r) / olen then
          units = n
        end
      elseif kind == 5 then
        -- A calendar's count, while its window (under the calendar it was counted by) runs.
        local w, n = sunpack('<dI4', stored)
        if w * 1000000 > now_us then
          units = n
        end
      elseif #stored == 8 + 4 * (osl + 1) + 17 then
        local om = osl + 1
        local v = {sunpack('<d' .. rep('I4', om), stored)}
        local r = fmod(now_us, olen)
        local by = (now_us - r) / olen - v[1]
        if by < 0 then
          by = 0
        end
        -- The counts moved on to the sub-window of now, as below: the oldest's weight, then
        -- the rest.
        local oldest, rest = 0, 0
        for y = 1, om - by do
          if y == 1 then
            oldest = v[y + 1 + by]
          else
            rest = rest + v[y + 1 + by]
          end
        end
        units = oldest * (olen - r) / olen + rest
      end
      local limit = lim
      if not (units > 0) or strategy == 1 then
        units = 0
      elseif strategy == 2 then
        units = units * limit / olim
      elseif strategy == 3 and limit < olim then
        units = units - (olim - limit)
      end
      if units < 0 then
        units = 0
      elseif units > limit then
        units = limit
      end
      if kind == 0 then
        return floor(units * at[8 * g - 6])
      elseif kind == 1 or kind == 5 then
        return ceil(units)
      end
      local m = at[8 * g - 4] + 1
      local c = {}
      for y = 1, m do
        c[y] = 0
      end
      c[m] = ceil(units)
      c[m + 1], c[m + 2] = c[m], at[8 * g - 2]
      return c
    end
    if flen and key then
      recs = recs or {}
      recs[key] = {flen, flim, fsl}
    end
  else
    stored = false
  end
  if kind == 0 then
    if stored and #stored == 25 then
      local sec, ns = sunpack('<I4I4', stored)
      local rel = (sec - now_s) * 1000000000 + (ns - now_ns)
      if rel > 0 then
        return rel
      end
    end
    return 0
  elseif kind == 1 or kind == 5 then
    if stored and #stored == 29 then
      local w, n = sunpack('<dI4', stored)
      -- Another window's count (a past one, or a future one after a clock step back, as
      -- window.rs) is not this window's.
      if w == at[8 * g - 2] then
        return n
      end
    end
    return 0
  end
  local m = at[8 * g - 4] + 1
  local now_i = at[8 * g - 2]
  local c = {}
  local newest = now_i
  if stored and #stored == 8 + 4 * m + 17 then
    -- v[1] the newest sub-window's index, v[2 .. m + 1] the counts (then struct's position).
    local v = {sunpack(at[8 * g - 1], stored)}
    -- Move the counts on to the current sub-window, as window.rs: the sub-windows that left
    -- the window are dropped, those that passed without requests count zero; a stored index
    -- after now (a clock step back) is kept.
    local by = now_i - v[1]
    if by <= 0 then
      newest = v[1]
      by = 0
    elseif by > m then
      by = m
    end
    for y = 1, m - by do
      c[y] = v[y + 1 + by]
    end
    for y = m - by + 1, m do
      c[y] = 0
    end
  else
    for y = 1, m do
      c[y] = 0
    end
  end
  local rest = 0
  for y = 2, m do
    rest = rest + c[y]
  end
  c[m + 1], c[m + 2] = rest, newest
  return c
end

local function load(key, g)
  local kind = at[8 * g - 7]
  if kind == 3 then
    -- The leases still running: the expired ones are removed first.
    if type(pcall_redis('ZREMRANGEBYSCORE', key, '-inf', now_ms)) == 'table' then
      return false
    end
    return call('ZCARD', key)
  end
  -- pcall: a refused key fails its decisions, not the whole call. A value is a string, a
  -- missing key false, an error a table.
  local stored = pcall_redis('GET', key)
  if stored and type(stored) == 'table' then
    return false
  end
  if lk then
    -- The key format 1 gives the quota, written by instances of the release before (which
    -- write only it) and by upgrading ones (which write both). Instances of this release
    -- that do not upgrade write only format 2's. Whichever state has counted more is the
    -- one every instance's units are in (each writer's units are in the key it writes, and
    -- an upgrading one writes both): the larger, so that no step of the upgrade forgets
    -- another instance's units.
    local old = pcall_redis('GET', lk[key])
    if type(old) == 'string' then
      local len = 8
      if kind == 1 or kind == 5 then
        len = 12
      elseif kind == 2 then
        len = 8 + 4 * (at[8 * g - 4] + 1)
      end
      if #old == len and kind == 4 then
        old = old .. spack('B', FORMAT)
      elseif #old == len then
        old = old .. spack('<dI4I4B', at[8 * g - 6], at[8 * g - 5], at[8 * g - 4], FORMAT)
      else
        old = false
      end
      if old then
        local new, was = decode(stored, g, kind, key), decode(old, g, kind)
        if kind == 2 then
          -- Sliding: the state with more units in its window (c[1] the oldest, c[m + 1] the
          -- rest).
          local m = at[8 * g - 4] + 1
          if was[1] + was[m + 1] > new[1] + new[m + 1] then
            return was
          end
          return new
        elseif was > new then
          return was
        end
        return new
      end
    end
  end
  return decode(stored, g, kind, key)
end

-- The quotas' states this call has read, by key (see `load`). Decisions of one call on the same
-- key (a hot key, a global limit) read it once and see each other's updates, exactly as if they
-- ran one after another; each key changed is written once, at the end (dq: each key changed,
-- with its quota). The script is atomic, so deferring the writes is invisible to every other
-- client.
local states, dq = {}, {}
-- Per quota of the decision being made (reused): its code.
local cur = {}
local reply = {}
local nr = 0
-- The length of a quota's reply when its key holds another type (code 4, then zeros), by kind.
local WRONG = {[0] = 2, 3, 4, 2, 2, 3}
-- The leases each concurrent key takes in this call, written at the end with its other
-- changes (adds[key]: the members); made only when a slot is taken. (No helper functions here:
-- each would be a closure made on every call, garbage for the collector.)
local adds

a = a + 1
if ARGV[#ARGV] == 'L' then
  -- The second half of KEYS is format 1's (see `lk`).
  local nd = #KEYS / 2
  lk = {}
  for j = 1, nd do
    lk[KEYS[j]] = KEYS[nd + j]
  end
end
local k = 0
for _ = 1, tonumber(ARGV[a], 16) do
  local count, p, cost = tonumber(ARGV[a + 1], 16), tonumber(ARGV[a + 2], 16), tonumber(ARGV[a + 3], 16)
  local arg, op = ARGV[a + 4], ARGV[a + 5]
  local maxw, peek, lease = 0, op == '1', nil
  if op == '0' then
    maxw = tonumber(arg, 16)
  elseif op == '2' or op == '5' then
    lease = arg
  end
  a = a + 5
  local n, f = pq[2 * p - 1], pq[2 * p]
  local g1 = f + 1
  if op == '3' or op == '4' or op == '5' then
    -- Settlements: every quota as the op says, always allowed, nothing refused.
    local ago = 0
    if op == '3' then
      ago = tonumber(arg, 16)
    end
    for _ = 1, count do
      for i = 1, n do
        local key, g = KEYS[k + i], f + i
        local st = states[key]
        if st == nil then
          st = load(key, g)
          states[key] = st
        end
        local kind = at[8 * g - 7]
        if st == false then
          for z = 1, WRONG[kind] do
            reply[nr + z] = z == 1 and 4 or 0
          end
          nr = nr + WRONG[kind]
        elseif kind == 0 then
          local step = cost * at[8 * g - 6]
          if op == '3' then
            -- Never past full: a TAT before now is a full bucket.
            st = st - step
            if st < 0 then
              st = 0
            end
            dq[key] = g
          elseif op == '4' then
            st = st + step
            dq[key] = g
          end
          states[key] = st
          local tat = st
          if tat > CLAMP then
            tat = CLAMP
          end
          reply[nr + 1], reply[nr + 2] = 0, tat
          nr = nr + 2
        elseif kind == 1 or kind == 5 then
          local len = at[8 * g - 6]
          if kind == 5 then
            len = at[8 * g - 1]
          end
          if op == '3' then
            -- Only into the window that counted the units (a calendar's: taken since it
            -- started).
            if (kind == 5 and ago <= at[8 * g - 3])
              or (kind == 1 and floor((now_us - ago) / len) == at[8 * g - 2]) then
              st = st - cost
              if st < 0 then
                st = 0
              end
              dq[key] = g
            end
          elseif op == '4' then
            -- A count saturates at 2^32 - 1, as on every store (it is packed in 32 bits).
            st = st + cost
            if st > MAXC then
              st = MAXC
            end
            dq[key] = g
          end
          states[key] = st
          reply[nr + 1], reply[nr + 2], reply[nr + 3] = 0, st, len - at[8 * g - 3]
          nr = nr + 3
        elseif kind == 2 then
          local m = at[8 * g - 4] + 1
          if op == '3' then
            -- Only into the sub-window that counted the units, if still in the window.
            local pos = m - (st[m + 2] - floor((now_us - ago) / at[8 * g - 6]))
            if pos >= 1 and pos <= m then
              local old = st[pos]
              local new = old - cost
              if new < 0 then
                new = 0
              end
              st[pos] = new
              if pos >= 2 then
                st[m + 1] = st[m + 1] - (old - new)
              end
              dq[key] = g
            end
          elseif op == '4' then
            local new = st[m] + cost
            if new > MAXC then
              new = MAXC
            end
            st[m + 1] = st[m + 1] + (new - st[m])
            st[m] = new
            dq[key] = g
          end
          do
            local s, m, r, limit = at[8 * g - 6], at[8 * g - 4] + 1, at[8 * g - 3], at[8 * g - 5]
            local rest = st[m + 1]
            local remaining = floor(limit - (st[1] * (s - r) / s + rest))
            if remaining <= 0 then
              remaining = 0
            end
            local reset = 0
            if remaining < limit then
              reset = wait_us(st, m, s, r, limit, remaining + 1, st[1] + rest)
            end
            -- A settlement is never refused: no wait to report.
            reply[nr + 1], reply[nr + 2], reply[nr + 3], reply[nr + 4] = 0, remaining, reset, 0
            nr = nr + 4
          end
        elseif kind == 4 then
          local c = 0
          if st > 0 then
            c = 1
          end
          reply[nr + 1], reply[nr + 2] = c, st
          nr = nr + 2
        else
          if op == '5' and call('ZREM', key, lease) == 1 then
            st = st - 1
            states[key] = st
          end
          reply[nr + 1], reply[nr + 2] = 0, st
          nr = nr + 2
        end
      end
      k = k + n
    end
    count = 0
  elseif n == 1 and at[8 * g1 - 7] == 0 then
    -- One GCRA quota (the usual policy): the same decision as below, with the quota's
    -- numbers for this cost worked out once per run. Fits when TAT + T * (cost - burst) <= 0.
    local t, burst = at[8 * g1 - 6], at[8 * g1 - 5]
    local never, tol, step = cost > burst, t * (cost - burst), cost * t
    for _ = 1, count do
      k = k + 1
      local key = KEYS[k]
      local st = states[key]
      if st == nil then
        st = load(key, g1)
        states[key] = st
      end
      if st == false then
        reply[nr + 1], reply[nr + 2] = 4, 0
      else
        local c = 0
        if never then
          c = 2
        elseif st + tol > maxw then
          c = 1
        elseif peek then
          -- What the decision would leave, written nowhere.
          st = st + step
        else
          -- A reservation's wait, st + tol, is never more than st: the same update.
          st = st + step
          states[key] = st
          dq[key] = g1
        end
        if st > CLAMP then
          reply[nr + 1], reply[nr + 2] = c, CLAMP
        else
          reply[nr + 1], reply[nr + 2] = c, st
        end
      end
      nr = nr + 2
    end
    count = 0
  end
  -- The quotas whose refusal starts a block: the block's mask (0: any).
  local bm = 0
  if at[8 * (f + n) - 7] == 4 then
    bm = at[8 * (f + n) - 4]
  end
  for _ = 1, count do
    -- `refusal`: a quota refused the request (code 1), which starts a block.
    local denied, refused, refusal = false, false, false
    -- The wait of a reservation: the longest over its GCRA quotas (0 for a decision).
    local w = 0
    -- First every quota is checked, nothing written.
    for i = 1, n do
      local key = KEYS[k + i]
      local g = f + i
      local st = states[key]
      if st == nil then
        st = load(key, g)
        states[key] = st
      end
      if st == false then
        refused = true
        break
      end
      local kind, limit = at[8 * g - 7], at[8 * g - 5]
      local c = 0
      if kind == 4 then
        -- Blocked: refused, whatever the quotas hold.
        if st > 0 then
          c = 1
          denied = true
        end
      elseif kind == 3 then
        -- One slot per request, whatever its cost.
        if st + 1 > limit then
          c = 1
          denied = true
        end
      elseif cost > limit then
        c = 2
        denied = true
      elseif kind == 0 then
        -- The request fits when now >= TAT + (cost - 1) * T - tau, with tau = T * (burst - 1);
        -- a reservation when that holds within `maxw`.
        local wq = st + at[8 * g - 6] * (cost - limit)
        if wq > maxw then
          c = 1
          denied = true
        elseif wq > w then
          w = wq
        end
      elseif kind == 1 or kind == 5 then
        if st + cost > limit then
          c = 1
          denied = true
        end
      else
        local s, m = at[8 * g - 6], at[8 * g - 4] + 1
        if st[1] * (s - at[8 * g - 3]) / s + st[m + 1] + cost > limit then
          c = 1
          denied = true
        end
      end
      cur[i] = c
      if c == 1 and kind ~= 4 and (bm == 0 or floor(bm / 2 ^ (i - 1)) % 2 == 1) then
        refusal = true
      end
    end

    if refused then
      for i = 1, n do
        local kind = at[8 * (f + i) - 7]
        for z = 1, WRONG[kind] do
          reply[nr + z] = z == 1 and 4 or 0
        end
        nr = nr + WRONG[kind]
      end
    else
      -- Then, all allowed, every quota takes the cost; or, one denied, none does.
      for i = 1, n do
        local key = KEYS[k + i]
        local g = f + i
        local c = cur[i]
        local kind, limit = at[8 * g - 7], at[8 * g - 5]
        local st = states[key]
        local undo = false
        if kind == 4 then
          -- A refusal starts a block, unless one runs (a peek starts none).
          if refusal and st == 0 and not peek then
            st = at[8 * g - 6]
            states[key] = st
            dq[key] = g
          end
          if st > 0 then
            c = 1
          else
            c = 0
          end
        elseif denied then
          if c == 0 then
            c = 3
          end
        elseif kind == 3 then
          -- A slot is taken under the request's lease (op 2); otherwise only checked.
          if lease and not peek then
            st = st + 1
            states[key] = st
            if adds == nil then
              adds = {}
            end
            local list = adds[key]
            if list == nil then
              list = {}
              adds[key] = list
            end
            list[#list + 1] = lease
            dq[key] = g
          end
        else
          if kind == 0 then
            -- Counted as of the time the request goes on (now for a decision).
            if st < w then
              st = w
            end
            st = st + cost * at[8 * g - 6]
          elseif kind == 1 or kind == 5 then
            st = st + cost
          else
            local m = at[8 * g - 4] + 1
            st[m] = st[m] + cost
            st[m + 1] = st[m + 1] + cost
            -- A peek puts the counts back once the reply is made.
            undo = peek
          end
          if not peek then
            if kind ~= 2 then
              states[key] = st
            end
            -- First change of this key in this call: remember to write it.
            dq[key] = g
          end
        end
        if kind == 3 or kind == 4 then
          reply[nr + 1], reply[nr + 2] = c, st
          nr = nr + 2
        elseif kind == 0 then
          local tat = st
          if tat > CLAMP then
            tat = CLAMP
          end
          reply[nr + 1], reply[nr + 2] = c, tat
          nr = nr + 2
        elseif kind == 1 then
          reply[nr + 1], reply[nr + 2], reply[nr + 3] = c, st, at[8 * g - 6] - at[8 * g - 3]
          nr = nr + 3
        elseif kind == 5 then
          reply[nr + 1], reply[nr + 2], reply[nr + 3] = c, st, at[8 * g - 1] - at[8 * g - 3]
          nr = nr + 3
        else
          do
            local s, m, r, limit = at[8 * g - 6], at[8 * g - 4] + 1, at[8 * g - 3], at[8 * g - 5]
            local rest = st[m + 1]
            local remaining = floor(limit - (st[1] * (s - r) / s + rest))
            if remaining <= 0 then
              remaining = 0
            end
            local reset, retry = 0, 0
            if remaining < limit then
              reset = wait_us(st, m, s, r, limit, remaining + 1, st[1] + rest)
            end
            if c == 1 then
              retry = wait_us(st, m, s, r, limit, cost, st[1] + rest)
            end
            reply[nr + 1], reply[nr + 2], reply[nr + 3], reply[nr + 4] = c, remaining, reset, retry
            nr = nr + 4
          end
          if undo then
            local m = at[8 * g - 4] + 1
            st[m] = st[m] - cost
            st[m + 1] = st[m + 1] - cost
          end
        end
      end
    end
    k = k + n
  end
end

-- Write each changed key once: a GCRA bucket expires when it is full again (a missing key is
-- a full bucket), a fixed window at its end, a sliding window once its counts have all slid
-- out (a missing key is an empty window). Expiries are whole milliseconds, rounded up, as
-- decimal strings formatted once per call for each distinct value (keys changed alike, e.g.
-- fresh ones, a fixed window's, share it).
--
-- A write Redis refuses (its memory full under `noeviction`: OOM) stops the writing. Redis
-- checks a script's memory at its first write only, so nothing of this call was written then:
-- the decisions stand as decided, and one integer more, -1, after them says that none of
-- them took anything (the caller fails those that would have, and keeps the refusals).
local expiries = {}
local refused = false
for key, g in pairs(dq) do
  local kind, len = at[8 * g - 7], at[8 * g - 6]
  local st = states[key]
  local value, ms
  if kind == 4 then
    -- The block's end; the key expires then.
    value = spack('<dB', now_us + st, FORMAT)
    ms = base_ms + ceil((base_us + st) / 1000)
  elseif kind == 3 then
    -- The leases taken, each expiring `len` ms from now; the key with the newest.
    local expiry = now_ms + len
    for _, member in ipairs(adds[key]) do
      local added = pcall_redis('ZADD', key, expiry, member)
      if type(added) == 'table' and added.err then
        refused = true
        break
      end
    end
    ms = base_ms + ceil((base_us + len * 1000) / 1000)
  elseif kind == 0 then
    -- The TAT, now + st ns, as seconds and nanoseconds; `%` is exact up to rounding of its
    -- quotient, which can only make r negative by one second.
    local total = now_ns + st
    local r = total % 1000000000
    if r < 0 then
      r = r + 1000000000
    end
    value = spack('<I4I4dI4I4B', now_s + (total - r) / 1000000000, r, len, at[8 * g - 5], 0, FORMAT)
    ms = base_ms + ceil((base_us * 1000 + st) / 1000000)
  elseif kind == 1 then
    value = spack('<dI4dI4I4B', at[8 * g - 2], st, len, at[8 * g - 5], 0, FORMAT)
    ms = base_ms + ceil((base_us + len - at[8 * g - 3]) / 1000)
  elseif kind == 5 then
    value = spack('<dI4dI4I4B', at[8 * g - 2], st, len, at[8 * g - 5], 0, FORMAT)
    ms = base_ms + ceil((base_us + at[8 * g - 1] - at[8 * g - 3]) / 1000)
  else
    local m = at[8 * g - 4] + 1
    local newest = st[m + 2]
    -- (The counts are spread last in the call: the values follow, packed apart.)
    value = spack(at[8 * g - 1], newest, tunpack(st, 1, m))
      .. spack('<dI4I4B', len, at[8 * g - 5], m - 1, FORMAT)
    ms = base_ms + ceil((base_us + (newest + m) * len - now_us) / 1000)
  end
  -- A key with a record (see `recs`) has it between its state and its values.
  if recs and (kind <= 2 or kind == 5) then
    local rec = recs[key]
    if rec then
      local slen = #value - 17
      value = string.sub(value, 1, slen) .. spack('<dI4I4', rec[1], rec[2], rec[3])
        .. string.sub(value, slen + 1)
    end
  end
  if ms < 1 then
    ms = 1
  end
  local x = expiries[ms]
  if x == nil then
    x = format('%d', ms)
    expiries[ms] = x
  end
  local written
  if refused then
    break
  elseif kind == 3 then
    if px == 'PXAT' then
      written = pcall_redis('PEXPIREAT', key, x)
    else
      written = pcall_redis('PEXPIRE', key, x)
    end
  else
    written = pcall_redis('SET', key, value, px, x)
    if lk and not (type(written) == 'table' and written.err) then
      -- Format 1's value: the state alone (a block's end; a rate quota's value less its
      -- values and its record).
      local slen = 8
      if kind ~= 4 then
        slen = #value - 17
        if recs and recs[key] then
          slen = slen - 16
        end
      end
      written = pcall_redis('SET', lk[key], string.sub(value, 1, slen), px, x)
    end
  end
  -- An error is a table with `err` (a status reply, `OK`, is one with `ok`).
  if type(written) == 'table' and written.err then
    refused = true
    break
  end
end
if refused then
  reply[nr + 1] = -1
end
return reply
