//! The dtype codes both collective backends put on the wire: the socket backend in every
//! message header, the NCCL backend in the shape descriptors it exchanges before a gather.
//! One table, so that the two backends (and their error messages) never disagree on a code.

use candle_core::DType;

/// Every dtype with a wire code. Codes are part of the wire format: never renumber one.
const CODES: [(DType, u8); 10] = [
    (DType::U8, 1),
    (DType::U32, 2),
    (DType::I16, 3),
    (DType::I32, 4),
    (DType::I64, 5),
    (DType::BF16, 6),
    (DType::F16, 7),
    (DType::F32, 8),
    (DType::F64, 9),
    (DType::F8E4M3, 10),
];

/// The wire code of `dtype`; `None` for a dtype no backend carries.
pub fn code(dtype: DType) -> Option<u8> {
    CODES.iter().find(|&&(d, _)| d == dtype).map(|&(_, c)| c)
}

/// The dtype a wire code names; `None` for an unknown code.
pub fn from_code(code: u8) -> Option<DType> {
    CODES.iter().find(|&&(_, c)| c == code).map(|&(d, _)| d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_distinct() {
        for &(dtype, c) in &CODES {
            assert_eq!(code(dtype), Some(c));
            assert_eq!(from_code(c), Some(dtype));
        }
        assert_eq!(from_code(0), None);
        assert_eq!(from_code(255), None);
        assert_eq!(code(DType::F6E2M3), None);
    }
}
