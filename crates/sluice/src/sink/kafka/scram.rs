//! SASL/SCRAM client (RFC 5802, with SHA-256 and SHA-512 as RFC 7677 and Kafka's
//! `SCRAM-SHA-256`/`SCRAM-SHA-512`): the three messages a Kafka client sends and checks in
//! `SaslAuthenticate` requests.
//!
//! Owns: building client-first and client-final, checking the server's nonce, salt and
//! iteration count, and verifying the server's signature (so a broker that does not know the
//! password is not believed). Does not own: carrying the messages (the transport's
//! SaslHandshake/SaslAuthenticate) or reading the password (by path, in the config).
//!
//! Bounds: the iteration count must lie in [`MIN_ITERATIONS`]..=[`MAX_ITERATIONS`] (RFC 7677
//! asks at least 4,096; a hostile server must not make the gateway hash for minutes); a
//! server-first message above [`MAX_SERVER_MESSAGE`] bytes is refused. No channel binding
//! (`n,,`). Usernames are sent with `=` and `,` escaped; SASLprep is not applied (names and
//! passwords outside printable ASCII may not match what the broker stored).

use base64::Engine;
use ring::{digest, hmac, pbkdf2};

/// The lowest iteration count accepted (RFC 7677 §4).
pub const MIN_ITERATIONS: u32 = 4096;
/// The highest iteration count accepted.
pub const MAX_ITERATIONS: u32 = 1_000_000;
/// The largest server-first message accepted.
pub const MAX_SERVER_MESSAGE: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    Sha256,
    Sha512,
}

impl Mechanism {
    /// The SASL mechanism name Kafka knows it by.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Sha256 => "SCRAM-SHA-256",
            Mechanism::Sha512 => "SCRAM-SHA-512",
        }
    }
    fn hmac(self) -> hmac::Algorithm {
        match self {
            Mechanism::Sha256 => hmac::HMAC_SHA256,
            Mechanism::Sha512 => hmac::HMAC_SHA512,
        }
    }
    fn pbkdf2(self) -> pbkdf2::Algorithm {
        match self {
            Mechanism::Sha256 => pbkdf2::PBKDF2_HMAC_SHA256,
            Mechanism::Sha512 => pbkdf2::PBKDF2_HMAC_SHA512,
        }
    }
    fn digest(self) -> &'static digest::Algorithm {
        match self {
            Mechanism::Sha256 => &digest::SHA256,
            Mechanism::Sha512 => &digest::SHA512,
        }
    }
    fn len(self) -> usize {
        self.digest().output_len()
    }
}

/// Why an exchange failed: the server's message was malformed or not to be believed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScramError {
    #[error("the server's SCRAM message is malformed: {0}")]
    Malformed(&'static str),
    #[error("the server's nonce does not extend ours")]
    NonceMismatch,
    #[error("the server asks {0} iterations (accepted: {MIN_ITERATIONS} to {MAX_ITERATIONS})")]
    Iterations(u32),
    #[error("the server refused the authentication: {0}")]
    ServerError(String),
    #[error("the server's signature is wrong (it does not know the password)")]
    BadServerSignature,
}

/// One SCRAM exchange, client side.
pub struct ScramClient {
    mech: Mechanism,
    password: String,
    nonce: String,
    first_bare: String,
    /// Set by [`ScramClient::client_final`]: the server key and the auth message, whose
    /// HMAC the server must send (checked in constant time by `hmac::verify`).
    server_check: Option<(hmac::Key, String)>,
}

impl ScramClient {
    /// A new exchange with a random 24-byte nonce.
    pub fn new(mech: Mechanism, user: &str, password: &str) -> ScramClient {
        use ring::rand::SecureRandom;
        let mut raw = [0u8; 24];
        ring::rand::SystemRandom::new()
            .fill(&mut raw)
            .expect("the system random generator works");
        let nonce = base64::engine::general_purpose::STANDARD_NO_PAD.encode(raw);
        Self::with_nonce(mech, user, password, &nonce)
    }

