//! `strftime_now(format)`, the global transformers gives chat templates (Llama 3.x uses it to
//! print today's date). Python formats the machine's *local* time; this crate formats UTC, which
//! is what servers run in. Supports the C89 directives plus glibc's `%-d`-style "no padding"
//! flag; an unknown directive is copied through unchanged, like glibc does.

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tm {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Sunday
    weekday: u32,
    /// 1..=366
    yday: u32,
}

impl Tm {
    /// The UTC time `secs` seconds after the Unix epoch.
    pub(crate) fn from_unix(secs: i64) -> Tm {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        // Howard Hinnant's civil_from_days.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        const CUM: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let yday = CUM[(month - 1) as usize] + day + u32::from(leap && month > 2);
        Tm {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem % 3600 / 60,
            second: rem % 60,
            weekday: (days + 4).rem_euclid(7) as u32,
            yday,
        }
    }

    /// Now, in UTC.
    pub(crate) fn now() -> Tm {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        Tm::from_unix(secs)
    }
}

/// Format `tm` with a C `strftime` format string.
pub(crate) fn strftime(tm: &Tm, format: &str) -> String {
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let Some(d) = chars.next() else {
            out.push('%');
            if no_pad {
                out.push('-');
            }
            break;
        };
        let num = |out: &mut String, v: u32, width: usize| {
            if no_pad {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        let hour12 = match tm.hour % 12 {
            0 => 12,
            h => h,
        };
        match d {
            'Y' => {
                let _ = write!(out, "{}", tm.year);
            }
            'y' => num(&mut out, tm.year.rem_euclid(100) as u32, 2),
            'C' => num(&mut out, tm.year.div_euclid(100) as u32, 2),
            'm' => num(&mut out, tm.month, 2),
            'd' => num(&mut out, tm.day, 2),
            'e' => {
                if no_pad {
                    let _ = write!(out, "{}", tm.day);
                } else {
                    let _ = write!(out, "{:2}", tm.day);
                }
            }
            'H' => num(&mut out, tm.hour, 2),
            'I' => num(&mut out, hour12, 2),
            'M' => num(&mut out, tm.minute, 2),
            'S' => num(&mut out, tm.second, 2),
            'j' => num(&mut out, tm.yday, 3),
            'p' => out.push_str(if tm.hour < 12 { "AM" } else { "PM" }),
            'B' => out.push_str(MONTHS[(tm.month - 1) as usize]),
            'b' | 'h' => out.push_str(&MONTHS[(tm.month - 1) as usize][..3]),
            'A' => out.push_str(WEEKDAYS[tm.weekday as usize]),
            'a' => out.push_str(&WEEKDAYS[tm.weekday as usize][..3]),
            'w' => {
                let _ = write!(out, "{}", tm.weekday);
            }
            'u' => {
                let _ = write!(out, "{}", if tm.weekday == 0 { 7 } else { tm.weekday });
            }
            'F' => {
                let _ = write!(out, "{}-{:02}-{:02}", tm.year, tm.month, tm.day);
            }
            'T' => {
                let _ = write!(out, "{:02}:{:02}:{:02}", tm.hour, tm.minute, tm.second);
            }
            'R' => {
                let _ = write!(out, "{:02}:{:02}", tm.hour, tm.minute);
            }
            'D' | 'x' => {
                let _ = write!(
                    out,
                    "{:02}/{:02}/{:02}",
                    tm.month,
                    tm.day,
                    tm.year.rem_euclid(100)
                );
            }
            'X' => {
                let _ = write!(out, "{:02}:{:02}:{:02}", tm.hour, tm.minute, tm.second);
            }
            'c' => {
                let _ = write!(
                    out,
                    "{} {} {:2} {:02}:{:02}:{:02} {}",
                    &WEEKDAYS[tm.weekday as usize][..3],
                    &MONTHS[(tm.month - 1) as usize][..3],
                    tm.day,
                    tm.hour,
                    tm.minute,
                    tm.second,
                    tm.year
                );
            }
            'Z' => out.push_str("UTC"),
            'z' => out.push_str("+0000"),
            'n' => out.push('\n'),
            't' => out.push('\t'),
            '%' => out.push('%'),
            other => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_python_strftime() {
        // Python: datetime.fromtimestamp(T, timezone.utc).strftime(f), T = 1709251199 and
        // 1735689600 (a leap-year Feb 29 and Jan 1).
        let tm = Tm::from_unix(1_709_251_199);
        assert_eq!(strftime(&tm, "%d %b %Y"), "29 Feb 2024");
        assert_eq!(
            strftime(&tm, "%A %B %-d %H:%M:%S %j %p %I %y %%"),
            "Thursday February 29 23:59:59 060 PM 11 24 %"
        );
        let tm = Tm::from_unix(1_735_689_600);
        assert_eq!(
            strftime(&tm, "%Y-%m-%d %a %j %I%p"),
            "2025-01-01 Wed 001 12AM"
        );
        assert_eq!(strftime(&tm, "%-m/%-d %e"), "1/1  1");
        let tm = Tm::from_unix(0);
        assert_eq!(strftime(&tm, "%c"), "Thu Jan  1 00:00:00 1970");
        let tm = Tm::from_unix(-86_400);
        assert_eq!(strftime(&tm, "%F %u %w"), "1969-12-31 3 3");
    }
}
