//! The limit's admission rule with flows and levels: properties, real concurrency, the fair
//! queue.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

fn fixed(limit: u32) -> AdaptiveLimitBuilder {
    AdaptiveLimit::builder().initial(limit).range(limit, limit)
}

/// The slots held by each lane of `level`.
fn lanes_of(limit: &AdaptiveLimit, level: Criticality) -> Vec<u32> {
    let inner = &limit.inner;
    (0..inner.per_level as u32)
        .map(|l| inner.lane(level, l).held.load(Ordering::Relaxed))
        .collect()
}

const FLOWS: [&str; 6] = ["a", "b", "c", "d", "e", "f"];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the order of asks and releases: never past the limit; a request refused while
    /// a slot is free is of the flow holding the most of its level (a flow under its share is
    /// never refused while another holds more), or of a level below one that keeps slots back;
    /// every slot comes back.
    #[test]
    fn never_past_the_limit_and_a_lighter_flow_is_never_refused_for_a_heavier_one(
        limit in 1u32..24,
        ops in proptest::collection::vec((0usize..6, 0usize..3, any::<bool>(), any::<u8>()), 1..200),
    ) {
        let lim = fixed(limit).build().unwrap();
        let mut held: Vec<Permit> = Vec::new();
        for (flow, level, release, pick) in ops {
            if release && !held.is_empty() {
                let at = pick as usize % held.len();
                drop(held.swap_remove(at));
                continue;
            }
            let level = LEVELS[level];
            let before = lim.in_flight();
            let claim = lim.claim(Ask::new().flow(FLOWS[flow]).criticality(level));
            let reserve = lim.inner.reserve_above(level, limit);
            match lim.take(claim) {
                Ok(p) => held.push(p),
                Err(shed) => {
                    let flow = claim.flow.unwrap();
                    let lane = lim.inner.pick(level, flow);
                    if before + reserve < limit && shed == Shed::OverShare {
                        // Refused with room: its lane held as much as any other flow's of its
                        // level, and a lighter flow of its level asks.
                        let lanes = lanes_of(&lim, level);
                        let mine = lanes[lane as usize];
                        let mut others = false;
                        for (i, h) in lanes.iter().enumerate() {
                            let l = lim.inner.lane(level, i as u32);
                            let own = i as u32 == lane
                                || (*h > 0 && l.mark.load(Ordering::Relaxed) == flow.mark)
                                || (*h == 0 && flow.hand.contains(&(i as u32)));
                            if !own {
                                prop_assert!(*h <= mine, "lane {i} holds {h}, the refused {mine}");
                                others |= *h < mine && (*h > 0 || l.asked.load(Ordering::Relaxed) != 0);
                            }
                        }
                        prop_assert!(others, "refused with no lighter flow asking: {lanes:?}");
                    } else {
                        prop_assert!(
                            before + reserve >= limit || shed == Shed::OverShare,
                            "refused with {before} in flight of {limit} (reserve {reserve})"
                        );
                    }
                }
            }
            prop_assert!(lim.in_flight() <= limit);
            prop_assert_eq!(lim.in_flight() as usize, held.len());
            let by_levels: u32 = lim.levels().iter().map(|l| l.in_flight).sum();
            prop_assert_eq!(by_levels as usize, held.len());
            let by_lanes: u32 = LEVELS.iter().map(|l| lanes_of(&lim, *l).iter().sum::<u32>()).sum();
            prop_assert_eq!(by_lanes as usize, held.len());
        }
        drop(held);
        prop_assert_eq!(lim.in_flight(), 0);
        for level in LEVELS {
            prop_assert!(lanes_of(&lim, level).iter().all(|h| *h == 0));
        }
        prop_assert!(lim.levels().iter().all(|l| l.in_flight == 0));
    }
}

#[test]
fn near_the_limit_the_heaviest_flow_stops_and_the_others_get_the_headroom() {
    // 8 slots, headroom 1/8: one.
    let lim = fixed(8).build().unwrap();
    let heavy = Ask::new().flow("heavy");
    let light = Ask::new().flow("light");
    let mut permits = vec![lim.try_acquire_as(light).unwrap()];
    // Alone with light at 1, heavy takes up to the headroom (8 − 1 = 7 in flight)...
    while let Some(p) = lim.try_acquire_as(heavy) {
        permits.push(p);
    }
    assert_eq!(lim.in_flight(), 7);
    // ... and light, under its share, still finds the last slot.
    permits.push(
        lim.try_acquire_as(light)
            .expect("the headroom is the lighter flow's"),
    );
    assert_eq!(lim.in_flight(), 8);
    assert!(lim.try_acquire_as(light).is_none(), "never past the limit");
    let default = &lim.levels()[Criticality::Default as usize];
    assert!(default.over_share >= 1, "{default:?}");
    drop(permits);
    assert_eq!(lim.in_flight(), 0);
}