    /// An exchange with the given nonce (for tests against published vectors).
    pub fn with_nonce(mech: Mechanism, user: &str, password: &str, nonce: &str) -> ScramClient {
        let user = user.replace('=', "=3D").replace(',', "=2C");
        ScramClient {
            mech,
            password: password.to_string(),
            nonce: nonce.to_string(),
            first_bare: format!("n={user},r={nonce}"),
            server_check: None,
        }
    }

    pub fn mechanism(&self) -> Mechanism {
        self.mech
    }

    /// client-first-message: no channel binding, then the bare part.
    pub fn client_first(&self) -> String {
        format!("n,,{}", self.first_bare)
    }

    /// client-final-message for the server's first message.
    pub fn client_final(&mut self, server_first: &[u8]) -> Result<String, ScramError> {
        if server_first.len() > MAX_SERVER_MESSAGE {
            return Err(ScramError::Malformed("longer than 4096 bytes"));
        }
        let server_first =
            std::str::from_utf8(server_first).map_err(|_| ScramError::Malformed("not UTF-8"))?;
        let (mut nonce, mut salt, mut iters) = (None, None, None);
        // RFC 5802 gives each attribute once: one given twice is refused rather than one of
        // the two picked (found by the scram_server fuzz target, whose oracle read the first).
        for attr in server_first.split(',') {
            match attr.split_once('=') {
                Some(("r", v)) => once(&mut nonce, v)?,
                Some(("s", v)) => once(&mut salt, v)?,
                Some(("i", v)) => once(&mut iters, v)?,
                Some(("e", v)) => return Err(ScramError::ServerError(v.to_string())),
                Some(("m", _)) => return Err(ScramError::Malformed("mandatory extension")),
                _ => {}
            }
        }
        let nonce = nonce.ok_or(ScramError::Malformed("no nonce"))?;
        if !nonce.starts_with(&self.nonce) || nonce.len() == self.nonce.len() {
            return Err(ScramError::NonceMismatch);
        }
        let salt = base64::engine::general_purpose::STANDARD
            .decode(salt.ok_or(ScramError::Malformed("no salt"))?)
            .map_err(|_| ScramError::Malformed("salt is not base64"))?;
        let iters: u32 = iters
            .ok_or(ScramError::Malformed("no iteration count"))?
            .parse()
            .map_err(|_| ScramError::Malformed("iteration count is not a number"))?;
        if !(MIN_ITERATIONS..=MAX_ITERATIONS).contains(&iters) {
            return Err(ScramError::Iterations(iters));
        }
        let n = self.mech.len();
        let mut salted = vec![0u8; n];
        pbkdf2::derive(
            self.mech.pbkdf2(),
            std::num::NonZeroU32::new(iters).expect("checked above"),
            &salt,
            self.password.as_bytes(),
            &mut salted,
        );
        let salted_key = hmac::Key::new(self.mech.hmac(), &salted);
        let client_key = hmac::sign(&salted_key, b"Client Key");
        let stored_key = digest::digest(self.mech.digest(), client_key.as_ref());
        // c=biws: base64 of "n,," (no channel binding).
        let without_proof = format!("c=biws,r={nonce}");
        let auth_message = format!("{},{server_first},{without_proof}", self.first_bare);
        let client_sig = hmac::sign(
            &hmac::Key::new(self.mech.hmac(), stored_key.as_ref()),
            auth_message.as_bytes(),
        );
        let proof: Vec<u8> = client_key
            .as_ref()
            .iter()
            .zip(client_sig.as_ref())
            .map(|(a, b)| a ^ b)
            .collect();
        let server_key = hmac::sign(&salted_key, b"Server Key");
        self.server_check = Some((
            hmac::Key::new(self.mech.hmac(), server_key.as_ref()),
            auth_message,
        ));
        Ok(format!(
            "{without_proof},p={}",
            base64::engine::general_purpose::STANDARD.encode(proof)
        ))
    }

