//! Edge functions: this folder will hold the local function instances, their
//! autoscaler and the predictor that tells the autoscaler when to pre-warm and
//! how long to keep an idle instance (issue 19, point 5).
//!
//! Today it holds only the pure prediction core, [`predict`]: sans-IO,
//! clock-free policies fed with arrival times and asked for a decision. Nothing
//! wires it to the gateway yet.

pub mod predict;
