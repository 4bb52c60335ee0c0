//! The OpenAI wire format: request bodies in, response objects out.

pub mod agent_tools;
pub mod infill;
pub mod inputs;
pub mod messages;
pub mod request;
pub mod response;
pub mod responses;
pub mod router_defaults;
