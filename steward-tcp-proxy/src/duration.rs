//! Go duration syntax (`30s`, `1m30s`, `1.5h`, `250ms`), so the original's flag values keep working.

use std::time::Duration;

/// Parses a Go `time.ParseDuration` string. Negative durations are refused: no flag here means
/// anything by them.
pub fn parse(input: &str) -> Result<Duration, String> {
    let text = input.trim();
    if text.is_empty() {
        return Err("empty duration".to_owned());
    }
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    if text.starts_with('-') {
        return Err(format!(
            "{input:?}: a negative duration makes no sense here"
        ));
    }
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    let mut total = 0f64;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(number_len);
        if number.is_empty() || number == "." {
            return Err(format!("{input:?}: expected a number"));
        }
        let value: f64 = number
            .parse()
            .map_err(|_| format!("{input:?}: {number:?} is not a number"))?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let seconds_per_unit = match unit {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "" => return Err(format!("{input:?}: missing unit (ns, us, ms, s, m, h)")),
            other => return Err(format!("{input:?}: unknown unit {other:?}")),
        };
        total += value * seconds_per_unit;
        rest = tail;
    }
    Duration::try_from_secs_f64(total).map_err(|_| format!("{input:?}: out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_go_syntax() {
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("2h45m0.5s"), Ok(Duration::from_millis(9_900_500)));
        assert_eq!(parse("0"), Ok(Duration::ZERO));
        assert_eq!(parse("10us"), Ok(Duration::from_micros(10)));
    }

    #[test]
    fn refuses_what_go_refuses_and_negatives() {
        for bad in ["", "30", "s", "1x", "-5s", "1..2s", "1e3s", "ten seconds"] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
    }
}
