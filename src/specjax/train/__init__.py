"""Drafter training: target-regenerated data, the DFlash objective, the optimiser loop and checkpoints."""
