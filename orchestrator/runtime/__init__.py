"""The worker runtime: what runs inside every torchrun worker. Imports no Ray and no launcher."""
