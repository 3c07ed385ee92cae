//! A coarse hashed timer wheel: one per event loop, for every connection's deadlines.
//!
//! Entries are never removed early: each names its connection by slab key and id, and the
//! loop ignores one whose connection is gone or was filed again since. A deadline beyond the
//! wheel's horizon lands in the last slot within it and is filed again when that slot comes.

use std::time::{Duration, Instant};

/// Slot width: deadlines fire up to this late.
pub(super) const TICK: Duration = Duration::from_millis(100);
/// Slots in the wheel: the horizon is `SLOTS` ticks (25.6 s).
const SLOTS: u64 = 256;

/// One filed deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    /// The connection's slab key.
    pub(super) key: usize,
    /// The connection's id (slab keys are reused).
    pub(super) id: u64,
    /// The tick it was filed for.
    pub(super) tick: u64,
}

pub(super) struct Wheel {
    base: Instant,
    /// Every tick up to this one has been expired.
    now_tick: u64,
    slots: Vec<Vec<Entry>>,
    len: usize,
}

impl Wheel {
    pub(super) fn new(base: Instant) -> Self {
        Self {
            base,
            now_tick: 0,
            slots: (0..SLOTS).map(|_| Vec::new()).collect(),
            len: 0,
        }
    }

    fn ticks_until(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.base);
        let ticks = since.as_nanos().div_ceil(TICK.as_nanos());
        u64::try_from(ticks).unwrap_or(u64::MAX)
    }

    /// Files `key`/`id` for `at` (rounded up to a tick, at least the next one, at most the
    /// horizon); returns the tick it was filed for.
    pub(super) fn schedule(&mut self, key: usize, id: u64, at: Instant) -> u64 {
        let tick = self
            .ticks_until(at)
            .clamp(self.now_tick + 1, self.now_tick + SLOTS - 1);
        self.slots[slot(tick)].push(Entry { key, id, tick });
        self.len += 1;
        tick
    }

    /// Whether `at` would be filed before tick `filed`.
    pub(super) fn before(&self, at: Instant, filed: u64) -> bool {
        self.ticks_until(at).max(self.now_tick + 1) < filed
    }

    /// Moves every entry due at `now` into `due`.
    pub(super) fn expire(&mut self, now: Instant, due: &mut Vec<Entry>) {
        let since = now.saturating_duration_since(self.base);
        let target = u64::try_from(since.as_nanos() / TICK.as_nanos()).unwrap_or(u64::MAX);
        if target <= self.now_tick {
            return;
        }
        // Each slot holds the ticks of one round only, so a stall longer than the horizon
        // makes every entry due after one pass.
        let steps = (target - self.now_tick).min(SLOTS);
        if self.len > 0 {
            for step in 1..=steps {
                let entries = &mut self.slots[slot(self.now_tick + step)];
                self.len -= entries.len();
                due.append(entries);
            }
        }
        self.now_tick = target;
    }

    /// When the earliest filed entry is due, if any.
    pub(super) fn next_due(&self) -> Option<Instant> {
        if self.len == 0 {
            return None;
        }
        (1..=SLOTS)
            .map(|step| self.now_tick + step)
            .find(|tick| !self.slots[slot(*tick)].is_empty())
            .map(|tick| self.at(tick))
    }

    fn at(&self, tick: u64) -> Instant {
        let nanos = u128::from(tick) * TICK.as_nanos();
        self.base + Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

fn slot(tick: u64) -> usize {
    // Below SLOTS, so the cast cannot truncate.
    (tick % SLOTS) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_fire_at_their_tick_not_before() {
        let base = Instant::now();
        let mut wheel = Wheel::new(base);
        let tick = wheel.schedule(1, 10, base + Duration::from_millis(250));
        assert_eq!(tick, 3, "rounded up to the next tick");
        wheel.schedule(2, 20, base + Duration::from_secs(3600));
        let mut due = Vec::new();
        wheel.expire(base + Duration::from_millis(299), &mut due);
        assert!(due.is_empty());
        assert_eq!(wheel.next_due(), Some(base + Duration::from_millis(300)));
        wheel.expire(base + Duration::from_millis(300), &mut due);
        assert_eq!(
            due,
            [Entry {
                key: 1,
                id: 10,
                tick: 3
            }]
        );
        // Beyond the horizon: filed in the last slot within it, to be filed again then.
        due.clear();
        wheel.expire(base + Duration::from_secs(26), &mut due);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].key, 2);
        assert_eq!(wheel.next_due(), None);
    }

    #[test]
    fn a_stall_longer_than_the_horizon_expires_everything_once() {
        let base = Instant::now();
        let mut wheel = Wheel::new(base);
        for key in 0..10 {
            wheel.schedule(key, 0, base + Duration::from_millis(100 * key as u64 + 1));
        }
        let mut due = Vec::new();
        wheel.expire(base + Duration::from_secs(100), &mut due);
        assert_eq!(due.len(), 10);
        assert_eq!(wheel.next_due(), None);
        // Filing after the stall starts from the new present.
        let tick = wheel.schedule(0, 0, base);
        assert_eq!(tick, 1001);
    }
}
