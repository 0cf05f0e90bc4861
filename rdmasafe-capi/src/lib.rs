//! rdmasafe C ABI
