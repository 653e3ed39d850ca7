-- tollgate: the MySQL / MariaDB store (MySQL 8.0.17+, MariaDB 10.6+: JSON_TABLE, CAST AS
-- DOUBLE). A migration template; idempotent.
-- Placeholders, replaced textually before running:
--   {table}   the table, quoted, possibly schema-qualified: `tollgate_buckets`
--   {decide}  the procedure, quoted likewise: `tollgate_buckets_decide_2` (the stored format's
--             number ends its name: a release of another format calls its own, so that
--             instances of both can run side by side)
-- No other brace appears in this file.
-- Statements: split the text on the lines that hold only "-- statement" and send each part
-- as one statement (no DELIMITER: the bodies hold semicolons).
--
-- The semantics are those of src/backend/redis/gcra.lua (GCRA, fixed and sliding windows,
-- calendars' windows, mixed freely, every quota of a decision all-or-nothing, several
-- decisions per call seeing each other's updates) and of src/backend/window.rs (the window
-- arithmetic, and the sliding estimate in the same IEEE double operations in the same order).
--
-- One row per client key and quota:
--   k           the key's bytes (at most 512)
--   a           GCRA: the theoretical arrival time (TAT), ns since the Unix epoch;
--               fixed window: the index of the window counted (now_us DIV window);
--               calendar: the end of the window counted (s since the epoch);
--               sliding window: the index of the newest sub-window kept (now_us DIV sub-window)
--   n           fixed window, calendar: the count of window a; sliding window: the sum of the
--               counts c
--   c           sliding window: the slices + 1 counts kept, oldest first, the last that of
--               sub-window a, decimal, comma-separated (NULL otherwise; counts of another
--               length count as nothing); concurrent quota: the leases, "id:expiry_us",
--               comma-separated (n their number). A rate quota's (GCRA, fixed, sliding,
--               calendar) c ends with ";" and the values its state was counted under and the
--               stored format: "length,limit,sub-windows,2" (sub-windows 0 but for sliding
--               windows; a calendar's "length" is its calendar's id: a changed calendar is a
--               change of values, as on Redis).
--               A row counted under other values than its quota's now is converted first
--               (the policy's OnChange strategy, as gcra.lua's `carried`); a rate quota's row
--               without them is a fresh one. A row so converted keeps the values it came
--               from, ";length,limit,sub-windows" at the end of its c, and converts back to
--               them as keep does (gcra.lua's `recs`).
-- Rows are named by stored format 2's keys (src/backend/remote/keys.rs: `...:2.g0`), whose
-- quota is its identity, not its values.
--   (a block: a is the Unix time in us it ends)
--   expires_us  us since the epoch after which the row is the same as no row (GCRA: the TAT,
--               rounded up, when the bucket is full again; fixed, calendar: the window's end;
--               sliding: when every count has slid out); the sweep deletes rows past it.
-- A default row (a = 0, n = 0, c = NULL, expires_us = 0) is a fresh bucket: a TAT in the past
-- (full), nothing counted. No secondary index.
CREATE TABLE IF NOT EXISTS {table} (
    k VARBINARY(512) NOT NULL,
    a BIGINT NOT NULL DEFAULT 0,
    n BIGINT NOT NULL DEFAULT 0,
    c VARCHAR(11100) CHARACTER SET ascii COLLATE ascii_bin NULL,
    expires_us BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (k)
) ENGINE = InnoDB
-- statement
DROP PROCEDURE IF EXISTS {decide}
-- statement
-- CALL {decide}(spec, now_ns): one result set of one row of one column, the reply.
--
-- now_ns  NULL: the database's clock (SYSDATE(6) read in UTC once the keys are locked);
--         otherwise a fixed time in ns since the epoch (tests)
-- spec    ASCII text, numbers in decimal, keys in lowercase hexadecimal (2 digits a byte):
--           spec      = keys ";" decision *( ";" decision )
--           keys      = hexkey *( "," hexkey )     every distinct key of the call, once, in
--                                                  ascending byte order (= ascending order of
--                                                  the lowercase hex strings)
--           decision  = cost "," arg "," op 1*( "|" quota )
--                                           cost >= 1; op (arg):
--                                           0  decide; arg > 0 (ns) makes it a reservation:
--                                              a GCRA quota passes when the cost fits within
--                                              it, charged as of the time the request goes
--                                              on, the longest wait of the decision's GCRA
--                                              quotas; a concurrent quota is checked only
--                                           1  peek: what the decision would get, nothing
--                                              written
--                                           2  decide, holding a slot of each concurrent
--                                              quota under the lease id arg
--                                           3  refund cost units taken arg us ago (a
--                                              window: only into the (sub-)window that
--                                              counted them; a calendar's when arg is at
--                                              most the time since its window started)
--                                           4  debit cost more units (into debt)
--                                           5  release the slot of the lease id arg
--                                           (3 to 5: settlements, always allowed, as in
--                                           gcra.lua); then the decision's quotas
--           quota     = kind "," a "," limit "," slices "," hexkey    (a rate quota's kind plus
--                       8 times the policy's OnChange strategy: 0 keep, 1 reset,
--                       2 proportional, 3 additive)
--                       0,emission ns (>= 1),burst (>= 1),0            GCRA
--                       1,window us (>= 1),limit (>= 1),0              fixed window
--                       2,sub-window us (>= 1),limit (>= 1),slices     sliding window
--                       3,lease ms (>= 1),slots (>= 1),0               requests in flight
--                       5,boundary * 2^20 + id,limit (>= 1),before * 2^32 + after
--                                                  a calendar's fixed window
--                                                  (src/quota/calendar.rs, numbers written per
--                                                  call by the instance, src/backend/sql/mod.rs
--                                                  `calendar_args`): the calendar boundary
--                                                  nearest the instance's time (s since the
--                                                  epoch, < 2^32), the calendar's id (20 bits),
--                                                  the lengths (s, >= 1) of the windows before
--                                                  and after the boundary. The window counted
--                                                  is the one of the two that holds now (this
--                                                  procedure's time): it starts at boundary -
--                                                  before when now is before the boundary, else
--                                                  at the boundary; its index is its end (s).
--                                                  Its values are "id,limit,0". Only integers
--                                                  are compared (no time zone tables): the
--                                                  instance computed every boundary (zones,
--                                                  DST, month ends), so the instance's and the
--                                                  database's clocks may differ by up to half a
--                                                  window (11.5 hours for a day; past that, now
--                                                  counts in the nearer of the two windows)
--                       4,block us (>= 1),1,mask                       a penalty, last: once
--                                                  a quota refuses (code 1), the key is
--                                                  refused for `block` us; mask 0 for any
--                                                  quota, else only the i-th quota's
--                                                  refusal (bit i - 1) starts it
--         e.g. one GCRA decision of cost 1 on key 0x6b31:  "6b31;1,0,0|0,200000000,10,0,6b31"
--         Nothing else (no spaces). A key of a quota missing from `keys` is an error (45000).
-- Reply, decimal integers separated by ",", decision after decision, quota after quota
-- (codes: 0 allowed, 1 denied, 2 never fits: cost > burst or limit, 3 had room but another
-- quota of the decision denied; with 1, 2 or 3 nothing of the decision is written, and the
-- state is reported as it stands):
--   GCRA     code, TAT after the decision relative to now (ns, 0 = full, at most 9e18)
--   fixed    code, count after the decision, us until the window's end (a calendar's too)
--   sliding  code, r = now_us mod sub-window, then the slices + 1 counts after the decision,
--            oldest first (moved on to now's sub-window)
--   concurrent  code, slots held after the decision
--   block    1 and the us left when the key is blocked (before the decision or from it), else
--            0, 0
--
-- Call it in autocommit mode, outside any transaction: the procedure sets READ COMMITTED for
-- its own transaction (SET TRANSACTION, the next transaction only, which is not allowed while
-- one is open) and runs START TRANSACTION ... COMMIT. Any error rolls back and is raised again
-- (deadlock 1213, lock wait timeout 1205: retry the call).
--
-- Exactness under concurrency (any number of connections and instances, no SERIALIZABLE):
--   1. Every distinct key of the call is locked first, in ascending byte order, inserting the
--      missing ones: INSERT ... ON DUPLICATE KEY UPDATE takes an exclusive lock on the existing
--      row (a record lock, no gap, under READ COMMITTED), and a row it inserts is its own until
--      commit. Every call locks its keys in the same (ascending) order, so two calls never
--      deadlock on each other over rows; the locks are held until COMMIT.
--   2. Then the clock is read (so a call that waited decides at a time after the commit it
--      waited for, and a row the sweep deleted was expired at that time too), and each row is
--      read with a locking read (SELECT ... FOR UPDATE: the last committed version, which only
--      lock holders write, plus this transaction's own writes).
--   3. Each changed row is written (UPDATE) before another key is read and at the end, then
--      COMMIT makes every write visible at once and releases the locks.
--   So the calls on a key are serialized by its row lock, each deciding from the exact state
--   the previous one left: never more admitted than the quota allows. (READ COMMITTED only
--   avoids the gap locks of REPEATABLE READ, which cause deadlocks between inserts of new
--   keys; exactness does not depend on it.)
--
-- A key must count the same quota in every call (the keys of different quotas differ).
--
-- Kind 5 (calendars) came after this procedure's first release under this name, without a
-- change of the rows' format: a procedure from before it does not count calendars (under a
-- strict sql_mode, the default, it fails on their numbers: 1264, out of range), so migrate
-- (which replaces a procedure whose body differs) before serving calendar quotas.
CREATE PROCEDURE {decide}(IN spec LONGTEXT CHARACTER SET ascii, IN now_ns BIGINT)
MODIFIES SQL DATA
BEGIN
    DECLARE slen, keys_end, kp, ke, pos, de, nq, i, pass, m INT;
    DECLARE dtext LONGTEXT CHARACTER SET ascii;
    DECLARE qt VARCHAR(1200) CHARACTER SET ascii;
    DECLARE hk VARCHAR(1100) CHARACTER SET ascii;
    -- The row being worked on (key ck, hex), as stored or as changed (dirty: to be written).
    DECLARE ck VARCHAR(1100) CHARACTER SET ascii DEFAULT NULL;
    DECLARE ra, rn, rexp BIGINT;
    DECLARE rc VARCHAR(11100) CHARACTER SET ascii;
    DECLARE dirty, denied TINYINT DEFAULT 0;
    DECLARE codes LONGTEXT CHARACTER SET ascii;
    DECLARE reply LONGTEXT CHARACTER SET ascii DEFAULT '';
    DECLARE tz VARCHAR(64) DEFAULT NULL;
    DECLARE now_us, kind, qa, lim, sl, cost, code, cur, r, w, ix, byn, newest, total, c1 BIGINT;
    -- A decision's reservation: the longest wait it accepts (ns, 0 for a decision), a GCRA
    -- quota's wait, the longest so far; whether it only peeks; its head "cost,mw,pk".
    DECLARE mw, wq, wx BIGINT DEFAULT 0;
    DECLARE pk TINYINT DEFAULT 0;
    DECLARE dhead VARCHAR(64);
    -- The decision's op and arg; whether a quota refused it (code 1: a block starts); the
    -- leases being filtered (li, lnum, lpart, lx, lmax, lcs) and a refund's sub-window (ip).
    DECLARE op, arg, lx, lmax, lastc, lastd BIGINT DEFAULT 0;
    DECLARE refusal TINYINT DEFAULT 0;
    -- The quotas that refused the decision (code 1), a bit each: the block's mask picks.
    DECLARE refused_bits BIGINT UNSIGNED DEFAULT 0;
    DECLARE li, lnum, ip INT;
    DECLARE lpart VARCHAR(64) CHARACTER SET ascii;
    DECLARE lcs VARCHAR(11100) CHARACTER SET ascii;
    DECLARE cs VARCHAR(11100) CHARACTER SET ascii;
    DECLARE e DOUBLE;
    -- The values the row at hand was counted under (ola: length, oli: limit, osl: sub-windows;
    -- ov as stored), the units it used (u), the policy's OnChange strategy (stg), and the
    -- values of its quota now (cv, which end its c when written; NULL for slots and blocks).
    DECLARE ola, oli, osl, stg BIGINT;
    DECLARE u DOUBLE;
    DECLARE sep INT;
    DECLARE ov, cv VARCHAR(100) CHARACTER SET ascii DEFAULT NULL;
    -- The record of a key a change converted: the values it came from, "length,limit,
    -- sub-windows", after ";" at the end of its c (NULL for none; gcra.lua's `recs`).
    DECLARE fv VARCHAR(100) CHARACTER SET ascii DEFAULT NULL;
    -- A calendar's window (kind 5), picked when its quota is read: cr, now's time into it (us,
    -- within [0, length - 1]); cl, its length (us); ce, its end (s since the epoch, the index
    -- its row keeps); cb, its start (us).
    DECLARE cr, cl, ce, cb BIGINT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        IF tz IS NOT NULL THEN
            SET @@session.time_zone = tz;
        END IF;
        RESIGNAL;
    END;

    SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
    START TRANSACTION;

    -- 1. Lock every key of the call, ascending, inserting the missing ones (default rows).
    SET slen = LENGTH(spec);
    SET keys_end = LOCATE(';', spec);
    IF keys_end = 0 THEN
        SET keys_end = slen + 1;
    END IF;
    SET kp = 1;
    WHILE kp < keys_end DO
        SET ke = LOCATE(',', spec, kp);
        IF ke = 0 OR ke > keys_end THEN
            SET ke = keys_end;
        END IF;
        INSERT INTO {table} (k) VALUES (UNHEX(SUBSTRING(spec, kp, ke - kp)))
            ON DUPLICATE KEY UPDATE k = k;
        SET kp = ke + 1;
    END WHILE;

    -- 2. Now, read after the locks (see above), in UTC (no DST ambiguity): SYSDATE is the time
    -- it runs at (NOW would be the CALL's start).
    IF now_ns IS NULL THEN
        SET tz = @@session.time_zone;
        SET @@session.time_zone = '+00:00';
        SET now_us = TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', SYSDATE(6));
        SET @@session.time_zone = tz;
        SET tz = NULL;
        SET now_ns = now_us * 1000;
    ELSE
        SET now_us = now_ns DIV 1000;
    END IF;

    -- 3. The decisions, one after another. A decision of one quota is checked and applied in
    -- one pass (0); of several, every quota is checked first (pass 1), then all take the cost,
    -- or, one denied, none does (pass 2).
    SET pos = keys_end + 1;
    WHILE pos <= slen DO
        SET de = LOCATE(';', spec, pos);
        IF de = 0 THEN
            SET de = slen + 1;
        END IF;
        SET dtext = SUBSTRING(spec, pos, de - pos);
        SET pos = de + 1;
        SET dhead = SUBSTRING_INDEX(dtext, '|', 1);
        SET cost = CAST(SUBSTRING_INDEX(dhead, ',', 1) AS SIGNED);
        SET arg = CAST(SUBSTRING_INDEX(SUBSTRING_INDEX(dhead, ',', 2), ',', -1) AS SIGNED);
        SET op = CAST(SUBSTRING_INDEX(dhead, ',', -1) AS SIGNED);
        SET mw = IF(op = 0, arg, 0), pk = IF(op = 1, 1, 0);
        SET nq = LENGTH(dtext) - LENGTH(REPLACE(dtext, '|', ''));
        -- Settlements are made in one pass, always allowed.
        SET pass = IF(nq = 1 OR op >= 3, 0, 1), denied = 0, refusal = 0, refused_bits = 0, codes = '', wx = 0;
        passes: LOOP
            SET i = 1;
            WHILE i <= nq DO
                SET qt = SUBSTRING_INDEX(SUBSTRING_INDEX(dtext, '|', i + 1), '|', -1);
                SET kind = CAST(SUBSTRING_INDEX(qt, ',', 1) AS SIGNED);
                -- A rate quota's kind carries the policy's OnChange strategy times 8.
                SET stg = kind DIV 8, kind = kind % 8;
                SET qa = CAST(SUBSTRING_INDEX(SUBSTRING_INDEX(qt, ',', 2), ',', -1) AS SIGNED);
                SET lim = CAST(SUBSTRING_INDEX(SUBSTRING_INDEX(qt, ',', 3), ',', -1) AS SIGNED);
                SET sl = CAST(SUBSTRING_INDEX(SUBSTRING_INDEX(qt, ',', 4), ',', -1) AS SIGNED);
                SET hk = SUBSTRING_INDEX(qt, ',', -1);
                IF kind = 5 THEN
                    -- A calendar's window: of the two around the boundary, the one that holds
                    -- now (the instance computed them, around its time). From here on its
                    -- numbers are its values as a rate quota's (id, limit, 0).
                    SET ce = qa >> 20;
                    SET cb = ce * 1000000;
                    IF now_us < cb THEN
                        SET cl = GREATEST(sl >> 32, 1) * 1000000;
                        SET cb = cb - cl;
                    ELSE
                        SET cl = GREATEST(sl & 4294967295, 1) * 1000000;
                        SET ce = ce + cl DIV 1000000;
                    END IF;
                    SET cr = LEAST(GREATEST(now_us - cb, 0), cl - 1);
                    SET qa = qa & 1048575, sl = 0;
                END IF;
                -- The row of the key: the one at hand, or (after writing that one if changed)
                -- read with a locking read.
                IF ck IS NULL OR hk <> ck THEN
                    IF dirty THEN
                        UPDATE {table} SET a = ra, n = rn,
                            c = IF(cv IS NULL, rc, CONCAT(COALESCE(rc, ''), ';', cv, IF(fv IS NULL, '', CONCAT(';', fv)))),
                            expires_us = rexp
                            WHERE k = UNHEX(ck);
                        SET dirty = 0;
                    END IF;
                    SET ra = NULL;
                    SELECT a, n, c INTO ra, rn, rc FROM {table} WHERE k = UNHEX(hk) FOR UPDATE;
                    IF ra IS NULL THEN
                        SIGNAL SQLSTATE '45000'
                            SET MESSAGE_TEXT = 'tollgate: a key of a quota is missing from the key list';
                    END IF;
                    SET ck = hk, cv = NULL, fv = NULL;
                    IF kind <= 2 OR kind = 5 THEN
                        -- A rate quota's c ends with ";" and the values it was counted under
                        -- and the format: "length,limit,sub-windows,2", then, for a key a
                        -- change converted, ";" and its record. Without them, the row is a
                        -- fresh one.
                        SET cv = CONCAT(qa, ',', lim, ',', sl, ',2');
                        SET sep = LOCATE(';', COALESCE(rc, ''));
                        SET ov = IF(sep > 0, SUBSTRING(rc, sep + 1), '');
                        IF LOCATE(';', ov) > 0 THEN
                            SET fv = SUBSTRING_INDEX(ov, ';', -1), ov = SUBSTRING_INDEX(ov, ';', 1);
                        END IF;
                        IF sep > 0 AND SUBSTRING_INDEX(ov, ',', -1) = '2' THEN
                            SET rc = IF(sep = 1, NULL, LEFT(rc, sep - 1));
                        ELSE
                            SET ov = cv, fv = NULL, ra = 0, rn = 0, rc = NULL;
                        END IF;
                        IF ov <> cv THEN
                            -- Counted under other values: the units it used now (gcra.lua's
                            -- `carried`), converted as the strategy says (OnChange::carry), are
                            -- its state under these. Converted back to the values it came from
                            -- (an instance the change has not reached, or a change back), it
                            -- converts as keep does; its record is then the values it had.
                            IF fv = CONCAT(qa, ',', lim, ',', sl) THEN
                                SET stg = 0;
                            END IF;
                            SET fv = LEFT(ov, LENGTH(ov) - 2);
                            SET ola = CAST(SUBSTRING_INDEX(ov, ',', 1) AS SIGNED);
                            SET oli = CAST(SUBSTRING_INDEX(SUBSTRING_INDEX(ov, ',', 2), ',', -1) AS SIGNED);
                            SET osl = CAST(SUBSTRING_INDEX(SUBSTRING_INDEX(ov, ',', 3), ',', -1) AS SIGNED);
                            SET u = 0;
                            IF kind = 0 THEN
                                IF ra > now_ns THEN
                                    SET u = CAST(ra - now_ns AS DOUBLE) / CAST(ola AS DOUBLE);
                                END IF;
                            ELSEIF kind = 1 THEN
                                IF ra = now_us DIV ola THEN
                                    SET u = rn;
                                END IF;
                            ELSEIF kind = 5 THEN
                                -- A calendar's count, while its window (under the calendar it
                                -- was counted by: its end, ra) runs.
                                IF ra * 1000000 > now_us THEN
                                    SET u = rn;
                                END IF;
                            ELSEIF rc IS NOT NULL AND LENGTH(rc) - LENGTH(REPLACE(rc, ',', '')) = osl THEN
                                SET byn = GREATEST(now_us DIV ola - ra, 0);
                                IF byn < osl + 1 THEN
                                    SET c1 = CAST(SUBSTRING_INDEX(SUBSTRING_INDEX(rc, ',', byn + 1), ',', -1) AS SIGNED);
                                    SET total = 0;
                                    IF byn < osl THEN
                                        SELECT COALESCE(SUM(j.x), 0) INTO total
                                            FROM JSON_TABLE(CONCAT('[', SUBSTRING_INDEX(rc, ',', byn - osl), ']'),
                                                '$[*]' COLUMNS (x BIGINT PATH '$')) AS j;
                                    END IF;
                                    SET u = CAST(c1 AS DOUBLE) * CAST(ola - now_us % ola AS DOUBLE)
                                        / CAST(ola AS DOUBLE) + CAST(total AS DOUBLE);
                                END IF;
                            END IF;
                            IF NOT (u > 0) THEN
                                SET u = 0;
                            END IF;
                            IF stg = 1 THEN
                                SET u = 0;
                            ELSEIF stg = 2 THEN
                                SET u = u * CAST(lim AS DOUBLE) / CAST(oli AS DOUBLE);
                            ELSEIF stg = 3 AND lim < oli THEN
                                SET u = u - CAST(oli - lim AS DOUBLE);
                            END IF;
                            SET u = LEAST(GREATEST(u, 0), CAST(lim AS DOUBLE));
                            IF kind = 0 THEN
                                SET ra = now_ns + CAST(FLOOR(u * CAST(qa AS DOUBLE)) AS SIGNED), rn = 0;
                            ELSEIF kind = 1 THEN
                                SET ra = now_us DIV qa, rn = CAST(CEIL(u) AS SIGNED);
                            ELSEIF kind = 5 THEN
                                SET ra = ce, rn = CAST(CEIL(u) AS SIGNED);
                            ELSE
                                SET ra = now_us DIV qa, rn = CAST(CEIL(u) AS SIGNED);
                                SET rc = CONCAT(REPEAT('0,', sl), rn);
                            END IF;
                        END IF;
                    END IF;
                END IF;
                -- The quota's state now (cur; sliding: the counts cs moved on to now's
                -- sub-window, their sum total, the newest index), and whether the cost fits.
                IF kind = 0 THEN
                    SET cur = GREATEST(ra - now_ns, 0);
                    -- Fits when TAT + T * (cost - burst) <= 0 (TAT relative to now); a
                    -- reservation when that wait is at most mw.
                    SET wq = cur + qa * (cost - lim);
                    IF cost > lim THEN
                        SET code = 2;
                    ELSEIF wq > mw THEN
                        SET code = 1;
                    ELSE
                        SET code = 0;
                        IF wq > wx THEN
                            SET wx = wq;
                        END IF;
                    END IF;
                ELSEIF kind = 1 THEN
                    SET w = now_us DIV qa, r = now_us % qa;
                    -- Another window's count (a past one, or a future one after a clock step
                    -- back) is not this window's.
                    SET cur = IF(ra = w, rn, 0);
                    IF cost > lim THEN
                        SET code = 2;
                    ELSEIF cur + cost > lim THEN
                        SET code = 1;
                    ELSE
                        SET code = 0;
                    END IF;
                ELSEIF kind = 5 THEN
                    -- Likewise a calendar's: its window is the one that ends at ce.
                    SET cur = IF(ra = ce, rn, 0);
                    IF cost > lim THEN
                        SET code = 2;
                    ELSEIF cur + cost > lim THEN
                        SET code = 1;
                    ELSE
                        SET code = 0;
                    END IF;
                ELSEIF kind = 3 THEN
                    -- The leases still running (expired ones dropped; a release's too), and
                    -- the last expiry among them. One slot per request, whatever its cost.
                    SET lcs = '', cur = 0, lmax = now_us, li = 1;
                    SET lnum = IF(rc IS NULL OR rc = '', 0, LENGTH(rc) - LENGTH(REPLACE(rc, ',', '')) + 1);
                    WHILE li <= lnum DO
                        SET lpart = SUBSTRING_INDEX(SUBSTRING_INDEX(rc, ',', li), ',', -1);
                        SET lx = CAST(SUBSTRING_INDEX(lpart, ':', -1) AS SIGNED);
                        IF lx > now_us AND NOT (op = 5 AND CAST(SUBSTRING_INDEX(lpart, ':', 1) AS SIGNED) = arg) THEN
                            SET lcs = IF(lcs = '', lpart, CONCAT(lcs, ',', lpart));
                            SET cur = cur + 1, lmax = GREATEST(lmax, lx);
                        END IF;
                        SET li = li + 1;
                    END WHILE;
                    SET code = IF(cur + 1 > lim, 1, 0);
                ELSEIF kind = 4 THEN
                    -- Blocked for cur us more: refused, whatever the quotas hold.
                    SET cur = GREATEST(ra - now_us, 0);
                    SET code = IF(cur > 0, 1, 0);
                ELSE
                    SET m = sl + 1, ix = now_us DIV qa, r = now_us % qa;
                    SET newest = ix, byn = m;
                    IF rc IS NOT NULL AND LENGTH(rc) - LENGTH(REPLACE(rc, ',', '')) = m - 1 THEN
                        -- Move the counts on to now's sub-window; a stored index after now (a
                        -- clock step back) is kept.
                        SET byn = ix - ra;
                        IF byn <= 0 THEN
                            SET newest = ra, byn = 0;
                        ELSEIF byn > m THEN
                            SET byn = m;
                        END IF;
                    END IF;
                    IF byn = 0 THEN
                        SET cs = rc, total = rn;
                    ELSEIF byn = m THEN
                        SET cs = CONCAT('0', REPEAT(',0', m - 1)), total = 0;
                    ELSE
                        SET cs = CONCAT(SUBSTRING_INDEX(rc, ',', byn - m), REPEAT(',0', byn));
                        SELECT COALESCE(SUM(j.x), 0) INTO total
                            FROM JSON_TABLE(CONCAT('[', cs, ']'), '$[*]' COLUMNS (x BIGINT PATH '$')) AS j;
                    END IF;
                    SET c1 = CAST(SUBSTRING_INDEX(cs, ',', 1) AS SIGNED);
                    -- E = c_oldest * (S - r) / S + rest, in doubles, in this order (window.rs).
                    SET e = CAST(c1 AS DOUBLE) * CAST(qa - r AS DOUBLE) / CAST(qa AS DOUBLE)
                        + CAST(total - c1 AS DOUBLE);
                    IF cost > lim THEN
                        SET code = 2;
                    ELSEIF e + CAST(cost AS DOUBLE) <= CAST(lim AS DOUBLE) THEN
                        SET code = 0;
                    ELSE
                        SET code = 1;
                    END IF;
                END IF;

                IF pass = 1 THEN
                    SET codes = CONCAT(codes, code);
                    IF code <> 0 THEN
                        SET denied = 1;
                    END IF;
                    IF code = 1 AND kind <> 4 THEN
                        SET refused_bits = refused_bits | (1 << (i - 1));
                    END IF;
                    IF kind = 4 THEN
                        -- Last: whether a quota whose refusal starts the block refused.
                        SET refusal = IF(sl = 0, refused_bits <> 0, (refused_bits & sl) <> 0);
                    END IF;
                ELSEIF op >= 3 THEN
                    -- A settlement: the quota as the op says.
                    SET code = 0;
                    IF kind = 0 THEN
                        IF op = 3 THEN
                            -- Never past full: a TAT before now is a full bucket.
                            SET cur = GREATEST(cur - cost * qa, 0);
                        ELSEIF op = 4 THEN
                            SET cur = cur + cost * qa;
                        END IF;
                        IF op <> 5 THEN
                            SET ra = now_ns + cur, rn = 0, rc = NULL, rexp = (now_ns + cur + 999) DIV 1000;
                            SET dirty = 1;
                        END IF;
                    ELSEIF kind = 1 THEN
                        IF op = 3 AND (now_us - arg) DIV qa = w THEN
                            -- Only into the window that counted the units.
                            SET cur = GREATEST(cur - cost, 0);
                            SET ra = w, rn = cur, rc = NULL, rexp = (w + 1) * qa, dirty = 1;
                        ELSEIF op = 4 THEN
                            -- A count saturates at 2^32 - 1, as on every store.
                            SET cur = LEAST(cur + cost, 4294967295);
                            SET ra = w, rn = cur, rc = NULL, rexp = (w + 1) * qa, dirty = 1;
                        END IF;
                    ELSEIF kind = 5 THEN
                        IF op = 3 AND arg <= cr THEN
                            -- Only into the window that counted the units: taken since it
                            -- started.
                            SET cur = GREATEST(cur - cost, 0);
                            SET ra = ce, rn = cur, rc = NULL, rexp = ce * 1000000, dirty = 1;
                        ELSEIF op = 4 THEN
                            SET cur = LEAST(cur + cost, 4294967295);
                            SET ra = ce, rn = cur, rc = NULL, rexp = ce * 1000000, dirty = 1;
                        END IF;
                    ELSEIF kind = 2 THEN
                        IF op = 3 THEN
                            -- Only into the sub-window that counted the units, if still counted.
                            SET ip = m - (newest - (now_us - arg) DIV qa);
                            IF ip >= 1 AND ip <= m THEN
                                SET lcs = '', li = 1;
                                WHILE li <= m DO
                                    SET lx = CAST(SUBSTRING_INDEX(SUBSTRING_INDEX(cs, ',', li), ',', -1) AS SIGNED);
                                    IF li = ip THEN
                                        SET total = total - LEAST(lx, cost), lx = lx - LEAST(lx, cost);
                                    END IF;
                                    SET lcs = IF(li = 1, CAST(lx AS CHAR), CONCAT(lcs, ',', lx));
                                    SET li = li + 1;
                                END WHILE;
                                SET cs = lcs;
                                SET ra = newest, rn = total, rc = cs, rexp = (newest + m) * qa, dirty = 1;
                            END IF;
                        ELSEIF op = 4 THEN
                            -- A count saturates at 2^32 - 1, as on every store.
                            SET lastc = CAST(SUBSTRING_INDEX(cs, ',', -1) AS SIGNED);
                            SET lastd = LEAST(lastc + cost, 4294967295) - lastc;
                            SET cs = CONCAT(SUBSTRING_INDEX(cs, ',', m - 1), ',', lastc + lastd);
                            SET total = total + lastd;
                            SET ra = newest, rn = total, rc = cs, rexp = (newest + m) * qa, dirty = 1;
                        END IF;
                    ELSEIF kind = 3 THEN
                        IF op = 5 THEN
                            SET ra = 0, rn = cur, rc = lcs, rexp = lmax, dirty = 1;
                        END IF;
                    ELSE
                        SET code = IF(cur > 0, 1, 0);
                    END IF;
                ELSE
                    IF pass = 2 THEN
                        SET code = CAST(SUBSTRING(codes, i, 1) AS SIGNED);
                        IF kind = 4 THEN
                            -- A refusal starts a block, unless one runs (a peek starts none).
                            IF refusal AND cur = 0 AND pk = 0 THEN
                                SET cur = qa;
                                SET ra = now_us + cur, rn = 0, rc = NULL, rexp = now_us + cur;
                                SET dirty = 1;
                            END IF;
                            SET code = IF(cur > 0, 1, 0);
                        ELSEIF denied AND code = 0 THEN
                            SET code = 3;
                        END IF;
                    END IF;
                    IF kind = 3 THEN
                        -- A slot is taken under the request's lease (op 2); otherwise checked.
                        IF code = 0 AND op = 2 THEN
                            SET lx = now_us + qa * 1000;
                            SET lcs = IF(lcs = '', CONCAT(arg, ':', lx), CONCAT(lcs, ',', arg, ':', lx));
                            SET cur = cur + 1;
                            SET ra = 0, rn = cur, rc = lcs, rexp = GREATEST(lmax, lx), dirty = 1;
                        END IF;
                    ELSEIF code = 0 AND kind <> 4 THEN
                        -- Take the cost (a reservation's GCRA quotas as of the time it goes
                        -- on, wx from now); the row (to be written) follows, unless the
                        -- decision only peeks.
                        IF kind = 0 THEN
                            SET cur = GREATEST(cur, wx) + cost * qa;
                            IF pk = 0 THEN
                                SET ra = now_ns + cur, rn = 0, rc = NULL;
                                SET rexp = (ra + 999) DIV 1000;
                            END IF;
                        ELSEIF kind = 1 THEN
                            SET cur = cur + cost;
                            IF pk = 0 THEN
                                SET ra = w, rn = cur, rc = NULL, rexp = (w + 1) * qa;
                            END IF;
                        ELSEIF kind = 5 THEN
                            -- A calendar's window, by its end, when the row expires.
                            SET cur = cur + cost;
                            IF pk = 0 THEN
                                SET ra = ce, rn = cur, rc = NULL, rexp = ce * 1000000;
                            END IF;
                        ELSE
                            SET cs = CONCAT(SUBSTRING_INDEX(cs, ',', m - 1), ',',
                                CAST(SUBSTRING_INDEX(cs, ',', -1) AS SIGNED) + cost);
                            SET total = total + cost;
                            IF pk = 0 THEN
                                SET ra = newest, rn = total, rc = cs, rexp = (newest + m) * qa;
                            END IF;
                        END IF;
                        IF pk = 0 THEN
                            SET dirty = 1;
                        END IF;
                    END IF;
                END IF;
                -- The quota's reply, once its code and state are final (pass 1 replies nothing).
                IF pass <> 1 THEN
                    IF kind = 0 THEN
                        SET reply = CONCAT(reply, ',', code, ',', LEAST(cur, 9000000000000000000));
                    ELSEIF kind = 1 THEN
                        SET reply = CONCAT(reply, ',', code, ',', cur, ',', qa - r);
                    ELSEIF kind = 5 THEN
                        SET reply = CONCAT(reply, ',', code, ',', cur, ',', cl - cr);
                    ELSEIF kind >= 3 THEN
                        SET reply = CONCAT(reply, ',', code, ',', cur);
                    ELSE
                        SET reply = CONCAT(reply, ',', code, ',', r, ',', cs);
                    END IF;
                END IF;
                SET i = i + 1;
            END WHILE;
            IF pass = 1 THEN
                SET pass = 2;
            ELSE
                LEAVE passes;
            END IF;
        END LOOP;
    END WHILE;

    IF dirty THEN
        UPDATE {table} SET a = ra, n = rn,
            c = IF(cv IS NULL, rc, CONCAT(COALESCE(rc, ''), ';', cv, IF(fv IS NULL, '', CONCAT(';', fv)))), expires_us = rexp
            WHERE k = UNHEX(ck);
    END IF;
    COMMIT;
    SELECT SUBSTRING(reply, 2) AS reply;
END
-- For the Rust side (not run by the migration; these comments end the last statement):
--
-- Sweep: delete at most ? expired rows (expired by the database's clock; UTC_TIMESTAMP is
-- zone-free). Returns the number deleted (run again while it equals the limit). A full scan
-- (no index on expires_us); it waits for rows a decision has locked, and may rarely deadlock
-- with one (1213: the loser is rolled back; retry it).
--   DELETE FROM {table}
--   WHERE expires_us < TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))
--   LIMIT ?
--
-- Decide (? NULL for the database's clock):
--   CALL {decide}(?, ?)
