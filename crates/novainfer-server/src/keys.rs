//! API keys and the tenant a request belongs to.
//!
//! With `--api-key`, each configured key is a tenant: sessions, cancellation and the per-user
//! token budget are scoped to the key that created them, so one key's holder can neither
//! read another's conversation nor cancel its requests nor spend its budget. Without keys
//! every request is the one anonymous tenant.

use std::hash::{Hash, Hasher};
use std::num::NonZeroU32;

use subtle::{ConditionallySelectable, ConstantTimeEq};

/// Which configured key authenticated a request (`None`: keys are off).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tenant(pub Option<u32>);

pub struct ApiKeys(Vec<Vec<u8>>);

impl ApiKeys {
    pub fn new(keys: &[String]) -> Option<Self> {
        (!keys.is_empty()).then(|| Self(keys.iter().map(|k| k.as_bytes().to_vec()).collect()))
    }

    /// The tenant of `presented`, if it equals a configured key. Every key is compared, each
    /// in constant time, so neither the timing nor the position of a match leaks a key.
    pub fn tenant(&self, presented: &[u8]) -> Option<Tenant> {
        let mut found = subtle::Choice::from(0);
        let mut index = 0u32;
        for (i, key) in self.0.iter().enumerate() {
            let hit = key.as_slice().ct_eq(presented);
            // Key counts come from the command line: far below u32::MAX.
            let i = u32::try_from(i).expect("fewer than 2^32 API keys: this is a bug");
            index = u32::conditional_select(&index, &i, hit & !found);
            found |= hit;
        }
        bool::from(found).then_some(Tenant(Some(index)))
    }
}

/// Each API key's weight in the fair share (`--tenant-weights`, in `--api-key` order).
#[derive(Debug, Clone, Default)]
pub struct TenantWeights(Vec<NonZeroU32>);

impl TenantWeights {
    /// Zero weights are refused by the argument check; here they count as 1.
    pub fn new(weights: &[u32]) -> Self {
        Self(
            weights
                .iter()
                .map(|&w| NonZeroU32::new(w).unwrap_or(NonZeroU32::MIN))
                .collect(),
        )
    }

    /// Whose share a request uses: its API key's, or with keys off its `user`'s (weight 1;
    /// requests without a `user` share one anonymous tenant).
    pub fn share(&self, tenant: Tenant, user: &str) -> novainfer_core::Tenant {
        match tenant.0 {
            Some(key) => novainfer_core::Tenant {
                id: u64::from(key),
                weight: self.0.get(key as usize).copied().unwrap_or(NonZeroU32::MIN),
            },
            None => {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                user.hash(&mut h);
                // The top bit set keeps user tenants apart from key indexes.
                novainfer_core::Tenant {
                    id: h.finish() | 1 << 63,
                    weight: NonZeroU32::MIN,
                }
            }
        }
    }
}

/// Why a configured key list is refused at start-up.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KeyError {
    /// An empty key would accept `Authorization: Bearer ` (or nothing at all) — almost
    /// certainly an unset shell variable or a trailing comma, so refuse to start.
    #[error("--api-key (or NOVAINFER_API_KEY) item {position} is empty; remove it (a trailing comma?) or give a non-empty key")]
    Empty { position: usize },
    #[error("--api-key (or NOVAINFER_API_KEY) item {position} has leading or trailing whitespace, which no Authorization header can carry")]
    Whitespace { position: usize },
}

/// Checks the configured keys: none may be empty or padded with whitespace.
pub fn check_keys(keys: &[String]) -> Result<(), KeyError> {
    for (i, key) in keys.iter().enumerate() {
        let position = i + 1;
        if key.trim().is_empty() {
            return Err(KeyError::Empty { position });
        }
        if key.trim() != key {
            return Err(KeyError::Whitespace { position });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_is_its_own_tenant() {
        let keys = ApiKeys::new(&["secret".into(), "other".into()]).expect("some keys");
        assert_eq!(keys.tenant(b"secret"), Some(Tenant(Some(0))));
        assert_eq!(keys.tenant(b"other"), Some(Tenant(Some(1))));
        for wrong in [&b"secre"[..], b"", b"secretx"] {
            assert_eq!(keys.tenant(wrong), None);
        }
        assert!(ApiKeys::new(&[]).is_none());
    }

    #[test]
    fn shares_follow_the_key_weights_and_users_without_keys() {
        let w = TenantWeights::new(&[3, 1]);
        let key0 = w.share(Tenant(Some(0)), "x");
        assert_eq!((key0.id, key0.weight.get()), (0, 3));
        assert_eq!(w.share(Tenant(Some(1)), "y").weight.get(), 1);
        let (a, b) = (w.share(Tenant(None), "alice"), w.share(Tenant(None), "bob"));
        assert_ne!(a.id, b.id);
        assert_eq!(a, w.share(Tenant(None), "alice"));
        assert!(a.id >= 1 << 63 && a.weight.get() == 1);
    }

    #[test]
    fn a_repeated_key_is_the_first_tenant() {
        let keys = ApiKeys::new(&["k".into(), "k".into()]).expect("some keys");
        assert_eq!(keys.tenant(b"k"), Some(Tenant(Some(0))));
    }

    #[test]
    fn empty_or_padded_keys_are_refused() {
        assert_eq!(
            check_keys(&["a".into(), "".into()]),
            Err(KeyError::Empty { position: 2 })
        );
        assert_eq!(
            check_keys(&[" ".into()]),
            Err(KeyError::Empty { position: 1 })
        );
        assert_eq!(
            check_keys(&["a ".into()]),
            Err(KeyError::Whitespace { position: 1 })
        );
        assert!(check_keys(&["a".into(), "b".into()]).is_ok());
        assert!(check_keys(&[]).is_ok());
    }
}
