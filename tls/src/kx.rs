//! (EC)DHE key exchange groups: x25519 and secp256r1, through aws-lc-rs's agreement API.

use aws_lc_rs::agreement::{self, PrivateKey, UnparsedPublicKey};

use super::error::TlsError;
use super::schedule::Secret;

/// A key exchange group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// x25519 (0x001d): OpenSSL's default share.
    X25519,
    /// secp256r1 (0x0017): GnuTLS shares it along with x25519.
    Secp256r1,
}

impl Group {
    /// The NamedGroup code.
    pub fn code(self) -> u16 {
        match self {
            Group::X25519 => 0x001d,
            Group::Secp256r1 => 0x0017,
        }
    }

    /// From the NamedGroup code, if supported.
    pub fn from_code(code: u16) -> Option<Group> {
        match code {
            0x001d => Some(Group::X25519),
            0x0017 => Some(Group::Secp256r1),
            _ => None,
        }
    }

    fn alg(self) -> &'static agreement::Algorithm {
        match self {
            Group::X25519 => &agreement::X25519,
            Group::Secp256r1 => &agreement::ECDH_P256,
        }
    }

    /// Whether `share` has the form TLS 1.3 requires: 32 bytes for x25519, an uncompressed point
    /// (0x04 || x || y) for secp256r1.
    fn share_well_formed(self, share: &[u8]) -> bool {
        match self {
            Group::X25519 => share.len() == 32,
            Group::Secp256r1 => share.len() == 65 && share[0] == 4,
        }
    }
}

/// An ephemeral key pair of one group.
pub(crate) struct KeyPair {
    pub group: Group,
    private: PrivateKey,
    pub public: Vec<u8>,
}

impl KeyPair {
    pub(crate) fn generate(group: Group) -> Result<KeyPair, TlsError> {
        let private = PrivateKey::generate(group.alg())
            .map_err(|_| TlsError::Internal("key share generation failed"))?;
        let public = private
            .compute_public_key()
            .map_err(|_| TlsError::Internal("key share generation failed"))?
            .as_ref()
            .to_vec();
        Ok(KeyPair {
            group,
            private,
            public,
        })
    }

    /// The shared secret with the peer's share; a malformed share, a point not on the curve or an
    /// all-zero x25519 result is illegal_parameter.
    pub(crate) fn agree(&self, peer: &[u8]) -> Result<Secret, TlsError> {
        const BAD: TlsError = TlsError::IllegalParameter("invalid key share");
        if !self.group.share_well_formed(peer) {
            return Err(BAD);
        }
        let secret = agreement::agree(
            &self.private,
            UnparsedPublicKey::new(self.group.alg(), peer),
            BAD,
            |s| Ok(Secret::new(s.to_vec())),
        )?;
        if secret.as_bytes().iter().all(|&b| b == 0) {
            return Err(BAD);
        }
        Ok(secret)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_groups_agree() {
        for g in [Group::X25519, Group::Secp256r1] {
            let a = KeyPair::generate(g).unwrap();
            let b = KeyPair::generate(g).unwrap();
            assert_eq!(
                a.agree(&b.public).unwrap().as_bytes(),
                b.agree(&a.public).unwrap().as_bytes()
            );
            assert!(a.agree(&b.public[1..]).is_err());
        }
        let p = KeyPair::generate(Group::Secp256r1).unwrap();
        let mut off_curve = p.public.clone();
        off_curve[64] ^= 1;
        assert!(p.agree(&off_curve).is_err());
        let x = KeyPair::generate(Group::X25519).unwrap();
        // A small-order point gives an all-zero secret.
        assert!(x.agree(&[0; 32]).is_err());
    }
}
