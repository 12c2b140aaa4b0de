//! `[acl]`: who may publish and subscribe where, for every edge (ADR 0008).
//!
//! Owns: the config types and their defaults, and reading the optional rules file (`file`,
//! the same `[[rule]]` shape). Does not own: compiling or applying the rules
//! (`crate::control::acl`, which also checks each rule's globs and filters at load, with the
//! rule's key path).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `[acl]`. With no rules and `default = "allow"` (the default) every device may publish and
/// subscribe anywhere, as before the ACL existed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AclConfig {
    /// What a message or subscription no rule matches gets.
    pub default: AclPermission,
    /// More rules, read from this TOML file (`[[rule]]` tables of the same shape), checked
    /// after the ones here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// Rules in order; the first that matches decides.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rule: Vec<AclRuleConfig>,
}

impl Default for AclConfig {
    fn default() -> Self {
        AclConfig {
            default: AclPermission::Allow,
            file: None,
            rule: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AclPermission {
    Allow,
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AclAction {
    Publish,
    Subscribe,
    All,
}

/// `[[acl.rule]]`: which devices (`devices`, a client-id glob; `users`, a username glob; both
/// must match when both are given), which action, which topics (MQTT filters, `%c` = the
/// device's id, `%u` = its username), and the answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AclRuleConfig {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub users: Option<String>,
    pub action: AclAction,
    pub topics: Vec<String>,
    pub permission: AclPermission,
}

/// The rules file's shape: `[[rule]]` tables only.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AclFile {
    #[serde(default)]
    pub rule: Vec<AclRuleConfig>,
}

/// Reads and parses the rules file; the error names the file and the key path.
pub fn read_acl_file(path: &std::path::Path) -> Result<AclFile, super::ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| super::ConfigError::File {
        key: "acl.file".into(),
        path: path.to_path_buf(),
        source,
    })?;
    serde_path_to_error::deserialize(toml::Deserializer::new(&text)).map_err(|e| {
        let key = format!("acl.file({}).{}", path.display(), e.path());
        super::ConfigError::Invalid {
            key,
            reason: e.into_inner().message().trim().replace('\n', "; "),
        }
    })
}
