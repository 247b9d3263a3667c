//! Minimal msgpack writer and bounded, non-panicking reader.
//!
//! The writer picks the smallest representation for every value, which is what
//! both msgspec and Python `msgpack` do (positive integers always use the
//! unsigned family, floats are always float64 unless explicitly `F32`). The
//! reader never allocates more than the remaining input can justify and never
//! recurses except in [`Reader::read_value`], which is depth-limited.

use crate::decode::DecodeError;
use crate::types::MsgValue;

// ---------------------------------------------------------------- writer ---

pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
}

fn len32(len: usize) -> u32 {
    // msgpack cannot express longer collections; vLLM never gets near this.
    u32::try_from(len).expect("msgpack collection longer than u32::MAX")
}

impl Writer {
    pub(crate) fn with_capacity(cap: usize) -> Self {
        Writer {
            buf: Vec::with_capacity(cap),
        }
    }

    pub(crate) fn nil(&mut self) {
        self.buf.push(0xc0);
    }

    pub(crate) fn bool(&mut self, v: bool) {
        self.buf.push(if v { 0xc3 } else { 0xc2 });
    }

    pub(crate) fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.buf.push(v as u8);
        } else if v <= u8::MAX as u64 {
            self.buf.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u16::MAX as u64 {
            self.buf.push(0xcd);
            self.buf.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u32::MAX as u64 {
            self.buf.push(0xce);
            self.buf.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.buf.push(0xcf);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub(crate) fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.buf.push(v as i8 as u8);
        } else if v >= i8::MIN as i64 {
            self.buf.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i16::MIN as i64 {
            self.buf.push(0xd1);
            self.buf.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i32::MIN as i64 {
            self.buf.push(0xd2);
            self.buf.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.buf.push(0xd3);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub(crate) fn f64(&mut self, v: f64) {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    pub(crate) fn f32(&mut self, v: f32) {
        self.buf.push(0xca);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    pub(crate) fn str(&mut self, s: &str) {
        let len = len32(s.len());
        if len < 32 {
            self.buf.push(0xa0 | len as u8);
        } else if len <= u8::MAX as u32 {
            self.buf.extend_from_slice(&[0xd9, len as u8]);
        } else if len <= u16::MAX as u32 {
            self.buf.push(0xda);
            self.buf.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.buf.push(0xdb);
            self.buf.extend_from_slice(&len.to_be_bytes());
        }
        self.buf.extend_from_slice(s.as_bytes());
    }

    pub(crate) fn bin(&mut self, b: &[u8]) {
        let len = len32(b.len());
        if len <= u8::MAX as u32 {
            self.buf.extend_from_slice(&[0xc4, len as u8]);
        } else if len <= u16::MAX as u32 {
            self.buf.push(0xc5);
            self.buf.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.buf.push(0xc6);
            self.buf.extend_from_slice(&len.to_be_bytes());
        }
        self.buf.extend_from_slice(b);
    }

    pub(crate) fn array_len(&mut self, len: usize) {
        let len = len32(len);
        if len < 16 {
            self.buf.push(0x90 | len as u8);
        } else if len <= u16::MAX as u32 {
            self.buf.push(0xdc);
            self.buf.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.buf.push(0xdd);
            self.buf.extend_from_slice(&len.to_be_bytes());
        }
    }

    pub(crate) fn map_len(&mut self, len: usize) {
        let len = len32(len);
        if len < 16 {
            self.buf.push(0x80 | len as u8);
        } else if len <= u16::MAX as u32 {
            self.buf.push(0xde);
            self.buf.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.buf.push(0xdf);
            self.buf.extend_from_slice(&len.to_be_bytes());
        }
    }

    pub(crate) fn ext(&mut self, ty: i8, data: &[u8]) {
        let len = len32(data.len());
        match len {
            1 => self.buf.push(0xd4),
            2 => self.buf.push(0xd5),
            4 => self.buf.push(0xd6),
            8 => self.buf.push(0xd7),
            16 => self.buf.push(0xd8),
            _ if len <= u8::MAX as u32 => self.buf.extend_from_slice(&[0xc7, len as u8]),
            _ if len <= u16::MAX as u32 => {
                self.buf.push(0xc8);
                self.buf.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                self.buf.push(0xc9);
                self.buf.extend_from_slice(&len.to_be_bytes());
            }
        }
        self.buf.push(ty as u8);
        self.buf.extend_from_slice(data);
    }

    pub(crate) fn value(&mut self, v: &MsgValue) {
        match v {
            MsgValue::Nil => self.nil(),
            MsgValue::Bool(b) => self.bool(*b),
            MsgValue::UInt(u) => self.uint(*u),
            MsgValue::Int(i) => self.int(*i),
            MsgValue::F32(f) => self.f32(*f),
            MsgValue::F64(f) => self.f64(*f),
            MsgValue::Str(s) => self.str(s),
            MsgValue::Bin(b) => self.bin(b),
            MsgValue::Array(items) => {
                self.array_len(items.len());
                for item in items {
                    self.value(item);
                }
            }
            MsgValue::Map(entries) => {
                self.map_len(entries.len());
                for (k, val) in entries {
                    self.value(k);
                    self.value(val);
                }
            }
            MsgValue::Ext(ty, data) => self.ext(*ty, data),
        }
    }
}

// ---------------------------------------------------------------- reader ---

/// The head of one msgpack value. Containers carry only their length; their
/// elements follow in the stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Head<'a> {
    Nil,
    Bool(bool),
    UInt(u64),
    /// Always negative (non-negative signed encodings are folded into `UInt`).
    Int(i64),
    F32(f32),
    F64(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext(i8, &'a [u8]),
}

impl Head<'_> {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool(_) => "bool",
            Head::UInt(_) | Head::Int(_) => "int",
            Head::F32(_) | Head::F64(_) => "float",
            Head::Str(_) => "str",
            Head::Bin(_) => "bin",
            Head::Array(_) => "array",
            Head::Map(_) => "map",
            Head::Ext(..) => "ext",
        }
    }
}

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn set_pos(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError::Truncated { offset: self.pos });
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len_u8(&mut self) -> Result<usize, DecodeError> {
        Ok(self.u8()? as usize)
    }

    fn len_u16(&mut self) -> Result<usize, DecodeError> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }

    fn len_u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.be()?))
    }

    /// Checks that a container of `n` elements (each at least one byte) can
    /// still fit in the input, so callers may size allocations from `n`.
    fn container(&self, n: u32, per_elem: u64, start: usize) -> Result<u32, DecodeError> {
        if (n as u64) * per_elem > self.remaining() as u64 {
            return Err(DecodeError::Truncated { offset: start });
        }
        Ok(n)
    }

    pub(crate) fn next_head(&mut self) -> Result<Head<'a>, DecodeError> {
        let start = self.pos;
        let m = self.u8()?;
        let head = match m {
            0x00..=0x7f => Head::UInt(m as u64),
            0x80..=0x8f => Head::Map(self.container((m & 0x0f) as u32, 2, start)?),
            0x90..=0x9f => Head::Array(self.container((m & 0x0f) as u32, 1, start)?),
            0xa0..=0xbf => Head::Str(self.take((m & 0x1f) as usize)?),
            0xc0 => Head::Nil,
            0xc1 => return Err(DecodeError::ReservedMarker { offset: start }),
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4 => {
                let n = self.len_u8()?;
                Head::Bin(self.take(n)?)
            }
            0xc5 => {
                let n = self.len_u16()?;
                Head::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.len_u32()? as usize;
                Head::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = match m {
                    0xc7 => self.len_u8()?,
                    0xc8 => self.len_u16()?,
                    _ => self.len_u32()? as usize,
                };
                let ty = self.u8()? as i8;
                Head::Ext(ty, self.take(n)?)
            }
            0xca => Head::F32(f32::from_be_bytes(self.be()?)),
            0xcb => Head::F64(f64::from_be_bytes(self.be()?)),
            0xcc => Head::UInt(self.u8()? as u64),
            0xcd => Head::UInt(u16::from_be_bytes(self.be()?) as u64),
            0xce => Head::UInt(u32::from_be_bytes(self.be()?) as u64),
            0xcf => Head::UInt(u64::from_be_bytes(self.be()?)),
            0xd0 => signed(i8::from_be_bytes(self.be()?) as i64),
            0xd1 => signed(i16::from_be_bytes(self.be()?) as i64),
            0xd2 => signed(i32::from_be_bytes(self.be()?) as i64),
            0xd3 => signed(i64::from_be_bytes(self.be()?)),
            0xd4..=0xd8 => {
                let n = 1usize << (m - 0xd4);
                let ty = self.u8()? as i8;
                Head::Ext(ty, self.take(n)?)
            }
            0xd9 => {
                let n = self.len_u8()?;
                Head::Str(self.take(n)?)
            }
            0xda => {
                let n = self.len_u16()?;
                Head::Str(self.take(n)?)
            }
            0xdb => {
                let n = self.len_u32()? as usize;
                Head::Str(self.take(n)?)
            }
            0xdc => {
                let n = self.len_u16()? as u32;
                Head::Array(self.container(n, 1, start)?)
            }
            0xdd => {
                let n = self.len_u32()?;
                Head::Array(self.container(n, 1, start)?)
            }
            0xde => {
                let n = self.len_u16()? as u32;
                Head::Map(self.container(n, 2, start)?)
            }
            0xdf => {
                let n = self.len_u32()?;
                Head::Map(self.container(n, 2, start)?)
            }
            0xe0..=0xff => Head::Int(m as i8 as i64),
        };
        Ok(head)
    }

    /// Skips one complete value without recursion: the loop runs at most once
    /// per input byte, so it is bounded by the payload size.
    pub(crate) fn skip_value(&mut self) -> Result<(), DecodeError> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            match self.next_head()? {
                Head::Array(n) => pending += n as u64,
                Head::Map(n) => pending += 2 * n as u64,
                _ => {}
            }
            if pending > self.remaining() as u64 {
                return Err(DecodeError::Truncated { offset: self.pos });
            }
        }
        Ok(())
    }

    /// Reads one value into a [`MsgValue`], with a nesting limit and a budget
    /// on the total number of values produced.
    pub(crate) fn read_value(
        &mut self,
        depth_left: usize,
        budget: &mut usize,
        context: &'static str,
    ) -> Result<MsgValue, DecodeError> {
        let offset = self.pos;
        if *budget == 0 {
            return Err(DecodeError::LimitExceeded {
                what: "extra_keys values",
                context,
                offset,
            });
        }
        *budget -= 1;
        let head = self.next_head()?;
        Ok(match head {
            Head::Nil => MsgValue::Nil,
            Head::Bool(b) => MsgValue::Bool(b),
            Head::UInt(u) => MsgValue::UInt(u),
            Head::Int(i) => MsgValue::Int(i),
            Head::F32(f) => MsgValue::F32(f),
            Head::F64(f) => MsgValue::F64(f),
            Head::Str(s) => MsgValue::Str(utf8(s, context, offset)?.to_string()),
            Head::Bin(b) => MsgValue::Bin(b.to_vec()),
            Head::Ext(ty, d) => MsgValue::Ext(ty, d.to_vec()),
            Head::Array(n) | Head::Map(n) if n > 0 && depth_left == 0 => {
                return Err(DecodeError::TooDeep { context, offset });
            }
            Head::Array(n) => {
                let mut items = Vec::with_capacity((n as usize).min(*budget));
                for _ in 0..n {
                    items.push(self.read_value(depth_left - 1, budget, context)?);
                }
                MsgValue::Array(items)
            }
            Head::Map(n) => {
                let mut entries = Vec::with_capacity((n as usize).min(*budget));
                for _ in 0..n {
                    let k = self.read_value(depth_left - 1, budget, context)?;
                    let v = self.read_value(depth_left - 1, budget, context)?;
                    entries.push((k, v));
                }
                MsgValue::Map(entries)
            }
        })
    }
}

