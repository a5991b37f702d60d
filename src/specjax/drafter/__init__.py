"""Drafters: DFlash (block diffusion, z-lab format) and their checkpoint loaders."""