    /// Check the server's final message: its signature proves it knows the password.
    pub fn verify_server_final(&self, server_final: &[u8]) -> Result<(), ScramError> {
        let text =
            std::str::from_utf8(server_final).map_err(|_| ScramError::Malformed("not UTF-8"))?;
        if let Some(e) = text.strip_prefix("e=") {
            return Err(ScramError::ServerError(e.to_string()));
        }
        let v = text
            .split(',')
            .find_map(|a| a.strip_prefix("v="))
            .ok_or(ScramError::Malformed("no server signature"))?;
        let got = base64::engine::general_purpose::STANDARD
            .decode(v)
            .map_err(|_| ScramError::Malformed("server signature is not base64"))?;
        match &self.server_check {
            Some((key, auth)) if hmac::verify(key, auth.as_bytes(), &got).is_ok() => Ok(()),
            _ => Err(ScramError::BadServerSignature),
        }
    }
}

/// Fill `slot` with `v` unless it already holds a value.
fn once<'a>(slot: &mut Option<&'a str>, v: &'a str) -> Result<(), ScramError> {
    match slot.replace(v) {
        None => Ok(()),
        Some(_) => Err(ScramError::Malformed("an attribute given twice")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7677 §3, SCRAM-SHA-256: user "user", password "pencil".
    #[test]
    fn the_rfc_7677_exchange_is_reproduced() {
        let mut c =
            ScramClient::with_nonce(Mechanism::Sha256, "user", "pencil", "rOprNGfwEbeRWgbNEkqO");
        assert_eq!(c.client_first(), "n,,n=user,r=rOprNGfwEbeRWgbNEkqO");
        let server_first =
            b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096";
        assert_eq!(
            c.client_final(server_first).unwrap(),
            "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
        );
        c.verify_server_final(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
            .unwrap();
        assert_eq!(
            c.verify_server_final(b"v=AAAATRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="),
            Err(ScramError::BadServerSignature)
        );
    }

    #[test]
    fn a_server_that_does_not_extend_our_nonce_or_asks_too_many_rounds_is_refused() {
        let mut c = ScramClient::with_nonce(Mechanism::Sha512, "a=b,c", "pw", "abc");
        assert_eq!(c.client_first(), "n,,n=a=3Db=2Cc,r=abc");
        assert_eq!(
            c.client_final(b"r=xyz123,s=AAAA,i=4096"),
            Err(ScramError::NonceMismatch)
        );
        assert_eq!(
            c.client_final(b"r=abc,s=AAAA,i=4096"),
            Err(ScramError::NonceMismatch)
        );
        assert_eq!(
            c.client_final(b"r=abcdef,s=AAAA,i=999999999"),
            Err(ScramError::Iterations(999_999_999))
        );
        assert_eq!(
            c.client_final(b"r=abcdef,s=AAAA,i=1"),
            Err(ScramError::Iterations(1))
        );
        assert!(matches!(
            c.client_final(b"e=invalid-proof"),
            Err(ScramError::ServerError(_))
        ));
        // An attribute given twice (the scram_server fuzz target's finding: a second i= after
        // one that is not a number) is refused, whichever copy is valid.
        for twice in [
            &b"r=abcdef,s=AAAA,i=4O96,i=4096"[..],
            b"r=abcdef,s=AAAA,i=4096,i=4096",
            b"r=abcdef,r=abcxyz,s=AAAA,i=4096",
            b"r=abcdef,s=AAAA,s=BBBB,i=4096",
        ] {
            assert_eq!(
                c.client_final(twice),
                Err(ScramError::Malformed("an attribute given twice")),
                "{}",
                String::from_utf8_lossy(twice)
            );
        }
        // No final message before a client-final: nothing to check against.
        assert_eq!(
            ScramClient::with_nonce(Mechanism::Sha256, "u", "p", "n")
                .verify_server_final(b"v=AAAA"),
            Err(ScramError::BadServerSignature)
        );
    }

    proptest::proptest! {
        /// Whatever the server sends, the client answers or refuses without panicking.
        #[test]
        fn any_server_message_is_answered_or_refused(msg: Vec<u8>) {
            let mut c = ScramClient::with_nonce(Mechanism::Sha256, "u", "p", "n");
            let _ = c.client_final(&msg);
            let _ = c.verify_server_final(&msg);
        }
    }
}