#[test]
fn heavy_flows_tied_at_the_top_leave_the_headroom_to_a_lighter_one() {
    // 16 slots, headroom 2. A light flow holds one; two heavy flows take all they can: they
    // stop short of the limit...
    let lim = fixed(16).build().unwrap();
    let (a, b, light) = (
        Ask::new().flow("a"),
        Ask::new().flow("b"),
        Ask::new().flow("light"),
    );
    let mut held = vec![lim.try_acquire_as(light).unwrap()];
    loop {
        let (pa, pb) = (lim.try_acquire_as(a), lim.try_acquire_as(b));
        if pa.is_none() && pb.is_none() {
            break;
        }
        held.extend(pa.into_iter().chain(pb));
    }
    assert!(lim.in_flight() <= 15, "{}", lim.in_flight());
    // ... and the light one finds the rest.
    while lim.in_flight() < 16 {
        held.push(lim.try_acquire_as(light).expect("headroom"));
    }
}

#[test]
fn a_flow_alone_in_its_level_has_the_whole_limit() {
    let lim = fixed(8).build().unwrap();
    let permits: Vec<_> = std::iter::from_fn(|| lim.try_acquire_as(Ask::new().flow("only")))
        .take(20)
        .collect();
    assert_eq!(permits.len(), 8);
}

#[test]
fn a_refused_flow_is_asking_and_the_heaviest_then_leaves_it_room() {
    let lim = fixed(8).build().unwrap();
    let mut heavy: Vec<_> = std::iter::from_fn(|| lim.try_acquire_as(Ask::new().flow("heavy")))
        .take(20)
        .collect();
    assert_eq!(heavy.len(), 8);
    // A newcomer finds the limit full: refused, and now asking.
    assert!(lim.try_acquire_as(Ask::new().flow("new")).is_none());
    // As heavy's requests end, heavy may not take the last slot back: the newcomer gets it.
    heavy.pop();
    assert!(lim.try_acquire_as(Ask::new().flow("heavy")).is_none());
    assert!(lim.try_acquire_as(Ask::new().flow("new")).is_some());
}

#[test]
fn sheddable_requests_leave_the_slots_critical_ones_used_lately() {
    let lim = fixed(10).build().unwrap();
    let critical = Ask::new().criticality(Criticality::Critical);
    let sheddable = Ask::new().criticality(Criticality::Sheddable);
    // Critical traffic used 4 slots lately, then ended.
    let used: Vec<_> = (0..4)
        .map(|_| lim.try_acquire_as(critical).unwrap())
        .collect();
    drop(used);
    // Sheddable may fill what is left of the limit, less those 4 and the headroom (2 of 10).
    let shed: Vec<_> = std::iter::from_fn(|| lim.try_acquire_as(sheddable))
        .take(20)
        .collect();
    assert_eq!(shed.len(), 4);
    // Critical requests find their slots.
    let back: Vec<_> = std::iter::from_fn(|| lim.try_acquire_as(critical))
        .take(20)
        .collect();
    assert_eq!(back.len(), 6, "the 4 used lately, and the headroom");
    assert_eq!(lim.in_flight(), 10);
    let levels = lim.levels();
    assert!(levels[Criticality::Sheddable as usize].rejected >= 1);
    assert_eq!(levels[Criticality::Critical as usize].rejected, 1);
}

#[test]
fn without_levels_or_flows_nothing_changes() {
    // No flow, the default level: the limit as before, every slot usable.
    let lim = fixed(5).build().unwrap();
    let permits: Vec<_> = std::iter::from_fn(|| lim.try_acquire()).take(9).collect();
    assert_eq!(permits.len(), 5);
}

#[test]
fn the_current_criticality_is_the_asks_when_it_says_none() {
    let lim = fixed(4).build().unwrap();
    let p = Criticality::sync_scoped(Criticality::Sheddable, || lim.try_acquire().unwrap());
    assert_eq!(lim.levels()[Criticality::Sheddable as usize].in_flight, 1);
    drop(p);
}

