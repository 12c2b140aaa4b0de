//! Block-wise transfers (RFC 7959): reassembling a request body sent in Block1 blocks, and
//! slicing a response body into Block2 blocks.
//!
//! Owns: the state of one Block1 transfer (body so far, the next block expected, the size
//! limit) and the Block2 slice arithmetic. Does not own: which transfers exist or when they go
//! stale (the caller keys them by peer and resource and expires them) or the response codes
//! sent (it maps [`BlockError`] to 4.08 / 4.13).

use bytes::{Bytes, BytesMut};

use super::Block;

/// Why a Block1 block cannot be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// Not the block expected next (a block is missing): 4.08 Request Entity Incomplete.
    #[error("block {got} where block {expected} was expected")]
    OutOfOrder { expected: u32, got: u32 },
    /// The body would be larger than the limit: 4.13 Request Entity Too Large.
    #[error("body over {max} bytes")]
    TooLarge { max: usize },
    /// A non-final block whose payload is not exactly the block size, or SZX 7 over UDP.
    #[error("block payload does not match its size")]
    BadSize,
}

/// What taking a block led to.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    /// More blocks are due: answer 2.31 Continue echoing this Block1 value.
    Continue(Block),
    /// The last block: the whole body.
    Complete(Bytes),
}

/// One Block1 transfer being reassembled.
#[derive(Debug)]
pub struct Assembly {
    body: BytesMut,
    next: u32,
    szx: u8,
    max: usize,
}

impl Assembly {
    /// A transfer of at most `max` bytes; blocks larger than `our_szx` are answered with
    /// `our_szx` (the client continues with the smaller size, RFC 7959 §2.3).
    pub fn new(max: usize, our_szx: u8) -> Assembly {
        Assembly {
            body: BytesMut::new(),
            next: 0,
            szx: our_szx.min(6),
            max,
        }
    }

    /// Bytes received so far.
    pub fn len(&self) -> usize {
        self.body.len()
    }

    pub fn is_empty(&self) -> bool {
        self.body.is_empty()
    }

    /// Take block `block` with `payload`; `size1` is the total the client announced, if any.
    pub fn push(
        &mut self,
        block: Block,
        payload: &[u8],
        size1: Option<u32>,
    ) -> Result<Progress, BlockError> {
        if block.szx > 6 {
            return Err(BlockError::BadSize);
        }
        if size1.is_some_and(|s| s as usize > self.max) {
            return Err(BlockError::TooLarge { max: self.max });
        }
        let offset = block.offset();
        if offset != self.body.len() {
            return Err(BlockError::OutOfOrder {
                expected: self.next,
                got: block.num,
            });
        }
        if block.more && payload.len() != block.size() || payload.len() > block.size() {
            return Err(BlockError::BadSize);
        }
        if self.body.len() + payload.len() > self.max {
            return Err(BlockError::TooLarge { max: self.max });
        }
        self.body.extend_from_slice(payload);
        if !block.more {
            return Ok(Progress::Complete(std::mem::take(&mut self.body).freeze()));
        }
        // The client continues at the next block of the size sluice answers with.
        let szx = block.szx.min(self.szx);
        let size = 1usize << (szx + 4);
        self.next = (self.body.len() / size) as u32;
        Ok(Progress::Continue(Block {
            num: block.num,
            more: true,
            szx,
        }))
    }
}

/// Block `num` of `body` in blocks of SZX `szx`: the slice and the Block2 value to send with
/// it; `None` when `num` is past the end.
pub fn slice(body: &Bytes, num: u32, szx: u8) -> Option<(Bytes, Block)> {
    let szx = szx.min(6);
    let size = 1usize << (szx + 4);
    let start = (num as usize).checked_mul(size)?;
    if start >= body.len() && !(start == 0 && body.is_empty()) {
        return None;
    }
    let end = (start + size).min(body.len());
    Some((
        body.slice(start..end),
        Block {
            num,
            more: end < body.len(),
            szx,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blk(num: u32, more: bool, szx: u8) -> Block {
        Block { num, more, szx }
    }

    #[test]
    fn blocks_in_order_reassemble_the_body() {
        let body: Vec<u8> = (0..100u8).collect();
        let mut a = Assembly::new(1000, 6);
        assert_eq!(
            a.push(blk(0, true, 1), &body[..32], Some(100)),
            Ok(Progress::Continue(blk(0, true, 1)))
        );
        assert!(matches!(
            a.push(blk(1, true, 1), &body[32..64], None),
            Ok(Progress::Continue(_))
        ));
        assert!(matches!(
            a.push(blk(2, true, 1), &body[64..96], None),
            Ok(Progress::Continue(_))
        ));
        assert_eq!(
            a.push(blk(3, false, 1), &body[96..], None),
            Ok(Progress::Complete(Bytes::from(body)))
        );
    }

    #[test]
    fn a_missing_block_an_oversized_body_and_a_short_block_are_refused() {
        let mut a = Assembly::new(64, 6);
        a.push(blk(0, true, 0), &[0; 16], None).unwrap();
        assert_eq!(
            a.push(blk(2, true, 0), &[0; 16], None),
            Err(BlockError::OutOfOrder {
                expected: 1,
                got: 2
            })
        );
        assert_eq!(
            a.push(blk(1, true, 0), &[0; 15], None),
            Err(BlockError::BadSize)
        );
        assert_eq!(
            Assembly::new(64, 6).push(blk(0, true, 0), &[0; 16], Some(65)),
            Err(BlockError::TooLarge { max: 64 })
        );
        let mut b = Assembly::new(40, 6);
        b.push(blk(0, true, 1), &[0; 32], None).unwrap();
        assert_eq!(
            b.push(blk(1, true, 1), &[0; 32], None),
            Err(BlockError::TooLarge { max: 40 })
        );
    }

    #[test]
    fn a_larger_block_is_answered_with_our_size_and_the_client_continues_at_it() {
        let mut a = Assembly::new(4096, 4); // 256-byte blocks
        assert_eq!(
            a.push(blk(0, true, 6), &[1; 1024], None),
            Ok(Progress::Continue(blk(0, true, 4)))
        );
        // 1024 bytes taken = four 256-byte blocks: the next is block 4.
        assert!(matches!(
            a.push(blk(4, false, 4), &[2; 10], None),
            Ok(Progress::Complete(b)) if b.len() == 1034
        ));
    }

    #[test]
    fn block2_slices_cover_the_body() {
        let body = Bytes::from(vec![7u8; 40]);
        let (s0, b0) = slice(&body, 0, 0).unwrap();
        assert_eq!((s0.len(), b0.more), (16, true));
        let (s2, b2) = slice(&body, 2, 0).unwrap();
        assert_eq!((s2.len(), b2.more, b2.num), (8, false, 2));
        assert!(slice(&body, 3, 0).is_none());
        assert_eq!(slice(&Bytes::new(), 0, 2).unwrap().0.len(), 0);
    }
}
