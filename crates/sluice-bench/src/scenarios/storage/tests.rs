use super::*;

#[test]
fn records_are_split_over_threads_without_loss() {
    for (n, t) in [(5000u64, 1usize), (5000, 3), (7, 32), (5_000_000, 32)] {
        let total: u64 = (0..t).map(|i| share(n, t, i)).sum();
        assert_eq!(total, n, "N={n} T={t}");
    }
    assert_eq!(share(10, 4, 0), 3);
    assert_eq!(share(10, 4, 3), 2);
}

#[test]
fn tally_is_order_independent_and_sees_changed_bytes() {
    let mut g = RecordGen::new(2, 64);
    let bodies: Vec<Vec<u8>> = (0..10).map(|i| g.body(i).to_vec()).collect();
    let mut forward = Tally::default();
    bodies.iter().for_each(|b| forward.add(b));
    let mut backward = Tally::default();
    bodies.iter().rev().for_each(|b| backward.add(b));
    assert_eq!(forward, backward);
    assert_eq!(forward, RecordGen::expected(2, 64, 10));
    let mut changed = bodies.clone();
    changed[3][40] ^= 1;
    let mut damaged = Tally::default();
    changed.iter().for_each(|b| damaged.add(b));
    assert_ne!(damaged, forward);
}

#[test]
fn record_bodies_carry_thread_and_index() {
    let mut g = RecordGen::new(7, 256);
    let b = g.body(0x0102_0304_0506).to_vec();
    assert_eq!(b.len(), 256);
    assert_eq!(&b[0..4], &7u32.to_le_bytes());
    assert_eq!(&b[4..12], &0x0102_0304_0506u64.to_le_bytes());
    assert_ne!(
        RecordGen::new(8, 256).body(0),
        RecordGen::new(7, 256).body(0)
    );
}

#[test]
fn byte_sizes_parse_with_binary_units() {
    assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
    assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
    assert_eq!(parse_bytes("0.5 GiB"), Ok(1 << 29));
    assert_eq!(parse_bytes("4096"), Ok(4096));
    assert!(parse_bytes("1 parsec").is_err());
    assert!(parse_bytes("GiB").is_err());
}

fn point(engine: Engine, n: u64, t: usize, rate: f64, verified: bool) -> PointResult {
    let mut p = PointResult::empty(engine, n, t, PointStatus::Measured);
    p.append_records_per_s = rate;
    p.verified = verified;
    p
}

#[test]
fn headline_compares_at_the_largest_n_both_engines_measured() {
    let points = vec![
        point(Engine::Spool, 5000, 1, 1.5e6, true),
        point(Engine::Sqlite, 5000, 1, 5e4, true),
        point(Engine::Spool, 50_000, 1, 2e6, true),
        point(Engine::Sqlite, 50_000, 1, 1e5, true),
        point(Engine::Spool, 500_000, 1, 2e6, true),
        PointResult::empty(
            Engine::Sqlite,
            500_000,
            1,
            PointStatus::Skipped("slow".into()),
        ),
        point(Engine::Spool, 5000, 8, 8e5, true),
        point(Engine::Sqlite, 5000, 8, 1e5, false),
    ];
    let h = headline(&points);
    assert_eq!(h.len(), 1, "T=8 has no verified SQLite point");
    assert_eq!((h[0].records, h[0].threads), (50_000, 1));
    assert!((h[0].ratio - 20.0).abs() < 1e-9);
    assert!(h[0].meets_1m && h[0].meets_20x);
}

#[test]
fn counts_print_short() {
    assert_eq!(short_count(5000), "5K");
    assert_eq!(short_count(5_000_000), "5M");
    assert_eq!(short_count(1234), "1234");
}
