-- wrk script: every request carries an `x-key` header drawn from a key distribution, so that
-- the server sees many clients instead of one. Used by scripts/bench-http.sh and
-- scripts/bench-corun.sh (KEYS=...); on its own:
--
--   KEYS=uniform:10000 wrk -t1 -c64 -d10s -s scripts/wrk-keys.lua http://127.0.0.1:3000/hello
--
-- KEYS (environment):
--   one             no header: every request is the same client (the server keys by its IP)
--   uniform:N       keys k0 .. k(N-1), each equally often, in a shuffled order
--   zipf:N          keys over N clients with Zipf weights 1/rank (s = 1): a few heavy clients
--                   and a long tail (with N = 100 000 the top key is ~8 % of requests, the
--                   top 100 ~43 %, and about half of all keys are seen in a million requests)
--
-- The requests are formatted once, in `init`, into a ring of up to 1 048 576 (a uniform
-- distribution over more keys cycles through all of them in order instead, each formatted on
-- the fly): the per-request work of wrk stays a table lookup, so that wrk is not the
-- bottleneck.

local dist = os.getenv("KEYS") or "one"
local ring, n_ring, at = {}, 0, 0
local on_the_fly = nil

local RING = 1048576

local function req(key)
  return wrk.format(nil, nil, { ["x-key"] = key })
end

function init(args)
  local kind, n = dist:match("^(%a+):(%d+)$")
  n = tonumber(n)
  -- Each wrk thread draws its own sequence.
  math.randomseed(os.time() + (tonumber(tostring({}):match("0x(%x+)"), 16) or 0) % 100000)
  if dist == "one" then
    ring[1] = wrk.format()
    n_ring = 1
  elseif kind == "uniform" and n then
    if n > RING then
      on_the_fly = n
      return
    end
    for i = 1, n do
      ring[i] = i - 1
    end
    for i = n, 2, -1 do -- Fisher-Yates
      local j = math.random(i)
      ring[i], ring[j] = ring[j], ring[i]
    end
    for i = 1, n do
      ring[i] = req("k" .. ring[i])
    end
    n_ring = n
  elseif kind == "zipf" and n then
    local cdf, total = {}, 0
    for r = 1, n do
      total = total + 1 / r
      cdf[r] = total
    end
    for i = 1, RING do
      local u = math.random() * total
      local lo, hi = 1, n
      while lo < hi do
        local mid = math.floor((lo + hi) / 2)
        if cdf[mid] < u then lo = mid + 1 else hi = mid end
      end
      ring[i] = req("z" .. (lo - 1))
    end
    n_ring = RING
  else
    error("KEYS=" .. dist .. ": use one, uniform:N or zipf:N")
  end
end

function request()
  if on_the_fly then
    local k = at
    at = (at + 1) % on_the_fly
    return req("k" .. k)
  end
  at = at % n_ring + 1
  return ring[at]
end