/// Threads at once, many flows and every level, on a limit that the windows move: never past
/// the limit in force, and every slot, lane and level count back to zero at the end.
#[test]
fn many_threads_and_flows_at_once_never_pass_the_limit_and_return_every_slot() {
    let lim = AdaptiveLimit::builder()
        .initial(16)
        .range(4, 32)
        .min_samples(1)
        .window(Duration::from_micros(50), Duration::from_micros(200))
        .build()
        .unwrap();
    let over = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _guard = rt.enter();
    std::thread::scope(|s| {
        for t in 0..8u32 {
            let (lim, over) = (lim.clone(), over.clone());
            s.spawn(move || {
                let keys: Vec<String> = (0..40)
                    .map(|k| format!("tenant-{}", (k * 7 + t) % 97))
                    .collect();
                let mut held = Vec::new();
                for i in 0..20_000u32 {
                    let level = LEVELS[(i % 3) as usize];
                    let ask = Ask::new().flow(&keys[(i % 40) as usize]).criticality(level);
                    if let Some(p) = lim.try_acquire_as(ask) {
                        // The count at admission, itself included, is within the largest limit.
                        if p.in_flight_at_start() > 32 {
                            over.fetch_add(1, Ordering::Relaxed);
                        }
                        held.push(p);
                    }
                    if !held.is_empty() && (held.len() > 3 || i % 5 == 0) {
                        let p = held.swap_remove(0);
                        match i % 3 {
                            0 => p.success(),
                            1 => p.dropped(),
                            _ => drop(p),
                        }
                    }
                }
            });
        }
    });
    assert_eq!(over.load(Ordering::Relaxed), 0);
    assert_eq!(lim.in_flight(), 0);
    for level in LEVELS {
        assert!(lanes_of(&lim, level).iter().all(|h| *h == 0), "{level}");
    }
    assert!(lim.levels().iter().all(|l| l.in_flight == 0));
    assert!(lim.partitions().iter().all(|p| p.in_flight == 0));
}

