//! Matching for `[acl]` rules: client-id and username globs, and MQTT topic filters with the
//! `%c` / `%u` placeholders compared level by level against a device's values (never substituted
//! into a string). Owns no decision: `super` orders the rules and decides.

use sluice_proto::mqtt::topic;

use super::Subject;
use crate::shard::limits::TopicLimits;

/// A client-id or username glob: `*` any run of characters, `?` one character.
#[derive(Debug, Clone)]
pub(super) enum Glob {
    Any,
    Exact(Box<str>),
    Pattern(Box<str>),
}

impl Glob {
    pub(super) fn parse(text: &str) -> Result<Glob, String> {
        if text.is_empty() {
            return Err("an empty glob matches nothing; use \"*\" for every device".into());
        }
        if let Some(c) = text
            .chars()
            .find(|c| matches!(c, '[' | ']' | '{' | '}' | '\\'))
        {
            return Err(format!(
                "{c:?} is not allowed in a glob (only * and ? are special)"
            ));
        }
        Ok(if text.chars().all(|c| c == '*') {
            Glob::Any
        } else if !text.contains(['*', '?']) {
            Glob::Exact(text.into())
        } else {
            Glob::Pattern(text.into())
        })
    }

    pub(super) fn matches(&self, s: &str) -> bool {
        match self {
            Glob::Any => true,
            Glob::Exact(e) => **e == *s,
            Glob::Pattern(p) => glob_matches(p, s),
        }
    }
}

/// Iterative glob matching (`*`, `?` = one character), linear backtracking to the last `*`.
pub(super) fn glob_matches(pattern: &str, s: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), s.as_bytes());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == b'?' {
            pi += 1;
            ti += utf8_len(t[ti]);
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            let next = st + utf8_len(t[st]);
            star = Some((sp, next));
            pi = sp + 1;
            ti = next;
        } else {
            return false;
        }
    }
    p[pi.min(p.len())..].iter().all(|&b| b == b'*')
}

