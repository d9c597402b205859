"""The image lane: diffusion pipelines served with step-level batching (see docs/images.md)."""