/// The fair queue under real concurrency: worker threads, many flows and levels, waits that
/// end in a slot, at their deadline, evicted from a full line, or with their future dropped
/// mid-wait. Never past the limit, and every slot, lane, level and place in line comes back.
#[test]
fn the_fair_queue_under_threads_returns_every_slot_and_place() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap();
    let lim = fixed(6).queue(8, QueueOrder::Lifo).build().unwrap();
    let over = Arc::new(std::sync::atomic::AtomicU32::new(0));
    rt.block_on(async {
        let tasks: Vec<_> = (0..64u32)
            .map(|t| {
                let (lim, over) = (lim.clone(), over.clone());
                tokio::spawn(async move {
                    for i in 0..40u32 {
                        let flow = FLOWS[((t + i) % 6) as usize];
                        let ask = Ask::new().flow(flow).criticality(LEVELS[(i % 3) as usize]);
                        let wait = lim.acquire_as(ask, Duration::from_millis(2));
                        // Every fifth wait is dropped after 500 µs, wherever it is.
                        let permit = if i % 5 == 0 {
                            tokio::time::timeout(Duration::from_micros(500), wait)
                                .await
                                .ok()
                                .flatten()
                        } else {
                            wait.await
                        };
                        if let Some(p) = permit {
                            if p.in_flight_at_start() > 6 {
                                over.fetch_add(1, Ordering::Relaxed);
                            }
                            tokio::task::yield_now().await;
                            drop(p);
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    assert_eq!(over.load(Ordering::Relaxed), 0);
    assert_eq!(lim.in_flight(), 0);
    assert_eq!(lim.waiting(), 0);
    for level in LEVELS {
        assert!(lanes_of(&lim, level).iter().all(|h| *h == 0), "{level}");
    }
    assert!(lim.levels().iter().all(|l| l.in_flight == 0));
    let levels = lim.levels();
    let admitted: u64 = levels.iter().map(|l| l.admitted).sum();
    assert!(
        admitted > 0 && levels.iter().any(|l| l.rejected > 0),
        "{levels:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_queue_serves_the_lighter_flow_first() {
    let lim = fixed(3).queue(8, QueueOrder::Fifo).build().unwrap();
    let mut heavy_held: Vec<_> = (0..3)
        .map(|_| lim.try_acquire_as(Ask::new().flow("heavy")).unwrap())
        .collect();
    let wait = |ask: Ask<'static>| {
        let lim = lim.clone();
        tokio::spawn(async move { lim.acquire_as(ask, Duration::from_secs(5)).await })
    };
    // In line, in this order: heavy, then light.
    let heavy = wait(Ask::new().flow("heavy"));
    tokio::task::yield_now().await;
    let light = wait(Ask::new().flow("light"));
    tokio::task::yield_now().await;
    assert_eq!(lim.waiting(), 2);
    // The first slot: light, which holds none (heavy two), though it came after heavy (FIFO).
    heavy_held.pop();
    let l = light.await.unwrap().expect("the lighter flow first");
    assert_eq!(lim.waiting(), 1);
    heavy_held.pop();
    let h = heavy.await.unwrap().expect("then heavy");
    drop((l, h, heavy_held));
    assert_eq!(lim.in_flight(), 0);
    assert_eq!(lim.waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_waiting_flow_is_asking_and_the_heaviest_leaves_it_the_slot() {
    let lim = fixed(8).queue(8, QueueOrder::Lifo).build().unwrap();
    let heavy = Ask::new().flow("heavy");
    let mut held: Vec<_> = std::iter::from_fn(|| lim.try_acquire_as(heavy))
        .take(9)
        .collect();
    assert_eq!(held.len(), 8, "alone, heavy takes every slot");
    let waiter = {
        let lim = lim.clone();
        tokio::spawn(async move {
            lim.acquire_as(Ask::new().flow("light"), Duration::from_secs(5))
                .await
        })
    };
    tokio::task::yield_now().await;
    assert_eq!(lim.waiting(), 1);
    // A slot frees; before the waiter runs, heavy asks again: refused, light is asking.
    held.pop();
    assert!(lim.try_acquire_as(heavy).is_none());
    assert!(waiter.await.unwrap().is_some(), "the slot went to light");
}

#[tokio::test(start_paused = true)]
async fn the_queue_serves_the_higher_level_first() {
    let lim = fixed(2).queue(8, QueueOrder::Fifo).build().unwrap();
    let mut held: Vec<_> = (0..2).map(|_| lim.try_acquire().unwrap()).collect();
    let wait = |ask: Ask<'static>| {
        let lim = lim.clone();
        tokio::spawn(async move { lim.acquire_as(ask, Duration::from_secs(5)).await })
    };
    let default = wait(Ask::new());
    tokio::task::yield_now().await;
    let critical = wait(Ask::new().criticality(Criticality::Critical));
    tokio::task::yield_now().await;
    held.pop();
    let c = critical
        .await
        .unwrap()
        .expect("critical first, though it came last");
    assert_eq!(lim.waiting(), 1, "default still waits");
    drop((c, held));
    default.abort();
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_gives_a_higher_level_the_place_of_the_lowest() {
    let lim = fixed(1).queue(2, QueueOrder::Lifo).build().unwrap();
    let held = lim
        .try_acquire_as(Ask::new().criticality(Criticality::Critical))
        .unwrap();
    let wait = |ask: Ask<'static>| {
        let lim = lim.clone();
        tokio::spawn(async move { lim.acquire_as(ask, Duration::from_secs(5)).await })
    };
    let shed = wait(Ask::new().criticality(Criticality::Sheddable));
    tokio::task::yield_now().await;
    let first = wait(Ask::new().criticality(Criticality::Critical));
    tokio::task::yield_now().await;
    // Full: another sheddable is refused at once...
    let late = wait(Ask::new().criticality(Criticality::Sheddable));
    assert!(late.await.unwrap().is_none());
    // ... a critical one takes the sheddable waiter's place, which is refused.
    let second = wait(Ask::new().criticality(Criticality::Critical));
    assert!(shed.await.unwrap().is_none(), "put out of the line");
    assert_eq!(lim.waiting(), 2);
    // LIFO among equals: the newest first.
    drop(held);
    let b = second.await.unwrap().expect("served");
    drop(b);
    assert!(first.await.unwrap().is_some());
    assert_eq!(lim.in_flight(), 0);
    assert_eq!(lim.waiting(), 0);
    let shed_level = &lim.levels()[Criticality::Sheddable as usize];
    assert_eq!(shed_level.rejected, 2);
}

#[tokio::test(start_paused = true)]
async fn a_level_above_that_went_quiet_keeps_slots_back_for_two_longest_windows_only() {
    let lim = fixed(10).build().unwrap();
    let critical: Vec<_> = (0..9)
        .map(|_| {
            lim.try_acquire_as(Ask::new().criticality(Criticality::Critical))
                .unwrap()
        })
        .collect();
    // Cancelled, no samples: no window ends.
    drop(critical);
    let sheddable = Ask::new().criticality(Criticality::Sheddable);
    assert!(
        lim.try_acquire_as(sheddable).is_none(),
        "kept back for critical"
    );
    // A longest window (1 s) later, the last window's peak is still 9...
    tokio::time::advance(Duration::from_millis(1100)).await;
    assert!(lim.try_acquire_as(sheddable).is_none());
    // ... and after another, nothing is kept back.
    tokio::time::advance(Duration::from_millis(1100)).await;
    let p = lim.try_acquire_as(sheddable).expect("the peaks moved on");
    drop(p);
}

#[test]
fn lanes_and_headroom_are_checked() {
    let err = |b: AdaptiveLimitBuilder| b.build().unwrap_err().to_string();
    assert!(err(AdaptiveLimit::builder().flow_lanes(0)).contains("flow_lanes"));
    assert!(err(AdaptiveLimit::builder().flow_lanes(70_000)).contains("flow_lanes"));
    assert!(err(AdaptiveLimit::builder().flow_headroom(0.6)).contains("flow_headroom"));
    assert!(err(AdaptiveLimit::builder().flow_headroom(f64::NAN)).contains("flow_headroom"));
    assert!(
        AdaptiveLimit::builder()
            .flow_lanes(1)
            .flow_headroom(0.0)
            .build()
            .is_ok()
    );
}
