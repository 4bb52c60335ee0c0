//! `strftime` over UTC for the `strftime_now` template global, with no date-time dependency.

/// A strftime subset over UTC: `%Y %y %m %d %e %H %I %M %S %p %j %a %A %b %B %Z %z %F %T %D %%`,
/// with glibc's `%-d` style to drop zero padding. Unknown directives are kept as written.
// Long: the civil-date arithmetic, then one arm per directive; the table is the function.
pub fn strftime_utc(format: &str, unix_secs: i64) -> String {
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
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
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (
        secs_of_day / 3600,
        secs_of_day % 3600 / 60,
        secs_of_day % 60,
    );
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let month_name = MONTHS[(month - 1) as usize];

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |n: i64, width: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let Some(directive) = chars.next() else {
            out.push('%');
            break;
        };
        let text = match directive {
            'Y' => year.to_string(),
            'y' => num(year.rem_euclid(100), 2),
            'm' => num(month, 2),
            'd' => num(day, 2),
            'e' => {
                if unpadded {
                    day.to_string()
                } else {
                    format!("{day:>2}")
                }
            }
            'H' => num(hour, 2),
            'I' => num(hour12, 2),
            'M' => num(minute, 2),
            'S' => num(second, 2),
            'p' => if hour < 12 { "AM" } else { "PM" }.to_owned(),
            'j' => num(day_of_year, 3),
            'a' => DAYS[weekday][..3].to_owned(),
            'A' => DAYS[weekday].to_owned(),
            'b' | 'h' => month_name[..3].to_owned(),
            'B' => month_name.to_owned(),
            'Z' => "UTC".to_owned(),
            'z' => "+0000".to_owned(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'D' => format!("{month:02}/{day:02}/{:02}", year.rem_euclid(100)),
            '%' => "%".to_owned(),
            other => format!("%{}{other}", if unpadded { "-" } else { "" }),
        };
        out.push_str(&text);
    }
    out
}

/// Proleptic Gregorian (year, month, day) from days since 1970-01-01, by 400-year eras
/// (146,097 days each) counted from 0000-03-01, so the leap day ends each era-year.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153; // 0 = March
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let month_index = if month > 2 { month - 3 } else { month + 9 };
    let day_of_year = (153 * month_index + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_instants() {
        let fmt = "%Y-%m-%d %H:%M:%S %a %A %b %B %j %I %p %y %e|%-d %-m %-I";
        let cases = [
            (
                0,
                "1970-01-01 00:00:00 Thu Thursday Jan January 001 12 AM 70  1|1 1 12",
            ),
            (
                1_709_251_200,
                "2024-03-01 00:00:00 Fri Friday Mar March 061 12 AM 24  1|1 3 12",
            ),
            (
                951_696_000,
                "2000-02-28 00:00:00 Mon Monday Feb February 059 12 AM 00 28|28 2 12",
            ),
            (
                1_735_689_599,
                "2024-12-31 23:59:59 Tue Tuesday Dec December 366 11 PM 24 31|31 12 11",
            ),
            (
                4_102_498_861,
                "2100-01-01 15:01:01 Fri Friday Jan January 001 03 PM 00  1|1 1 3",
            ),
        ];
        for (secs, expected) in cases {
            assert_eq!(strftime_utc(fmt, secs), expected, "{secs}");
        }
    }
}
