//! The setter shape shared by this crate's builders: `value` in, builder out.

/// `setter!(/// doc \n name: Type)` defines `pub fn name(mut self, value: Type) -> Self`.
macro_rules! setter {
    ($(#[$doc:meta])* $name:ident: $ty:ty) => {
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Self {
            self.$name = value;
            self
        }
    };
}

pub(crate) use setter;
