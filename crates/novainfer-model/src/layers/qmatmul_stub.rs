//! Stand-in for `qmatmul` off x86-64: no packed kernels, so every quantized
//! weight goes through candle's `QMatMul`.

use candle_core::quantized::QTensor;

use crate::error::Result;

/// Most matrices one [`matmul_many_into`] takes.
pub const MAX_MANY: usize = 4;

pub enum PackedMatrix {}

impl PackedMatrix {
    pub fn from_qtensor(_t: &QTensor) -> Result<Option<Self>> {
        Ok(None)
    }

    pub fn from_int4(_w: &crate::int4::GroupedInt4) -> Option<Self> {
        None
    }

    pub fn matmul(&self, _x: &[f32], _m: usize) -> Vec<f32> {
        match *self {}
    }

    pub fn matmul_into(&self, _x: &[f32], _m: usize, _out: &mut Vec<f32>) {
        match *self {}
    }
}

/// Never called: no `PackedMatrix` exists off x86-64.
pub fn matmul_many(mats: &[&PackedMatrix], _x: &[f32], _m: usize) -> Vec<Vec<f32>> {
    match mats.first() {
        Some(w) => match **w {},
        None => Vec::new(),
    }
}

/// Never called: no `PackedMatrix` exists off x86-64.
pub fn matmul_many_into(
    mats: &[&PackedMatrix],
    _x: &[f32],
    _m: usize,
    _outs: &mut [&mut Vec<f32>],
) {
    if let Some(w) = mats.first() {
        match **w {}
    }
}