pub(super) fn utf8_len(first: u8) -> usize {
    match first {
        0xF0.. => 4,
        0xE0.. => 3,
        0xC0.. => 2,
        _ => 1,
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Piece {
    Lit(Box<str>),
    Client,
    User,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Level {
    Lit(Box<str>),
    Plus,
    Hash,
    /// A level with `%c`/`%u` in it, compared piece by piece.
    Pattern(Box<[Piece]>),
}

#[derive(Debug, Clone)]
pub(super) struct Filter {
    levels: Box<[Level]>,
    client: bool,
    user: bool,
}

impl Filter {
    pub(super) fn parse(text: &str, limits: &TopicLimits) -> Result<Filter, String> {
        if text.starts_with("$share/") {
            return Err("a rule's topic is a plain filter; a shared subscription is checked by its inner filter".into());
        }
        limits.check(text).map_err(|e| e.to_string())?;
        // Validity of everything but the placeholders.
        let plain = text.replace("%c", "c").replace("%u", "u");
        if plain.contains('%') {
            return Err(format!(
                "{text:?}: only %c (client id) and %u (username) may follow %"
            ));
        }
        if !topic::valid_topic_filter(&plain) {
            return Err(format!("{text:?} is not a valid MQTT topic filter"));
        }
        let (mut client, mut user) = (false, false);
        let levels = text
            .split('/')
            .map(|l| match l {
                "+" => Level::Plus,
                "#" => Level::Hash,
                l if l.contains('%') => {
                    let mut pieces = Vec::new();
                    let mut rest = l;
                    while let Some(i) = rest.find('%') {
                        if i > 0 {
                            pieces.push(Piece::Lit(rest[..i].into()));
                        }
                        if rest[i..].starts_with("%c") {
                            client = true;
                            pieces.push(Piece::Client);
                        } else {
                            user = true;
                            pieces.push(Piece::User);
                        }
                        rest = &rest[i + 2..];
                    }
                    if !rest.is_empty() {
                        pieces.push(Piece::Lit(rest.into()));
                    }
                    Level::Pattern(pieces.into())
                }
                l => Level::Lit(l.into()),
            })
            .collect();
        Ok(Filter {
            levels,
            client,
            user,
        })
    }

    /// Whether the device's values may be substituted here (see the module docs).
    pub(super) fn substitutable(&self, s: &Subject) -> bool {
        let ok = |v: &str| !v.is_empty() && !v.contains(['+', '#', '/']);
        (!self.client || ok(s.client_id)) && (!self.user || s.username.is_some_and(ok))
    }

    /// The first level, when it is a literal (the index key).
    pub(super) fn first_literal(&self) -> Option<&str> {
        match self.levels.first() {
            Some(Level::Lit(l)) => Some(l),
            _ => None,
        }
    }

    /// Publish: does this filter match the topic name?
    pub(super) fn matches_name(&self, s: &Subject, name: &str, widen: bool) -> bool {
        let dollar = name.starts_with('$');
        let mut parts = name.split('/');
        for (i, level) in self.levels.iter().enumerate() {
            if *level == Level::Hash {
                return !(i == 0 && dollar);
            }
            let Some(part) = parts.next() else {
                return false;
            };
            let ok = match level {
                Level::Plus => !(i == 0 && dollar),
                Level::Lit(l) => **l == *part,
                Level::Pattern(_) if widen => !(i == 0 && dollar),
                Level::Pattern(p) => pattern_eq(p, s, part),
                Level::Hash => true,
            };
            if !ok {
                return false;
            }
        }
        parts.next().is_none()
    }

    /// Subscribe, allow rules: is every topic `f` matches matched by this filter too?
    pub(super) fn covers(&self, s: &Subject, f: &str) -> bool {
        let rest_is_any = |i: usize| match &self.levels[i..] {
            [Level::Hash] => true,
            [Level::Plus, Level::Hash] => i == 0,
            _ => false,
        };
        let dollar = f.starts_with('$');
        let mut parts = f.split('/');
        for (i, level) in self.levels.iter().enumerate() {
            if *level == Level::Hash {
                return !(i == 0 && dollar);
            }
            let Some(part) = parts.next() else {
                return false;
            };
            if part == "#" {
                // `#` here matches any rest (at the root: at least one level).
                return rest_is_any(i) && !(i == 0 && dollar);
            }
            let ok = match level {
                Level::Plus => !(i == 0 && dollar),
                Level::Lit(l) => **l == *part,
                Level::Pattern(p) => pattern_eq(p, s, part),
                Level::Hash => true,
            };
            if !ok {
                return false;
            }
        }
        parts.next().is_none()
    }

    /// Subscribe, deny rules: is there a topic both this filter and `f` match?
    pub(super) fn overlaps(&self, s: &Subject, f: &str, widen: bool) -> bool {
        let f_dollar = f.starts_with('$');
        let mut parts = f.split('/');
        for (i, level) in self.levels.iter().enumerate() {
            let part = parts.next();
            let ok = match (level, part) {
                (Level::Hash, _) => return !(i == 0 && f_dollar),
                (_, Some("#")) => {
                    let r_dollar = matches!(level, Level::Lit(l) if l.starts_with('$'));
                    return !(i == 0 && r_dollar);
                }
                (_, None) => return false,
                (Level::Plus, Some(p)) => !(i == 0 && p.starts_with('$')),
                (Level::Lit(l), Some("+")) => !(i == 0 && l.starts_with('$')),
                (Level::Lit(l), Some(p)) => **l == *p,
                (Level::Pattern(_), Some("+")) => true,
                (Level::Pattern(_), Some(p)) if widen => !(i == 0 && p.starts_with('$')),
                (Level::Pattern(pieces), Some(p)) => pattern_eq(pieces, s, p),
            };
            if !ok {
                return false;
            }
        }
        matches!(parts.next(), None | Some("#"))
    }
}

/// Does `part` equal the pattern with the device's values in place? No string is built.
pub(super) fn pattern_eq(pieces: &[Piece], s: &Subject, part: &str) -> bool {
    let mut rest = part;
    for piece in pieces {
        let value = match piece {
            Piece::Lit(l) => &**l,
            Piece::Client => s.client_id,
            Piece::User => match s.username {
                Some(u) => u,
                None => return false,
            },
        };
        match rest.strip_prefix(value) {
            Some(r) => rest = r,
            None => return false,
        }
    }
    rest.is_empty()
}
