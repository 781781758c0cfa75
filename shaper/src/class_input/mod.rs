//! A class as every front end writes it ([`ClassInput`], declared once in `fields.rs`)
//! and the one validator that checks it (`check.rs`).

mod check;
mod combine;
mod fields;

pub use check::FieldError;
pub use fields::{ClassInput, FieldInfo, Kind, FIELDS};
