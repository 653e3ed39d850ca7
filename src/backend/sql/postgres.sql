-- tollgate: the PostgreSQL store (PostgreSQL 11+, YugabyteDB: plain PL/pgSQL, no extension).
-- A migration template, run as one batch (simple query protocol) at start-up; idempotent.
-- Placeholders, replaced textually before running:
--   {table}     the table, quoted, possibly schema-qualified: "public"."tollgate_buckets"
--   {decide}    the function, quoted likewise: "public"."tollgate_buckets_decide_2" (the
--               stored format's number ends its name: a release of another format calls its
--               own, so that instances of both can run side by side)
--   {unlogged}  empty, or "UNLOGGED " (with its trailing space)
-- No other brace appears in this file.
--
-- The semantics are those of src/backend/redis/gcra.lua (GCRA, fixed and sliding windows,
-- calendars' windows, mixed freely, every quota of a decision all-or-nothing, several
-- decisions per call seeing each other's updates) and of src/backend/window.rs (the window
-- arithmetic, and the sliding estimate in the same IEEE double operations in the same order).
--
-- One row per client key and quota:
--   k           the key's bytes (at most 512)
--   a           GCRA: the theoretical arrival time (TAT), ns since the Unix epoch;
--               fixed window: the index of the window counted (now_us / window);
--               calendar: the end of the window counted (s since the epoch);
--               sliding window: the index of the newest sub-window kept (now_us / sub-window)
--   n           fixed window, calendar: the count of window a
--   c           sliding window: the slices + 1 counts kept, oldest first, the last that of
--               sub-window a (counts of another length count as nothing); concurrent quota:
--               the leases, (id, expiry in us since the epoch) pairs. A rate quota's (GCRA,
--               fixed, sliding, calendar) c ends with the values its state was counted under
--               and the stored format: length, limit, sub-windows (0 but for sliding windows),
--               2; a calendar's "length" is its calendar's id (a changed calendar is a change
--               of values, as on Redis).
--               A row counted under other values than its quota's now is converted first
--               (the policy's OnChange strategy, as gcra.lua's `carried`); a rate quota's row
--               without them is a fresh one. A row so converted keeps the values it came
--               from (length, limit, sub-windows) between its state and its values, and
--               converts back to them as keep does (gcra.lua's `recs`).
-- Rows are named by stored format 2's keys (src/backend/remote/keys.rs: `...:2.g0`), whose
-- quota is its identity, not its values.
--   (a block: a is the Unix time in us it ends)
--   expires_us  us since the epoch after which the row is the same as no row (GCRA: the TAT,
--               rounded up, when the bucket is full again; fixed, calendar: the window's end;
--               sliding: when every count has slid out); the sweep deletes rows past it.
-- A default row (a = 0, n = 0, c = NULL, expires_us = 0) is a fresh bucket: a TAT in the past
-- (full), nothing counted. No secondary index, so that every update is HOT.
CREATE {unlogged}TABLE IF NOT EXISTS {table} (
    k bytea PRIMARY KEY CHECK (octet_length(k) <= 512),
    a bigint NOT NULL DEFAULT 0,
    n bigint NOT NULL DEFAULT 0,
    c bigint[],
    expires_us bigint NOT NULL DEFAULT 0
);

-- {decide}(keys, quotas, decisions, now_ns) -> bigint[]
--   keys       one per quota of every decision, decision after decision
--   quotas     4 numbers per key, the quota that key counts (a rate quota's kind plus 8 times
--              the policy's OnChange strategy: 0 keep, 1 reset, 2 proportional, 3 additive):
--                0, emission interval (ns >= 1), burst (>= 1), 0          GCRA
--                1, window (us >= 1), limit (>= 1), 0                     fixed window
--                2, sub-window (us >= 1), limit (>= 1), slices (>= 1)     sliding window
--                3, lease (ms >= 1), slots (>= 1), 0                      requests in flight
--                5, boundary * 2^20 + id, limit (>= 1), before * 2^32 + after
--                                              a calendar's fixed window
--                                              (src/quota/calendar.rs, numbers written per call
--                                              by the instance, src/backend/sql/mod.rs
--                                              `calendar_args`): the calendar boundary nearest
--                                              the instance's time (s since the epoch, < 2^32),
--                                              the calendar's id (20 bits), the lengths (s,
--                                              >= 1) of the windows before and after the
--                                              boundary. The window counted is the one of the
--                                              two that holds now (this function's time): it
--                                              starts at boundary - before when now is before
--                                              the boundary, else at the boundary; its index is
--                                              its end (s). Its values are (id, limit, 0). Only
--                                              integers are compared: the instance computed
--                                              every boundary (time zones, DST, month ends), so
--                                              the instance's and the database's clocks may
--                                              differ by up to half a window (11.5 hours for a
--                                              day; past that, now counts in the nearer of the
--                                              two windows)
--                4, block (us >= 1), 1, mask   a penalty, last of its decision's keys if any:
--                                              once a quota refuses (code 1), the key is
--                                              refused for `block` us (not extended meanwhile);
--                                              mask 0 for any quota, else only the j-th
--                                              quota's refusal (bit j - 1) starts it
--   decisions  4 numbers per decision: q (it uses the next q keys), cost (>= 1), arg, op:
--                0  decide; arg > 0 makes it a reservation: a GCRA quota passes when the cost
--                   fits within arg ns, and is charged as of the time the request goes on,
--                   the longest wait over the decision's GCRA quotas; a concurrent quota is
--                   checked, no slot taken
--                1  peek: answer what the decision would get, write nothing
--                2  decide, and hold a slot of each concurrent quota under the lease id arg
--                3  refund cost units taken arg us ago (a GCRA bucket never past full, a
--                   window only into the (sub-)window that counted them: a calendar's when
--                   arg is at most the time since its window started)
--                4  debit cost more units (past empty: into debt)
--                5  release the slot held under the lease id arg (none if it expired)
--              (3 to 5 are settlements: always allowed, concurrent quotas untouched by 3 and
--              4, rate quotas by 5)
--   now_ns     NULL: the database's clock (clock_timestamp(), read once the keys are locked);
--              otherwise a fixed time in ns since the epoch (tests)
-- Reply, decision after decision, quota after quota (codes: 0 allowed, 1 denied, 2 never fits:
-- cost > burst or limit, 3 had room but another quota of the decision denied; with 1, 2 or 3
-- nothing of the decision is written, and the state is reported as it stands):
--   GCRA     code, TAT after the decision relative to now (ns, 0 = full, at most 9e18)
--   fixed    code, count after the decision, us until the window's end (a calendar's too)
--   sliding  code, r = now_us mod sub-window, then the slices + 1 counts after the decision,
--            oldest first (moved on to now's sub-window)
--   concurrent  code, slots held after the decision
--   block    1 and the us left when the key is blocked (before the decision or from it), else
--            0, 0
--
-- Exactness under concurrency (any number of connections and instances, READ COMMITTED, no
-- SERIALIZABLE needed):
--   1. The first statement locks every distinct key of the call, inserting the missing ones,
--      in ascending byte order: INSERT ... ON CONFLICT DO UPDATE ... WHERE false locks each
--      conflicting row (PostgreSQL documents that "all rows will be locked when the ON
--      CONFLICT DO UPDATE action is taken", whatever the WHERE gives), and a row it inserts is
--      its own until commit. Every call locks its keys in the same (ascending) order, so two
--      calls never deadlock on each other; every lock is held until the call's transaction
--      ends.
--   2. Then the clock is read (so a call that waited for a lock decides at a time after the
--      commit it waited for: times never go backwards from one holder of a key to the next,
--      and a row the sweep deleted was expired at that time too), and the rows are read by a
--      new statement: a VOLATILE PL/pgSQL function takes a new snapshot for each statement
--      under READ COMMITTED, so the read sees every transaction committed before the locks
--      were granted, i.e. the last write of every key (nobody else can write them until this
--      transaction ends).
--   3. The decisions are made in memory and each changed row is written once; the function is
--      one statement, so (autocommit) one transaction: its writes become visible all at once,
--      at commit, which releases the locks.
--   So the calls on a key are serialized by its row lock, each deciding from the exact state
--   the previous one left: never more admitted than the quota allows.
--   Under REPEATABLE READ or SERIALIZABLE (session default) the result is still exact, but a
--   call that waited for a concurrent writer fails with a serialization error (40001) instead
--   of going on: call it in READ COMMITTED (the default). On YugabyteDB, READ COMMITTED needs
--   yb_enable_read_committed_isolation=true; under its default (snapshot) isolation the same
--   holds: exact, with retryable errors.
--   The sweep (end of file) deletes only expired rows (equal to missing ones) and skips locked
--   rows; a call waiting on a row the sweep deleted re-inserts it (ON CONFLICT retries).
--
-- A key must count the same quota in every call (the keys of different quotas differ): a row
-- is read as the quota of the key's first use in the call.
--
-- Kind 5 (calendars) came after this function's first release under this name, without a
-- change of the rows' format: a function from before it does not count calendars (it fails
-- on their numbers: integer out of range), so migrate (which replaces the function) before
-- serving calendar quotas.
CREATE OR REPLACE FUNCTION {decide}(keys bytea[], quotas bigint[], decisions bigint[], now_ns bigint)
RETURNS bigint[]
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    nk int := coalesce(cardinality(keys), 0);
    now_us bigint;
    rec record;
    cur refcursor;
    -- Per key position p: slot(p), the first position of the same key (whose entries below
    -- hold the key's state for the whole call).
    slot int[];
    -- Per slot: GCRA, the TAT relative to now (ns, >= 0); fixed, the count of now's window;
    -- sliding, the newest sub-window's index.
    st bigint[];
    -- Per slot, sliding: the sum of the counts but the oldest; off, where the counts start in
    -- cs (the m counts are cs[off + 1 .. off + m]).
    rest bigint[];
    off int[];
    cs bigint[] := ARRAY[]::bigint[];
    ncs int := 0;
    dirty boolean[];
    codes int[];
    reply bigint[] := ARRAY[]::bigint[];
    nr int := 0;
    pos int := 0;
    p int;
    s int;
    o int;
    m int;
    kind bigint;
    qa bigint;
    lim bigint;
    nq int;
    cost bigint;
    code int;
    denied boolean;
    r bigint;
    byn bigint;
    newest bigint;
    ix bigint;
    e float8;
    -- A decision's reservation: the longest wait it accepts (ns, 0 for a decision), whether
    -- it only peeks, its wait so far, a GCRA quota's wait, a state kept for a peek.
    maxw bigint;
    pk boolean;
    w bigint;
    wq bigint;
    saved bigint;
    -- The decision's op and arg (see above), and whether a quota refused it (code 1: a
    -- block starts).
    op bigint;
    arg bigint;
    refusal boolean;
    -- The quotas whose refusal starts the decision's block (0: any).
    bm bigint;
    ip int;
    -- The live leases of the call's concurrent keys: id, expiry (us), slot (0: released).
    lids bigint[] := ARRAY[]::bigint[];
    lexp bigint[] := ARRAY[]::bigint[];
    lslot int[] := ARRAY[]::int[];
    nl int := 0;
    newc bigint[];
    ex bigint;
    -- A row as read (a, n, c), converted when counted under other values; the values it was
    -- counted under (ola: length, oli: limit, osl: sub-windows), the units it used (u), the
    -- policy's OnChange strategy (stg), the count of c (nv).
    va bigint;
    vn bigint;
    vc bigint[];
    nv int;
    ola bigint;
    oli bigint;
    osl bigint;
    u float8;
    stg bigint;
    strat bigint[];
    -- A key a change converted keeps the values it was converted from (fa: length, fl:
    -- limit, fs: sub-windows), in its c between its state and its values; rf[3 * slot - 2 ..
    -- 3 * slot] each slot's, NULL for none.
    fa bigint;
    fl bigint;
    fs bigint;
    ns int;
    rf bigint[];
    -- Per key position, a calendar's window (kind 5), picked once now is known: cr, now's time
    -- into it (us, within [0, length - 1]); cl, its length (us); ce, its end (s since the
    -- epoch, the index its row keeps); cb, its start (us) while it is picked.
    cr bigint[];
    cl bigint[];
    ce bigint[];
    cb bigint;
BEGIN
    IF nk = 0 THEN
        RETURN reply;
    END IF;

    -- Each rate quota's kind carries the policy's OnChange strategy times 8: kept apart.
    FOR q IN 1 .. nk LOOP
        strat[q] := quotas[4 * q - 3] / 8;
        quotas[4 * q - 3] := quotas[4 * q - 3] % 8;
    END LOOP;

    -- 1. Lock every key of the call, ascending, inserting the missing ones (default rows).
    INSERT INTO {table} AS t (k)
    SELECT DISTINCT x FROM unnest(keys) AS x ORDER BY x
    ON CONFLICT (k) DO UPDATE SET a = t.a WHERE false;

    -- 2. Now, read after the locks (see above).
    IF now_ns IS NULL THEN
        now_us := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
        now_ns := now_us * 1000;
    ELSE
        now_us := now_ns / 1000;
    END IF;

    -- A calendar's window: of the two around the boundary, the one that holds now (the
    -- instance computed them, around its time). From here on its numbers are its values as
    -- a rate quota's (id, limit, 0), its window in cr, cl, ce.
    FOR q IN 1 .. nk LOOP
        CONTINUE WHEN quotas[4 * q - 3] <> 5;
        ce[q] := quotas[4 * q - 2] >> 20;
        cb := ce[q] * 1000000;
        IF now_us < cb THEN
            cl[q] := greatest(quotas[4 * q] >> 32, 1) * 1000000;
            cb := cb - cl[q];
        ELSE
            cl[q] := greatest(quotas[4 * q] & 4294967295, 1) * 1000000;
            ce[q] := ce[q] + cl[q] / 1000000;
        END IF;
        cr[q] := least(greatest(now_us - cb, 0), cl[q] - 1);
        quotas[4 * q - 2] := quotas[4 * q - 2] & 1048575;
        quotas[4 * q] := 0;
    END LOOP;

    -- 3. Read the rows, once per distinct key, as the state of the quota of its first use
    -- (ro: the key's position, rs: its slot). One key (the usual call): a plain lookup, half
    -- the cost of the general query.
    IF nk = 1 THEN
        OPEN cur FOR
        SELECT 1 AS ro, 1 AS rs, t.a AS ra, t.n AS rn, t.c AS rc
        FROM {table} AS t WHERE t.k = keys[1];
    ELSE
        OPEN cur FOR
        SELECT z.o::int AS ro, z.s::int AS rs, t.a AS ra, t.n AS rn, t.c AS rc
        FROM (SELECT u.o, u.x, min(u.o) OVER (PARTITION BY u.x) AS s
              FROM unnest(keys) WITH ORDINALITY AS u(x, o)) AS z
        JOIN {table} AS t ON t.k = z.x;
    END IF;
    LOOP
        FETCH cur INTO rec;
        EXIT WHEN NOT FOUND;
        slot[rec.ro] := rec.rs;
        CONTINUE WHEN rec.ro <> rec.rs;
        p := rec.ro;
        kind := quotas[4 * p - 3];
        qa := quotas[4 * p - 2];
        va := rec.ra;
        vn := rec.rn;
        vc := rec.rc;
        IF kind <= 2 OR kind = 5 THEN
            -- A rate quota's c ends with the values it was counted under and the format:
            -- length, limit, sub-windows, 2. Without them, the row is a fresh one.
            nv := coalesce(cardinality(vc), 0);
            fa := NULL;
            IF nv >= 4 AND array_lower(vc, 1) = 1 AND vc[nv] = 2 THEN
                ola := vc[nv - 3];
                oli := vc[nv - 2];
                osl := vc[nv - 1];
                vc := vc[1 : nv - 4];
                -- The state's length in c (GCRA and fixed keep theirs in a and n), and the
                -- record of a key a change converted, after it.
                ns := CASE WHEN kind = 2 THEN osl + 1 ELSE 0 END;
                IF cardinality(vc) = ns + 3 THEN
                    fa := vc[ns + 1];
                    fl := vc[ns + 2];
                    fs := vc[ns + 3];
                    vc := vc[1 : ns];
                END IF;
            ELSE
                ola := qa;
                oli := quotas[4 * p - 1];
                osl := quotas[4 * p];
                va := 0;
                vn := 0;
                vc := NULL;
            END IF;
            IF ola <> qa OR oli <> quotas[4 * p - 1] OR osl <> quotas[4 * p] THEN
                -- Counted under other values: the units it used now (gcra.lua's `carried`),
                -- converted as the strategy says (OnChange::carry), are its state under these.
                -- Converted back to the values it came from (an instance the change has not
                -- reached, or a change back), it converts as keep does (gcra.lua's `recs`).
                stg := strat[p];
                IF fa = qa AND fl = quotas[4 * p - 1] AND fs = quotas[4 * p] THEN
                    stg := 0;
                END IF;
                fa := ola;
                fl := oli;
                fs := osl;
                u := 0;
                IF kind = 0 THEN
                    IF va > now_ns THEN
                        u := (va - now_ns)::float8 / ola::float8;
                    END IF;
                ELSIF kind = 1 THEN
                    IF va = now_us / ola THEN
                        u := vn;
                    END IF;
                ELSIF kind = 5 THEN
                    -- A calendar's count, while its window (under the calendar it was counted
                    -- by: its end, a) runs.
                    IF va * 1000000 > now_us THEN
                        u := vn;
                    END IF;
                ELSIF cardinality(vc) = osl + 1 THEN
                    byn := greatest(now_us / ola - va, 0);
                    IF byn < osl + 1 THEN
                        u := vc[1 + byn]::float8 * (ola - now_us % ola)::float8 / ola::float8
                            + (SELECT coalesce(sum(x), 0) FROM unnest(vc[2 + byn : osl + 1]) AS x)::float8;
                    END IF;
                END IF;
                lim := quotas[4 * p - 1];
                IF NOT (u > 0) THEN
                    u := 0;
                END IF;
                IF stg = 1 THEN
                    u := 0;
                ELSIF stg = 2 THEN
                    u := u * lim::float8 / oli::float8;
                ELSIF stg = 3 AND lim < oli THEN
                    u := u - (oli - lim)::float8;
                END IF;
                u := least(greatest(u, 0), lim::float8);
                IF kind = 0 THEN
                    va := now_ns + floor(u * qa::float8)::bigint;
                ELSIF kind = 1 THEN
                    va := now_us / qa;
                    vn := ceil(u)::bigint;
                ELSIF kind = 5 THEN
                    va := ce[p];
                    vn := ceil(u)::bigint;
                ELSE
                    va := now_us / qa;
                    vc := array_fill(0::bigint, ARRAY[quotas[4 * p]::int]) || ceil(u)::bigint;
                END IF;
            END IF;
            IF fa IS NOT NULL THEN
                rf[3 * p - 2] := fa;
                rf[3 * p - 1] := fl;
                rf[3 * p] := fs;
            END IF;
        END IF;
        IF kind = 0 THEN
            st[p] := greatest(va - now_ns, 0);
        ELSIF kind = 1 THEN
            -- Another window's count (a past one, or a future one after a clock step back)
            -- is not this window's.
            st[p] := CASE WHEN va = now_us / qa THEN vn ELSE 0 END;
        ELSIF kind = 5 THEN
            -- Likewise a calendar's: its window is the one that ends at ce.
            st[p] := CASE WHEN va = ce[p] THEN vn ELSE 0 END;
        ELSIF kind = 3 THEN
            -- The leases still running (the expired ones are dropped).
            st[p] := 0;
            IF rec.rc IS NOT NULL AND array_lower(rec.rc, 1) = 1 THEN
                FOR i IN 1 .. cardinality(rec.rc) / 2 LOOP
                    IF rec.rc[2 * i] > now_us THEN
                        nl := nl + 1;
                        lids[nl] := rec.rc[2 * i - 1];
                        lexp[nl] := rec.rc[2 * i];
                        lslot[nl] := p;
                        st[p] := st[p] + 1;
                    END IF;
                END LOOP;
            END IF;
        ELSIF kind = 4 THEN
            -- The us left of the block.
            st[p] := greatest(rec.ra - now_us, 0);
        ELSE
            m := quotas[4 * p] + 1;
            ix := now_us / qa;
            newest := ix;
            byn := m;
            IF cardinality(vc) = m AND array_lower(vc, 1) = 1 THEN
                -- Move the counts on to now's sub-window; a stored index after now (a clock
                -- step back) is kept.
                byn := ix - va;
                IF byn <= 0 THEN
                    newest := va;
                    byn := 0;
                ELSIF byn > m THEN
                    byn := m;
                END IF;
            END IF;
            off[p] := ncs;
            IF byn = 0 THEN
                cs := cs || vc;
            ELSIF byn = m THEN
                cs := cs || array_fill(0::bigint, ARRAY[m]);
            ELSE
                cs := cs || vc[byn + 1 : m] || array_fill(0::bigint, ARRAY[byn::int]);
            END IF;
            st[p] := newest;
            rest[p] := (SELECT coalesce(sum(v), 0) FROM unnest(cs[ncs + 2 : ncs + m]) AS v);
            ncs := ncs + m;
        END IF;
    END LOOP;
    CLOSE cur;

    -- 4. The decisions, one after another.
    FOR d IN 1 .. coalesce(cardinality(decisions), 0) / 4 LOOP
        nq := decisions[4 * d - 3];
        cost := decisions[4 * d - 2];
        arg := decisions[4 * d - 1];
        op := decisions[4 * d];
        maxw := CASE WHEN op = 0 THEN arg ELSE 0 END;
        pk := op = 1;
        denied := false;
        refusal := false;
        w := 0;
        IF op >= 3 THEN
            -- A settlement: every quota as the op says, always allowed.
            FOR j IN 1 .. nq LOOP
                p := pos + j;
                s := slot[p];
                kind := quotas[4 * p - 3];
                qa := quotas[4 * p - 2];
                IF kind = 0 THEN
                    IF op = 3 THEN
                        -- Never past full: a TAT before now is a full bucket.
                        st[s] := greatest(st[s] - cost * qa, 0);
                        dirty[s] := true;
                    ELSIF op = 4 THEN
                        st[s] := st[s] + cost * qa;
                        dirty[s] := true;
                    END IF;
                    reply[nr + 1] := 0;
                    reply[nr + 2] := least(st[s], 9000000000000000000);
                    nr := nr + 2;
                ELSIF kind = 1 THEN
                    IF op = 3 THEN
                        -- Only into the window that counted the units.
                        IF (now_us - arg) / qa = now_us / qa THEN
                            st[s] := greatest(st[s] - cost, 0);
                            dirty[s] := true;
                        END IF;
                    ELSIF op = 4 THEN
                        -- A count saturates at 2^32 - 1, as on every store.
                        st[s] := least(st[s] + cost, 4294967295);
                        dirty[s] := true;
                    END IF;
                    reply[nr + 1] := 0;
                    reply[nr + 2] := st[s];
                    reply[nr + 3] := qa - now_us % qa;
                    nr := nr + 3;
                ELSIF kind = 5 THEN
                    IF op = 3 THEN
                        -- Only into the window that counted the units: taken since it started.
                        IF arg <= cr[p] THEN
                            st[s] := greatest(st[s] - cost, 0);
                            dirty[s] := true;
                        END IF;
                    ELSIF op = 4 THEN
                        st[s] := least(st[s] + cost, 4294967295);
                        dirty[s] := true;
                    END IF;
                    reply[nr + 1] := 0;
                    reply[nr + 2] := st[s];
                    reply[nr + 3] := cl[p] - cr[p];
                    nr := nr + 3;
                ELSIF kind = 2 THEN
                    m := quotas[4 * p] + 1;
                    o := off[s];
                    IF op = 3 THEN
                        -- Only into the sub-window that counted the units, if still counted.
                        ix := m - (st[s] - (now_us - arg) / qa);
                        IF ix >= 1 AND ix <= m THEN
                            ip := ix;
                            r := least(cs[o + ip], cost);
                            cs[o + ip] := cs[o + ip] - r;
                            IF ip >= 2 THEN
                                rest[s] := rest[s] - r;
                            END IF;
                            dirty[s] := true;
                        END IF;
                    ELSIF op = 4 THEN
                        r := least(cs[o + m] + cost, 4294967295) - cs[o + m];
                        cs[o + m] := cs[o + m] + r;
                        rest[s] := rest[s] + r;
                        dirty[s] := true;
                    END IF;
                    reply[nr + 1] := 0;
                    reply[nr + 2] := now_us % qa;
                    nr := nr + 2;
                    FOR y IN 1 .. m LOOP
                        reply[nr + y] := cs[o + y];
                    END LOOP;
                    nr := nr + m;
                ELSIF kind = 3 THEN
                    IF op = 5 THEN
                        FOR i IN 1 .. nl LOOP
                            IF lslot[i] = s AND lids[i] = arg THEN
                                lslot[i] := 0;
                                st[s] := st[s] - 1;
                                dirty[s] := true;
                                EXIT;
                            END IF;
                        END LOOP;
                    END IF;
                    reply[nr + 1] := 0;
                    reply[nr + 2] := st[s];
                    nr := nr + 2;
                ELSE
                    reply[nr + 1] := CASE WHEN st[s] > 0 THEN 1 ELSE 0 END;
                    reply[nr + 2] := st[s];
                    nr := nr + 2;
                END IF;
            END LOOP;
            pos := pos + nq;
            CONTINUE;
        END IF;
        -- First every quota is checked, nothing changed.
        bm := CASE WHEN quotas[4 * (pos + nq) - 3] = 4 THEN quotas[4 * (pos + nq)] ELSE 0 END;
        FOR j IN 1 .. nq LOOP
            p := pos + j;
            s := slot[p];
            kind := quotas[4 * p - 3];
            qa := quotas[4 * p - 2];
            lim := quotas[4 * p - 1];
            IF kind = 4 THEN
                -- Blocked: refused, whatever the quotas hold.
                code := CASE WHEN st[s] > 0 THEN 1 ELSE 0 END;
            ELSIF kind = 3 THEN
                -- One slot per request, whatever its cost.
                code := CASE WHEN st[s] + 1 > lim THEN 1 ELSE 0 END;
            ELSIF cost > lim THEN
                code := 2;
            ELSIF kind = 0 THEN
                -- Fits when TAT + T * (cost - burst) <= 0 (TAT relative to now); a
                -- reservation when that is at most maxw, its wait.
                wq := st[s] + qa * (cost - lim);
                code := CASE WHEN wq > maxw THEN 1 ELSE 0 END;
                IF code = 0 AND wq > w THEN
                    w := wq;
                END IF;
            ELSIF kind = 1 OR kind = 5 THEN
                code := CASE WHEN st[s] + cost > lim THEN 1 ELSE 0 END;
            ELSE
                -- E = c_oldest * (S - r) / S + rest, in doubles, in this order (window.rs).
                o := off[s];
                e := cs[o + 1]::float8 * (qa - now_us % qa)::float8 / qa::float8
                     + rest[s]::float8;
                code := CASE WHEN e + cost::float8 <= lim::float8 THEN 0 ELSE 1 END;
            END IF;
            codes[j] := code;
            IF code <> 0 THEN
                denied := true;
            END IF;
            IF code = 1 AND kind <> 4 AND (bm = 0 OR (bm >> (j - 1)) & 1 = 1) THEN
                refusal := true;
            END IF;
        END LOOP;
        -- Then, all allowed, every quota takes the cost; or, one denied, none does.
        FOR j IN 1 .. nq LOOP
            p := pos + j;
            s := slot[p];
            kind := quotas[4 * p - 3];
            qa := quotas[4 * p - 2];
            code := codes[j];
            IF kind = 4 THEN
                -- A refusal starts a block, unless one runs (a peek starts none).
                IF refusal AND st[s] = 0 AND NOT pk THEN
                    st[s] := qa;
                    dirty[s] := true;
                END IF;
                code := CASE WHEN st[s] > 0 THEN 1 ELSE 0 END;
            ELSIF denied THEN
                IF code = 0 THEN
                    code := 3;
                END IF;
            ELSIF kind = 3 THEN
                -- A slot is taken under the request's lease (op 2); otherwise only checked.
                IF op = 2 THEN
                    st[s] := st[s] + 1;
                    nl := nl + 1;
                    lids[nl] := arg;
                    lexp[nl] := now_us + qa * 1000;
                    lslot[nl] := s;
                    dirty[s] := true;
                END IF;
            ELSE
                -- A peek changes the state for its reply, and puts it back after.
                saved := st[s];
                IF kind = 0 THEN
                    -- Counted as of the time the request goes on (now for a decision).
                    st[s] := greatest(st[s], w) + cost * qa;
                ELSIF kind = 1 OR kind = 5 THEN
                    st[s] := st[s] + cost;
                ELSE
                    m := quotas[4 * p] + 1;
                    o := off[s];
                    cs[o + m] := cs[o + m] + cost;
                    rest[s] := rest[s] + cost;
                END IF;
                IF NOT pk THEN
                    dirty[s] := true;
                END IF;
            END IF;
            IF kind = 0 THEN
                reply[nr + 1] := code;
                reply[nr + 2] := least(st[s], 9000000000000000000);
                nr := nr + 2;
            ELSIF kind = 1 THEN
                reply[nr + 1] := code;
                reply[nr + 2] := st[s];
                reply[nr + 3] := qa - now_us % qa;
                nr := nr + 3;
            ELSIF kind = 5 THEN
                reply[nr + 1] := code;
                reply[nr + 2] := st[s];
                reply[nr + 3] := cl[p] - cr[p];
                nr := nr + 3;
            ELSIF kind >= 3 THEN
                reply[nr + 1] := code;
                reply[nr + 2] := st[s];
                nr := nr + 2;
            ELSE
                m := quotas[4 * p] + 1;
                o := off[s];
                reply[nr + 1] := code;
                reply[nr + 2] := now_us % qa;
                nr := nr + 2;
                FOR y IN 1 .. m LOOP
                    reply[nr + y] := cs[o + y];
                END LOOP;
                nr := nr + m;
            END IF;
            IF pk AND NOT denied AND (kind <= 2 OR kind = 5) THEN
                IF kind = 2 THEN
                    cs[o + m] := cs[o + m] - cost;
                    rest[s] := rest[s] - cost;
                ELSE
                    st[s] := saved;
                END IF;
            END IF;
        END LOOP;
        pos := pos + nq;
    END LOOP;

    -- 5. Write each changed key once, as the quota of its first use in the call. (One UPDATE
    -- per key: as fast as one UPDATE ... FROM unnest(...) for 10 keys, faster for one.)
    FOR q IN 1 .. nk LOOP
        CONTINUE WHEN dirty[q] IS NOT TRUE;
        kind := quotas[4 * q - 3];
        qa := quotas[4 * q - 2];
        -- A rate quota's values and the format, which end its c, after its record if it
        -- has one.
        newc := ARRAY[qa, quotas[4 * q - 1], quotas[4 * q], 2];
        IF rf[3 * q] IS NOT NULL THEN
            newc := ARRAY[rf[3 * q - 2], rf[3 * q - 1], rf[3 * q]] || newc;
        END IF;
        IF kind = 0 THEN
            UPDATE {table} SET a = now_ns + st[q], n = 0, c = newc,
                expires_us = (now_ns + st[q] + 999) / 1000
            WHERE k = keys[q];
        ELSIF kind = 1 THEN
            ix := now_us / qa;
            UPDATE {table} SET a = ix, n = st[q], c = newc, expires_us = (ix + 1) * qa
            WHERE k = keys[q];
        ELSIF kind = 5 THEN
            -- A calendar's window, by its end, when the row expires.
            UPDATE {table} SET a = ce[q], n = st[q], c = newc, expires_us = ce[q] * 1000000
            WHERE k = keys[q];
        ELSIF kind = 3 THEN
            -- The leases still held; the row expires with the last.
            newc := ARRAY[]::bigint[];
            ex := now_us;
            FOR i IN 1 .. nl LOOP
                IF lslot[i] = q THEN
                    newc := newc || lids[i] || lexp[i];
                    ex := greatest(ex, lexp[i]);
                END IF;
            END LOOP;
            UPDATE {table} SET a = 0, n = cardinality(newc) / 2, c = newc, expires_us = ex
            WHERE k = keys[q];
        ELSIF kind = 4 THEN
            UPDATE {table} SET a = now_us + st[q], n = 0, c = NULL, expires_us = now_us + st[q]
            WHERE k = keys[q];
        ELSE
            m := quotas[4 * q] + 1;
            o := off[q];
            UPDATE {table} SET a = st[q], n = 0, c = cs[o + 1 : o + m] || newc,
                expires_us = (st[q] + m) * qa
            WHERE k = keys[q];
        END IF;
    END LOOP;

    RETURN reply;
END
$$;

-- For the Rust side (not run by the migration):
--
-- Sweep: delete at most $1 expired rows (expired by the database's clock); rows locked by a
-- decision in flight are skipped, so the sweep never waits for nor deadlocks with one. Returns
-- the number deleted (run again while it equals $1). Sequential scan: no index on expires_us.
--   DELETE FROM {table} WHERE k IN (
--       SELECT k FROM {table}
--       WHERE expires_us < (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
--       LIMIT $1 FOR UPDATE SKIP LOCKED)
--
-- Decide ($4 NULL for the database's clock):
--   SELECT {decide}($1::bytea[], $2::bigint[], $3::bigint[], $4::bigint)
