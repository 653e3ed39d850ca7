-- wrk script: every request carries an `x-key` header drawn from a key distribution, so that
-- the server sees many clients instead of one. Used by scripts/bench-http.sh and
-- scripts/bench-corun.sh (KEYS=...); on its own:
--
--   KEYS=uniform:10000 wrk -t1 -c64 -d10s -s scripts/wrk-keys.lua http://127.0.0.1:3000/hello
--
-- KEYS (environment):
--   one             no header: every request is the same client (the server keys by its IP)
--   uniform:N       keys k0 .. k(N-1), each exactly once every N requests, in a scrambled
--                   order (a multiplicative permutation, different per wrk thread)
--   zipf:N          keys over N clients with Zipf weights 1/rank (s = 1): a few heavy clients
--                   and a long tail (with N = 100 000 the top key is ~8 % of requests, the
--                   top 100 ~43 %, and about 4 keys in 5 are seen in a million requests)
--
-- Each request is built when wrk asks for it: the request's text around the key is formatted
-- once, and a request is that text with its key in between (one concatenation; a zipf key
-- also costs a binary search of its weights, formatted for up to N entries in `init`). No
-- ring of pre-formatted requests: wrk runs each thread's `init` before the next thread's and
-- starts its clock after the last one, so an `init` that took seconds (a million requests
-- formatted) let the first thread send load that was counted but not timed, and a run over a
-- million keys printed about twice its true rate.

local dist = os.getenv("KEYS") or "one"
local head, tail -- a request is head .. key .. tail
local plain      -- KEYS=one: the same request every time
local uniform_n, step, offset, at = nil, 0, 0, 0
local cdf, total, zipf_n = nil, 0, 0

-- A prime larger than any N given here: coprime to N, so i -> (i * STEP + offset) % N visits
-- every key once per N requests. Products stay below 2^53 (N <= 10^7).
local STEP = 1000000007
local MAX_N = 10000000

function init(args)
  local kind, n = dist:match("^(%a+):(%d+)$")
  n = tonumber(n)
  -- Each wrk thread draws its own sequence.
  math.randomseed(os.time() + (tonumber(tostring({}):match("0x(%x+)"), 16) or 0) % 100000)
  if dist == "one" then
    plain = wrk.format()
    return
  end
  if not n or n < 1 or n > MAX_N then
    error("KEYS=" .. dist .. ": use one, uniform:N or zipf:N with 1 <= N <= " .. MAX_N)
  end
  local text = wrk.format(nil, nil, { ["x-key"] = "\1" })
  local cut = text:find("\1", 1, true)
  head, tail = text:sub(1, cut - 1), text:sub(cut + 1)
  if kind == "uniform" then
    uniform_n = n
    step = STEP % n
    offset = math.random(n) - 1
    at = math.random(n) - 1
  elseif kind == "zipf" then
    cdf, zipf_n = {}, n
    for r = 1, n do
      total = total + 1 / r
      cdf[r] = total
    end
  else
    error("KEYS=" .. dist .. ": use one, uniform:N or zipf:N")
  end
end

function request()
  if plain then
    return plain
  end
  if uniform_n then
    local k = (at * step + offset) % uniform_n
    at = (at + 1) % uniform_n
    return head .. "k" .. k .. tail
  end
  local u = math.random() * total
  local lo, hi = 1, zipf_n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cdf[mid] < u then lo = mid + 1 else hi = mid end
  end
  return head .. "z" .. (lo - 1) .. tail
end
