//! hotstart-demo: the main job.

pub mod model;