fn signed(v: i64) -> Head<'static> {
    if v >= 0 {
        Head::UInt(v as u64)
    } else {
        Head::Int(v)
    }
}

pub(crate) fn utf8<'a>(
    s: &'a [u8],
    context: &'static str,
    offset: usize,
) -> Result<&'a str, DecodeError> {
    std::str::from_utf8(s).map_err(|_| DecodeError::InvalidUtf8 { context, offset })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(f: impl FnOnce(&mut Writer)) -> Vec<u8> {
        let mut w = Writer::with_capacity(16);
        f(&mut w);
        w.buf
    }

    #[test]
    fn integer_boundaries_use_smallest_form() {
        let cases: [(i64, &[u8]); 12] = [
            (0, &[0x00]),
            (127, &[0x7f]),
            (128, &[0xcc, 0x80]),
            (255, &[0xcc, 0xff]),
            (256, &[0xcd, 0x01, 0x00]),
            (65536, &[0xce, 0, 1, 0, 0]),
            (-1, &[0xff]),
            (-32, &[0xe0]),
            (-33, &[0xd0, 0xdf]),
            (-129, &[0xd1, 0xff, 0x7f]),
            (-32769, &[0xd2, 0xff, 0xff, 0x7f, 0xff]),
            (i64::MIN, &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]),
        ];
        for (v, want) in cases {
            let got = enc(|w| w.int(v));
            assert_eq!(got, want, "{v}");
            let head = Reader::new(&got).next_head().unwrap();
            let back = match head {
                Head::UInt(u) => u as i64,
                Head::Int(i) => i,
                other => panic!("{other:?}"),
            };
            assert_eq!(back, v);
        }
        assert_eq!(enc(|w| w.uint(u64::MAX))[0], 0xcf);
        assert_eq!(enc(|w| w.uint(1 << 32))[0], 0xcf);
    }

    #[test]
    fn length_boundaries() {
        assert_eq!(enc(|w| w.str(&"a".repeat(31)))[0], 0xbf);
        assert_eq!(enc(|w| w.str(&"a".repeat(32)))[..2], [0xd9, 32]);
        assert_eq!(enc(|w| w.str(&"a".repeat(256)))[..3], [0xda, 1, 0]);
        assert_eq!(enc(|w| w.bin(&[]))[..], [0xc4, 0]);
        assert_eq!(enc(|w| w.array_len(15))[..], [0x9f]);
        assert_eq!(enc(|w| w.array_len(16))[..], [0xdc, 0, 16]);
        assert_eq!(enc(|w| w.map_len(16))[..], [0xde, 0, 16]);
        assert_eq!(enc(|w| w.array_len(70_000))[..], [0xdd, 0, 1, 0x11, 0x70]);
        assert_eq!(enc(|w| w.ext(5, &[1, 2]))[..], [0xd5, 5, 1, 2]);
        assert_eq!(enc(|w| w.ext(5, &[1, 2, 3]))[..], [0xc7, 3, 5, 1, 2, 3]);
    }

    #[test]
    fn values_round_trip_and_skip() {
        let v = MsgValue::Map(vec![
            (
                MsgValue::str("k"),
                MsgValue::Array(vec![MsgValue::F32(1.5), MsgValue::Nil]),
            ),
            (MsgValue::UInt(7), MsgValue::Ext(-3, vec![9; 20])),
            (MsgValue::Bool(true), MsgValue::Bin(vec![1; 300])),
        ]);
        let bytes = enc(|w| w.value(&v));
        let mut budget = 100;
        let mut r = Reader::new(&bytes);
        assert_eq!(r.read_value(4, &mut budget, "t").unwrap(), v);
        assert_eq!(r.remaining(), 0);
        let mut r = Reader::new(&bytes);
        r.skip_value().unwrap();
        assert_eq!(r.remaining(), 0);
    }
}
