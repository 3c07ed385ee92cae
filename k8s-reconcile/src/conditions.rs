//! Status conditions as Kubernetes API conventions define them.
//!
//! Pure functions over `Vec<Condition>`: a condition is replaced by type, and its
//! `lastTransitionTime` changes only when its `status` flips, so a reconciler can set every
//! condition on every pass without making the status churn. [`Conditions`] sets several in the
//! `Option<Vec<Condition>>` field a status struct has, all observed at one generation:
//!
//! ```
//! use k8s_reconcile::conditions::{Conditions, is_true};
//!
//! let mut field = None;
//! Conditions::of(&mut field, Some(3))
//!     .set("Accepted", true, "Valid", "The spec is valid.")
//!     .set("Ready", false, "Waiting", "Waiting for the Deployment.");
//! let list = field.unwrap_or_default();
//! assert!(is_true(&list, "Accepted") && !is_true(&list, "Ready"));
//! assert_eq!(list[1].observed_generation, Some(3));
//! ```

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// The three statuses a condition can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// `"True"`
    True,
    /// `"False"`
    False,
    /// `"Unknown"`
    Unknown,
}

impl Status {
    /// The API string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }
}

impl From<bool> for Status {
    fn from(value: bool) -> Self {
        if value { Self::True } else { Self::False }
    }
}

/// A condition to set; `lastTransitionTime` is filled in by [`set_condition`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConditionUpdate {
    /// The condition type, e.g. `Ready` (PascalCase).
    pub type_: String,
    /// Its status.
    pub status: Status,
    /// A PascalCase reason.
    pub reason: String,
    /// A human-readable message.
    pub message: String,
    /// The `metadata.generation` this condition was computed from.
    pub observed_generation: Option<i64>,
}

impl ConditionUpdate {
    /// A condition with an empty message and no observed generation.
    pub fn new(
        type_: impl Into<String>,
        status: impl Into<Status>,
        reason: impl Into<String>,
    ) -> Self {
        Self {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: String::new(),
            observed_generation: None,
        }
    }

    /// Sets the message.
    pub fn message(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
    }

    /// Sets the observed generation.
    pub fn observed_generation(mut self, generation: Option<i64>) -> Self {
        self.observed_generation = generation;
        self
    }
}

/// Sets `update` in `conditions` at time `now`; returns whether anything changed.
///
/// The existing condition of the same type keeps its `lastTransitionTime` unless the status
/// differs; reason, message and observed generation are always refreshed.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    update: ConditionUpdate,
    now: Timestamp,
) -> bool {
    let status = update.status.as_str();
    match conditions.iter_mut().find(|c| c.type_ == update.type_) {
        Some(existing) => {
            let flipped = existing.status != status;
            let changed = flipped
                || existing.reason != update.reason
                || existing.message != update.message
                || existing.observed_generation != update.observed_generation;
            if flipped {
                existing.status = status.to_owned();
                existing.last_transition_time = Time(now);
            }
            existing.reason = update.reason;
            existing.message = update.message;
            existing.observed_generation = update.observed_generation;
            changed
        }
        None => {
            conditions.push(Condition {
                type_: update.type_,
                status: status.to_owned(),
                reason: update.reason,
                message: update.message,
                observed_generation: update.observed_generation,
                last_transition_time: Time(now),
            });
            true
        }
    }
}

/// Sets conditions in a status's `conditions` field, each observed at the same generation and
/// stamped with the same time.
#[derive(Debug)]
pub struct Conditions<'a> {
    list: &'a mut Vec<Condition>,
    generation: Option<i64>,
    now: Timestamp,
}

impl<'a> Conditions<'a> {
    /// The conditions of `field` (created when absent), observed at `generation`.
    pub fn of(field: &'a mut Option<Vec<Condition>>, generation: Option<i64>) -> Self {
        Self {
            list: field.get_or_insert_with(Vec::new),
            generation,
            now: Timestamp::now(),
        }
    }

    /// Sets condition `type_` to `True` or `False` with `reason` and `message`.
    pub fn set(
        &mut self,
        type_: &str,
        ok: bool,
        reason: &str,
        message: impl Into<String>,
    ) -> &mut Self {
        let update = ConditionUpdate::new(type_, Status::from(ok), reason)
            .message(message)
            .observed_generation(self.generation);
        set_condition(self.list, update, self.now);
        self
    }

    /// The condition of type `type_`, if present.
    pub fn find(&self, type_: &str) -> Option<&Condition> {
        find(self.list, type_)
    }

    /// Whether the condition of type `type_` is present and `"True"`.
    pub fn is_true(&self, type_: &str) -> bool {
        is_true(self.list, type_)
    }
}

/// The condition of type `type_`, if present.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of type `type_` is present and `"True"`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let mut conditions = Vec::new();
        assert!(set_condition(
            &mut conditions,
            ConditionUpdate::new("Ready", false, "Starting"),
            at(100)
        ));
        // Same status, new reason: changed, but the transition time stays.
        assert!(set_condition(
            &mut conditions,
            ConditionUpdate::new("Ready", false, "Waiting").message("still waiting"),
            at(200)
        ));
        assert_eq!(conditions[0].last_transition_time, Time(at(100)));
        assert_eq!(conditions[0].reason, "Waiting");
        assert_eq!(conditions[0].message, "still waiting");
        // Identical update: nothing changes.
        assert!(!set_condition(
            &mut conditions,
            ConditionUpdate::new("Ready", false, "Waiting").message("still waiting"),
            at(300)
        ));
        // Flip: the transition time moves.
        assert!(set_condition(
            &mut conditions,
            ConditionUpdate::new("Ready", true, "Available").observed_generation(Some(4)),
            at(400)
        ));
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].status, "True");
        assert_eq!(conditions[0].last_transition_time, Time(at(400)));
        assert_eq!(conditions[0].observed_generation, Some(4));
        assert!(is_true(&conditions, "Ready"));
        assert!(!is_true(&conditions, "Missing"));
    }

    #[test]
    fn conditions_of_other_types_are_kept() {
        let mut conditions = Vec::new();
        set_condition(&mut conditions, ConditionUpdate::new("A", true, "X"), at(1));
        set_condition(
            &mut conditions,
            ConditionUpdate::new("B", Status::Unknown, "Y"),
            at(2),
        );
        set_condition(
            &mut conditions,
            ConditionUpdate::new("A", false, "Z"),
            at(3),
        );
        assert_eq!(conditions.len(), 2);
        assert_eq!(
            find(&conditions, "B").map(|c| c.status.as_str()),
            Some("Unknown")
        );
        assert_eq!(find(&conditions, "A").map(|c| c.reason.as_str()), Some("Z"));
    }
}
